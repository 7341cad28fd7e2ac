#!/usr/bin/env bash
# The trainer's throughput side by side, one run: examples/trainer (`trainer --bench` under
# dtrun) against the same job in PyTorch 1.13 under torchrun (bench/peers/torch_trainer.py):
# Fashion-MNIST from Debian's dataset-fashion-mnist, MLP 784-256-128-10, AdamW with a cosine
# schedule, global batch 128 (128 / world per rank), DDP over gloo, one thread per rank, at
# world 1, 2 and 4. Each side runs WARMUP steps, then STEPS timed steps of its real training
# loop (data loading included; no checkpoints, no evaluation). Repetitions are interleaved, so
# machine load hits both alike. Prints the RESULT lines, the medians, and a table with the
# dtrain / torch ratio of samples/s (above 1: dtrain is faster).
#
# usage: bench/run_trainer_bench.sh   (env: WORLDS="1 2 4" REPS=3 STEPS=300 WARMUP=20 BATCH=128
#                                       DATA=/usr/share/datasets/fashion-mnist TORCH_WORKERS=0
#                                       DT_BUILD_DIR=build-bench OUT=file)
#   BEFORE=path/to/an/older/trainer also runs that build in the same loop, as impl=dtrain-before
#   (after dtrain at each world and repetition), and prints the dtrain : dtrain-before ratios.
#   STRAGGLERS_OFF=1 also runs the same trainer with straggler detection off (DT_STRAGGLER_EVERY=0)
#   as impl=dtrain-nostragglers in the same loop, and prints a RATIO line per world: detection on
#   against off (goal: at most 1 % slower). TORCH=0 skips the torch peer.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
build=${DT_BUILD_DIR:-build-bench}
worlds=${WORLDS:-"1 2 4"}
reps=${REPS:-3}
steps=${STEPS:-300}
warmup=${WARMUP:-20}
batch=${BATCH:-128}
data=${DATA:-/usr/share/datasets/fashion-mnist}
torch_workers=${TORCH_WORKERS:-0}
peers=$repo/bench/peers
out=${OUT:-$(mktemp /tmp/trainer-bench.XXXXXX.txt)}
py=/usr/bin/python3
before=${BEFORE:-}
stragglers_off=${STRAGGLERS_OFF:-0}
[ -z "$before" ] || [ -x "$before" ] || { echo "BEFORE=$before is not an executable trainer" >&2; exit 2; }

# Same BLAS for both: OpenBLAS (pthread build), one thread (see bench/peers/README.md).
openblas_dir=/usr/lib/x86_64-linux-gnu/openblas-pthread
if [ -d "$openblas_dir" ]; then export LD_LIBRARY_PATH="$openblas_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 DT_NUM_THREADS=1

if [ ! -f "$data/train-images-idx3-ubyte.gz" ]; then
  echo "run_trainer_bench: no Fashion-MNIST in $data (scripts/setup.sh installs dataset-fashion-mnist)" >&2
  exit 2
fi

echo "== building trainer and dtrun in $build" >&2
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF -DDT_BUILD_TESTS=OFF -DDT_BUILD_BENCH=ON -DDT_BUILD_EXAMPLES=ON >/dev/null &&
  cmake --build "$build" -j "${DT_JOBS:-2}" --target trainer dtrun >/dev/null ||
  { echo "run_trainer_bench: building trainer failed" >&2; exit 2; }
dtrun="$build/launcher/dtrun"
trainer="$build/examples/trainer"

have_torch=1
[ "${TORCH:-1}" = 1 ] || have_torch=0
[ $have_torch = 0 ] || "$py" -c "import torch, numpy" 2>/dev/null || { have_torch=0; echo "# torch peer skipped: $py cannot import torch and numpy (scripts/setup.sh --peers)" >&2; }

echo "# run_trainer_bench: worlds=[$worlds] reps=$reps steps=$steps warmup=$warmup global_batch=$batch torch_workers=$torch_workers $(date -u +%FT%TZ) $(getconf _NPROCESSORS_ONLN) cpus" | tee "$out"
run_dtrain() {  # binary, world, impl label[, NAME=VALUE for the environment]
  echo "## world $2, repetition $rep: $3" >&2
  env ${4:-} timeout 900 "$dtrun" --standalone --nproc "$2" --prefix none "$1" --bench --quiet --no-eval \
    --checkpoint-dir none --data "$data" --global-batch "$batch" --steps $((warmup + steps)) --bench-warmup "$warmup" \
    2>>"$out.log" | grep '^RESULT' | sed "s/ impl=dtrain / impl=$3 /" | tee -a "$out"
}
for ((rep = 1; rep <= reps; rep++)); do
  for n in $worlds; do
    run_dtrain "$trainer" "$n" dtrain
    [ -z "$before" ] || run_dtrain "$before" "$n" dtrain-before
    [ "$stragglers_off" = 0 ] || run_dtrain "$trainer" "$n" dtrain-nostragglers DT_STRAGGLER_EVERY=0
    [ $have_torch = 1 ] || continue
    echo "## world $n, repetition $rep: torch" >&2
    timeout 900 "$py" "$peers/torchrun_py311.py" --nproc_per_node "$n" --standalone \
      "$peers/torch_trainer.py" --data "$data" --global-batch "$batch" --steps "$steps" --warmup "$warmup" \
      --workers "$torch_workers" 2>>"$out.log" | grep '^RESULT' | tee -a "$out"
  done
done

echo
echo "# medians ($out; stderr of the runs in $out.log)"
"$py" "$peers/summarize.py" "$out"
[ -z "$before" ] || { echo; "$py" "$peers/summarize.py" "$out" --ratio dtrain:dtrain-before; }
if [ "$stragglers_off" != 0 ]; then
  # summarize.py pairs the two per world; the goal's verdict goes on the end of each line.
  echo
  "$py" "$peers/summarize.py" "$out" --ratio dtrain:dtrain-nostragglers |
    awk 'match($0, /ratio_samples_per_s=[0-9.]+/) { v = substr($0, RSTART + 20, RLENGTH - 20) + 0
           $0 = $0 " goal: at most 1% slower (samples/s >= 0.99): " (v >= 0.99 ? "met" : "MISSED") } { print }'
fi
[ $have_torch = 1 ] || exit 0
echo
"$py" "$peers/summarize.py" "$out" --ratio dtrain:torch
echo
# The table: samples/s per side and the ratio, from the medians.
"$py" - "$out" <<'EOF'
import re, statistics, sys
rates = {}
for line in open(sys.argv[1]):
    if not line.startswith("RESULT trainer "):
        continue
    kv = dict(f.split("=", 1) for f in line.split()[2:] if "=" in f)
    rates.setdefault((int(kv["world"]), kv["impl"]), []).append(float(kv["samples_per_s"]))
print("| world | dtrain samples/s | torch samples/s | dtrain / torch |")
print("|---|---|---|---|")
for world in sorted({w for w, _ in rates}):
    d, t = rates.get((world, "dtrain")), rates.get((world, "torch"))
    dm = statistics.median(d) if d else float("nan")
    tm = statistics.median(t) if t else float("nan")
    print(f"| {world} | {dm:.0f} | {tm:.0f} | {dm / tm:.2f} |")
EOF
