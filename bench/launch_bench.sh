#!/usr/bin/env bash
# Launcher overhead: wall time from start to exit of
#     dtrun --standalone --nproc N /bin/true
# (median of REPS runs), side by side in the same run with torchrun
# (bench/peers/launch_overhead.sh: torchrun with default settings and with
# --monitor_interval 0.1, its fastest), measured the same way (date +%s%N around
# the command, output to /dev/null). Prints
#     RESULT launch impl=dtrun nproc=4 reps=.. time_ms=.. min_ms=..
# then the peers' RESULT lines and the ratios (summarize.py --ratio; < 1 means dtrun is faster).
#
# Env: DTRUN (default: build-bench/launcher/dtrun, built there first), REPS (21), NPROCS ("4"), PEER_REPS (5),
#      PEERS (bench/peers), SKIP_PEERS=1 to time dtrun only, PY (/usr/bin/python3).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REPS=${REPS:-21}
NPROCS=${NPROCS:-4}
PEER_REPS=${PEER_REPS:-5}
PEERS=${PEERS:-$ROOT/bench/peers}
PY=${PY:-/usr/bin/python3}
if [ -z "${DTRUN:-}" ]; then
  # Always (re)build: a stale dtrun would measure old code.
  echo "# building dtrun in build-bench" >&2
  cmake -S "$ROOT" -B "$ROOT/build-bench" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF -DDT_BUILD_TESTS=OFF \
    -DDT_BUILD_BENCH=ON >/dev/null && cmake --build "$ROOT/build-bench" -j "${DT_JOBS:-2}" --target dtrun >/dev/null &&
    DTRUN=$ROOT/build-bench/launcher/dtrun
fi
[ -n "${DTRUN:-}" ] && [ -x "$DTRUN" ] || { echo "launch_bench.sh: dtrun not found; build it (cmake --build build-bench --target dtrun) or set DTRUN" >&2; exit 1; }

out=$(mktemp)
trap 'rm -f "$out"' EXIT

# time_cmd LABEL NPROC REPS CMD... (the same method as the peers' launch_overhead.sh)
time_cmd() {
  local label=$1 nproc=$2 reps=$3; shift 3
  local ts=()
  "$@" >/dev/null 2>&1 || { echo "launch_bench.sh: '$*' failed" >&2; return 1; }  # warm-up (page cache)
  for _ in $(seq "$reps"); do
    local t0 t1
    t0=$(date +%s%N)
    "$@" >/dev/null 2>&1 || { echo "launch_bench.sh: '$*' failed" >&2; return 1; }
    t1=$(date +%s%N)
    ts+=("$(( (t1 - t0) / 1000 ))")
  done
  printf '%s\n' "${ts[@]}" | sort -n | awk -v l="$label" -v n="$nproc" -v r="$reps" '
    { v[NR] = $1 }
    END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2;
          printf "RESULT launch impl=%s nproc=%d reps=%d time_ms=%.1f min_ms=%.1f\n", l, n, r, m / 1000, v[1] / 1000 }'
}

echo "# launch_bench: $DTRUN, $(getconf _NPROCESSORS_ONLN) cores, $(date -u +%FT%TZ)"
for n in $NPROCS; do
  time_cmd dtrun "$n" "$REPS" "$DTRUN" --standalone --nproc "$n" /bin/true | tee -a "$out"
done
if [ "${SKIP_PEERS:-0}" != 1 ]; then
  if [ -f "$PEERS/launch_overhead.sh" ] && "$PY" -c "import torch" >/dev/null 2>&1; then
    REPS=$PEER_REPS NPROCS=$NPROCS STOCK_TORCHRUN="" bash "$PEERS/launch_overhead.sh" | tee -a "$out"
    echo "# ratios (time_ms: dtrun / peer; < 1 means dtrun is faster)"
    for peer in torchrun-monitor0.1 torchrun; do
      "$PY" "$PEERS/summarize.py" "$out" --ratio "dtrun:$peer" | grep RATIO || true
    done
    awk '$1 == "RESULT" { for (i = 3; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] } t[v["impl"] "/" v["nproc"]] = v["time_ms"] }
         END { for (k in t) { split(k, p, "/"); if (p[1] != "dtrun" && p[1] != "python3-import-torch" && t["dtrun/" p[2]] > 0)
                 printf "# nproc=%s: dtrun is %.0fx faster than %s (%.1f ms vs %.1f ms)\n", p[2], t[k] / t["dtrun/" p[2]], p[1], t["dtrun/" p[2]], t[k] } }' "$out"
  else
    echo "# peers skipped: $PEERS/launch_overhead.sh missing or torch not importable by $PY"
  fi
fi
