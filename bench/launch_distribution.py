#!/usr/bin/env python3
"""Distribution of per-launch medians, from the RESULT lines of bench/run_small_ops_bench.sh.

    launch_distribution.py FILE

Input lines: `RESULT <op>_launch impl=... cond=idle|busy launch=N ... time_us=...`.
Prints per impl and condition the launch medians' best, p10, median, p90 and worst (us), the
worst/best ratio and how many launches are beyond 2x the best, as
    RESULT launch_distribution impl=... cond=... launches=N best_us= p10_us= median_us= p90_us= worst_us= worst_over_best=
then, for every dtrain impl, the goals (the MPI one for dtrain-shm, which shares its medium):
    GOAL slow_mode impl=... cond=... worst_over_best=... (<= 2 within its condition) MET|MISSED
    GOAL vs_idle_best impl=... cond=busy worst_over_idle_best=... (<= 2) MET|MISSED
    GOAL vs_mpi impl=... cond=... worst_over_mpi_median=... (<= 1.5) MET|MISSED
    RATIO launch_distribution a=IMPL b=mpi-sm cond=... ratio_median_us=... ratio_worst_us=...
and the same distribution as a markdown table (idle rows first).

Lines with rtt_ns= (bench/core_roundtrip after the launch: a cache line's round trip between two
CPUs) are also split by the host's mode: "close" where the round trip was under half the run's
median round trip (a VM's host running the two vCPUs close together), else "usual". When both
modes occur, the distribution follows per mode, as
    RESULT launch_distribution_by_host impl=... cond=... host=close|usual launches=N best_us= median_us= worst_us= worst_over_best=
    GOAL slow_mode_within_host_mode impl=... cond=... worst_over_best=... (<= 2, the worse mode) MET|MISSED
and a second table. The GOAL lines above stay as they are: this split explains them, it does
not replace them.

Lines with steal_ms= (the time the host kept the VM's vCPUs from running during the launch) add,
per impl and condition, how many launches had at least STOLEN_MS of it and how many of the
outliers (launches beyond 2x the median launch) did:
    RESULT launch_steal impl=... cond=... launches=N with_steal=K beyond_2x_median=B beyond_2x_median_with_steal=J
and the outliers one by one (time, steal, round trip). An explanation again, not a goal.
"""
import statistics
import sys

# At 10 ms ticks, a launch (0.2-0.5 s of start-up and ops) usually shows 0-20 ms of steal; 40 ms
# or more says the host held a vCPU for a while, not that it did so during the timed ops.
STOLEN_MS = 40


