#!/usr/bin/env bash
# scripts/gpu_check.sh on a machine without a GPU (every CI machine): it must say so and exit 2
# before building anything; on a GPU machine this test has nothing to check and says why.
#   tests/repo/gpu_check_test.sh SOURCE_DIR
src=${1:?usage: gpu_check_test.sh SOURCE_DIR}
if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "gpu_check_test: this machine has a GPU; run scripts/gpu_check.sh itself (it takes minutes)"
  exit 0
fi
output=$(DT_BUILD_DIR=/nonexistent-gpu-check-build "$src/scripts/gpu_check.sh" 2>&1)
rc=$?
echo "$output"
[ $rc -eq 2 ] || { echo "gpu_check_test: expected exit 2 without a GPU, got $rc" >&2; exit 1; }
grep -q "no NVIDIA GPU on this machine" <<<"$output" || { echo "gpu_check_test: the reason is missing" >&2; exit 1; }
[ ! -e /nonexistent-gpu-check-build ] || { echo "gpu_check_test: it built without a GPU" >&2; exit 1; }
echo "gpu_check_test: passed"
