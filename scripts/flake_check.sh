#!/usr/bin/env bash
# Runs the timing- and process-sensitive tests (elastic, chaos, launcher, liveness, shared-memory
# waits, SLURM, etcd, forked ranks) N times on an idle machine and with one and with two busy
# processes competing for the cores, and reports each test's failures. A test that fails here
# under load is a wrong test (it waits for a fixed time, or asserts on where the kernel puts a
# thread) or a race in the code: either is a defect, found before CI finds it.
#
#   scripts/flake_check.sh [N]          N runs per load level (default 5)
#
# env: BUSY="0 1 2"     the load levels: how many busy processes (a loop each) run meanwhile
#      PATTERN=REGEX    the tests (ctest -R); default: the sensitive set below
#      DT_BUILD_DIR     the build (default build/; built as scripts/test.sh builds it)
#      OUT=DIR          where each run's ctest log goes (default: a new temporary folder)
# Exit status: 0 when no test failed in any run, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

runs=${1:-5}
busy_levels=${BUSY:-0 1 2}
pattern=${PATTERN:-'Elastic|Chaos|Dtrun|Launcher|Liveness|Scheduling|WaitRules|CorePlacement|Shm|ProcessFailure|Spawn|Slurm|slurm|Etcd|Recovery|Regrow|Watchdog|Hang|Trainer|Fault'}
build_dir=${DT_BUILD_DIR:-build}
out=${OUT:-$(mktemp -d /tmp/flake_check.XXXXXX)}
mkdir -p "$out"

if [[ ! -f "$build_dir/CTestTestfile.cmake" ]]; then
  scripts/setup.sh
  scripts/build.sh -DDT_BUILD_TESTS=ON -DDT_BUILD_EXAMPLES=ON -DDT_BUILD_BENCH=ON
fi
tests=$(ctest --test-dir "$build_dir" -N -R "$pattern" | sed -n 's/^ *Test *#[0-9]*: //p')
count=$(grep -c . <<<"$tests")
if ((count == 0)); then
  echo "flake_check: no test matches '$pattern' in $build_dir" >&2
  exit 1
fi
echo "flake_check: $count tests, $runs run(s) at each load level (busy processes: $busy_levels); logs in $out"

spinners=()
stop_spinners() {
  ((${#spinners[@]})) && kill "${spinners[@]}" 2>/dev/null
  wait "${spinners[@]}" 2>/dev/null
  spinners=()
}
trap stop_spinners EXIT

declare -A failures  # "<busy> <test>" -> count
total_failed=0
for busy in $busy_levels; do
  for ((i = 0; i < busy; i++)); do
    bash -c 'while :; do :; done' &
    spinners+=($!)
  done
  for ((run = 1; run <= runs; run++)); do
    log="$out/busy${busy}_run${run}.log"
    started=$SECONDS
    ctest --test-dir "$build_dir" -R "$pattern" -j 2 --timeout 600 --output-on-failure >"$log" 2>&1
    failed=$(sed -n '/The following tests FAILED:/,$p' "$log" | sed -n 's/^[[:space:]]*[0-9]* - \(.*\) (.*)$/\1/p')
    n=0
    while read -r name; do
      [[ -z "$name" ]] && continue
      failures["$busy $name"]=$((${failures["$busy $name"]:-0} + 1))
      n=$((n + 1))
    done <<<"$failed"
    total_failed=$((total_failed + n))
    echo "flake_check: busy=$busy run $run/$runs: $n failed in $((SECONDS - started)) s"
  done
  stop_spinners
done

echo
printf '%-90s' "test (failures per load level)"
for busy in $busy_levels; do printf ' busy=%-3s' "$busy"; done
echo
names=$(for key in "${!failures[@]}"; do echo "${key#* }"; done | sort -u)
if [[ -z "$names" ]]; then
  echo "(no test failed)"
else
  while read -r name; do
    printf '%-90s' "$name"
    for busy in $busy_levels; do printf ' %8s' "${failures["$busy $name"]:-0}"; done
    echo
  done <<<"$names"
fi
levels=$(wc -w <<<"$busy_levels")
echo "flake_check: $((count * runs * levels)) test runs ($count tests x $runs runs x $levels load levels), $total_failed failed"
((total_failed == 0))
