#!/usr/bin/env bash
# Configures and builds dtrain into build/ (or $DT_BUILD_DIR), Release, -j2.
# Extra arguments go to CMake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${DT_BUILD_DIR:-build}
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$build_dir" -j "${DT_JOBS:-2}"
