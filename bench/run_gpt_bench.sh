#!/usr/bin/env bash
# The GPT workload side by side, one run: examples/gpt (`gpt --bench` under dtrun) against the
# same job in PyTorch 1.13 under torchrun (bench/peers/torch_gpt.py): Debian's fortunes, byte
# tokens, the same random windows, GPT L4-H4-C256-T128 (3.26M parameters, tied output layer),
# AdamW with decay groups, warm-up + cosine, clipping at 1, global batch 16 x 128 tokens, DDP
# over gloo (dtrain: its shared-memory backend, what a one-host job gets), one thread per rank,
# at world 1, 2 and 4. Both sides start from the same weights (dtrain's --init-out, the
# peer's --init) and train STEPS steps; the first WARMUP are not timed. Then the forward +
# backward of one block and of the attention core alone (gpt_bench vs torch_gpt.py --micro)
# at the per-rank batches of world 1 and 4. Repetitions are interleaved.
#
# Prints the RESULT lines, medians, RATIO lines (dtrain / torch) and a table: tokens/s (goal:
# dtrain >= 1.5x), validation loss after the same steps (goal: within 2 %), peak RSS per rank
# (goal: dtrain <= torch), and the micro timings.
#
# usage: bench/run_gpt_bench.sh   (env: WORLDS="1 2 4" REPS=2 STEPS=100 WARMUP=10 BATCH=16 MICRO_REPS=20
#                                   DT_BUILD_DIR=build-bench OUT=file)
#   BEFORE=path/to/an/older/gpt also runs that build in the same loop, as impl=dtrain-before
#   (after dtrain at each world and repetition), and prints the dtrain : dtrain-before ratios.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
build=${DT_BUILD_DIR:-build-bench}
worlds=${WORLDS:-"1 2 4"}
reps=${REPS:-2}
steps=${STEPS:-100}
warmup=${WARMUP:-10}
batch=${BATCH:-16}
micro_reps=${MICRO_REPS:-20}
peers=$repo/bench/peers
out=${OUT:-$(mktemp /tmp/gpt-bench.XXXXXX.txt)}
py=/usr/bin/python3
before=${BEFORE:-}
[ -z "$before" ] || [ -x "$before" ] || { echo "BEFORE=$before is not an executable gpt" >&2; exit 2; }
lr_warmup=$((steps / 10))

# Same BLAS for both: OpenBLAS (pthread build), one thread (see bench/peers/README.md).
openblas_dir=/usr/lib/x86_64-linux-gnu/openblas-pthread
if [ -d "$openblas_dir" ]; then export LD_LIBRARY_PATH="$openblas_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 DT_NUM_THREADS=1

if [ ! -d /usr/share/games/fortunes ]; then
  echo "run_gpt_bench: no fortunes in /usr/share/games/fortunes (scripts/setup.sh installs the fortunes package)" >&2
  exit 2
fi
echo "== building gpt, gpt_bench and dtrun in $build" >&2
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF -DDT_BUILD_TESTS=OFF -DDT_BUILD_BENCH=ON -DDT_BUILD_EXAMPLES=ON >/dev/null &&
  cmake --build "$build" -j "${DT_JOBS:-2}" --target gpt gpt_bench dtrun >/dev/null ||
  { echo "run_gpt_bench: building failed" >&2; exit 2; }
dtrun="$build/launcher/dtrun"
gpt="$build/examples/gpt"

have_torch=1
"$py" -c "import torch" 2>/dev/null || { have_torch=0; echo "# torch peer skipped: $py cannot import torch (scripts/setup.sh --peers)" >&2; }
init=$(mktemp /tmp/gpt-init.XXXXXX.safetensors)
common=(--steps "$steps" --warmup "$lr_warmup" --global-batch "$batch")

