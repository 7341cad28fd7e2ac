// Internal: the CPU matrix product below mm, bmm, matmul and linear, routed to OpenBLAS or
// oneDNN (tensor/matmul_backend.h says which, docs/tensor.md "Matrix products" why).
//
// Contract: thread-safe (any number of threads may multiply at once; oneDNN's primitives are
// cached per shape behind a mutex and run with per-thread scratch memory). Blocking: returns
// when C is written, having run on numThreads() threads (OpenBLAS's pool, or oneDNN's OpenMP
// team of the calling thread). Pointers are borrowed for the call only.
#pragma once

#include <cstdint>
#include <string>

#include "tensor/dtype.h"

namespace dt::detail {

enum class GemmEngine : uint8_t { OpenBlas, OneDnn };
const char* gemmEngineName(GemmEngine engine);

// C[i] = alpha * op(A[i]) . op(B[i]) + beta * C[i] for i < batch, row-major as CBLAS: op(A) is
// [m, k], op(B) [k, n], C [m, n]; trans means the operand is stored as the transpose (rows of
// the stored matrix ld apart). Matrix i of an operand starts stride elements after matrix i-1.
struct GemmProblem {
  DType inType = DType::Float32;  // A and B: Float32, Float64 or BFloat16
  DType outType = DType::Float32;  // C: Float64 with Float64 inputs, else Float32
  bool transA = false, transB = false;
  int64_t batch = 1, m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0, strideA = 0;
  const void* b = nullptr;
  int64_t ldb = 0, strideB = 0;
  void* c = nullptr;
  int64_t ldc = 0, strideC = 0;
  double alpha = 1.0, beta = 0.0;
  // Float32 C only: a row of n added to every row of C (with beta 0: Linear's bias), in the
  // product's epilogue on oneDNN, written into C before the product on OpenBLAS.
  const float* bias = nullptr;
};

// Whether OpenBLAS's kernels (`core`, blasKernelName()) use the CPU's widest vectors: where they
// do not, the auto rule sends every large float32 product to oneDNN (docs/tensor.md).
bool openblasKernelsFitCpu(const std::string& core, bool cpuHasAvx512, bool cpuHasAvx2);

// The engine the current setting picks for p (Float64 always OpenBLAS).
GemmEngine gemmEngineFor(const GemmProblem& p);
// Runs p on the engine the setting picks; returns the one that ran (OpenBLAS where oneDNN has
// no optimised implementation for the problem).
GemmEngine cpuGemm(const GemmProblem& p);
// Runs p on `engine` whatever the setting (benchmarks, tests); same fallback.
GemmEngine cpuGemmOn(GemmEngine engine, const GemmProblem& p);

// The operand dtype a product of `in` operands computing in `compute` should convert them to:
// BFloat16 when bf16 kernels run natively and the setting allows oneDNN, else `compute`. The
// first bf16 product that falls back logs one line naming the reason (module "tensor", warn).
DType gemmOperandType(DType in, DType compute);

namespace onednn {
// Runs p on oneDNN; false (nothing written) when oneDNN has only a reference implementation for
// it or cannot express it. Only in a build with DT_HAVE_ONEDNN (elsewhere always false).
bool gemm(const GemmProblem& p);
// oneDNN's implementation string for p ("brg:avx512_core", "gemm:jit"), or "" when gemm(p)
// would return false.
std::string implName(const GemmProblem& p);
// Primitives created so far by this process's cache (a training step creates none after its first).
int64_t primitivesCreated();
// Products oneDNN ran so far (tests use it to see that a product did not fall back).
int64_t productsRun();
// "2.6.3"; "" without oneDNN.
std::string version();
// bf16 instructions within oneDNN's effective ISA (AVX512_BF16, or AMX); the reason they are
// missing, "" when they are there.
bool bf16Instructions();
std::string bf16MissingReason();
// AMX-BF16 within oneDNN's effective ISA.
bool hasAmx();
// Multiply-adds per second of the CPU's AVX512_BF16 dot products over its float32 FMAs, both
// on 512-bit vectors with enough independent chains to measure throughput (measured once per
// process, the best of several short trials: about 2 ms); 0 where bf16Instructions() is false.
double bf16DotOverFloat32FmaRate();
// Whether oneDNN's effective ISA includes AVX-512 (avx512_core).
bool hasAvx512();
}  // namespace onednn

}  // namespace dt::detail
