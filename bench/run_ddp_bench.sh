#!/usr/bin/env bash
# DDP training step side by side, one run: dtrain's DistributedDataParallel
# (bench/ddp_bench) against PyTorch 1.13 DDP on gloo (bench/peers/torch_ddp_mlp.py),
# the peers' MLP (8 x Linear(1024,1024)+ReLU, Linear(1024,10)), batch 32 per rank,
# SGD, one thread per rank, at world 1, 2 and 4. For each world and repetition
# (interleaved, so machine load hits all alike) and each side, three launches:
#   DDP (impl=dtrain | torch-ddp), no overlap (one flattened allreduce after
#   backward: dtrain-nooverlap | torch-nooverlap), and compute only (no
#   communication: dtrain-compute | torch-compute).
# Prints the RESULT lines, then a table: step time, throughput, peak RSS, the
# communication each adds to the compute-only step, the hidden share of
# communication = 1 - (step - compute) / (nooverlap - compute), and dtrain/torch ratios.
#
# dtrain runs on the shared-memory backend (what a one-host job gets) and on
# Gloo (what ranks on separate hosts use); compute-only runs once.
#
# usage: bench/run_ddp_bench.sh   (env: WORLDS="1 2 4" REPS=3 STEPS=30 BACKENDS="shm gloo" DT_BUILD_DIR=build-bench OUT=file)
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
build=${DT_BUILD_DIR:-build-bench}
worlds=${WORLDS:-"1 2 4"}
reps=${REPS:-3}
steps=${STEPS:-30}
backends=${BACKENDS:-"shm gloo"}
peers=$repo/bench/peers
out=${OUT:-$(mktemp /tmp/ddp-bench.XXXXXX.txt)}
py=/usr/bin/python3

# Same BLAS for both: OpenBLAS (pthread build), one thread (see bench/peers/README.md).
openblas_dir=/usr/lib/x86_64-linux-gnu/openblas-pthread
if [ -d "$openblas_dir" ]; then export LD_LIBRARY_PATH="$openblas_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 DT_NUM_THREADS=1

bench="$build/bench/ddp_bench"
echo "== building ddp_bench in $build" >&2
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF -DDT_BUILD_TESTS=OFF -DDT_BUILD_BENCH=ON >/dev/null &&
  cmake --build "$build" -j "${DT_JOBS:-2}" --target ddp_bench >/dev/null ||
  { echo "run_ddp_bench: building ddp_bench failed" >&2; exit 2; }

have_torch=1
"$py" -c "import torch" 2>/dev/null || { have_torch=0; echo "# torch peer skipped: $py cannot import torch (scripts/setup.sh --peers)" >&2; }

echo "# run_ddp_bench: worlds=[$worlds] reps=$reps steps=$steps $(date -u +%FT%TZ) $(getconf _NPROCESSORS_ONLN) cpus" | tee "$out"
for ((rep = 1; rep <= reps; rep++)); do
  for n in $worlds; do
    for backend in $backends; do
      for mode in dtrain dtrain-nooverlap dtrain-compute; do
        [ "$backend" != shm ] && [ "$mode" = dtrain-compute ] && continue  # no communication: same as on shm
        echo "## world $n, repetition $rep: $mode on $backend" >&2
        timeout 900 "$bench" --nproc "$n" --mode "$mode" --backend "$backend" --steps "$steps" 2>>"$out.log" | tee -a "$out"
      done
    done
    [ $have_torch = 1 ] || continue
    for mode in ddp nooverlap compute; do
      echo "## world $n, repetition $rep: torch-$mode" >&2
      timeout 900 "$py" "$peers/torchrun_py311.py" --nproc_per_node "$n" --standalone \
        "$peers/torch_ddp_mlp.py" --modes "$mode" --steps "$steps" 2>>"$out.log" | grep '^RESULT' | tee -a "$out"
    done
  done
done

echo
echo "# medians ($out; stderr of the runs in $out.log)"
"$py" "$peers/summarize.py" "$out"
echo
"$py" "$repo/bench/ddp_report.py" "$out"
