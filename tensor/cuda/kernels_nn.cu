// Row kernels (reductions, softmax, cross-entropy, layer norm), embedding gathers and
// scatters, and the AdamW update. One block of kThreads per row where a row is reduced, except
// the sum and extreme reductions and layer norm's parameter gradients, which spread a few long
// rows (or columns) over many blocks in two passes (kernels.h: rowReduceGeometry,
// columnReduceGeometry); float32/float64 only (the ops layer converts 16-bit floats to float32
// first). Every kernel
// loops over its rows or elements with a stride of the grid (gridForBlocks/gridForThreads cap
// the grid), so any count fits; a loop that contains __syncthreads runs the same iterations
// on every thread of a block.
#include <algorithm>
#include <cmath>

#include "tensor/cuda/kernels_common.cuh"
#include "tensor/internal/row_math.h"

namespace dt::cuda {

using namespace kern;

namespace {

// Scratch memory for a two-pass reduction, from the caching allocator on the
// current stream: freed once the launches are queued, it is reused only by
// later work on that same stream, which runs after them.
DataPtr workspace(Device device, size_t bytes) { return cudaAllocator().allocateOn(device, bytes); }

template <typename Fn>
void dispatchFloat(DType t, const char* op, Fn&& fn) {
  if (t == DType::Float32) return fn(float{});
  if (t == DType::Float64) return fn(double{});
  throw InvalidArgument(str(op, ": CUDA kernel computes in float32/float64, not ", t));
}


// ---- sum / extreme -------------------------------------------------------------------------

// Work item `item` of a chunked row reduction: row item / chunks, elements [begin, end).
struct ChunkRange {
  int64_t row, begin, end;
};
__device__ inline ChunkRange chunkRange(int64_t item, int64_t chunks, int64_t chunkLen, int64_t n) {
  const int64_t begin = (item % chunks) * chunkLen;
  return ChunkRange{item / chunks, begin, begin + chunkLen < n ? begin + chunkLen : n};
}

// One block per (row, chunk): the chunk's sum into out[item] (item = row * chunks + chunk).
// With one chunk per row it is the row's sum; otherwise a partial for the second pass (this
// kernel again, over the partials).
template <typename In, typename Out, typename Acc>
__global__ void sumChunksKernel(Out* out, const In* in, int64_t rows, int64_t n, int64_t chunks,
                                int64_t chunkLen) {
  __shared__ Acc shared[kThreads / 32];
  for (int64_t item = blockIdx.x; item < rows * chunks; item += gridDim.x) {
    const ChunkRange c = chunkRange(item, chunks, chunkLen, n);
    const In* row = in + c.row * n;
    Acc acc = 0;
    for (int64_t j = c.begin + threadIdx.x; j < c.end; j += kThreads) acc += static_cast<Acc>(row[j]);
    acc = blockSum(acc, shared);
    if (threadIdx.x == 0) out[item] = static_cast<Out>(acc);
  }
}

// Rows of at most kShortRow elements: one thread adds a row in order.
template <typename T, typename Acc>
__global__ void sumShortRowsKernel(T* out, const T* in, int64_t rows, int64_t n) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Acc acc = 0;
    for (int64_t j = 0; j < n; ++j) acc += static_cast<Acc>(in[r * n + j]);
    out[r] = static_cast<T>(acc);
  }
}

template <typename T>
__global__ void extremeShortRowsKernel(T* values, int64_t* indices, const T* in, int64_t rows, int64_t n,
                                       bool isMax) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    indices[r] = detail::extremeIndex(in + r * n, n, isMax, values[r]);
  }
}

// The block's best candidate (detail::betterExtreme), on every thread.
template <typename T>
__device__ inline detail::ExtremeCandidate<T> blockBestExtreme(detail::ExtremeCandidate<T> mine,
                                                               detail::ExtremeCandidate<T>* shared, bool isMax) {
  shared[threadIdx.x] = mine;
  __syncthreads();
  for (int step = kThreads / 2; step > 0; step >>= 1) {
    if (threadIdx.x < step) {
      shared[threadIdx.x] = detail::betterExtreme(shared[threadIdx.x], shared[threadIdx.x + step], isMax);
    }
    __syncthreads();
  }
  const detail::ExtremeCandidate<T> best = shared[0];
  __syncthreads();  // shared is reused by the next row
  return best;
}

