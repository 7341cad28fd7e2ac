// CUDA kernels behind the tensor ops (only in builds with DT_HAVE_CUDA).
//
// Contract:
//  * Plain C++: no CUDA header leaks from here; pointers are device pointers
//    to element 0 of the operand (storage data + offset), strides and sizes
//    count elements, never bytes.
//  * Every function launches on cuda::currentStream(device) and returns
//    without waiting (ops are asynchronous, as in PyTorch). None waits: an
//    index out of range, which a kernel cannot throw, is reported through
//    checkIndicesAsync into host memory and raised later by the ops layer
//    (tensor/deferred_checks.h); the kernels that take such indices skip them.
//  * Compute dtypes: elementwise and reduction kernels take float32, float64,
//    int32 or int64 (the ops layer converts float16/bfloat16/bool first, as
//    the cpu kernels do); copy() converts between every dtype of dtype.h;
//    float results accumulate in float64 where the cpu kernels do.
//  * Errors: a failed launch throws BackendError naming the kernel, the
//    device and CUDA's message; a geometry beyond kMaxDims (after merging
//    dims) throws NotSupportedError naming the op and the shape.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/device.h"
#include "tensor/dtype.h"

namespace dt::cuda {

constexpr int kMaxDims = 8;
constexpr int kMaxOperands = 4;

// The iteration space of an elementwise launch: operand 0 is the output,
// strides[k][d] is operand k's stride along dim d (0 where broadcast).
struct Geometry {
  int ndim = 0;
  int operands = 0;
  int64_t numel = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxOperands][kMaxDims] = {};
};

// Drops size-1 dims and merges dims every operand walks contiguously, so
// most launches index 1 or 2 dims. `strides` holds one stride vector per
// operand, each as long as `sizes`.
Geometry makeGeometry(const std::vector<int64_t>& sizes, const std::vector<std::vector<int64_t>>& strides,
                      const char* op);

// ---- grids (host code, checked in every CUDA build without a device) -----------------------------

constexpr int kBlockThreads = 256;
// No launch has more blocks than this: every kernel loops over the rest of
// its work (a grid-stride loop over int64 indices), so no count is ever cut
// to 32 bits (rows between 2^31 and 2^32 would fail to launch, above 2^32
// they would silently run rows mod 2^32), and huge launches stay small.
constexpr int64_t kMaxGridBlocks = int64_t{65536} * 8;
// Blocks for `items` units of work of one block each (rows), at least 1.
unsigned gridForBlocks(int64_t items);
// Blocks of kBlockThreads for `items` units of work of one thread each.
unsigned gridForThreads(int64_t items);

// How a reduction of `rows` contiguous rows of `n` elements is spread over
// the GPU. One block per row starves the device when rows are few (a full
// reduction, a loss sum, a grad norm: one block of 256 threads for the whole
// tensor), so a long row is split into chunks, each reduced by its own block
// into a partial, and a second pass reduces each row's partials (two-stage,
// in a fixed order: the same result on every run and device). Short rows
// take one thread each.
struct RowReduceGeometry {
  bool threadPerRow = false;  // n <= kShortRow: one thread walks a whole row
  int64_t chunks = 1;         // blocks per row in the first pass (1: one pass)
  int64_t chunkLen = 0;       // elements per chunk (the last may be shorter)
  unsigned grid = 1;          // blocks of the first pass
};
constexpr int64_t kShortRow = 32;
constexpr int64_t kReduceTargetBlocks = 1024;  // enough blocks to fill a large GPU several times
constexpr int64_t kMinChunk = 4096;            // a chunk gives each of 256 threads 16 elements or more
constexpr int64_t kMaxChunks = 1024;           // the second pass: at most 4 partials per thread
RowReduceGeometry rowReduceGeometry(int64_t rows, int64_t n);

// The same for sums down the columns of a contiguous [rows, cols] matrix
// (layer norm's weight and bias gradients): threads take neighbouring
// columns, and the rows are split into chunks along the grid's y dimension
// when the columns alone give too few blocks; a second pass adds each
// column's partials in chunk order.
struct ColumnReduceGeometry {
  int64_t rowChunks = 1;
  int64_t rowsPerChunk = 0;
  unsigned gridX = 1;  // blocks across the columns
};
constexpr int64_t kMinRowsPerChunk = 64;
ColumnReduceGeometry columnReduceGeometry(int64_t rows, int64_t cols);

// Mirror tensor/ops_elementwise.cpp's Bin and Un (same order, same meaning).
enum class BinaryOp : int {
  Add,
  Sub,
  Mul,
  Div,
  Pow,
  Max,
  Min,
  Eq,
  Ne,
  Lt,
  Le,
  Gt,
  Ge,
  ReluGrad,
  GeluGrad,
  TanhGrad,
  SigmoidGrad,
  SqrtGrad,
  AbsGrad,
};
enum class UnaryOp : int { Neg, Exp, Log, Sqrt, Abs, Clamp, Relu, Gelu, Tanh, Sigmoid };

// out = op(a, b) in `compute` (out is bool for comparisons); alpha scales b for Add/Sub.
void binary(Device device, BinaryOp op, DType compute, void* out, const void* a, const void* b,
            const Geometry& g, double alpha);
// out = op(a); Clamp takes [p0, p1].
void unary(Device device, UnaryOp op, DType compute, void* out, const void* a, const Geometry& g, double p0,
           double p1);
