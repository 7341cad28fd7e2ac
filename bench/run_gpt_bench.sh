#!/usr/bin/env bash
# The GPT workload side by side, one run: examples/gpt (`gpt --bench` under dtrun) against the
# same job in PyTorch 1.13 under torchrun (bench/peers/torch_gpt.py): Debian's fortunes, byte
# tokens, the same random windows, GPT L4-H4-C256-T128 (3.26M parameters, tied output layer),
# AdamW with decay groups, warm-up + cosine, clipping at 1, global batch 16 x 128 tokens, DDP
# over gloo (dtrain: its shared-memory backend, what a one-host job gets), one thread per rank,
# at world 1, 2 and 4, each side in fp32 and in bf16 mixed precision (dtrain: gpt --precision bf16,
# dt::autocast; PyTorch: torch.cpu.amp.autocast(dtype=torch.bfloat16)). Each PyTorch run goes
# with OPENBLAS_CORETYPE as the environment has it, unset where the environment sets it (some
# environments force an older core than the CPU's, which halves OpenBLAS's speed), and set to
# the core that fits the CPU (SkylakeX for AVX-512, Haswell for AVX2) where that differs (a CPU
# newer than OpenBLAS 0.3.21 gets its SSE3 kernels unset), each in that command alone; the
# fastest is the peer. Both sides start from the same weights (dtrain's --init-out, the
# peer's --init) and train STEPS steps; the first WARMUP are not timed. Then the forward +
# backward of one block and of the attention core alone (gpt_bench vs torch_gpt.py --micro)
# at the per-rank batches of world 1 and 4. Repetitions are interleaved.
#
# Prints the RESULT lines, medians, RATIO lines (dtrain / torch) and a table: tokens/s (goals:
# dtrain fp32 >= 1.5x PyTorch fp32; dtrain bf16 >= 2x PyTorch fp32 and >= 1.3x PyTorch bf16
# autocast, each a RATIO line saying met or MISSED), validation loss after the same steps
# (goal: within 2 %), peak RSS per rank (goal: dtrain <= torch), and the micro timings.
#
# usage: bench/run_gpt_bench.sh   (env: WORLDS="1 2 4" REPS=2 STEPS=100 WARMUP=10 BATCH=16 MICRO_REPS=20
#                                   PRECISIONS="fp32 bf16" DT_BUILD_DIR=build-bench OUT=file)
#   MICRO_REPS=0 leaves the micro timings out. NO_BUILD=1 runs the binaries already in the build
#   directory (one configured with tests, say, that this script's configure would change).
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
precisions=${PRECISIONS:-"fp32 bf16"}
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
if [ "${NO_BUILD:-0}" = 1 ]; then
  echo "== NO_BUILD=1: the binaries in $build as they are" >&2
else
  echo "== building gpt, gpt_bench and dtrun in $build" >&2
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF -DDT_BUILD_TESTS=OFF -DDT_BUILD_BENCH=ON -DDT_BUILD_EXAMPLES=ON >/dev/null &&
    cmake --build "$build" -j "${DT_JOBS:-2}" --target gpt gpt_bench dtrun >/dev/null ||
    { echo "run_gpt_bench: building failed" >&2; exit 2; }
fi
dtrun="$build/launcher/dtrun"
gpt="$build/examples/gpt"

have_torch=1
"$py" -c "import torch" 2>/dev/null || { have_torch=0; echo "# torch peer skipped: $py cannot import torch (scripts/setup.sh --peers)" >&2; }
init=$(mktemp /tmp/gpt-init.XXXXXX.safetensors)
common=(--steps "$steps" --warmup "$lr_warmup" --global-batch "$batch")