// One block per (row, chunk), as sumChunksKernel: the chunk's best element. `partials` null: one
// chunk per row, written to values/indices; else partials[item] for extremePartialsKernel.
template <typename T>
__global__ void extremeChunksKernel(detail::ExtremeCandidate<T>* partials, T* values, int64_t* indices,
                                    const T* in, int64_t rows, int64_t n, int64_t chunks, int64_t chunkLen,
                                    bool isMax) {
  __shared__ detail::ExtremeCandidate<T> shared[kThreads];
  for (int64_t item = blockIdx.x; item < rows * chunks; item += gridDim.x) {
    const ChunkRange c = chunkRange(item, chunks, chunkLen, n);
    const T* row = in + c.row * n;
    detail::ExtremeCandidate<T> mine{T(0), -1};
    for (int64_t j = c.begin + threadIdx.x; j < c.end; j += kThreads) {
      mine = detail::betterExtreme(mine, detail::ExtremeCandidate<T>{row[j], j}, isMax);
    }
    const detail::ExtremeCandidate<T> best = blockBestExtreme(mine, shared, isMax);
    if (threadIdx.x == 0) {
      if (partials != nullptr) {
        partials[item] = best;
      } else {
        values[c.row] = best.value;
        indices[c.row] = best.index;
      }
    }
  }
}

// The second pass: one block per row picks the best of its chunks' candidates.
template <typename T>
__global__ void extremePartialsKernel(T* values, int64_t* indices, const detail::ExtremeCandidate<T>* partials,
                                      int64_t rows, int64_t chunks, bool isMax) {
  __shared__ detail::ExtremeCandidate<T> shared[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    detail::ExtremeCandidate<T> mine{T(0), -1};
    for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
      mine = detail::betterExtreme(mine, partials[r * chunks + c], isMax);
    }
    const detail::ExtremeCandidate<T> best = blockBestExtreme(mine, shared, isMax);
    if (threadIdx.x == 0) {
      values[r] = best.value;
      indices[r] = best.index;
    }
  }
}

template <typename T>
__global__ void scatterRowsKernel(T* out, const T* grad, const int64_t* idx, int64_t outer, int64_t r,
                                  int64_t inner) {
  const int64_t total = outer * inner;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t o = i / inner, k = i % inner;
    out[(o * r + idx[i]) * inner + k] = grad[i];
  }
}

// ---- softmax ---------------------------------------------------------------------------------

// Same arithmetic as the cpu's softmaxRows: max in T, sum of exp in float64.
template <typename T>
__global__ void softmaxRowsKernel(T* out, const T* in, int64_t rows, int64_t n, bool logMode) {
  __shared__ double sharedD[kThreads / 32];
  __shared__ T sharedT[kThreads / 32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = in + r * n;
    T* yr = out + r * n;
    T mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < n; j += kThreads) mx = xr[j] > mx ? xr[j] : mx;
    mx = blockMax(mx, sharedT);
    if (isinf(mx) && mx < 0) mx = 0;
    double s = 0;
    for (int64_t j = threadIdx.x; j < n; j += kThreads) s += ::exp(static_cast<double>(xr[j] - mx));
    s = blockSum(s, sharedD);
    if (logMode) {
      const T logSum = static_cast<T>(::log(s));
      for (int64_t j = threadIdx.x; j < n; j += kThreads) yr[j] = (xr[j] - mx) - logSum;
    } else {
      const double inv = 1.0 / s;
      for (int64_t j = threadIdx.x; j < n; j += kThreads)
        yr[j] = static_cast<T>(::exp(static_cast<double>(xr[j] - mx)) * inv);
    }
  }
}

// ---- cross entropy ---------------------------------------------------------------------------