// out = cond ? a : b, all of dtype `type` except the bool cond.
void where(Device device, DType type, void* out, const void* cond, const void* a, const void* b,
           const Geometry& g);
// dst = convert(src) elementwise (C++ semantics: bool is != 0, 16-bit floats round to nearest even).
void copy(Device device, DType dstType, void* dst, DType srcType, const void* src, const Geometry& g);
void fill(Device device, DType type, void* dst, const Geometry& g, double value);

// ---- row kernels: `in` is a contiguous [rows, n] matrix -----------------------------------------

// out[r] = sum of row r (float32/float64/int64 accumulate in float64/float64/int64).
void sumRows(Device device, DType type, void* out, const void* in, int64_t rows, int64_t n);
// values[r], indices[r] = max (isMax) or min of row r; the first NaN wins, ties keep the first index.
void extremeRows(Device device, DType type, void* values, int64_t* indices, const void* in, int64_t rows,
                 int64_t n, bool isMax);
// out viewed as [outer, r, inner] (zeroed by the caller): out[o, idx[o, k], k] = grad[o, k].
void scatterRows(Device device, DType type, void* out, const void* grad, const int64_t* idx, int64_t outer,
                 int64_t r, int64_t inner);
void softmaxRows(Device device, DType type, void* out, const void* in, int64_t rows, int64_t n, bool logMode);

// losses[r] and counted[r] (float64 [n] each) from log-probabilities lsm: counted[r] is 1 where
// target[r] is a class, 0 where it is ignoreIndex or out of range (loss 0; the caller checks
// the targets with checkIndicesAsync).
void crossEntropyForward(Device device, DType type, double* losses, double* counted, const void* lsm,
                         const int64_t* target, int64_t n, int64_t c, int64_t ignoreIndex, double labelSmoothing);
// out[r, j] = scale_r * (exp(lsm) - smoothing/c - (1 - smoothing) * [j == target]), where
// scale_r = grad[r] (perRow) or grad[0] / *divisor (a device float64; null divides by 1); 0 in
// rows whose target is ignoreIndex or out of range.
void crossEntropyBackward(Device device, DType type, void* out, const void* lsm, const int64_t* target,
                          const double* grad, bool perRow, const double* divisor, int64_t n, int64_t c,
                          int64_t ignoreIndex, double labelSmoothing);

// w and b may be null. mean/rstd are float64 [rows]; gw/gb float64 [d] (overwritten), each may be null.
void layerNormForward(Device device, DType type, void* y, double* mean, double* rstd, const void* x,
                      const void* w, const void* b, int64_t rows, int64_t d, double eps);
void layerNormBackward(Device device, DType type, void* gx, double* gw, double* gb, const void* x,
                       const void* w, const void* grad, const double* mean, const double* rstd, int64_t rows,
                       int64_t d);

// Queues a range check of idx[0, count) and returns without waiting: result[0] becomes the
// first position whose value is outside [0, limit) (a value equal to `ignore` passes when
// hasIgnore), or -1, and result[1] that value (0 when none). `result` is pinned host memory
// (pinnedHostAllocator; the copy into it is asynchronous), valid once the stream has passed
// this point (record an event after the call) and kept alive until then. count 0 writes
// {-1, 0} at once.
void checkIndicesAsync(Device device, const int64_t* idx, int64_t count, int64_t limit, bool hasIgnore,
                       int64_t ignore, int64_t* result);
// out[i, :] = weight[idx[i], :] for rows of rowElems elements of itemSize bytes; a row whose
// index is outside [0, limit) is zeros.
void gatherRows(Device device, size_t itemSize, void* out, const void* weight, const int64_t* idx,
                int64_t count, int64_t rowElems, int64_t limit);
// gw[idx[i], :] += grad[i, :] (float64, atomic: repeated indices accumulate); an index
// outside [0, limit) adds nothing.
void scatterAddRows(Device device, double* gw, const double* grad, const int64_t* idx, int64_t count,
                    int64_t rowElems, int64_t limit);

// One AdamW step over contiguous float32/float64 arrays, the same arithmetic as
// optim.cpp's adamwRange (no fused multiply-add, so the bits match the cpu).
void adamw(Device device, DType type, void* p, const void* g, void* m, void* v, int64_t n, double lr,
           double beta1, double beta2, double eps, double weightDecay, double bc1, double bc2Sqrt);

// Row-major c[m, n] = alpha * op(a)[m, k] . op(b)[k, n] + beta * c through cuBLAS.
// transX: the memory holds X transposed (row-major, leading dim ldX). float32 runs with
// cuBLAS's default math (no TF32), float64 in float64.
void gemm(Device device, DType type, bool transA, bool transB, int64_t m, int64_t n, int64_t k, double alpha,
          const void* a, int64_t lda, const void* b, int64_t ldb, double beta, void* c, int64_t ldc);
// `batch` products at once: matrix i of X starts strideX elements after matrix i - 1 (0 repeats
// one matrix), with the same layout and transpose flags as gemm().
void gemmStridedBatched(Device device, DType type, bool transA, bool transB, int64_t m, int64_t n, int64_t k,
                        double alpha, const void* a, int64_t lda, int64_t strideA, const void* b, int64_t ldb,
                        int64_t strideB, double beta, void* c, int64_t ldc, int64_t strideC, int64_t batch);

}  // namespace dt::cuda
