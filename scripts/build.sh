#!/usr/bin/env bash
# Configures and builds dtrain into build/ (or $DT_BUILD_DIR), Release, -j2.
# Extra arguments go to CMake's configure step; $DT_BUILD_TARGET builds one target instead of all.
# A new build directory uses Ninja when it is installed (the set-up script installs it): it
# schedules the ~90 targets' compiles and links as one graph, where make runs them target by target.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${DT_BUILD_DIR:-build}
generator=()
if [[ ! -f "$build_dir/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
  generator=(-G Ninja)
fi
cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$build_dir" -j "${DT_JOBS:-2}" ${DT_BUILD_TARGET:+--target "$DT_BUILD_TARGET"}