// counted[i]: 1 for a row whose target is a class, else 0 (summed for the mean's divisor on
// the device, so the host never reads the count). An out-of-range target (reported by the
// deferred index check) counts as ignored and reads nothing.
template <typename T>
__global__ void crossEntropyForwardKernel(double* losses, double* counted, const T* lsm, const int64_t* target,
                                          int64_t n, int64_t c, int64_t ignoreIndex, double eps) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = target[i];
    if (t == ignoreIndex || t < 0 || t >= c) {
      losses[i] = 0;
      counted[i] = 0;
      continue;
    }
    counted[i] = 1;
    losses[i] = detail::smoothedNll(lsm + i * c, t, c, eps);
  }
}

template <typename T>
__global__ void crossEntropyBackwardKernel(T* out, const T* lsm, const int64_t* target, const double* grad,
                                           bool perRow, const double* divisor, int64_t n, int64_t c,
                                           int64_t ignoreIndex, double eps) {
  const int64_t total = n * c;
  const double smooth = eps / static_cast<double>(c);
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / c, j = e % c;
    const int64_t t = target[i];
    if (t == ignoreIndex || t < 0 || t >= c) {  // out of range: ignored, as in the forward
      out[e] = T(0);
      continue;
    }
    const double g = perRow ? grad[i] : divisor != nullptr ? grad[0] / *divisor : grad[0];
    // The cpu rounds the shared term to T before subtracting at the target: do the same.
    T v = static_cast<T>(g * (::exp(static_cast<double>(lsm[e])) - smooth));
    if (j == t) v = static_cast<T>(static_cast<double>(v) - g * (1.0 - eps));
    out[e] = v;
  }
}

// ---- layer norm --------------------------------------------------------------------------------

template <typename T>
__global__ void layerNormForwardKernel(T* y, double* meanOut, double* rstdOut, const T* x, const T* w,
                                       const T* b, int64_t rows, int64_t d, double eps) {
  __shared__ double shared[kThreads / 32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    double s = 0;
    for (int64_t j = threadIdx.x; j < d; j += kThreads) s += static_cast<double>(xr[j]);
    const double mu = blockSum(s, shared) / static_cast<double>(d);
    double v = 0;
    for (int64_t j = threadIdx.x; j < d; j += kThreads) {
      const double t = static_cast<double>(xr[j]) - mu;
      v += t * t;
    }
    const double rstd = 1.0 / ::sqrt(blockSum(v, shared) / static_cast<double>(d) + eps);
    if (threadIdx.x == 0) {
      meanOut[r] = mu;
      rstdOut[r] = rstd;
    }
    for (int64_t j = threadIdx.x; j < d; j += kThreads) {
      double t = (static_cast<double>(xr[j]) - mu) * rstd;
      if (w != nullptr) t *= static_cast<double>(w[j]);
      if (b != nullptr) t += static_cast<double>(b[j]);
      yr[j] = static_cast<T>(t);
    }
  }
}

template <typename T>
__global__ void layerNormBackwardInputKernel(T* gx, const T* x, const T* w, const T* g, const double* meanIn,
                                             const double* rstdIn, int64_t rows, int64_t d) {
  __shared__ double shared[kThreads / 32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    const T* gr = g + r * d;
    const double mu = meanIn[r], rstd = rstdIn[r];
    double sumG = 0, sumGX = 0;
    for (int64_t j = threadIdx.x; j < d; j += kThreads) {
      const double xhat = (static_cast<double>(xr[j]) - mu) * rstd;
      const double gh = static_cast<double>(gr[j]) * (w ? static_cast<double>(w[j]) : 1.0);
      sumG += gh;
      sumGX += gh * xhat;
    }
    sumG = blockSum(sumG, shared);
    sumGX = blockSum(sumGX, shared);
    const double invD = 1.0 / static_cast<double>(d);
    T* o = gx + r * d;
    for (int64_t j = threadIdx.x; j < d; j += kThreads) {
      const double xhat = (static_cast<double>(xr[j]) - mu) * rstd;
      const double gh = static_cast<double>(gr[j]) * (w ? static_cast<double>(w[j]) : 1.0);
      o[j] = static_cast<T>(rstd * (gh - sumG * invD - xhat * sumGX * invD));
    }
  }
}

