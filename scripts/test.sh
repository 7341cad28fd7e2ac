#!/usr/bin/env bash
# Sets everything up, builds, and runs the whole test suite.
# The README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
build_dir=${DT_BUILD_DIR:-build}
ctest --test-dir "$build_dir" -j 2 --output-on-failure --timeout 600 "$@"
