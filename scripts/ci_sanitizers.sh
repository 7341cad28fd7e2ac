#!/usr/bin/env bash
# Sanitizer builds for CI: ASan+UBSan over the store and common tests (CPU-only
# build), and TSan over the store's concurrency tests.
set -euo pipefail
cd "$(dirname "$0")/.."
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDT_SANITIZE=address,undefined \
  -DDT_USE_CUDA=OFF -DDT_BUILD_BENCH=OFF -DDT_BUILD_EXAMPLES=OFF
cmake --build build-asan -j 2 --target common_test store_conformance_test tcp_store_process_test \
  launcher_unit_test launcher_coordinator_test dtrun_e2e_test dtrun dtrun_test_worker ${DT_ASAN_TARGETS:-}
ctest --test-dir build-asan -j 2 --output-on-failure --timeout 600 -L "${DT_ASAN_LABELS:-sanitize}"

# ThreadSanitizer over the store's concurrency tests (threads as ranks; the
# forking process tests stay out: TSan and fork() after threads do not mix).
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDT_SANITIZE=thread \
  -DDT_USE_CUDA=OFF -DDT_USE_GLOO=OFF -DDT_BUILD_BENCH=OFF -DDT_BUILD_EXAMPLES=OFF
cmake --build build-tsan -j 2 --target store_conformance_test launcher_coordinator_test ${DT_TSAN_TARGETS:-}
ctest --test-dir build-tsan -j 2 --output-on-failure --timeout 600 -L "${DT_TSAN_LABELS:-tsan}"
