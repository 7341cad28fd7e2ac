# Sourced by bench/run_collectives_bench.sh and bench/run_small_ops_bench.sh (not run
# directly): builds collectives_bench into $build (always: a stale binary would measure old
# code), builds the MPI peer, and defines mpi_results. Expects build, peers, peers_build set
# and the repository root as the working directory. Sets bench, have_mpi, mpi_bench.
bench="$build/bench/collectives_bench"
echo "# building collectives_bench in $build" >&2
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDT_USE_CUDA=OFF -DDT_BUILD_TESTS=OFF -DDT_BUILD_BENCH=ON >/dev/null &&
  cmake --build "$build" -j "${DT_JOBS:-2}" --target collectives_bench >/dev/null
[ -x "$bench" ] || { echo "missing $bench (collectives_bench needs Gloo: scripts/setup.sh)" >&2; exit 2; }
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 DT_NUM_THREADS=1

have_mpi=0
if ! command -v mpirun >/dev/null; then
  echo "# mpi peer skipped: no mpirun (apt-get install openmpi-bin, or scripts/setup.sh --peers)" >&2
elif mpi_bench=$("$peers/build.sh" "$peers_build" mpi_bench); then
  have_mpi=1
else
  echo "# mpi peer skipped" >&2
fi

# mpi_results WORLD OP SIZES: one launch of the MPI peer, as RESULT key=value lines
# (mpi_bench prints columns: RESULT impl op n bytes k samples med_us min_us algbw busbw p99_us).
mpi_results() {
  timeout 600 mpirun --oversubscribe --allow-run-as-root --bind-to none -np "$1" --mca pml ob1 \
    --mca btl vader,self "$mpi_bench" --op "$2" --label mpi-sm --sizes "$3" 2>/dev/null |
    awk '$1 == "RESULT" && NF >= 12 { printf "RESULT %s impl=%s world=%s bytes=%s reps=%s threads=1 time_us=%s min_us=%s p99_us=%s algbw_GBps=%s busbw_GBps=%s\n", $3, $2, $4, $5, $7, $8, $9, $12, $10, $11 }'
}
