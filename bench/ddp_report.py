#!/usr/bin/env python3
"""The DDP benchmark table from RESULT ddp_mlp lines (bench/run_ddp_bench.sh).

    ddp_report.py RESULTS_FILE

Per world size and side (dtrain on shm, dtrain on gloo, torch): median step time, throughput and peak RSS of DDP,
of no overlap (one allreduce after backward) and of compute only (no communication);
comm_ms = step - compute (what communication adds to the step); hidden share =
1 - (ddp - compute) / (nooverlap - compute). Then RESULT lines with the ratios
dtrain / torch (below 1: dtrain is faster or smaller).
"""
import statistics
import sys
from collections import defaultdict

MODES = {"dtrain": "ddp", "dtrain-nooverlap": "nooverlap", "dtrain-compute": "compute",
         "torch-ddp": "ddp", "torch-nooverlap": "nooverlap", "torch-compute": "compute"}


def main(path):
    runs = defaultdict(list)  # (world, side, mode) -> [(step_ms, samples_per_s, peak_rss_mb)]
    with open(path) as lines:
        for line in lines:
            fields = line.split()
            if len(fields) < 3 or fields[:2] != ["RESULT", "ddp_mlp"]:
                continue
            kv = dict(f.split("=", 1) for f in fields[2:] if "=" in f)
            impl = kv.get("impl", "")
            if impl not in MODES:
                continue
            side = f"dtrain-{kv.get('backend', 'shm')}" if impl.startswith("dtrain") else "torch"
            if impl == "dtrain-compute":
                side = "dtrain-compute"
            runs[(int(kv["world"]), side, MODES[impl])].append(
                (float(kv["step_ms"]), float(kv["samples_per_s"]), float(kv.get("peak_rss_mb", "nan"))))

    def med(world, side, mode, column):
        values = [r[column] for r in runs.get((world, side, mode), [])]
        return statistics.median(values) if values else float("nan")

    print("| world | side | DDP step ms | samples/s | peak RSS MiB | no-overlap ms | compute-only ms "
          "| comm added ms | hidden share |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary = {}
    sides = sorted({key[1] for key in runs if key[1] != "dtrain-compute"}, key=lambda s: (s == "torch", s))
    for world in sorted({key[0] for key in runs}):
        for side in sides:
            step, rate, rss = (med(world, side, "ddp", c) for c in range(3))
            nooverlap = med(world, side, "nooverlap", 0)
            compute = med(world, "dtrain-compute" if side.startswith("dtrain") else side, "compute", 0)
            added = step - compute
            exposed = nooverlap - compute
            hidden = 1 - added / exposed if exposed > 0 and world > 1 else float("nan")
            summary[(world, side)] = (step, rate, rss, hidden, added)
            print(f"| {world} | {side} | {step:.1f} | {rate:.0f} | {rss:.0f} | {nooverlap:.1f} | {compute:.1f} "
                  f"| {added:.1f} | {hidden:.2f} |")
    print()
    for world in sorted({key[0] for key in summary}):
        t = summary.get((world, "torch"))
        for side in sides:
            d = summary.get((world, side))
            if side == "torch" or not d or not t:
                continue
            print(f"RESULT ddp_ratio a={side} b=torch world={world} step_ratio={d[0] / t[0]:.3f} "
                  f"throughput_ratio={d[1] / t[1]:.3f} rss_ratio={d[2] / t[2]:.3f} hidden_a={d[3]:.2f} "
                  f"hidden_b={t[3]:.2f} comm_added_ms_a={d[4]:.1f} comm_added_ms_b={t[4]:.1f}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
