#!/usr/bin/env bash
# Builds compiled peers from bench/peers into a build folder and says, for each target
# asked for, whether it is there:
#
#   bench/peers/build.sh BUILD_DIR TARGET...
#
# Prints the path of every target that built (one a line, on stdout); for one that
# cannot be built it prints the reason on stderr. Exit status 0 when all were built, 1
# when any is missing. Configures BUILD_DIR the first time, and again when a target was
# left out before (its dependency may have been installed since). Env: DT_JOBS (2).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:?usage: bench/peers/build.sh BUILD_DIR TARGET...}
shift
log="$build/peers-build.log"
mkdir -p "$build"

: >"$log"
need_configure=0
[ -f "$build/CMakeCache.txt" ] || need_configure=1
for target in "$@"; do
  [ -e "$build/unavailable/$target" ] && need_configure=1
done
if [ "$need_configure" = 1 ]; then
  if ! cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release >"$log" 2>&1; then
    echo "peers: configuring $build failed (see $log):" >&2
    tail -n 5 "$log" >&2
    exit 1
  fi
fi

rc=0
for target in "$@"; do
  if [ -e "$build/unavailable/$target" ]; then
    echo "peers: skipping $target: $(cat "$build/unavailable/$target")" >&2
    rc=1
  elif cmake --build "$build" -j "${DT_JOBS:-2}" --target "$target" >>"$log" 2>&1 && [ -x "$build/$target" ]; then
    echo "$build/$target"
  else
    echo "peers: $target did not build (see $log)" >&2
    rc=1
  fi
done
exit "$rc"
