#!/usr/bin/env bash
# Sharded training on the GPT workload, one run: examples/gpt (`gpt --bench` under dtrun) with
# --sharding ddp, zero1, zero2 (ZeRO on DDP's buckets, ddp/zero.h), fsdp and fsdp-keep (the
# fully sharded wrapper with and without resharding after forward, fsdp/fully_shard.h), and
# PyTorch 1.13's ZeroRedundancyOptimizer over DDP on gloo (bench/peers/torch_zero_gpt.py), at
# world 2 and 4: GPT L12-H8-C512-T128 (38.0M parameters: 12 blocks of 3.15M), AdamW with decay
# groups, warm-up + cosine, clipping, global batch BATCH x 128 tokens, one thread per rank.
#
# Memory, per rank (the largest over the ranks):
#   peak_rss_mb   VmHWM of training: both sides reset it (clear_refs) once the model, its wrapper
#                 and optimizer are built, so the whole model every rank builds before sharding
#                 it is not counted (gpt --bench also returns the allocator's idle blocks first)
#   fixed_rss_mb  VmRSS before the model is built: the runtime, the corpus, the process group
#   activation_mb what one forward keeps for backward, measured by DDP in the same run (the
#                 allocator's live bytes after the forward minus before it): the same model and
#                 micro-batch in every mode
#   state         peak_rss - fixed - activations: the model state (parameters, gradients,
#                 optimizer state, gathered units, buffers on the wire, and what the CPU
#                 allocator keeps cached for reuse); state_alloc: the same from the allocator's
#                 live peak instead of RSS (no idle cached blocks)
#   goal          16 Psi / W + 2 units' parameters (4 bytes each), x 1.15 allowed
# Step time: median of the timed steps' mean (gpt --bench: after WARMUP steps).
#
# Prints the RESULT lines, one RATIO line per comparison and a table with the goals:
#   fsdp state <= 1.15 x goal; fsdp step_ms <= 1.25 x ddp's; zero1 faster and smaller than torch-zero.
#
# usage: bench/run_sharded_bench.sh   (env: WORLDS="2 4" STEPS=5 WARMUP=2 BATCH=8 REPS=1
#                                      MODES="ddp zero1 zero2 fsdp fsdp-keep" DT_BUILD_DIR=build-bench OUT=file)
#   quick: STEPS=3 WARMUP=1 BATCH=4 (about 3 minutes here)
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
build=${DT_BUILD_DIR:-build-bench}
worlds=${WORLDS:-"2 4"}
steps=${STEPS:-5}
warmup=${WARMUP:-2}
batch=${BATCH:-8}
reps=${REPS:-1}
modes=${MODES:-"ddp zero1 zero2 fsdp fsdp-keep"}
layers=${LAYERS:-12}
width=${WIDTH:-512}
heads=${HEADS:-8}
context=${CONTEXT:-128}
peers=$repo/bench/peers
out=${OUT:-$(mktemp /tmp/sharded-bench.XXXXXX.txt)}
py=/usr/bin/python3

openblas_dir=/usr/lib/x86_64-linux-gnu/openblas-pthread
if [ -d "$openblas_dir" ]; then export LD_LIBRARY_PATH="$openblas_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 DT_NUM_THREADS=1

if [ ! -d /usr/share/games/fortunes ]; then
  echo "run_sharded_bench: no fortunes in /usr/share/games/fortunes (scripts/setup.sh installs the fortunes package)" >&2
  exit 2
fi
echo "== building gpt and dtrun in $build" >&2
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDT_BUILD_EXAMPLES=ON >/dev/null &&
  cmake --build "$build" -j "${DT_JOBS:-2}" --target gpt dtrun >/dev/null ||
  { echo "run_sharded_bench: building failed" >&2; exit 2; }
dtrun="$build/launcher/dtrun"
gpt="$build/examples/gpt"
have_torch=1
"$py" -c "import torch" 2>/dev/null || { have_torch=0; echo "# torch peer skipped: $py cannot import torch (scripts/setup.sh --peers)" >&2; }
model=(--layers "$layers" --width "$width" --heads "$heads" --context "$context")
common=(--steps "$steps" --warmup 1 --global-batch "$batch")

