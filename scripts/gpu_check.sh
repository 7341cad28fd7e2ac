#!/usr/bin/env bash
# The GPU check, for a machine with NVIDIA GPUs (CI machines have none): builds the CUDA
# configuration, runs the CUDA and NCCL tests, trains with --device cuda under dtrun, and prints
#   * NCCL allreduce time, algbw and busbw by size through dtrain's ProcessGroup (one rank per
#     GPU; with one GPU, world 1 measures launch and synchronisation overhead only), and
#   * the MLP training step on the GPU (examples/trainer --bench),
# each side by side with PyTorch (bench/peers/torch_allreduce.py, torch_trainer.py) when this
# machine's python3 has torch with CUDA. Every stage has its own time limit, so the whole check
# stays under 8 minutes; a stage that fails is reported and the check goes on.
#
# usage: scripts/gpu_check.sh [--setup]   (--setup first runs scripts/setup.sh)
#   env: DT_BUILD_DIR=build-gpu  DT_JOBS=<cores>  STEPS=300  DATA=/usr/share/datasets/fashion-mnist
#        OUT=<file for the RESULT lines>
# Exit status: 0 when every stage passed, 1 when one failed, 2 when there is no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
build=${DT_BUILD_DIR:-build-gpu}
jobs=${DT_JOBS:-$(nproc)}
steps=${STEPS:-300}
data=${DATA:-/usr/share/datasets/fashion-mnist}
out=${OUT:-$(mktemp /tmp/gpu-check.XXXXXX.txt)}
log=$(mktemp /tmp/gpu-check-stage.XXXXXX.log)
peers=$repo/bench/peers
started=$SECONDS
failed=()

stage() { echo; echo "== $* ($((SECONDS - started)) s)"; }
# run LIMIT NAME CMD...: runs CMD under a time limit and records a failure by name.
# Not in a pipeline (a pipeline's subshell would lose the record): callers redirect.
run() {
  local limit=$1 name=$2
  shift 2
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  if [ $rc -ne 0 ]; then
    [ $rc -eq 124 ] && echo "gpu_check: $name ran past its ${limit} s limit" >&2 || echo "gpu_check: $name failed (exit $rc)" >&2
    failed+=("$name")
  fi
  return $rc
}

if [ "${1:-}" = "--setup" ]; then
  stage "setup"
  scripts/setup.sh || { echo "gpu_check: scripts/setup.sh failed" >&2; exit 1; }
fi

stage "GPUs"
gpus=0
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [ "$gpus" -eq 0 ]; then
  echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi lists none); this check needs one" >&2
  exit 2
fi
world=$((gpus > 8 ? 8 : gpus))
echo "gpu_check: $gpus GPU(s); the distributed stages run $world rank(s), one per GPU"

stage "build ($build, CUDA and NCCL on, -j$jobs)"
# One architecture (this machine's) keeps nvcc's share of the build short.
run 300 configure cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=ON -DDT_USE_NCCL=ON \
  -DCMAKE_CUDA_ARCHITECTURES=native -DDT_BUILD_TESTS=ON -DDT_BUILD_EXAMPLES=ON -DDT_BUILD_BENCH=ON >/dev/null || exit 1
if ! run 300 build cmake --build "$build" -j "$jobs" >"$log" 2>&1; then
  grep -E 'error|warning' "$log" | head -40
  echo "gpu_check: the build failed (log: $log)" >&2
  exit 1
fi
grep -E 'warning' "$log" | head -20

stage "CUDA and NCCL tests"
# The GPU tests, and the suites a GPU changes (routing, DDP on CUDA tensors); on a GPU machine
# none of them may skip for want of a device.
run 240 tests ctest --test-dir "$build" -j 4 --output-on-failure --timeout 200 \
  -R 'Cuda|Nccl|CachingAllocator|Device\.|Module\.To|ProcessGroup\.|Work\.|TrainerE2E\.Cuda' >"$log" 2>&1
grep -E '^[0-9]+% tests passed|\*\*\*Failed|Skipped|Not Run|Timeout' "$log"
echo "gpu_check: the tests that skipped here (with one GPU, only those that need more GPUs may):"
grep -h -A2 'Skipped' "$log" | grep -v '^--$' | head -40

stage "trainer: $steps steps on cuda, $world rank(s), under dtrun"
dtrun=$build/launcher/dtrun
trainer=$build/examples/trainer
run 120 trainer "$dtrun" --standalone --nproc "$world" "$trainer" --device cuda --steps "$steps" --log-every 100 \
  --checkpoint-dir none --data "$data"