// One thread per column walks the rows of chunk blockIdx.y (neighbouring threads read
// neighbouring columns) into pw/pb[chunk * d + j]: with one chunk, the gradients themselves.
template <typename T>
__global__ void layerNormBackwardParamsKernel(double* pw, double* pb, const T* x, const T* g,
                                              const double* meanIn, const double* rstdIn, int64_t rows,
                                              int64_t d, int64_t rowsPerChunk) {
  const int64_t chunk = blockIdx.y;
  const int64_t r0 = chunk * rowsPerChunk;
  const int64_t r1 = r0 + rowsPerChunk < rows ? r0 + rowsPerChunk : rows;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < d;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double sw = 0, sb = 0;
    for (int64_t r = r0; r < r1; ++r) {
      const double gv = static_cast<double>(g[r * d + j]);
      sw += gv * (static_cast<double>(x[r * d + j]) - meanIn[r]) * rstdIn[r];
      sb += gv;
    }
    if (pw) pw[chunk * d + j] = sw;
    if (pb) pb[chunk * d + j] = sb;
  }
}

// The second pass: out[j] = the column's partials added in chunk order.
__global__ void sumColumnChunksKernel(double* out, const double* partials, int64_t chunks, int64_t d) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < d;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double s = 0;
    for (int64_t c = 0; c < chunks; ++c) s += partials[c * d + j];
    out[j] = s;
  }
}

// ---- embedding ------------------------------------------------------------------------------------

// first: atomicMin of the bad positions (all ones when none).
__global__ void indexCheckKernel(unsigned long long* first, const int64_t* idx, int64_t count, int64_t limit,
                                 bool hasIgnore, int64_t ignore) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t v = idx[i];
    if ((v < 0 || v >= limit) && !(hasIgnore && v == ignore)) atomicMin(first, static_cast<unsigned long long>(i));
  }
}

// After indexCheckKernel on the same stream: out = {first bad position or -1, its value}.
__global__ void indexCheckResultKernel(int64_t* out, const unsigned long long* first, const int64_t* idx) {
  const unsigned long long f = *first;
  out[0] = f == ~0ull ? -1 : static_cast<int64_t>(f);
  out[1] = f == ~0ull ? 0 : idx[f];
}

template <typename T>
__global__ void gatherRowsKernel(T* out, const T* weight, const int64_t* idx, int64_t count,
                                 int64_t rowElems, int64_t limit) {
  const int64_t total = count * rowElems;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx[e / rowElems];
    // An index out of range (its check is raised later) gathers zeros, never foreign memory.
    out[e] = row >= 0 && row < limit ? weight[row * rowElems + e % rowElems] : T(0);
  }
}

__global__ void scatterAddRowsKernel(double* gw, const double* grad, const int64_t* idx, int64_t count,
                                     int64_t rowElems, int64_t limit) {
  const int64_t total = count * rowElems;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx[e / rowElems];
    if (row >= 0 && row < limit) atomicAdd(&gw[row * rowElems + e % rowElems], grad[e]);
  }
}

// ---- AdamW -------------------------------------------------------------------------------------------

// Explicitly rounded operations: nvcc would otherwise fuse a*b+c into one FMA, whose single
// rounding differs from the cpu's two.
__device__ inline float mulR(float a, float b) { return __fmul_rn(a, b); }
__device__ inline float addR(float a, float b) { return __fadd_rn(a, b); }
__device__ inline float subR(float a, float b) { return __fsub_rn(a, b); }
__device__ inline float divR(float a, float b) { return __fdiv_rn(a, b); }
__device__ inline float sqrtR(float a) { return __fsqrt_rn(a); }
__device__ inline double mulR(double a, double b) { return __dmul_rn(a, b); }
__device__ inline double addR(double a, double b) { return __dadd_rn(a, b); }
__device__ inline double subR(double a, double b) { return __dsub_rn(a, b); }
__device__ inline double divR(double a, double b) { return __ddiv_rn(a, b); }
__device__ inline double sqrtR(double a) { return __dsqrt_rn(a); }

