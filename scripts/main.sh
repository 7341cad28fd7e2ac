#!/usr/bin/env bash
# Sets everything up, builds, and runs the main job on embedded defaults:
# four ranks of data-parallel training on Fashion-MNIST under dtrun
# (examples/trainer; checkpoints go to ./trainer-checkpoints, and a second run resumes there).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh -DDT_BUILD_TESTS=OFF -DDT_BUILD_BENCH=OFF -DDT_BUILD_EXAMPLES=ON
build_dir=${DT_BUILD_DIR:-build}
exec "$build_dir/launcher/dtrun" --nproc 4 "$build_dir/examples/trainer" "$@"