stage "NCCL allreduce through dtrain ($world rank(s))"
sizes=4K,64K,1M,16M,64M,256M
: >"$out"
run 120 nccl-bench "$dtrun" --standalone --nproc "$world" --prefix none "$build/bench/collectives_bench" \
  --backend nccl --ops allreduce --sizes "$sizes" >"$log" 2>&1
grep -v '^RESULT' "$log" | tail -20
grep '^RESULT' "$log" | tee -a "$out"

stage "MLP step on cuda (trainer --bench)"
run 120 trainer-bench "$dtrun" --standalone --nproc "$world" --prefix none "$trainer" --device cuda --bench --quiet \
  --no-eval --checkpoint-dir none --data "$data" --steps $((steps + 20)) --bench-warmup 20 >"$log" 2>&1
grep -v '^RESULT' "$log" | tail -5
grep '^RESULT' "$log" | tee -a "$out"

have_torch=0
if python3 -c 'import torch, numpy, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  have_torch=1
  torchrun=(python3 -m torch.distributed.run)
  # Debian's python3-torch ships no torchrun for python3.11; our launcher shim covers it.
  python3 -c 'import torch.distributed.run' 2>/dev/null || torchrun=(python3 "$peers/torchrun_py311.py")
  stage "PyTorch peers: NCCL allreduce and the MLP step on cuda"
  run 120 torch-nccl "${torchrun[@]}" --nproc_per_node "$world" --standalone "$peers/torch_allreduce.py" \
    --backend nccl --ops allreduce --sizes "$sizes" >"$log" 2>&1
  grep '^RESULT' "$log" | tee -a "$out" || tail -5 "$log"
  run 120 torch-trainer "${torchrun[@]}" --nproc_per_node "$world" --standalone "$peers/torch_trainer.py" \
    --device cuda --data "$data" --steps "$steps" --warmup 20 >"$log" 2>&1
  grep '^RESULT' "$log" | tee -a "$out" || tail -5 "$log"
else
  echo; echo "# PyTorch peers skipped: python3 here has no torch with CUDA"
fi

stage "summary"
python3 - "$out" <<'EOF'
import re, sys
rows = {}
for line in open(sys.argv[1]):
    if not line.startswith("RESULT "):
        continue
    fields = line.split()
    kv = dict(f.split("=", 1) for f in fields[2:] if "=" in f)
    rows.setdefault(fields[1], []).append(kv)

def impl_of(kv, side):
    return kv["impl"].startswith(side)

ar = rows.get("allreduce", [])
if ar:
    print("NCCL allreduce, float32 sum (busbw = algbw * 2(n-1)/n; world 1: no transfer, busbw 0)")
    print("| bytes | world | dtrain time us | dtrain algbw GB/s | dtrain busbw GB/s | torch time us | torch busbw GB/s | dtrain / torch time |")
    print("|---|---|---|---|---|---|---|---|")
    for kv in [r for r in ar if impl_of(r, "dtrain")]:
        t = next((r for r in ar if impl_of(r, "torch") and r["bytes"] == kv["bytes"]), None)
        ratio = f"{float(kv['time_us']) / float(t['time_us']):.2f}" if t else "-"
        print(f"| {kv['bytes']} | {kv['world']} | {kv['time_us']} | {kv['algbw_GBps']} | {kv['busbw_GBps']} | "
              f"{t['time_us'] if t else '-'} | {t['busbw_GBps'] if t else '-'} | {ratio} |")
tr = rows.get("trainer", [])
if tr:
    print()
    print("MLP 784-256-128-10 training step on cuda (AdamW, global batch 128)")
    print("| impl | world | step ms | samples/s |")
    print("|---|---|---|---|")
    for kv in tr:
        print(f"| {kv['impl']} | {kv['world']} | {kv['step_ms']} | {kv['samples_per_s']} |")
    d = next((r for r in tr if r["impl"] == "dtrain"), None)
    t = next((r for r in tr if r["impl"] == "torch"), None)
    if d and t:
        print(f"RATIO trainer_step device=cuda dtrain/torch step_ms={float(d['step_ms']) / float(t['step_ms']):.2f}")
EOF

echo
echo "gpu_check: RESULT lines in $out; $((SECONDS - started)) s in all"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: FAILED stages: ${failed[*]}"
  exit 1
fi
echo "gpu_check: every stage passed"
