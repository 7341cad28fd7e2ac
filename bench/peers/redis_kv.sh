#!/usr/bin/env bash
# Redis peer for bench/store_bench: a key-value server everybody knows, on the same
# loopback, as a yardstick for the store's set/get/add.
#
# Starts a redis-server of its own on 127.0.0.1 and a free port, without persistence
# (--save "" --appendonly no), then for each client count K (1, 16, 64) runs
#     redis-benchmark -h 127.0.0.1 -p PORT -t set,get,incr -n REQS -c K -d 32 --csv
# (32-byte values, no pipelining, redis-benchmark's single thread) and prints per command
#     RESULT kv impl=redis op=set|get|add clients=K ops=REQS ops_per_s=.. lat_us=.. p50_ms=.. cmd=set|get|incr
# INCR stands for the store's add (op=add); lat_us = K / ops_per_s, the mean latency one
# client sees; p50_ms is redis-benchmark's median. Redis answers every SET, so op=set is a
# request/response there (TCPStore's SET is one-way). The server is stopped by its pid on
# exit. Without redis installed it prints why on stderr and exits 0 with no RESULT lines.
#
# Env: REQS (200000), CLIENTS ("1 16 64"), TESTS (set,get,incr), PY (/usr/bin/python3)
set -euo pipefail
REQS=${REQS:-200000}
CLIENTS=${CLIENTS:-"1 16 64"}
TESTS=${TESTS:-set,get,incr}
PY=${PY:-/usr/bin/python3}

for tool in redis-server redis-benchmark redis-cli; do
  if ! command -v "$tool" >/dev/null; then
    echo "redis_kv.sh: no $tool (apt-get install redis-server redis-tools): skipping" >&2
    exit 0
  fi
done

server_pid=
stop_server() {
  if [ -n "$server_pid" ]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
}
trap stop_server EXIT

# The kernel picks a free port for a socket bound to port 0; another program could take it
# before redis binds it, so a server that does not come up is retried on a new port.
port=
for attempt in 1 2 3 4 5; do
  candidate=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  redis-server --bind 127.0.0.1 --port "$candidate" --save "" --appendonly no --daemonize no \
    --logfile "" --loglevel warning >/dev/null 2>&1 &
  server_pid=$!
  for _ in $(seq 50); do
    if redis-cli -h 127.0.0.1 -p "$candidate" ping 2>/dev/null | grep -q PONG; then
      port=$candidate
      break
    fi
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.1
  done
  [ -n "$port" ] && break
  echo "redis_kv.sh: redis-server did not come up on port $candidate (attempt $attempt)" >&2
  stop_server
  server_pid=
done
[ -n "$port" ] || { echo "redis_kv.sh: could not start redis-server" >&2; exit 1; }

for k in $CLIENTS; do
  # --csv: a header, then "SET","rps","avg_latency_ms","min_latency_ms","p50_latency_ms",...
  redis-benchmark -h 127.0.0.1 -p "$port" -t "$TESTS" -n "$REQS" -c "$k" -d 32 --csv |
    tr -d '"' |
    awk -F, -v k="$k" -v n="$REQS" '
      $1 == "test" || NF < 5 { next }
      {
        cmd = tolower($1); op = (cmd == "incr") ? "add" : cmd
        printf "RESULT kv impl=redis op=%s clients=%d ops=%d ops_per_s=%s lat_us=%.1f p50_ms=%s cmd=%s\n",
               op, k, n, $2, k / $2 * 1e6, $5, cmd
      }'
done