def percentile(values, q):
    ordered = sorted(values)
    index = max(1, min(len(ordered), int(-(-q * len(ordered) // 1)))) - 1
    return ordered[index]


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    launches = {}  # (impl, cond) -> [time_us]
    probed = []  # (impl, cond, time_us, rtt_ns)
    stolen = []  # (impl, cond, launch, time_us, steal_ms, rtt_ns)
    for line in open(sys.argv[1]):
        fields = line.split()
        if len(fields) < 2 or fields[0] != "RESULT" or not fields[1].endswith("_launch"):
            continue
        kv = dict(f.split("=", 1) for f in fields[2:] if "=" in f)
        try:
            launches.setdefault((kv["impl"], kv["cond"]), []).append(float(kv["time_us"]))
        except (KeyError, ValueError):
            continue
        try:
            probed.append((kv["impl"], kv["cond"], float(kv["time_us"]), float(kv["rtt_ns"])))
        except (KeyError, ValueError):
            pass
        try:
            stolen.append((kv["impl"], kv["cond"], kv.get("launch", "?"), float(kv["time_us"]),
                           float(kv["steal_ms"]), kv.get("rtt_ns", "nan")))
        except (KeyError, ValueError):
            pass
    if not launches:
        print("launch_distribution: no launch results", file=sys.stderr)
        return 1
    stats = {}
    for (impl, cond), values in sorted(launches.items()):
        best, worst = min(values), max(values)
        s = {"best": best, "p10": percentile(values, 0.1), "median": statistics.median(values),
             "p90": percentile(values, 0.9), "worst": worst, "n": len(values),
             "beyond2x": sum(v > 2 * best for v in values)}
        stats[(impl, cond)] = s
        print(f"RESULT launch_distribution impl={impl} cond={cond} launches={s['n']} best_us={best:.2f} "
              f"p10_us={s['p10']:.2f} median_us={s['median']:.2f} p90_us={s['p90']:.2f} worst_us={worst:.2f} "
              f"worst_over_best={worst / best:.2f} beyond_2x_best={s['beyond2x']}")
    print()
    for (impl, cond), s in sorted(stats.items()):
        if not impl.startswith("dtrain"):
            continue
        ratio = s["worst"] / s["best"]
        print(f"GOAL slow_mode impl={impl} cond={cond} worst_over_best={ratio:.2f} (<= 2) "
              f"{'MET' if ratio <= 2 else 'MISSED'}")
        idle = stats.get((impl, "idle"))
        if cond != "idle" and idle:
            r = s["worst"] / idle["best"]
            print(f"GOAL vs_idle_best impl={impl} cond={cond} worst_over_idle_best={r:.2f} (<= 2) "
                  f"{'MET' if r <= 2 else 'MISSED'}")
        mpi = stats.get(("mpi-sm", cond))
        if mpi and impl.startswith("dtrain-shm"):  # both over shared memory; Gloo goes through TCP
            r = s["worst"] / mpi["median"]
            print(f"GOAL vs_mpi impl={impl} cond={cond} worst_over_mpi_median={r:.2f} (<= 1.5) "
                  f"{'MET' if r <= 1.5 else 'MISSED'}")
            print(f"RATIO launch_distribution a={impl} b=mpi-sm cond={cond} "
                  f"ratio_median_us={s['median'] / mpi['median']:.3f} ratio_worst_us={s['worst'] / mpi['worst']:.3f}")
    print()
    print("| impl | condition | launches | best µs | p10 | median | p90 | worst | worst/best | beyond 2x best |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (impl, cond), s in sorted(stats.items(), key=lambda item: (item[0][1] != "idle", item[0][1], item[0][0])):
        print(f"| {impl} | {cond} | {s['n']} | {s['best']:.2f} | {s['p10']:.2f} | {s['median']:.2f} | {s['p90']:.2f} "
              f"| {s['worst']:.2f} | {s['worst'] / s['best']:.2f} | {s['beyond2x']} |")
    by_host_mode(probed)
    by_steal(stolen, stats)
    return 0


def by_steal(stolen, stats):
    """Launches during which the host kept a vCPU from running (see the module's text)."""
    if not stolen:
        return
    print()
    slow = []
    for (impl, cond), s in sorted(stats.items()):
        mine = [row for row in stolen if row[0] == impl and row[1] == cond]
        if not mine:
            continue
        beyond = [row for row in mine if row[3] > 2 * s["median"]]
        slow += beyond
        print(f"RESULT launch_steal impl={impl} cond={cond} launches={len(mine)} "
              f"with_steal={sum(row[4] >= STOLEN_MS for row in mine)} beyond_2x_median={len(beyond)} "
              f"beyond_2x_median_with_steal={sum(row[4] >= STOLEN_MS for row in beyond)}")
    if slow:
        print(f"\nlaunches beyond 2x their median launch (steal: the time the host held a vCPU during the launch):")
        for impl, cond, launch, time_us, steal, rtt in sorted(slow, key=lambda row: (row[0], row[1], -row[3])):
            print(f"  {impl} {cond} launch {launch}: {time_us:.2f} us, steal {steal:.0f} ms, round trip {rtt} ns")


def by_host_mode(probed):
    """The launches split by the host's mode (see the module's text); nothing when only one occurs."""
    if not probed:
        return
    typical = statistics.median(rtt for _, _, _, rtt in probed)
    modes = {}  # (impl, cond, mode) -> [time_us]
    rtts = {}  # mode -> [rtt_ns]
    for impl, cond, time_us, rtt in probed:
        mode = "close" if rtt < typical / 2 else "usual"
        modes.setdefault((impl, cond, mode), []).append(time_us)
        rtts.setdefault(mode, []).append(rtt)
    if len(rtts) < 2:
        print(f"\nhost mode: one only (core round trip median {typical:.0f} ns over {len(probed)} launches)")
        return
    print(f"\nhost mode by core round trip: close {len(rtts['close'])} launches "
          f"(median {statistics.median(rtts['close']):.0f} ns), usual {len(rtts['usual'])} launches "
          f"(median {statistics.median(rtts['usual']):.0f} ns)")
    rows = []
    worst_ratio = {}  # (impl, cond) -> worst/best of its worse mode
    for (impl, cond, mode), values in sorted(modes.items()):
        best, worst = min(values), max(values)
        rows.append((impl, cond, mode, len(values), best, statistics.median(values), worst))
        print(f"RESULT launch_distribution_by_host impl={impl} cond={cond} host={mode} launches={len(values)} "
              f"best_us={best:.2f} median_us={statistics.median(values):.2f} worst_us={worst:.2f} "
              f"worst_over_best={worst / best:.2f}")
        worst_ratio[(impl, cond)] = max(worst_ratio.get((impl, cond), 0), worst / best)
    print()
    for (impl, cond), ratio in sorted(worst_ratio.items()):
        if impl.startswith("dtrain"):
            print(f"GOAL slow_mode_within_host_mode impl={impl} cond={cond} worst_over_best={ratio:.2f} (<= 2) "
                  f"{'MET' if ratio <= 2 else 'MISSED'}")
    print()
    print("| impl | condition | host mode | launches | best µs | median | worst | worst/best |")
    print("|---|---|---|---|---|---|---|---|")
    for impl, cond, mode, n, best, median, worst in sorted(rows, key=lambda r: (r[1] != "idle", r[1], r[0], r[2])):
        print(f"| {impl} | {cond} | {mode} | {n} | {best:.2f} | {median:.2f} | {worst:.2f} | {worst / best:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
