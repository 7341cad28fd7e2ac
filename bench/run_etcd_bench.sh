#!/usr/bin/env bash
# The etcd rendezvous backend against node 0's TcpStore, in the same run
# (bench/etcd_bench): rendezvous time of RDZV simulated nodes (8,64,256) and
# one client's set/get/add latency, medians of REPS interleaved repetitions,
# RESULT and RATIO lines (etcd / tcpstore). It starts a three-member etcd
# cluster (Debian's etcd-server, scripts/setup.sh) on free loopback ports with
# its data on tmpfs and etcd's default heartbeat/election settings, and stops
# it at the end.
#
# Env: DT_BUILD_DIR (build-bench), REPS (3), RDZV (8,64,256), OPS (2000), MEMBERS (3),
# OUT (results file; default in /tmp).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${DT_BUILD_DIR:-build-bench}
reps=${REPS:-3}
rdzv=${RDZV:-8,64,256}
ops=${OPS:-2000}
members=${MEMBERS:-3}
out=${OUT:-/tmp/etcd-bench-$(date +%Y%m%d-%H%M%S).txt}

if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF -DDT_BUILD_TESTS=OFF -DDT_BUILD_BENCH=ON >/dev/null
fi
cmake --build "$build_dir" -j "${DT_JOBS:-2}" --target etcd_bench >/dev/null

data=$(mktemp -d /dev/shm/dtrain-etcd-bench-XXXXXX)
source bench/etcd_cluster.sh
cleanup() {
  stop_etcd_cluster
  rm -rf "$data"
}
trap cleanup EXIT
start_etcd_cluster "$members" "$data"
endpoints=$etcd_endpoints

{
  echo "# etcd bench $(date -u +%FT%TZ) host=$(hostname) cores=$(getconf _NPROCESSORS_ONLN) members=$members etcd=$(etcd --version | head -1 | awk '{print $3}') reps=$reps"
  "$build_dir/bench/etcd_bench" --etcd "$endpoints" --rdzv "$rdzv" --reps "$reps" --ops "$ops"
} | tee "$out"
echo "results: $out" >&2