template <typename T>
__global__ void adamwKernel(T* p, const T* g, T* m, T* v, int64_t n, T decay, T tb1, T tb2, T ob1, T ob2,
                            T stepSize, T invBc2, T te) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const T gi = g[i];
    const T pi = mulR(p[i], decay);
    const T mi = addR(mulR(tb1, m[i]), mulR(ob1, gi));
    const T vi = addR(mulR(tb2, v[i]), mulR(mulR(ob2, gi), gi));
    m[i] = mi;
    v[i] = vi;
    p[i] = subR(pi, divR(mulR(stepSize, mi), addR(mulR(sqrtR(vi), invBc2), te)));
  }
}

template <typename T, typename Acc>
void launchSumRows(Device device, cudaStream_t s, T* out, const T* in, int64_t rows, int64_t n) {
  const RowReduceGeometry g = rowReduceGeometry(rows, n);
  if (g.threadPerRow) {
    sumShortRowsKernel<T, Acc><<<g.grid, kThreads, 0, s>>>(out, in, rows, n);
  } else if (g.chunks == 1) {
    sumChunksKernel<T, T, Acc><<<g.grid, kThreads, 0, s>>>(out, in, rows, n, 1, n);
  } else {
    const DataPtr partials = workspace(device, static_cast<size_t>(rows * g.chunks) * sizeof(Acc));
    Acc* p = static_cast<Acc*>(partials.get());
    sumChunksKernel<T, Acc, Acc><<<g.grid, kThreads, 0, s>>>(p, in, rows, n, g.chunks, g.chunkLen);
    checkLaunch("sumRows (first pass)", device);
    sumChunksKernel<Acc, T, Acc><<<gridForBlocks(rows), kThreads, 0, s>>>(out, p, rows, g.chunks, 1, g.chunks);
  }
  checkLaunch("sumRows", device);
}

template <typename T>
void launchExtremeRows(Device device, cudaStream_t s, T* values, int64_t* indices, const T* in, int64_t rows,
                       int64_t n, bool isMax) {
  const RowReduceGeometry g = rowReduceGeometry(rows, n);
  if (g.threadPerRow) {
    extremeShortRowsKernel<T><<<g.grid, kThreads, 0, s>>>(values, indices, in, rows, n, isMax);
  } else if (g.chunks == 1) {
    extremeChunksKernel<T><<<g.grid, kThreads, 0, s>>>(nullptr, values, indices, in, rows, n, 1, n, isMax);
  } else {
    using Candidate = detail::ExtremeCandidate<T>;
    const DataPtr partials = workspace(device, static_cast<size_t>(rows * g.chunks) * sizeof(Candidate));
    Candidate* p = static_cast<Candidate*>(partials.get());
    extremeChunksKernel<T>
        <<<g.grid, kThreads, 0, s>>>(p, nullptr, nullptr, in, rows, n, g.chunks, g.chunkLen, isMax);
    checkLaunch("extremeRows (first pass)", device);
    extremePartialsKernel<T><<<gridForBlocks(rows), kThreads, 0, s>>>(values, indices, p, rows, g.chunks, isMax);
  }
  checkLaunch("extremeRows", device);
}

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

RowReduceGeometry rowReduceGeometry(int64_t rows, int64_t n) {
  RowReduceGeometry g;
  if (n <= kShortRow) {
    g.threadPerRow = true;
    g.chunkLen = n;
    g.grid = gridForThreads(rows);
    return g;
  }
  int64_t chunks = 1;
  if (rows < kReduceTargetBlocks) {
    const int64_t wanted = ceilDiv(kReduceTargetBlocks, rows < 1 ? 1 : rows);
    const int64_t worth = n / kMinChunk;  // so that no chunk is shorter than kMinChunk
    chunks = std::max<int64_t>(1, std::min({wanted, worth, kMaxChunks}));
  }
  g.chunkLen = ceilDiv(n, chunks);
  g.chunks = ceilDiv(n, g.chunkLen);  // no empty chunk at the end
  g.grid = gridForBlocks(rows * g.chunks);
  return g;
}

