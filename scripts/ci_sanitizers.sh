#!/usr/bin/env bash
# Sanitizer configurations for CI (CPU-only builds, -O1 with line tables only:
# what sanitizer reports need, at about half the compile time of -O2 -g), compiled by Clang when
# it is installed (the set-up script installs it): with the sanitizers on, g++ 12 takes about twice
# Clang's CPU time on this code (measured: 190 CPU-s against 96 over eight of the heaviest files
# under ASan+UBSan; Clang's whole ASan+UBSan build is 860 CPU-s). DT_SANITIZER_CXX picks
# another compiler (e.g. g++); the Release build stays on the system's default compiler.
#  * AddressSanitizer + UndefinedBehaviorSanitizer over the tests labelled
#    `sanitize` (the whole suite less the multi-host, SLURM and end-to-end
#    launcher tests, whose cost is process start-up); only their targets are
#    built (dt_sanitize_tests).
#  * ThreadSanitizer over the concurrency tests labelled `tsan` (threads as
#    ranks; forking tests stay out: TSan and fork() after threads do not mix).
#
#   scripts/ci_sanitizers.sh                 all four steps in order
#   scripts/ci_sanitizers.sh STEP...         build-asan, test-asan, build-tsan, test-tsan
# (.ci/run runs the builds beside the other stages, at the lowest CPU priority.)
set -euo pipefail
cd "$(dirname "$0")/.."

export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
compilers=()
cxx=${DT_SANITIZER_CXX:-clang++}
if command -v "$cxx" >/dev/null; then
  cc=${cxx/clang++/clang}; cc=${cc/g++/gcc}
  compilers=("-DCMAKE_CXX_COMPILER=$cxx" "-DCMAKE_C_COMPILER=$cc")
else
  echo "ci_sanitizers.sh: $cxx not found (scripts/setup.sh installs clang); the default compiler builds the sanitizer configurations" >&2
fi
flags=("${compilers[@]}" "-DCMAKE_BUILD_TYPE=RelWithDebInfo" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
       "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" -DDT_USE_CUDA=OFF -DDT_BUILD_BENCH=OFF -DDT_BUILD_EXAMPLES=OFF)
tests=(-j 2 --output-on-failure --no-tests=error --timeout 600)

steps=("$@")
((${#steps[@]})) || steps=(build-asan test-asan build-tsan test-tsan)
for step in "${steps[@]}"; do
  started=$SECONDS
  case "$step" in
    build-asan) DT_BUILD_DIR=build-asan DT_BUILD_TARGET=dt_sanitize_tests scripts/build.sh "${flags[@]}" -DDT_SANITIZE=address,undefined ;;
    test-asan) ctest --test-dir build-asan "${tests[@]}" -L sanitize ;;
    build-tsan) DT_BUILD_DIR=build-tsan DT_BUILD_TARGET=dt_tsan_tests scripts/build.sh "${flags[@]}" -DDT_SANITIZE=thread -DDT_USE_GLOO=OFF ;;
    test-tsan) ctest --test-dir build-tsan "${tests[@]}" -L tsan ;;
    *) echo "ci_sanitizers.sh: unknown step '$step' (expected build-asan, test-asan, build-tsan or test-tsan)" >&2; exit 2 ;;
  esac
  echo "timing: $step $((SECONDS - started)) s"
done
