#!/usr/bin/env bash
# Side-by-side allreduce/broadcast benchmark, float32, world 2 and 4, one run (and the cost of
# an empty op through ProcessGroup and Work at world 1, dtrain's own floor):
#   dtrain-shm   bench/collectives_bench --backend shm (ProcessGroup + shared-memory backend, forked ranks)
#   dtrain-gloo  bench/collectives_bench --backend gloo (ProcessGroup + Gloo backend)
#   torch-gloo   PyTorch 1.13 gloo via bench/peers/torch_allreduce.py (same methodology)
#   mpi-sm       OpenMPI MPI_Allreduce/MPI_Bcast over shared memory (bench/peers/mpi_bench.cpp)
# Runs are interleaved (dtrain, torch, mpi per world and repetition) so machine
# load hits all alike. Prints the RESULT lines, per-configuration medians and
# ratios dtrain-gloo:torch-gloo, dtrain-shm:dtrain-gloo and dtrain-shm:mpi-sm
# (busbw ratio > 1 means the first is faster).
#
# usage: bench/run_collectives_bench.sh [build-dir]
#   build-dir: dtrain's build (default $DT_BUILD_DIR, else build-bench); collectives_bench is
#   built there first when missing. Env: WORLDS="2 4" REPS=1 SIZES=4K,64K,1M,16M,64M OUT=file,
#   PEERS (bench/peers), PEERS_BUILD (build-peers). Relative paths are from the repository root.
#   BEFORE=path/to/an/older/collectives_bench also runs that binary as dtrain-shm-before and
#   dtrain-gloo-before in the same loop, and prints the before/after ratios.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
build=${1:-${DT_BUILD_DIR:-build-bench}}
worlds=${WORLDS:-"2 4"}
reps=${REPS:-1}
sizes=${SIZES:-4K,64K,1M,16M,64M}
peers=${PEERS:-bench/peers}
peers_build=${PEERS_BUILD:-build-peers}
out=${OUT:-$(mktemp /tmp/collectives-bench.XXXXXX.txt)}
# shellcheck source=bench/collectives_setup.sh
. bench/collectives_setup.sh
before=${BEFORE:-}
[ -z "$before" ] || [ -x "$before" ] || { echo "BEFORE=$before is not an executable collectives_bench" >&2; exit 2; }
have_torch=1; /usr/bin/python3 -c "import torch" 2>/dev/null || { have_torch=0; echo "# torch peer skipped: /usr/bin/python3 cannot import torch (apt-get install python3-torch)" >&2; }

echo "# run_collectives_bench: worlds=[$worlds] reps=$reps sizes=$sizes $(date -u +%FT%TZ) $(getconf _NPROCESSORS_ONLN) cpus" | tee "$out"
for ((rep = 1; rep <= reps; rep++)); do
  for backend in shm gloo; do  # the API's own cost: a zero-element allreduce at world 1
    "$bench" --nproc 1 --backend "$backend" --ops empty 2>/dev/null | tee -a "$out"
  done
  if [ -n "$before" ]; then  # older binaries may lack the empty op: they print nothing
    "$before" --nproc 1 --backend shm --ops empty --impl dtrain-shm-before 2>/dev/null | grep '^RESULT' | tee -a "$out"
  fi
  for n in $worlds; do
    for backend in shm gloo; do
      echo "## world $n, repetition $rep: dtrain-$backend" >&2
      "$bench" --nproc "$n" --backend "$backend" --sizes "$sizes" | tee -a "$out"
      if [ -n "$before" ]; then
        "$before" --nproc "$n" --backend "$backend" --sizes "$sizes" --impl "dtrain-$backend-before" | tee -a "$out"
      fi
    done
    if [ $have_torch = 1 ]; then
      echo "## world $n, repetition $rep: torch-gloo" >&2
      /usr/bin/python3 "$peers/torchrun_py311.py" --nproc_per_node "$n" --standalone \
        "$peers/torch_allreduce.py" --threads 1 --sizes "$sizes" 2>/dev/null | grep '^RESULT' | tee -a "$out"
    fi
    if [ $have_mpi = 1 ]; then
      for op in allreduce broadcast; do
        echo "## world $n, repetition $rep: mpi-sm $op" >&2
        mpi_results "$n" "$op" "$sizes" | tee -a "$out"
      done
    fi
  done
done

echo
echo "# medians ($out)"
/usr/bin/python3 "$peers/summarize.py" "$out"
echo
echo "# ratios dtrain-gloo : torch-gloo (time <1 and busbw >1 mean dtrain is faster)"
/usr/bin/python3 "$peers/summarize.py" "$out" --ratio dtrain-gloo:torch-gloo
echo
echo "# ratios dtrain-shm : dtrain-gloo (shared memory against TCP on loopback)"
/usr/bin/python3 "$peers/summarize.py" "$out" --ratio dtrain-shm:dtrain-gloo
if [ $have_mpi = 1 ]; then
  echo
  echo "# ratios dtrain-shm : mpi-sm (both shared memory)"
  /usr/bin/python3 "$peers/summarize.py" "$out" --ratio dtrain-shm:mpi-sm
  if [ -n "$before" ]; then
    echo
    echo "# ratios dtrain-shm-before : mpi-sm"
    /usr/bin/python3 "$peers/summarize.py" "$out" --ratio dtrain-shm-before:mpi-sm
  fi
fi
if [ -n "$before" ]; then
  for backend in shm gloo; do
    echo
    echo "# ratios dtrain-$backend : dtrain-$backend-before (this build against the older one)"
    /usr/bin/python3 "$peers/summarize.py" "$out" --ratio "dtrain-$backend:dtrain-$backend-before"
  done
fi
