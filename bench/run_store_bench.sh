#!/usr/bin/env bash
# Runs dtrain's store benchmark side by side with its peers, in the same run,
# and prints medians and ratios:
#   dtrain TcpStore        (bench/store_bench, impl=dtrain)
#   LibTorch c10d TCPStore (bench/peers/libtorch_store.cpp, impl=libtorch-tcpstore)
#   Redis 7                (bench/peers/redis_kv.sh, impl=redis)
# The three are interleaved REPS times so that machine noise hits all of them.
# Peers that are not installed are skipped with a message (scripts/setup.sh --peers
# installs libtorch-dev and redis).
#
# Env: REPS (3), DT_BUILD_DIR (build-bench), PEERS_DIR (bench/peers), PEERS_BUILD
# (build-peers), OUT (results file; default in /tmp), RDZV (256,1024,4096),
# LIBTORCH_RDZV (256,1024: LibTorch needs ~6 fds and 2 threads per client, so 4096
# exceeds common limits), REQS (redis requests per test, 200000), CLIENTS (kv client
# counts, all three sides, 1,16,64), TOTAL (ops per kv phase for dtrain and LibTorch
# alike, 40000 as in the peer; raise it on a noisy machine so that each phase lasts
# longer). Relative paths are taken from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
REPS=${REPS:-3}
build_dir=${DT_BUILD_DIR:-build-bench}
peers=${PEERS_DIR:-$repo/bench/peers}
peers_build=${PEERS_BUILD:-build-peers}
out=${OUT:-/tmp/store-bench-$(date +%Y%m%d-%H%M%S).txt}
rdzv=${RDZV:-256,1024,4096}
libtorch_rdzv=${LIBTORCH_RDZV:-256,1024}
total=${TOTAL:-40000}
clients=${CLIENTS:-1,16,64}
py=/usr/bin/python3

echo "== building dtrain store_bench in $build_dir" >&2
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF -DDT_BUILD_TESTS=OFF \
  -DDT_BUILD_BENCH=ON >/dev/null
cmake --build "$build_dir" -j "${DT_JOBS:-2}" --target store_bench >/dev/null

have_libtorch=0
echo "== building the LibTorch peer in $peers_build" >&2
if "$peers/build.sh" "$peers_build" libtorch_store >/dev/null; then
  have_libtorch=1
else
  echo "   skipping the TCPStore peer" >&2
fi
have_redis=0
if command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null; then
  have_redis=1
else
  echo "== redis not installed: skipping the Redis peer (scripts/setup.sh --peers installs it)" >&2
fi

echo "# store bench $(date -u +%FT%TZ) host=$(hostname) cores=$(getconf _NPROCESSORS_ONLN) reps=$REPS" >"$out"
for rep in $(seq "$REPS"); do
  echo "== rep $rep/$REPS: dtrain" >&2
  "$build_dir/bench/store_bench" --clients "$clients" --total "$total" --rdzv "$rdzv" --reps 3 | tee -a "$out" | grep -v '^RESULT' >&2 || true
  if [ "$have_libtorch" = 1 ]; then
    echo "== rep $rep/$REPS: libtorch-tcpstore" >&2
    "$peers_build/libtorch_store" --clients "$clients" --total "$total" --rdzv "$libtorch_rdzv" --reps 3 2>/dev/null >>"$out" || echo "   libtorch_store failed" >&2
  fi
  if [ "$have_redis" = 1 ]; then
    echo "== rep $rep/$REPS: redis" >&2
    REQS=${REQS:-200000} CLIENTS="${clients//,/ }" PY=$py bash "$peers/redis_kv.sh" >>"$out" 2>/dev/null || echo "   redis_kv.sh failed" >&2
  fi
done

echo
echo "== medians ($out)"
$py "$peers/summarize.py" "$out"
if [ "$have_libtorch" = 1 ]; then
  echo
  echo "== dtrain / LibTorch TCPStore (ops_per_s > 1: dtrain faster; *_ms, lat_us < 1: dtrain faster)"
  $py "$peers/summarize.py" "$out" --ratio dtrain:libtorch-tcpstore
fi
if [ "$have_redis" = 1 ]; then
  echo
  echo "== dtrain / Redis"
  $py "$peers/summarize.py" "$out" --ratio dtrain:redis --ignore cmd
fi
