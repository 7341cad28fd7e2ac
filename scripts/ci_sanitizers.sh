#!/usr/bin/env bash
# Sanitizer configurations for CI (CPU-only builds, -O1 with line tables only:
# what sanitizer reports need, at about half the compile time of -O2 -g):
#  1. AddressSanitizer + UndefinedBehaviorSanitizer over the tests labelled
#     `sanitize` (the whole suite less the multi-host, SLURM and end-to-end
#     launcher tests, whose cost is process start-up); only their targets are
#     built (dt_sanitize_tests).
#  2. ThreadSanitizer over the concurrency tests labelled `tsan` (threads as
#     ranks; forking tests stay out: TSan and fork() after threads do not mix).
set -euo pipefail
cd "$(dirname "$0")/.."

export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
stage_start=$SECONDS
timed() {  # "timing: <stage> <seconds> s", as scripts/test.sh prints them
  echo "timing: $1 $((SECONDS - stage_start)) s"
  stage_start=$SECONDS
}
flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
       "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" -DDT_USE_CUDA=OFF -DDT_BUILD_BENCH=OFF -DDT_BUILD_EXAMPLES=OFF)
cmake -S . -B build-asan "${flags[@]}" -DDT_SANITIZE=address,undefined
cmake --build build-asan -j 2 --target dt_sanitize_tests
timed asan-build
ctest --test-dir build-asan -j 2 --output-on-failure --no-tests=error --timeout 600 -L sanitize
timed asan-tests

export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
cmake -S . -B build-tsan "${flags[@]}" -DDT_SANITIZE=thread -DDT_USE_GLOO=OFF
cmake --build build-tsan -j 2 --target dt_tsan_tests
timed tsan-build
ctest --test-dir build-tsan -j 2 --output-on-failure --no-tests=error --timeout 600 -L tsan
timed tsan-tests
