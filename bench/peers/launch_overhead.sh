#!/usr/bin/env bash
# torchrun peer for bench/launch_bench.sh: what starting N workers that do nothing costs.
#
# Wall time from start to exit (date +%s%N before and after, output to /dev/null), median
# and minimum of REPS runs, of
#   impl=torchrun             torchrun --nproc_per_node N --standalone --no_python /bin/true
#                             with its defaults: the agent checks on its workers every
#                             --monitor_interval seconds (5 in torch 1.13), so this is >= 5 s;
#   impl=torchrun-monitor0.1  the same with --monitor_interval 0.1 (torchrun at its quickest);
#   impl=torchrun-stock-tee1  Debian's own /usr/bin/torchrun, which only runs on Python 3.11
#                             with --redirects 1 --tee 1 (worker output through log files;
#                             see torchrun_py311.py); STOCK_TORCHRUN="" leaves it out;
#   impl=python3-import-torch python3 -c "import torch", the floor of any Python launcher.
# "torchrun" in the first two is torchrun_py311.py next to this file. torch 1.13 spells the
# options with underscores (--nproc_per_node, --no_python, --monitor_interval). Prints
#   RESULT launch impl=torchrun nproc=4 reps=5 time_ms=.. min_ms=..
#
# Env: REPS (5), NPROCS ("4", a list), PY (/usr/bin/python3), STOCK_TORCHRUN (/usr/bin/torchrun)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
REPS=${REPS:-5}
NPROCS=${NPROCS:-4}
PY=${PY:-/usr/bin/python3}
STOCK_TORCHRUN=${STOCK_TORCHRUN-/usr/bin/torchrun}

# wall_ms IMPL NPROC COMMAND...: runs COMMAND REPS times and prints its RESULT line.
wall_ms() {
  local impl=$1 nproc=$2
  shift 2
  local runs=() start end
  for ((i = 0; i < REPS; i++)); do
    start=$(date +%s%N)
    if ! "$@" >/dev/null 2>&1; then
      echo "launch_overhead.sh: failed: $*" >&2
      return 1
    fi
    end=$(date +%s%N)
    runs+=("$(((end - start) / 1000))")
  done
  printf '%s\n' "${runs[@]}" | sort -n | awk -v impl="$impl" -v nproc="$nproc" -v reps="$REPS" '
    { us[NR] = $1 }
    END {
      mid = (NR % 2 == 1) ? us[(NR + 1) / 2] : (us[NR / 2] + us[NR / 2 + 1]) / 2
      printf "RESULT launch impl=%s nproc=%d reps=%d time_ms=%.1f min_ms=%.1f\n", impl, nproc, reps, mid / 1000, us[1] / 1000
    }'
}

torchrun=("$PY" "$here/torchrun_py311.py")
for n in $NPROCS; do
  wall_ms torchrun "$n" "${torchrun[@]}" --nproc_per_node "$n" --standalone --no_python /bin/true
  wall_ms torchrun-monitor0.1 "$n" "${torchrun[@]}" --nproc_per_node "$n" --standalone --monitor_interval 0.1 \
    --no_python /bin/true
  if [ -n "$STOCK_TORCHRUN" ] && [ -x "$STOCK_TORCHRUN" ]; then
    wall_ms torchrun-stock-tee1 "$n" "$STOCK_TORCHRUN" --nproc_per_node "$n" --standalone --redirects 1 --tee 1 \
      --no_python /bin/true
  fi
done
wall_ms python3-import-torch 1 "$PY" -c "import torch"