echo "# run_gpt_bench: worlds=[$worlds] reps=$reps steps=$steps warmup=$warmup global_batch=$batch $(date -u +%FT%TZ) $(getconf _NPROCESSORS_ONLN) cpus" | tee "$out"
run_dtrain() {  # binary, world, impl label
  echo "## world $2, repetition $rep: $3" >&2
  timeout 900 "$dtrun" --standalone --nproc "$2" --prefix none "$1" --bench --quiet --checkpoint-dir none \
    --bench-warmup "$warmup" --eval-every 0 --sample-tokens 0 --init-out "$init" "${common[@]}" \
    2>>"$out.log" | grep '^RESULT' | sed "s/ impl=dtrain / impl=$3 /" | tee -a "$out"
}
for ((rep = 1; rep <= reps; rep++)); do
  for n in $worlds; do
    run_dtrain "$gpt" "$n" dtrain
    [ -z "$before" ] || run_dtrain "$before" "$n" dtrain-before
    [ $have_torch = 1 ] || continue
    echo "## world $n, repetition $rep: torch" >&2
    timeout 900 "$py" "$peers/torchrun_py311.py" --nproc_per_node "$n" --standalone "$peers/torch_gpt.py" \
      --bench-warmup "$warmup" --init "$init" "${common[@]}" 2>>"$out.log" | grep '^RESULT' | tee -a "$out"
  done
  for b in $batch $((batch / 4)); do
    for m in block attention; do
      "$build/bench/gpt_bench" --micro "$m" --batch "$b" --reps "$micro_reps" | tee -a "$out"
      [ $have_torch = 1 ] && "$py" "$peers/torch_gpt.py" --micro "$m" --batch "$b" --reps "$micro_reps" 2>>"$out.log" | tee -a "$out"
    done
  done
done
rm -f "$init"

echo
echo "# medians ($out; stderr of the runs in $out.log)"
"$py" "$peers/summarize.py" "$out"
[ -z "$before" ] || { echo; "$py" "$peers/summarize.py" "$out" --ratio dtrain:dtrain-before; }
[ $have_torch = 1 ] || exit 0
echo
"$py" "$peers/summarize.py" "$out" --ratio dtrain:torch
echo
"$py" - "$out" <<'PYEOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    if not line.startswith("RESULT "):
        continue
    fields = line.split()
    kv = dict(f.split("=", 1) for f in fields[2:] if "=" in f)
    key = (fields[1], kv.get("world", kv.get("batch")), kv["impl"])
    rows.setdefault(key, []).append(kv)
med = lambda key, metric: statistics.median(float(r[metric]) for r in rows[key]) if key in rows else float("nan")
print("| world | dtrain tokens/s | torch tokens/s | ratio (goal >= 1.5) | dtrain val loss | torch val loss | diff (goal <= 2 %) | dtrain peak RSS MiB | torch peak RSS MiB |")
print("|---|---|---|---|---|---|---|---|---|")
for w in sorted({k[1] for k in rows if k[0] == "gpt"}, key=int):
    d, t = ("gpt", w, "dtrain"), ("gpt", w, "torch")
    dv, tv = med(d, "val_loss_nats"), med(t, "val_loss_nats")
    print(f"| {w} | {med(d, 'tokens_per_s'):.0f} | {med(t, 'tokens_per_s'):.0f} | {med(d, 'tokens_per_s') / med(t, 'tokens_per_s'):.2f} "
          f"| {dv:.4f} | {tv:.4f} | {100 * abs(dv - tv) / tv:.2f} % | {med(d, 'peak_rss_mb'):.0f} | {med(t, 'peak_rss_mb'):.0f} |")
print()
print("| forward + backward | batch | dtrain ms | torch ms | torch / dtrain |")
print("|---|---|---|---|---|")
for kind in ("gpt_block", "gpt_attention"):
    for b in sorted({k[1] for k in rows if k[0] == kind}, key=int, reverse=True):
        d, t = med((kind, b, "dtrain"), "step_ms"), med((kind, b, "torch"), "step_ms")
        print(f"| {kind[4:]} | {b} | {d:.2f} | {t:.2f} | {t / d:.2f} |")
PYEOF
