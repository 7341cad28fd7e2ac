#!/usr/bin/env bash
# Sets everything up, builds, and runs the whole test suite.
# The README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
stage_start=$SECONDS
timed() {  # "timing: <stage> <seconds> s": where a CI run's time goes
  echo "timing: $1 $((SECONDS - stage_start)) s"
  stage_start=$SECONDS
}
scripts/setup.sh
timed setup
scripts/build.sh -DDT_BUILD_TESTS=ON -DDT_BUILD_EXAMPLES=ON -DDT_BUILD_BENCH=ON
timed build
build_dir=${DT_BUILD_DIR:-build}
ctest --test-dir "$build_dir" -j 2 --output-on-failure --no-tests=error --timeout 600 "$@"
timed tests
