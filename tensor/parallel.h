// Intra-op parallelism for tensor kernels.
//
// Contract: numThreads() comes from DT_NUM_THREADS when set (dtrun sets 1 when
// it runs several ranks on one machine), else the machine's cores; it also sets
// OpenBLAS's thread count so BLAS and our own kernels agree. parallelFor splits
// [begin, end) into at most numThreads() contiguous chunks of at least `grain`
// elements and runs fn(chunkBegin, chunkEnd) on pool threads plus the caller;
// it returns when all chunks are done and rethrows the first exception. Nested
// calls (from inside fn) run serially. Thread-safe; concurrent callers share the pool.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace dt {

int numThreads();
// What numThreads() starts from: DT_NUM_THREADS if set (InvalidArgument naming the
// variable if it is not a positive integer), else the machine's cores.
int defaultNumThreads();
// Overrides DT_NUM_THREADS for this process (also sets OpenBLAS threads).
void setNumThreads(int n);

// Stops OpenBLAS's worker threads (true; false where the BLAS library has no such pool). OpenBLAS
// (pthread build) starts them when it loads, and an idle worker polls for work with sched_yield
// for about 2^28 cycles (0.13 s measured) before it sleeps: every process linking it began with
// one busy core per worker, on a 2-core machine the whole other core, while a job's first
// collectives ran. This library calls it once before main; OpenBLAS starts the workers again at
// the first call that uses them, so only a process that uses BLAS threads has them. Call it
// only while no other thread is inside a BLAS call.
bool stopIdleBlasWorkers();

// The kernels OpenBLAS chose for this process ("SkylakeX", "Prescott", ...), for benchmark reports.
std::string blasKernelName();
// OpenBLAS picks its kernels from the CPU model when it loads; a model newer
// than the library (Debian 12's OpenBLAS 0.3.21 on Emerald Rapids, model 207)
// gets its generic SSE3 "Prescott" kernels, about 5x slower GEMM on a CPU with
// AVX-512. Likewise an AVX2 core (Haswell, Zen) on an AVX-512 CPU, whether OpenBLAS
// does not know the model or OPENBLAS_CORETYPE forces it (some environments do): about
// half speed. This returns the one-line warning for `core` (blasKernelName()) on a CPU
// with the given features, given OPENBLAS_CORETYPE's value ("" when unset) and whether
// this build has oneDNN (which then runs most products, and says so), naming the fix, or ""
// when the kernels fit the CPU or the user forced SSE-era kernels on purpose.
// numThreads() and setNumThreads() log it once (module "tensor", level warn).
std::string blasKernelWarning(const std::string& core, bool cpuHasAvx512, bool cpuHasAvx2,
                              const std::string& coretypeVariable = "", bool onednnBuiltIn = false);

// Whether the calling thread is running a chunk of a parallelFor (a pool thread, or the caller
// during its own chunk): libraries with thread teams of their own (oneDNN's OpenMP) run on one
// thread there, as nested parallelFor calls do, instead of a team per chunk.
bool insideParallelFor();

void parallelForImpl(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

template <typename Fn>
inline void parallelFor(int64_t begin, int64_t end, int64_t grain, Fn&& fn) {
  if (end - begin <= grain || numThreads() == 1) {
    if (end > begin) fn(begin, end);
    return;
  }
  parallelForImpl(begin, end, grain, std::function<void(int64_t, int64_t)>(fn));
}

}  // namespace dt