ColumnReduceGeometry columnReduceGeometry(int64_t rows, int64_t cols) {
  ColumnReduceGeometry g;
  const int64_t columnBlocks = ceilDiv(cols < 1 ? 1 : cols, kBlockThreads);
  const int64_t allRows = rows < 1 ? 1 : rows;
  int64_t chunks = 1;
  if (columnBlocks < kReduceTargetBlocks) {
    const int64_t wanted = ceilDiv(kReduceTargetBlocks, columnBlocks);
    const int64_t worth = allRows / kMinRowsPerChunk;
    chunks = std::max<int64_t>(1, std::min({wanted, worth, kMaxChunks}));
  }
  g.rowsPerChunk = ceilDiv(allRows, chunks);
  g.rowChunks = ceilDiv(allRows, g.rowsPerChunk);
  g.gridX = gridForThreads(cols);
  return g;
}

void sumRows(Device device, DType type, void* out, const void* in, int64_t rows, int64_t n) {
  if (rows == 0) return;
  DeviceGuard guard(device);
  cudaStream_t s = streamFor(device);
  switch (type) {
    case DType::Float32:
      launchSumRows<float, double>(device, s, static_cast<float*>(out), static_cast<const float*>(in), rows, n);
      break;
    case DType::Float64:
      launchSumRows<double, double>(device, s, static_cast<double*>(out), static_cast<const double*>(in), rows, n);
      break;
    case DType::Int64:
      launchSumRows<int64_t, long long>(device, s, static_cast<int64_t*>(out), static_cast<const int64_t*>(in),
                                        rows, n);
      break;
    default:
      throw InvalidArgument(str("sum: CUDA kernel sums float32/float64/int64, not ", type));
  }
}

void extremeRows(Device device, DType type, void* values, int64_t* indices, const void* in, int64_t rows,
                 int64_t n, bool isMax) {
  if (rows == 0) return;
  DeviceGuard guard(device);
  cudaStream_t s = streamFor(device);
  switch (type) {
    case DType::Float32:
      launchExtremeRows(device, s, static_cast<float*>(values), indices, static_cast<const float*>(in), rows, n,
                        isMax);
      break;
    case DType::Float64:
      launchExtremeRows(device, s, static_cast<double*>(values), indices, static_cast<const double*>(in), rows, n,
                        isMax);
      break;
    case DType::Int32:
      launchExtremeRows(device, s, static_cast<int32_t*>(values), indices, static_cast<const int32_t*>(in), rows,
                        n, isMax);
      break;
    case DType::Int64:
      launchExtremeRows(device, s, static_cast<int64_t*>(values), indices, static_cast<const int64_t*>(in), rows,
                        n, isMax);
      break;
    default:
      throw InvalidArgument(str(isMax ? "max" : "min", ": CUDA kernel does not take ", type));
  }
}

void scatterRows(Device device, DType type, void* out, const void* grad, const int64_t* idx, int64_t outer,
                 int64_t r, int64_t inner) {
  if (outer * inner == 0) return;
  DeviceGuard guard(device);
  dispatchFloat(type, "max/min backward", [&](auto zero) {
    using T = decltype(zero);
    scatterRowsKernel<T><<<blocksFor(outer * inner), kThreads, 0, streamFor(device)>>>(
        static_cast<T*>(out), static_cast<const T*>(grad), idx, outer, r, inner);
  });
  checkLaunch("scatterRows", device);
}

void softmaxRows(Device device, DType type, void* out, const void* in, int64_t rows, int64_t n,
                 bool logMode) {
  if (rows == 0 || n == 0) return;
  DeviceGuard guard(device);
  dispatchFloat(type, logMode ? "logSoftmax" : "softmax", [&](auto zero) {
    using T = decltype(zero);
    softmaxRowsKernel<T><<<gridForBlocks(rows), kThreads, 0, streamFor(device)>>>(
        static_cast<T*>(out), static_cast<const T*>(in), rows, n, logMode);
  });
  checkLaunch("softmaxRows", device);
}

void crossEntropyForward(Device device, DType type, double* losses, double* counted, const void* lsm,
                         const int64_t* target, int64_t n, int64_t c, int64_t ignoreIndex, double labelSmoothing) {
  if (n == 0) return;
  DeviceGuard guard(device);
  dispatchFloat(type, "crossEntropy", [&](auto zero) {
    using T = decltype(zero);
    crossEntropyForwardKernel<T><<<gridForThreads(n), kThreads, 0, streamFor(device)>>>(
        losses, counted, static_cast<const T*>(lsm), target, n, c, ignoreIndex, labelSmoothing);
  });
  checkLaunch("crossEntropyForward", device);
}

