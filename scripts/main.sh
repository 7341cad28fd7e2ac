#!/usr/bin/env bash
# Sets everything up, builds, and runs the main job on embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
DT_BUILD_TESTS=OFF scripts/build.sh -DDT_BUILD_TESTS=OFF
build_dir=${DT_BUILD_DIR:-build}
exec "$build_dir/examples/store_demo" "$@"
