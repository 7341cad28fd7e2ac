#!/usr/bin/env bash
# Small collectives across many launches: is there a slow mode? One launch is one process set
# (a fresh rendezvous, fresh scheduler placement) and gives one median; a runtime whose waits
# depend on where the kernel happened to put its ranks shows up as launches far from the best.
#
#   dtrain-shm        bench/collectives_bench --backend shm   (200 ops, barrier before each)
#   dtrain-shm-batch  the same, timed as mpi_bench times MPI: samples of back-to-back ops that
#                     last ~20 ms each (--batch-ms 20), barrier before each sample
#   dtrain-gloo       bench/collectives_bench --backend gloo
#   mpi-sm            OpenMPI over shared memory (bench/peers/mpi_bench.cpp, batches of back-to-back calls)
# One op per barrier is the stricter measure where ranks share a core: each timed op then includes
# two hand-overs of the core (the barrier's and the op's); back to back, ops overlap as in training.
#
# After each launch bench/core_roundtrip measures a cache line's round trip between the first two
# CPUs (rtt_ns= on the launch's line): on a VM the host may run the two vCPUs close together for a
# while (the development VM: 91 ns against 250-460 ns), and every implementation's small ops are
# about twice as fast then. launch_distribution.py shows the launches of each host mode apart.
# Each line also carries steal_ms=, the time the host kept this VM's vCPUs from running while
# they had work during the launch (/proc/stat's steal, all CPUs, counted in 10 ms ticks, so a
# stretch of a few ms shows only now and then). launch_distribution.py lists the outlier
# launches with it: in one loop the 3 launches whose ranks shared one core from start to end had
# 40-70 ms of it on the other CPU, in a later run 1 of 6 had 40 ms or more.
#
# Conditions, each impl interleaved launch by launch: "idle" (IDLE launches), and "busy"
# (BUSY launches) with one competing process spinning on a core, which this script starts and
# stops itself. Prints one RESULT line per launch, then per impl and condition the
# distribution of launch medians (best, p10, median, p90, worst, worst/best), and the goal
# checks: every launch within 2x of the best launch of its condition (and of the idle best),
# and within 1.5x of MPI's median launch in the same condition.
#
# usage: bench/run_small_ops_bench.sh [build-dir]
#   Env: IDLE=50 BUSY=20 WORLD=2 SIZE=4K OP=allreduce IMPLS="dtrain-shm dtrain-shm-batch dtrain-gloo mpi-sm"
#   OUT=file, PEERS (bench/peers), PEERS_BUILD (build-peers).
#   BEFORE=path/to/an/older/collectives_bench adds dtrain-shm-before and dtrain-gloo-before,
#   launched by the same loop (a before/after comparison in one run).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
build=${1:-${DT_BUILD_DIR:-build-bench}}
idle=${IDLE:-50}
busy=${BUSY:-20}
world=${WORLD:-2}
size=${SIZE:-4K}
op=${OP:-allreduce}
impls=${IMPLS:-"dtrain-shm dtrain-shm-batch dtrain-gloo mpi-sm"}
before=${BEFORE:-}
if [ -n "$before" ]; then
  [ -x "$before" ] || { echo "BEFORE=$before is not an executable collectives_bench" >&2; exit 2; }
  impls="$impls dtrain-shm-before dtrain-gloo-before"
fi
peers=${PEERS:-bench/peers}
peers_build=${PEERS_BUILD:-build-peers}
out=${OUT:-$(mktemp /tmp/small-ops-bench.XXXXXX.txt)}
# shellcheck source=bench/collectives_setup.sh
. bench/collectives_setup.sh
roundtrip="$build/bench/core_roundtrip"
cmake --build "$build" -j "${DT_JOBS:-2}" --target core_roundtrip >/dev/null || exit 2

spinner=""
stop_spinner() {
  [ -n "$spinner" ] && kill "$spinner" 2>/dev/null && wait "$spinner" 2>/dev/null
  spinner=""
}
trap stop_spinner EXIT INT TERM

# The vCPUs' steal time so far, in ms (0 where /proc/stat has no steal column).
steal_ms() {
  awk -v hz="$(getconf CLK_TCK)" '/^cpu[0-9]/ { ticks += $9 } END { printf "%d", ticks * 1000 / hz }' /proc/stat
}

launch() {  # impl condition index
  local impl=$1 cond=$2 i=$3 line steal_before
  steal_before=$(steal_ms)
  case $impl in
    dtrain-*-before) line=$("$before" --nproc "$world" --backend "$(echo "$impl" | cut -d- -f2)" --sizes "$size" --ops "$op" \
                       --impl "$impl" 2>/dev/null | grep '^RESULT') ;;
    dtrain-*-batch) line=$("$bench" --nproc "$world" --backend "$(echo "$impl" | cut -d- -f2)" --sizes "$size" --ops "$op" \
                      --batch-ms 20 --impl "$impl" 2>/dev/null | grep '^RESULT') ;;
    dtrain-*) line=$("$bench" --nproc "$world" --backend "${impl#dtrain-}" --sizes "$size" --ops "$op" 2>/dev/null | grep '^RESULT') ;;
    mpi-sm) [ "$have_mpi" = 1 ] || return 0
            line=$(mpi_results "$world" "$op" "$size") ;;
  esac
  [ -n "$line" ] || { echo "# $impl launch $i ($cond) gave no result" >&2; return 0; }
  local steal=$(($(steal_ms) - steal_before))
  # Right after the launch: its timed ops are its last ~10 ms (the host's mode can change between
  # a probe before the launch and its ops, which come after ~0.1 s of start-up).
  local rtt
  rtt=$("$roundtrip" 2>/dev/null | sed -n 's/.*median_ns=\([0-9]*\).*/\1/p')
  echo "$line cond=$cond launch=$i rtt_ns=${rtt:-nan} steal_ms=$steal" | sed "s/^RESULT $op /RESULT ${op}_launch /" | tee -a "$out"
}

echo "# run_small_ops_bench: $op $size world $world, $idle idle + $busy busy launches of [$impls] $(date -u +%FT%TZ) $(getconf _NPROCESSORS_ONLN) cpus" | tee "$out"
for ((i = 1; i <= idle; i++)); do
  for impl in $impls; do launch "$impl" idle "$i"; done
done
if ((busy > 0)); then
  sh -c 'while :; do :; done' &
  spinner=$!
  for ((i = 1; i <= busy; i++)); do
    for impl in $impls; do launch "$impl" busy "$i"; done
  done
  stop_spinner
fi
echo
/usr/bin/python3 bench/launch_distribution.py "$out"
