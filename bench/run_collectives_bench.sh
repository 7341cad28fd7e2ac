#!/usr/bin/env bash
# Side-by-side allreduce/broadcast benchmark, float32, world 2 and 4, one run:
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
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
build=${1:-${DT_BUILD_DIR:-build-bench}}
worlds=${WORLDS:-"2 4"}
reps=${REPS:-1}
sizes=${SIZES:-4K,64K,1M,16M,64M}
peers=${PEERS:-bench/peers}
peers_build=${PEERS_BUILD:-build-peers}
out=${OUT:-$(mktemp /tmp/collectives-bench.XXXXXX.txt)}
bench="$build/bench/collectives_bench"
# Always (re)build: a stale binary would measure old code.
echo "# building collectives_bench in $build" >&2
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF -DDT_BUILD_TESTS=OFF -DDT_BUILD_BENCH=ON >/dev/null &&
  cmake --build "$build" -j "${DT_JOBS:-2}" --target collectives_bench >/dev/null
[ -x "$bench" ] || { echo "missing $bench (collectives_bench needs Gloo: scripts/setup.sh)" >&2; exit 2; }
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 DT_NUM_THREADS=1

have_torch=1; /usr/bin/python3 -c "import torch" 2>/dev/null || { have_torch=0; echo "# torch peer skipped: /usr/bin/python3 cannot import torch (apt-get install python3-torch)" >&2; }
have_mpi=0
if ! command -v mpirun >/dev/null; then
  echo "# mpi peer skipped: no mpirun (apt-get install openmpi-bin, or scripts/setup.sh --peers)" >&2
elif mpi_bench=$("$peers/build.sh" "$peers_build" mpi_bench); then
  have_mpi=1
else
  echo "# mpi peer skipped" >&2
fi

echo "# run_collectives_bench: worlds=[$worlds] reps=$reps sizes=$sizes $(date -u +%FT%TZ) $(getconf _NPROCESSORS_ONLN) cpus" | tee "$out"
for ((rep = 1; rep <= reps; rep++)); do
  for n in $worlds; do
    for backend in shm gloo; do
      echo "## world $n, repetition $rep: dtrain-$backend" >&2
      "$bench" --nproc "$n" --backend "$backend" --sizes "$sizes" | tee -a "$out"
    done
    if [ $have_torch = 1 ]; then
      echo "## world $n, repetition $rep: torch-gloo" >&2
      /usr/bin/python3 "$peers/torchrun_py311.py" --nproc_per_node "$n" --standalone \
        "$peers/torch_allreduce.py" --threads 1 --sizes "$sizes" 2>/dev/null | grep '^RESULT' | tee -a "$out"
    fi
    if [ $have_mpi = 1 ]; then
      for op in allreduce broadcast; do
        echo "## world $n, repetition $rep: mpi-sm $op" >&2
        # mpi_bench prints columns: RESULT impl op n bytes k samples med_us min_us algbw busbw
        timeout 600 mpirun --oversubscribe --allow-run-as-root --bind-to none -np "$n" --mca pml ob1 \
          --mca btl vader,self "$mpi_bench" --op "$op" --label mpi-sm --sizes "$sizes" 2>/dev/null |
          awk '$1 == "RESULT" && NF >= 11 { printf "RESULT %s impl=%s world=%s bytes=%s reps=%s threads=1 time_us=%s min_us=%s algbw_GBps=%s busbw_GBps=%s\n", $3, $2, $4, $5, $7, $8, $9, $10, $11 }' |
          tee -a "$out"
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
fi