echo "# run_gpt_bench: worlds=[$worlds] precisions=[$precisions] OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-(unset)} reps=$reps steps=$steps warmup=$warmup global_batch=$batch $(date -u +%FT%TZ) $(getconf _NPROCESSORS_ONLN) cpus" | tee "$out"
run_dtrain() {  # binary, world, impl label, precision
  echo "## world $2, repetition $rep: $3 $4" >&2
  local precision=()  # fp32 without the flag, so that a BEFORE build older than --precision runs
  [ "$4" = fp32 ] || precision=(--precision "$4")
  timeout 900 "$dtrun" --standalone --nproc "$2" --prefix none "$1" --bench --quiet --checkpoint-dir none \
    --bench-warmup "$warmup" --eval-every 0 --sample-tokens 0 --init-out "$init" "${precision[@]}" "${common[@]}" \
    2>>"$out.log" | grep '^RESULT' | sed "s/ impl=dtrain / impl=$3 /" | tee -a "$out"
}
# PyTorch's OpenBLAS settings: the environment's; unset, where the environment sets one; and the
# core that fits this CPU's vector width, where the environment does not already force it (a CPU
# model newer than OpenBLAS 0.3.21 gets its SSE3 fallback when unset: the peer would be slow for
# a reason a user fixes with one variable, so that run is the peer's best).
fit_core=$(grep -qw avx512f /proc/cpuinfo && echo SkylakeX || { grep -qw avx2 /proc/cpuinfo && echo Haswell; })
torch_coretypes=(env)
[ -z "${OPENBLAS_CORETYPE:-}" ] || torch_coretypes+=(unset)
[ -z "$fit_core" ] || [ "${OPENBLAS_CORETYPE:-}" = "$fit_core" ] || torch_coretypes+=("$fit_core")
run_torch() {  # world, precision, env|unset|a core (OPENBLAS_CORETYPE)
  echo "## world $1, repetition $rep: torch $2, OPENBLAS_CORETYPE $3" >&2
  local setting=()
  case $3 in
    env) ;;
    unset) setting=(-u OPENBLAS_CORETYPE) ;;
    *) setting=("OPENBLAS_CORETYPE=$3") ;;
  esac
  timeout 900 env "${setting[@]}" "$py" "$peers/torchrun_py311.py" --nproc_per_node "$1" --standalone "$peers/torch_gpt.py" \
    --bench-warmup "$warmup" --init "$init" --precision "$2" "${common[@]}" 2>>"$out.log" | grep '^RESULT' |
    sed "s/\$/ openblas_coretype=$3/" | tee -a "$out"
}
for ((rep = 1; rep <= reps; rep++)); do
  for n in $worlds; do
    for p in $precisions; do
      run_dtrain "$gpt" "$n" dtrain "$p"
      [ -z "$before" ] || [ "$p" != fp32 ] || run_dtrain "$before" "$n" dtrain-before fp32
      [ $have_torch = 1 ] || continue
      for c in "${torch_coretypes[@]}"; do run_torch "$n" "$p" "$c"; done
    done
  done
  [ "$micro_reps" -gt 0 ] || continue
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
    if fields[1] == "gpt":  # one row per side and precision (and PyTorch's OpenBLAS setting)
        # dtrain's --precision bf16 says bf16-as-fp32 where its bf16 products run in float32 (no
        # bf16 instructions, or slower ones): still the bf16 run, which the table says it was.
        key += (kv.get("precision", "fp32").replace("bf16-as-fp32", "bf16"), kv.get("openblas_coretype", ""))
    rows.setdefault(key, []).append(kv)
med = lambda key, metric: statistics.median(float(r[metric]) for r in rows[key]) if key in rows else float("nan")


coretypes = sorted({k[4] for k in rows if k[0] == "gpt" and k[2] == "torch" and len(k) == 5}, key=lambda c: (c != "env", c))


def peer(w, precision):
    """PyTorch's fastest median over its OpenBLAS settings: (key, which)."""
    runs = [("gpt", w, "torch", precision, c) for c in coretypes if ("gpt", w, "torch", precision, c) in rows]
    if not runs:
        return None, "-"
    best = max(runs, key=lambda k: med(k, "tokens_per_s"))
    return best, best[4]


print(f"| world | precision | dtrain tokens/s | torch tokens/s (OPENBLAS_CORETYPE {' / '.join(coretypes)}) | peer | ratio | dtrain val loss | "
      "torch val loss | diff (goal <= 2 %) | dtrain peak RSS MiB | torch peak RSS MiB |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
worlds = sorted({k[1] for k in rows if k[0] == "gpt"}, key=int)
for w in worlds:
    for dp, tp in (("fp32", "fp32"), ("bf16", "bf16-autocast")):
        d = ("gpt", w, "dtrain", dp, "")
        t, which = peer(w, tp)
        if d not in rows or t is None:
            continue
        each = " / ".join(f'{med(("gpt", w, "torch", tp, c), "tokens_per_s"):.0f}' for c in coretypes)
        dv, tv = med(d, "val_loss_nats"), med(t, "val_loss_nats")
        ran = rows[d][0].get("precision", dp)
        print(f"| {w} | {ran} / {tp} | {med(d, 'tokens_per_s'):.0f} | {each} | {which} "
              f"| {med(d, 'tokens_per_s') / med(t, 'tokens_per_s'):.2f} | {dv:.4f} | {tv:.4f} | {100 * abs(dv - tv) / tv:.2f} % "
              f"| {med(d, 'peak_rss_mb'):.0f} | {med(t, 'peak_rss_mb'):.0f} |")
print()
# The goals, each against the fastest of PyTorch's OpenBLAS settings.
for w in worlds:
    for dp, tp, goal in (("fp32", "fp32", 1.5), ("bf16", "fp32", 2.0), ("bf16", "bf16-autocast", 1.3)):
        d = ("gpt", w, "dtrain", dp, "")
        t, which = peer(w, tp)
        if d not in rows or t is None:
            continue
        ratio = med(d, "tokens_per_s") / med(t, "tokens_per_s")
        print(f"RATIO gpt world={w} a=dtrain-{dp} b=torch-{tp} b_openblas_coretype={which} ratio_tokens_per_s={ratio:.3f} "
              f"goal>={goal} {'met' if ratio >= goal else 'MISSED'}")
if not any(k[0] in ("gpt_block", "gpt_attention") for k in rows):  # MICRO_REPS=0
    sys.exit(0)
print()
print("| forward + backward | batch | dtrain ms | torch ms | torch / dtrain |")
print("|---|---|---|---|---|")
for kind in ("gpt_block", "gpt_attention"):
    for b in sorted({k[1] for k in rows if k[0] == kind}, key=int, reverse=True):
        d, t = med((kind, b, "dtrain"), "step_ms"), med((kind, b, "torch"), "step_ms")
        print(f"| {kind[4:]} | {b} | {d:.2f} | {t:.2f} | {t / d:.2f} |")
PYEOF
