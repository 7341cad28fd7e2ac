#!/usr/bin/env bash
# No false loss under load: three `dtrun --nnodes 3 --nproc 2 --elastic --rdzv-backend etcd`
# agents (3 etcd members on loopback) with a short --node-timeout train the toy loop of
# tests/launcher/elastic_worker for DURATION seconds while BUSY processes spin on the cores.
# Nothing is killed: any "is lost", any worker death and any recovery is a false loss (a
# heartbeat or a lease that load delayed past its timeout). Prints the counts, a RESULT line and
# a GOAL line (zero false losses, every member's state what the steps say).
#
# usage: bench/run_false_loss_soak.sh   (env: DURATION=600 NODE_TIMEOUT=3s STEP_MS=30 BUSY=2
#                                        DT_BUILD_DIR=build OUT=file)
# Needs a build with tests (scripts/test.sh builds one): dtrun and tests/launcher's elastic worker.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${DT_BUILD_DIR:-build}
duration=${DURATION:-600}
node_timeout=${NODE_TIMEOUT:-3s}
step_ms=${STEP_MS:-30}
busy=${BUSY:-2}
out=${OUT:-/tmp/false-loss-soak-$(date +%Y%m%d-%H%M%S).txt}
dtrun="$build/launcher/dtrun"
worker="$build/tests/launcher/dtrun_elastic_worker"
for f in "$dtrun" "$worker"; do
  [[ -x "$f" ]] || { echo "run_false_loss_soak: $f is missing: build with tests first (scripts/test.sh)" >&2; exit 1; }
done

data=$(mktemp -d /dev/shm/dtrain-soak-XXXXXX)
source bench/etcd_cluster.sh
spinners=()
cleanup() {
  ((${#spinners[@]})) && kill "${spinners[@]}" 2>/dev/null
  stop_etcd_cluster
  rm -rf "$data"
}
trap cleanup EXIT
start_etcd_cluster 3 "$data" || exit 1
for ((i = 0; i < busy; i++)); do
  bash -c 'while :; do :; done' &
  spinners+=($!)
done

# Steps take at least STEP_MS each (more under load): the job lasts DURATION seconds or longer.
steps=$((duration * 1000 / step_ms))
echo "# run_false_loss_soak: ${duration}s, --node-timeout $node_timeout, $busy busy process(es), $steps steps of >= ${step_ms} ms, $(date -u +%FT%TZ), $(getconf _NPROCESSORS_ONLN) cpus" | tee "$out"
pids=()
for node in 0 1 2; do
  "$dtrun" --nnodes 3 --node-rank "$node" --nproc 2 --elastic --rdzv-backend etcd --rdzv-endpoint "$etcd_endpoints" \
    --rdzv-id soak --node-timeout "$node_timeout" "$worker" "$steps" "$step_ms" >"$data/node$node.log" 2>&1 &
  pids+=($!)
done
started=$SECONDS
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
elapsed=$((SECONDS - started))
cat "$data"/node*.log >>"$out.log"
losses=$(cat "$data"/node*.log | grep -c "is lost")
deaths=$(cat "$data"/node*.log | grep -c "the elastic job goes on without it")
recoveries=$(cat "$data"/node*.log | grep -c "go on from step")
members_ok=$(cat "$data"/node*.log | sed "s/^\[rank [0-9]*\] //" | grep -E "^member [0-9]+ rank [0-9]+/6 " | awk '$8 == $10' | wc -l)
echo "nodes lost: $losses, worker deaths: $deaths, recoveries: $recoveries, members ending with the right state: $members_ok of 6, dtruns failed: $failed, wall ${elapsed}s" | tee -a "$out"
echo "RESULT false_loss_soak duration_s=$elapsed node_timeout=$node_timeout busy=$busy nodes_lost=$losses worker_deaths=$deaths recoveries=$recoveries members_ok=$members_ok dtruns_failed=$failed" | tee -a "$out"
if ((losses == 0 && deaths == 0 && recoveries == 0 && members_ok == 6 && failed == 0)); then
  echo "GOAL no false loss over ${elapsed}s at --node-timeout $node_timeout with $busy busy processes -> met" | tee -a "$out"
else
  echo "GOAL no false loss over ${elapsed}s at --node-timeout $node_timeout with $busy busy processes -> MISSED (logs: $out.log)" | tee -a "$out"
fi
