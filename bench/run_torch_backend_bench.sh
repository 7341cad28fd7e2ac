#!/usr/bin/env bash
# PyTorch programs over torch.distributed's "gloo" backend and over "dtrain" (dtrain_torch,
# torch_shim/), one run, the same programs and launcher (torchrun), interleaved so that machine
# load hits both alike:
#   * DDP training step: bench/peers/torch_ddp_mlp.py --modes ddp (8 x Linear(1024,1024)+ReLU,
#     25 MB buckets, batch 32 per rank) and bench/peers/torch_gpt.py (the GPT of examples/gpt,
#     3.26M parameters, global batch 16), world 2 and 4;
#   * all_reduce through torch.distributed: bench/peers/torch_allreduce.py, the size sweep.
# Prints the RESULT lines, the medians, RATIO lines (dtrain / gloo: below 1 is faster for times)
# with each goal's verdict, and a table.
# Goals (issue 42): a DDP step over dtrain at most 0.8x the step over gloo; an all_reduce of up to
# 64 KiB at most 0.3x gloo's time.
#
# usage: bench/run_torch_backend_bench.sh
#   env: WORLDS="2 4" REPS=3 STEPS=30 GPT_STEPS=25 SIZES=4K,64K,1M,16M DT_BUILD_DIR=build-bench OUT=file
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
build=${DT_BUILD_DIR:-build-bench}
worlds=${WORLDS:-"2 4"}
reps=${REPS:-3}
steps=${STEPS:-30}
gpt_steps=${GPT_STEPS:-25}
sizes=${SIZES:-4K,64K,1M,16M}
peers=$repo/bench/peers
out=${OUT:-$(mktemp /tmp/torch-backend-bench.XXXXXX.txt)}
py=/usr/bin/python3

# Same BLAS and one compute thread per rank on both sides (see bench/peers/README.md).
openblas_dir=/usr/lib/x86_64-linux-gnu/openblas-pthread
if [ -d "$openblas_dir" ]; then export LD_LIBRARY_PATH="$openblas_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 DT_NUM_THREADS=1

"$py" -c "import torch" 2>/dev/null || { echo "run_torch_backend_bench: $py cannot import torch (scripts/setup.sh)" >&2; exit 2; }
echo "== building the dtrain_torch module in $build" >&2
configure=(-DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF -DDT_BUILD_TORCH=ON)
[ -f "$build/CMakeCache.txt" ] && configure=()  # an existing build keeps its configuration
cmake -S . -B "$build" "${configure[@]}" >/dev/null &&
  cmake --build "$build" -j "${DT_JOBS:-2}" --target dt_torch_python >/dev/null ||
  { echo "run_torch_backend_bench: building dt_torch_python failed" >&2; exit 2; }
build_abs=$build
[[ "$build_abs" = /* ]] || build_abs=$repo/$build
export PYTHONPATH="$build_abs/torch_shim/python${PYTHONPATH:+:$PYTHONPATH}"

torchrun() {
  timeout 900 "$py" "$peers/torchrun_py311.py" --nproc_per_node "$1" --standalone "${@:2}" 2>>"$out.log" |
    grep '^RESULT' | tee -a "$out"
}

echo "# run_torch_backend_bench: worlds=[$worlds] reps=$reps steps=$steps gpt_steps=$gpt_steps sizes=$sizes $(date -u +%FT%TZ) $(getconf _NPROCESSORS_ONLN) cpus" | tee "$out"
for ((rep = 1; rep <= reps; rep++)); do
  for n in $worlds; do
    for backend in gloo dtrain; do
      echo "## world $n, repetition $rep, backend $backend" >&2
      torchrun "$n" "$peers/torch_ddp_mlp.py" --modes ddp --steps "$steps" --backend "$backend"
      torchrun "$n" "$peers/torch_gpt.py" --steps "$gpt_steps" --bench-warmup 5 --backend "$backend"
      torchrun "$n" "$peers/torch_allreduce.py" --ops allreduce --sizes "$sizes" --backend "$backend"
    done
  done
done

echo
echo "# medians ($out; stderr of the runs in $out.log)"
"$py" "$peers/summarize.py" "$out"
echo
# The goals' verdicts go on the end of each RATIO line.
{
  "$py" "$peers/summarize.py" "$out" --ratio dtrain_torch-ddp:torch-ddp
  "$py" "$peers/summarize.py" "$out" --ratio dtrain_torch:torch
} | awk 'match($0, /ratio_step_ms=[0-9.]+/) { v = substr($0, RSTART + 14, RLENGTH - 14) + 0
           $0 = $0 " goal: DDP step at most 0.8x gloo: " (v <= 0.8 ? "met" : "MISSED") } { print }'
"$py" "$peers/summarize.py" "$out" --ratio torch-dtrain:torch-gloo |
  awk 'match($0, /ratio_time_us=[0-9.]+/) && match($0, /bytes=[0-9]+/) {
         b = substr($0, RSTART + 6, RLENGTH - 6) + 0
         match($0, /ratio_time_us=[0-9.]+/); v = substr($0, RSTART + 14, RLENGTH - 14) + 0
         if (b <= 65536) $0 = $0 " goal: at most 0.3x gloo up to 64 KiB: " (v <= 0.3 ? "met" : "MISSED") } { print }'
echo
"$py" - "$out" "$peers" <<'EOF'
import sys
sys.path.insert(0, sys.argv[2])
from summarize import median_metrics, read_results  # noqa: E402
rows = {}
for (workload, identity), runs in read_results([sys.argv[1]], ()).items():
    kv, medians = dict(identity), median_metrics(runs)
    backend = "dtrain" if "dtrain" in kv["impl"] else "gloo"
    if workload == "allreduce":
        what, ms = f"all_reduce {int(kv['bytes']) // 1024} KiB", medians["time_us"] / 1e3
    else:
        what, ms = {"ddp_mlp": "DDP step, MLP", "gpt": "DDP step, GPT"}[workload], medians["step_ms"]
    rows.setdefault((what, int(kv["world"])), {})[backend] = ms
print("| what | world | gloo ms | dtrain ms | dtrain / gloo |")
print("|---|---|---|---|---|")
nan = float("nan")
def order(row):  # the DDP steps, then the all_reduce sizes in ascending order, world by world
    (what, world), _ = row
    return what.startswith("all_reduce"), world, int("".join(c for c in what if c.isdigit()) or 0), what


for (what, world), by in sorted(rows.items(), key=order):
    print(f"| {what} | {world} | {by.get('gloo', nan):.3f} | {by.get('dtrain', nan):.3f} | "
          f"{by.get('dtrain', nan) / by.get('gloo', nan):.2f} |")
EOF
