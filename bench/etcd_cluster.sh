# Sourced by the benchmarks that need etcd: start_etcd_cluster MEMBERS DATA_DIR starts that many
# etcd members (Debian's etcd-server, scripts/setup.sh) on free loopback ports with their data
# under DATA_DIR and etcd's default heartbeat/election settings, waits until the first answers,
# and sets etcd_endpoints ("127.0.0.1:P,...") and appends the members' pids to etcd_pids. The
# caller stops them with stop_etcd_cluster.
etcd_pids=()
etcd_endpoints=""
start_etcd_cluster() {
  local members=$1 data=$2 cluster="" i
  command -v etcd >/dev/null || { echo "etcd is not installed; run scripts/setup.sh" >&2; return 1; }
  local ports
  mapfile -t ports < <(python3 - "$members" <<'PY'
import socket, sys
socks = []
for _ in range(2 * int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
for s in socks:
    print(s.getsockname()[1])
PY
  )
  etcd_endpoints=""
  for ((i = 0; i < members; i++)); do
    cluster+="${cluster:+,}m$i=http://127.0.0.1:${ports[2*i+1]}"
    etcd_endpoints+="${etcd_endpoints:+,}127.0.0.1:${ports[2*i]}"
  done
  for ((i = 0; i < members; i++)); do
    etcd --name "m$i" --data-dir "$data/m$i" \
      --listen-client-urls "http://127.0.0.1:${ports[2*i]}" --advertise-client-urls "http://127.0.0.1:${ports[2*i]}" \
      --listen-peer-urls "http://127.0.0.1:${ports[2*i+1]}" --initial-advertise-peer-urls "http://127.0.0.1:${ports[2*i+1]}" \
      --initial-cluster "$cluster" --initial-cluster-state new --logger zap --log-level error >"$data/m$i.log" 2>&1 &
    etcd_pids+=($!)
  done
  for _ in $(seq 400); do
    curl -sf "http://${etcd_endpoints%%,*}/health" | grep -q '"true"' && return 0
    sleep 0.05
  done
  echo "etcd did not become healthy within 20 s (logs in $data)" >&2
  return 1
}

# Kills the members start_etcd_cluster started and waits for them.
stop_etcd_cluster() {
  local pid
  for pid in "${etcd_pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  etcd_pids=()
}