void crossEntropyBackward(Device device, DType type, void* out, const void* lsm, const int64_t* target,
                          const double* grad, bool perRow, const double* divisor, int64_t n, int64_t c,
                          int64_t ignoreIndex, double labelSmoothing) {
  if (n * c == 0) return;
  DeviceGuard guard(device);
  dispatchFloat(type, "crossEntropy backward", [&](auto zero) {
    using T = decltype(zero);
    crossEntropyBackwardKernel<T><<<blocksFor(n * c), kThreads, 0, streamFor(device)>>>(
        static_cast<T*>(out), static_cast<const T*>(lsm), target, grad, perRow, divisor, n, c, ignoreIndex,
        labelSmoothing);
  });
  checkLaunch("crossEntropyBackward", device);
}

void layerNormForward(Device device, DType type, void* y, double* mean, double* rstd, const void* x,
                      const void* w, const void* b, int64_t rows, int64_t d, double eps) {
  if (rows == 0) return;
  DeviceGuard guard(device);
  dispatchFloat(type, "layerNorm", [&](auto zero) {
    using T = decltype(zero);
    layerNormForwardKernel<T><<<gridForBlocks(rows), kThreads, 0, streamFor(device)>>>(
        static_cast<T*>(y), mean, rstd, static_cast<const T*>(x), static_cast<const T*>(w),
        static_cast<const T*>(b), rows, d, eps);
  });
  checkLaunch("layerNormForward", device);
}

void layerNormBackward(Device device, DType type, void* gx, double* gw, double* gb, const void* x,
                       const void* w, const void* grad, const double* mean, const double* rstd, int64_t rows,
                       int64_t d) {
  DeviceGuard guard(device);
  cudaStream_t s = streamFor(device);
  dispatchFloat(type, "layerNorm backward", [&](auto zero) {
    using T = decltype(zero);
    if (gx != nullptr && rows > 0) {
      layerNormBackwardInputKernel<T><<<gridForBlocks(rows), kThreads, 0, s>>>(
          static_cast<T*>(gx), static_cast<const T*>(x), static_cast<const T*>(w),
          static_cast<const T*>(grad), mean, rstd, rows, d);
    }
    if ((gw != nullptr || gb != nullptr) && d > 0) {
      const ColumnReduceGeometry g = columnReduceGeometry(rows, d);
      const dim3 grid(g.gridX, static_cast<unsigned>(g.rowChunks));
      if (g.rowChunks == 1) {
        layerNormBackwardParamsKernel<T><<<grid, kThreads, 0, s>>>(
            gw, gb, static_cast<const T*>(x), static_cast<const T*>(grad), mean, rstd, rows, d, g.rowsPerChunk);
      } else {
        const size_t each = static_cast<size_t>(g.rowChunks * d);
        const size_t count = (gw != nullptr ? each : 0) + (gb != nullptr ? each : 0);
        const DataPtr partials = workspace(device, count * sizeof(double));
        double* pw = gw != nullptr ? static_cast<double*>(partials.get()) : nullptr;
        double* pb = gb != nullptr ? static_cast<double*>(partials.get()) + (gw != nullptr ? each : 0) : nullptr;
        layerNormBackwardParamsKernel<T><<<grid, kThreads, 0, s>>>(
            pw, pb, static_cast<const T*>(x), static_cast<const T*>(grad), mean, rstd, rows, d, g.rowsPerChunk);
        checkLaunch("layerNormBackward (parameter partials)", device);
        if (gw != nullptr) sumColumnChunksKernel<<<gridForThreads(d), kThreads, 0, s>>>(gw, pw, g.rowChunks, d);
        if (gb != nullptr) sumColumnChunksKernel<<<gridForThreads(d), kThreads, 0, s>>>(gb, pb, g.rowChunks, d);
      }
    }
  });
  checkLaunch("layerNormBackward", device);
}

