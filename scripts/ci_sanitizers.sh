#!/usr/bin/env bash
# Sanitizer configurations for CI (CPU-only builds):
#  1. AddressSanitizer + UndefinedBehaviorSanitizer: everything is built; the
#     tests labelled `sanitize` run (the whole suite less the multi-host,
#     SLURM and end-to-end launcher tests, whose cost is process start-up).
#  2. ThreadSanitizer over the concurrency tests labelled `tsan` (threads as
#     ranks; forking tests stay out: TSan and fork() after threads do not mix).
set -euo pipefail
cd "$(dirname "$0")/.."

export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDT_SANITIZE=address,undefined \
  -DDT_USE_CUDA=OFF -DDT_BUILD_BENCH=OFF -DDT_BUILD_EXAMPLES=OFF
cmake --build build-asan -j 2
ctest --test-dir build-asan -j 2 --output-on-failure --no-tests=error --timeout 600 -L sanitize

export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDT_SANITIZE=thread \
  -DDT_USE_CUDA=OFF -DDT_USE_GLOO=OFF -DDT_BUILD_BENCH=OFF -DDT_BUILD_EXAMPLES=OFF
cmake --build build-tsan -j 2 --target store_conformance_test launcher_coordinator_test tensor_autograd_test tensor_ops_test tensor_profiler_test data_test work_test \
  tensor_device_switch_test nccl_lifecycle_test ddp_comm_hooks_test
ctest --test-dir build-tsan -j 2 --output-on-failure --no-tests=error --timeout 600 -L tsan