echo "# run_sharded_bench: worlds=[$worlds] modes=[$modes] steps=$steps warmup=$warmup global_batch=$batch model=L$layers-C$width $(date -u +%FT%TZ) $(getconf _NPROCESSORS_ONLN) cpus" | tee "$out"
for ((rep = 1; rep <= reps; rep++)); do
  for n in $worlds; do
    for mode in $modes; do
      echo "## world $n, $mode, repetition $rep" >&2
      timeout 1200 "$dtrun" --standalone --nproc "$n" --prefix none "$gpt" --bench --quiet --checkpoint-dir none \
        --bench-warmup "$warmup" --eval-every 0 --eval-windows 8 --sample-tokens 0 --sharding "$mode" \
        "${model[@]}" "${common[@]}" 2>>"$out.log" | grep '^RESULT' | tee -a "$out"
    done
    [ $have_torch = 1 ] || continue
    echo "## world $n, torch ZeroRedundancyOptimizer, repetition $rep" >&2
    (cd "$peers" && timeout 1200 "$py" torchrun_py311.py --nproc_per_node "$n" --standalone torch_zero_gpt.py \
      --bench-warmup "$warmup" "${model[@]}" "${common[@]}" 2>>"$out.log") | grep '^RESULT' | tee -a "$out"
  done
done

echo
echo "# $out (stderr of the runs in $out.log)"
"$py" - "$out" "$layers" "$width" <<'PYEOF'
import statistics, sys
path, layers, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
runs = {}
for line in open(path):
    if not line.startswith("RESULT gpt "):
        continue
    kv = dict(f.split("=", 1) for f in line.split()[2:] if "=" in f)
    name = kv["sharding"] if kv["impl"] == "dtrain" else kv["impl"]
    runs.setdefault((int(kv["world"]), name), []).append(kv)
def med(world, name, key):
    rows = runs.get((world, name), [])
    vals = [float(r[key]) for r in rows if key in r]
    return statistics.median(vals) if vals else float("nan")
unit = 12 * width * width + 13 * width  # one block's parameters
ratios = []
print("| world | mode | step ms | x ddp | peak RSS MiB | fixed | activations (ddp) | state (RSS) | state (alloc) | goal 16Psi/W + 2 units | state / goal |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for world in sorted({w for w, _ in runs}):
    psi = med(world, "ddp", "parameters")
    act = med(world, "ddp", "activation_mb")
    ddp_ms = med(world, "ddp", "step_ms")
    goal = (16 * psi / world + 2 * 4 * unit) / 2**20
    for name in ("ddp", "zero1", "zero2", "fsdp", "fsdp-keep", "torch-zero"):
        if (world, name) not in runs:
            continue
        ms, rss, fixed = med(world, name, "step_ms"), med(world, name, "peak_rss_mb"), med(world, name, "fixed_rss_mb")
        state = rss - fixed - act
        alloc = med(world, name, "peak_alloc_mb") - act
        print(f"| {world} | {name} | {ms:.0f} | {ms / ddp_ms:.2f} | {rss:.0f} | {fixed:.0f} | {act:.0f} | {state:.0f} | "
              f"{alloc:.0f} | {goal:.0f} | {state / goal:.2f} |")
        if name != "ddp":
            ratios.append(f"RATIO step_ms {name}/ddp world={world} value={ms / ddp_ms:.3f}")
        if name.startswith("fsdp"):
            ratios.append(f"RATIO model_state {name}/goal world={world} value={state / goal:.3f} alloc={alloc / goal:.3f}")
    if (world, "zero1") in runs and (world, "torch-zero") in runs:
        ratios.append(f"RATIO step_ms zero1/torch-zero world={world} value={med(world, 'zero1', 'step_ms') / med(world, 'torch-zero', 'step_ms'):.3f}")
        ratios.append(f"RATIO peak_rss zero1/torch-zero world={world} value={med(world, 'zero1', 'peak_rss_mb') / med(world, 'torch-zero', 'peak_rss_mb'):.3f}")
        z_state = med(world, 'zero1', 'peak_rss_mb') - med(world, 'zero1', 'fixed_rss_mb')
        t_state = med(world, 'torch-zero', 'peak_rss_mb') - med(world, 'torch-zero', 'fixed_rss_mb')
        ratios.append(f"RATIO peak_minus_fixed zero1/torch-zero world={world} value={z_state / t_state:.3f}")
print()
print("\n".join(ratios))
print()
print("Goals: fsdp state / goal <= 1.15; fsdp step ms <= 1.25 x ddp; zero1 step ms and peak RSS below torch-zero's.")
# dtrain's GEMMs are OpenBLAS's: say which kernels these step times measured (docs/tensor.md).
kernels = sorted({r["blas"] for rows in runs.values() for r in rows if "blas" in r})
if kernels:
    print(f"dtrain's OpenBLAS kernels: {', '.join(kernels)}")
PYEOF
