#!/usr/bin/env bash
# Runs dtrain's tensor benchmark side by side with the LibTorch peer
# (bench/peers/libtorch_mlp.cpp), interleaved REPS times in the same run,
# both on OpenBLAS with one thread, and prints medians and dtrain/LibTorch
# ratios (bench/peers/summarize.py). Peak RSS of each process is measured
# the same way for both (/usr/bin/time -f %M, whole process) and printed as
# `RESULT peak_rss impl=... rss_mb=`.
#
# Then the matrix products of the 38M GPT, shape by shape (tensor_bench --gemm-shapes 1, one
# thread): OpenBLAS as the environment runs it (impl=openblas: OPENBLAS_CORETYPE as set),
# OpenBLAS with its own choice of kernels (impl=openblas_own: OPENBLAS_CORETYPE unset in that
# command alone), oneDNN float32 (impl=onednn) and oneDNN bfloat16 operands with float32 output
# (impl=onednn-bf16), in GF/s, each line naming the kernel that ran and what the auto rule picks;
# then their medians and the ratios to impl=openblas. GEMM_SHAPES=0 skips this part.
#
# Env: REPS (3), DT_BUILD_DIR (build-bench), PEERS_DIR (bench/peers), PEERS_BUILD
# (build-peers), OUT (results file). Relative paths are taken from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
REPS=${REPS:-3}
build_dir=${DT_BUILD_DIR:-build-bench}
peers=${PEERS_DIR:-$repo/bench/peers}
peers_build=${PEERS_BUILD:-build-peers}
out=${OUT:-/tmp/tensor-bench-$(date +%Y%m%d-%H%M%S).txt}
py=/usr/bin/python3

# Same BLAS for both: OpenBLAS (pthread build), one thread (see bench/peers/README.md).
openblas_dir=/usr/lib/x86_64-linux-gnu/openblas-pthread
if [ -d "$openblas_dir" ]; then export LD_LIBRARY_PATH="$openblas_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 DT_NUM_THREADS=1

echo "== building dtrain tensor_bench in $build_dir" >&2
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF -DDT_BUILD_TESTS=OFF \
  -DDT_BUILD_BENCH=ON >/dev/null
cmake --build "$build_dir" -j "${DT_JOBS:-2}" --target tensor_bench >/dev/null

have_libtorch=0
echo "== building the LibTorch peer in $peers_build" >&2
if "$peers/build.sh" "$peers_build" libtorch_mlp >/dev/null; then
  have_libtorch=1
else
  echo "   no LibTorch peer: dtrain and cblas only" >&2
fi

# Runs a command, appends its RESULT lines, and a peak_rss line for the whole process.
run_measured() {
  local impl=$1
  shift
  local tmp
  tmp=$(mktemp)
  /usr/bin/time -f "%M" -o "$tmp.rss" "$@" >"$tmp" 2>"$tmp.err" || { cat "$tmp.err" >&2; rm -f "$tmp"*; return 1; }
  grep '^RESULT' "$tmp" | tee -a "$out"
  awk -v impl="$impl" '{ printf "RESULT peak_rss impl=%s world=1 batch=32 threads=1 rss_mb=%.1f\n", impl, $1 / 1024 }' \
    "$tmp.rss" | tee -a "$out"
  grep -v '^RESULT' "$tmp.err" >&2 || true
  rm -f "$tmp" "$tmp.rss" "$tmp.err"
}

echo "# tensor bench $(date -u +%FT%TZ) host=$(hostname) cores=$(getconf _NPROCESSORS_ONLN) reps=$REPS" >"$out"
for rep in $(seq "$REPS"); do
  echo "== rep $rep/$REPS: dtrain" >&2
  run_measured dtrain "$build_dir/bench/tensor_bench" --threads 1
  if [ "$have_libtorch" = 1 ]; then
    echo "== rep $rep/$REPS: libtorch" >&2
    run_measured libtorch "$peers_build/libtorch_mlp" --threads 1
  fi
done

# Memory is compared through the peak_rss lines, measured alike for both (/usr/bin/time): they
# and dtrain's own getrusage figure (peak_rss_mb, which LibTorch does not print) stay out of
# summarize.py; the RSS ratio is computed below.
medians_in=$(mktemp)
grep -v '^RESULT peak_rss ' "$out" >"$medians_in"
echo "== medians ($out)" >&2
"$py" "$peers/summarize.py" "$medians_in" --ignore peak_rss_mb,matmul
if [ "$have_libtorch" = 1 ]; then
  echo "== ratios dtrain / libtorch (time: < 1 is faster; gflops, samples_per_s: > 1 is faster; rss: < 1 is smaller)" >&2
  "$py" "$peers/summarize.py" "$medians_in" --ratio dtrain:libtorch --ignore peak_rss_mb,matmul
  awk '/^RESULT peak_rss /{ for (i = 3; i <= NF; i++) { split($i, kv, "="); if (kv[1] == "impl") impl = kv[2]; if (kv[1] == "rss_mb") v[impl] = v[impl] " " kv[2] } }
       function med(s,   a, n, i, j, t) { n = split(s, a, " "); for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
                                    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
       END { d = med(v["dtrain"]); l = med(v["libtorch"]); if (l > 0) printf "RATIO peak_rss a=dtrain b=libtorch dtrain_mb=%.1f libtorch_mb=%.1f ratio_rss=%.3f\n", d, l, d / l }' "$out"
fi
echo "== ratio dtrain / direct cblas_sgemm (goal gflops >= 0.95)" >&2
"$py" "$peers/summarize.py" "$medians_in" --ratio dtrain:cblas --ignore peak_rss_mb,matmul
rm -f "$medians_in"

if [ "${GEMM_SHAPES:-1}" = 1 ]; then
  shapes_out=$(mktemp)
  for rep in $(seq "$REPS"); do
    echo "== rep $rep/$REPS: GPT matrix products, OpenBLAS as the environment runs it (OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}), oneDNN fp32 and bf16" >&2
    "$build_dir/bench/tensor_bench" --threads 1 --gemm-shapes 1 | tee -a "$out" "$shapes_out" >/dev/null
    echo "== rep $rep/$REPS: GPT matrix products, OpenBLAS with its own kernels (OPENBLAS_CORETYPE unset)" >&2
    env -u OPENBLAS_CORETYPE "$build_dir/bench/tensor_bench" --threads 1 --gemm-shapes 1 --engines openblas |
      sed 's/ impl=openblas / impl=openblas_own /' | tee -a "$out" "$shapes_out" >/dev/null
  done
  echo "== GPT matrix products: medians (GF/s)" >&2
  "$py" "$peers/summarize.py" "$shapes_out"
  for impl in openblas_own onednn onednn-bf16; do
    echo "== GPT matrix products: $impl / openblas (gflops > 1: faster)" >&2
    "$py" "$peers/summarize.py" "$shapes_out" --ratio "$impl:openblas" --ignore kernel,auto
  done
  rm -f "$shapes_out"
fi