void checkIndicesAsync(Device device, const int64_t* idx, int64_t count, int64_t limit, bool hasIgnore,
                       int64_t ignore, int64_t* result) {
  if (count == 0) {
    result[0] = -1;
    result[1] = 0;
    return;
  }
  DeviceGuard guard(device);
  cudaStream_t s = streamFor(device);
  // [0] the atomicMin word, [1..2] the result; freed at once: the caching allocator reuses it
  // only for work queued later on this stream.
  const DataPtr scratch = workspace(device, 3 * sizeof(int64_t));
  auto* first = static_cast<unsigned long long*>(scratch.get());
  int64_t* out = static_cast<int64_t*>(scratch.get()) + 1;
  checkCall(cudaMemsetAsync(first, 0xff, sizeof(unsigned long long), s), "memset", device);
  indexCheckKernel<<<gridForThreads(count), kThreads, 0, s>>>(first, idx, count, limit, hasIgnore, ignore);
  checkLaunch("indexCheck", device);
  indexCheckResultKernel<<<1, 1, 0, s>>>(out, first, idx);
  checkLaunch("indexCheck (result)", device);
  checkCall(cudaMemcpyAsync(result, out, 2 * sizeof(int64_t), cudaMemcpyDeviceToHost, s), "memcpy of an index check",
            device);
}

void gatherRows(Device device, size_t itemSize, void* out, const void* weight, const int64_t* idx,
                int64_t count, int64_t rowElems, int64_t limit) {
  if (count * rowElems == 0) return;
  DeviceGuard guard(device);
  const unsigned blocks = blocksFor(count * rowElems);
  cudaStream_t s = streamFor(device);
  switch (itemSize) {
    case 1:
      gatherRowsKernel<uint8_t><<<blocks, kThreads, 0, s>>>(
          static_cast<uint8_t*>(out), static_cast<const uint8_t*>(weight), idx, count, rowElems, limit);
      break;
    case 2:
      gatherRowsKernel<uint16_t><<<blocks, kThreads, 0, s>>>(
          static_cast<uint16_t*>(out), static_cast<const uint16_t*>(weight), idx, count, rowElems, limit);
      break;
    case 4:
      gatherRowsKernel<uint32_t><<<blocks, kThreads, 0, s>>>(
          static_cast<uint32_t*>(out), static_cast<const uint32_t*>(weight), idx, count, rowElems, limit);
      break;
    default:
      gatherRowsKernel<uint64_t><<<blocks, kThreads, 0, s>>>(
          static_cast<uint64_t*>(out), static_cast<const uint64_t*>(weight), idx, count, rowElems, limit);
      break;
  }
  checkLaunch("gatherRows", device);
}

void scatterAddRows(Device device, double* gw, const double* grad, const int64_t* idx, int64_t count,
                    int64_t rowElems, int64_t limit) {
  if (count * rowElems == 0) return;
  DeviceGuard guard(device);
  scatterAddRowsKernel<<<blocksFor(count * rowElems), kThreads, 0, streamFor(device)>>>(gw, grad, idx, count,
                                                                                        rowElems, limit);
  checkLaunch("scatterAddRows", device);
}

void adamw(Device device, DType type, void* p, const void* g, void* m, void* v, int64_t n, double lr,
           double beta1, double beta2, double eps, double weightDecay, double bc1, double bc2Sqrt) {
  if (n == 0) return;
  DeviceGuard guard(device);
  dispatchFloat(type, "AdamW", [&](auto zero) {
    using T = decltype(zero);
    // The scalars are rounded to T on the host exactly as optim.cpp's adamwKernel does.
    adamwKernel<T><<<blocksFor(n), kThreads, 0, streamFor(device)>>>(
        static_cast<T*>(p), static_cast<const T*>(g), static_cast<T*>(m), static_cast<T*>(v), n,
        static_cast<T>(1.0 - lr * weightDecay), static_cast<T>(beta1), static_cast<T>(beta2),
        static_cast<T>(1.0 - beta1), static_cast<T>(1.0 - beta2), static_cast<T>(lr / bc1),
        static_cast<T>(1.0 / bc2Sqrt), static_cast<T>(eps));
  });
  checkLaunch("adamw", device);
}

}  // namespace dt::cuda
