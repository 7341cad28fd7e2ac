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
command -v etcd >/dev/null || { echo "run_etcd_bench: etcd is not installed; run scripts/setup.sh" >&2; exit 1; }

if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF -DDT_BUILD_TESTS=OFF -DDT_BUILD_BENCH=ON >/dev/null
fi
cmake --build "$build_dir" -j "${DT_JOBS:-2}" --target etcd_bench >/dev/null

data=$(mktemp -d /dev/shm/dtrain-etcd-bench-XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$data"
}
trap cleanup EXIT

# 2 free loopback ports per member.
mapfile -t ports < <(python3 - "$members" <<'PY'
import socket, sys
socks = []
for _ in range(2 * int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
for s in socks:
    print(s.getsockname()[1])
PY
)
cluster=""
endpoints=""
for ((i = 0; i < members; i++)); do
  cluster+="${cluster:+,}m$i=http://127.0.0.1:${ports[2*i+1]}"
  endpoints+="${endpoints:+,}127.0.0.1:${ports[2*i]}"
done
for ((i = 0; i < members; i++)); do
  etcd --name "m$i" --data-dir "$data/m$i" \
    --listen-client-urls "http://127.0.0.1:${ports[2*i]}" --advertise-client-urls "http://127.0.0.1:${ports[2*i]}" \
    --listen-peer-urls "http://127.0.0.1:${ports[2*i+1]}" --initial-advertise-peer-urls "http://127.0.0.1:${ports[2*i+1]}" \
    --initial-cluster "$cluster" --initial-cluster-state new --logger zap --log-level error >"$data/m$i.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 200); do
  curl -sf "http://${endpoints%%,*}/health" | grep -q '"true"' && break
  sleep 0.05
done

{
  echo "# etcd bench $(date -u +%FT%TZ) host=$(hostname) cores=$(getconf _NPROCESSORS_ONLN) members=$members etcd=$(etcd --version | head -1 | awk '{print $3}') reps=$reps"
  "$build_dir/bench/etcd_bench" --etcd "$endpoints" --rdzv "$rdzv" --reps "$reps" --ops "$ops"
} | tee "$out"
echo "results: $out" >&2
