#!/usr/bin/env bash
# The flight recorder's cost (issue 41's benchmark, docs/debugging.md "Measured"):
#  1. the DDP step (bench/ddp_bench: the peers' 8.4 M-parameter MLP, shm) with the recorder on
#     (the default ring) and off (DT_FLIGHT_RECORDER_ENTRIES=0), launches alternating, PAIRS
#     pairs; RATIO on/off of the medians, goal <= 1.01;
#  2. the failure path at 4 and 16 ranks (bench/flight_bench: full rings of OPS allreduces,
#     each rank's dump, one node's post and another's fetch through the job's store, the
#     analysis).
# The empty op's cost is bench/collectives_bench --ops empty (run_collectives_bench.sh).
#
# usage: bench/run_flight_bench.sh   (env: PAIRS=8 WORLD=2 STEPS=60 OPS=5000 REPS=5 WORLDS="4 16"
#                                     DT_BUILD_DIR=build OUT=file)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${DT_BUILD_DIR:-build}
pairs=${PAIRS:-8}
world=${WORLD:-2}
steps=${STEPS:-60}
ops=${OPS:-5000}
reps=${REPS:-5}
worlds=${WORLDS:-"4 16"}
out=${OUT:-$(mktemp /tmp/flight-bench.XXXXXX.txt)}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 DT_NUM_THREADS=1

for b in ddp_bench flight_bench; do
  [[ -x "$build/bench/$b" ]] || { echo "run_flight_bench: $build/bench/$b is missing: build with -DDT_BUILD_BENCH=ON" >&2; exit 2; }
done
echo "# run_flight_bench: pairs=$pairs world=$world steps=$steps ops=$ops reps=$reps worlds=[$worlds] $(date -u +%FT%TZ) $(getconf _NPROCESSORS_ONLN) cpus, load $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$out"

for ((pair = 1; pair <= pairs; pair++)); do
  # Alternate which goes first, so that a drift of the machine falls on both alike.
  order=(on off)
  ((pair % 2 == 0)) && order=(off on)
  for recorder in "${order[@]}"; do
    entries=()
    [[ $recorder == off ]] && entries=(DT_FLIGHT_RECORDER_ENTRIES=0)
    env "${entries[@]}" timeout 600 "$build/bench/ddp_bench" --nproc "$world" --mode dtrain --backend shm --steps "$steps" 2>/dev/null |
      sed -n "s/^RESULT ddp_mlp /RESULT ddp_recorder recorder=$recorder pair=$pair /p" | tee -a "$out"
  done
done

for n in $worlds; do
  timeout 900 "$build/bench/flight_bench" --nproc "$n" --ops "$ops" --reps "$reps" 2>&1 | grep '^RESULT' | tee -a "$out"
done

/usr/bin/env python3 - "$out" <<'EOF'
import re, statistics, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in open(sys.argv[1]) if line.startswith("RESULT ddp_recorder")]
# A launch's median step, and its fastest step: launches on this kind of machine land in two
# modes (whole launches ~25 % apart, with the recorder on or off), which the fastest step shows
# apart from the recorder's own cost.
print(f"| DDP step (ms) | recorder on | recorder off | on / off | per-pair ratios |")
print(f"|---|---|---|---|---|")
for key, what in (("step_ms", "median step"), ("min_ms", "fastest step")):
    on = [float(r[key]) for r in rows if r["recorder"] == "on"]
    off = [float(r[key]) for r in rows if r["recorder"] == "off"]
    if not on or not off:
        continue
    ratio = statistics.median(on) / statistics.median(off)
    pairs = sorted(a / b for a, b in zip(on, off))
    print(f"| {what}, median of {len(on)} launches | {statistics.median(on):.2f} | {statistics.median(off):.2f} | {ratio:.3f} | "
          f"{pairs[0]:.2f} to {pairs[-1]:.2f}, median {statistics.median(pairs):.3f} |")
    print(f"RATIO ddp_step_{key} recorder on/off value={ratio:.3f} goal<=1.01 {'met' if ratio <= 1.01 else 'MISSED'}")
for line in open(sys.argv[1]):
    if line.startswith("RESULT flight_path"):
        r = dict(re.findall(r"(\w+)=(\S+)", line))
        print(f"flight path at world {r['world']}: dumps {r['dump_ms_median']} ms median / {r['dump_ms_max']} ms slowest "
              f"({r['dump_kib']} KiB each), gather {r['gather_ms']} ms, analysis {r['analyze_ms']} ms: {r['total_ms']} ms in all")
EOF
