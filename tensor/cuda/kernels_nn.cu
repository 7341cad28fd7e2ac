// Row kernels (reductions, softmax, cross-entropy, layer norm), embedding gathers and
// scatters, and the AdamW update. One block of kThreads per row where a row is reduced;
// float32/float64 only (the ops layer converts 16-bit floats to float32 first). Every kernel
// loops over its rows or elements with a stride of the grid (gridForBlocks/gridForThreads cap
// the grid), so any count fits; a loop that contains __syncthreads runs the same iterations
// on every thread of a block.
#include <cmath>

#include "tensor/cuda/kernels_common.cuh"
#include "tensor/internal/row_math.h"

namespace dt::cuda {

using namespace kern;

namespace {

template <typename Fn>
void dispatchFloat(DType t, const char* op, Fn&& fn) {
  if (t == DType::Float32) return fn(float{});
  if (t == DType::Float64) return fn(double{});
  throw InvalidArgument(str(op, ": CUDA kernel computes in float32/float64, not ", t));
}


// ---- sum / extreme -------------------------------------------------------------------------

template <typename T, typename Acc>
__global__ void sumRowsKernel(T* out, const T* in, int64_t rows, int64_t n) {
  __shared__ Acc shared[kThreads / 32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = in + r * n;
    Acc acc = 0;
    for (int64_t j = threadIdx.x; j < n; j += kThreads) acc += static_cast<Acc>(row[j]);
    acc = blockSum(acc, shared);
    if (threadIdx.x == 0) out[r] = static_cast<T>(acc);
  }
}

template <typename T>
__global__ void extremeRowsKernel(T* values, int64_t* indices, const T* in, int64_t rows, int64_t n,
                                  bool isMax) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    indices[r] = detail::extremeIndex(in + r * n, n, isMax, values[r]);
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

// status: [0] first bad row (atomicMin, INT64_MAX when none), [1] valid count.
template <typename T>
__global__ void crossEntropyForwardKernel(double* losses, unsigned long long* status, const T* lsm,
                                          const int64_t* target, int64_t n, int64_t c, int64_t ignoreIndex,
                                          double eps) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = target[i];
    if (t == ignoreIndex) {
      losses[i] = 0;
      continue;
    }
    if (t < 0 || t >= c) {
      atomicMin(&status[0], static_cast<unsigned long long>(i));
      losses[i] = 0;
      continue;
    }
    atomicAdd(&status[1], 1ull);
    losses[i] = detail::smoothedNll(lsm + i * c, t, c, eps);
  }
}

template <typename T>
__global__ void crossEntropyBackwardKernel(T* out, const T* lsm, const int64_t* target, const double* grad,
                                           bool perRow, double divisor, int64_t n, int64_t c,
                                           int64_t ignoreIndex, double eps) {
  const int64_t total = n * c;
  const double smooth = eps / static_cast<double>(c);
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / c, j = e % c;
    const int64_t t = target[i];
    if (t == ignoreIndex) {
      out[e] = T(0);
      continue;
    }
    const double g = perRow ? grad[i] : grad[0] / divisor;
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

// One thread per column walks the rows: neighbouring threads read neighbouring columns.
template <typename T>
__global__ void layerNormBackwardParamsKernel(double* gw, double* gb, const T* x, const T* g,
                                              const double* meanIn, const double* rstdIn, int64_t rows,
                                              int64_t d) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < d;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double sw = 0, sb = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const double gv = static_cast<double>(g[r * d + j]);
      sw += gv * (static_cast<double>(x[r * d + j]) - meanIn[r]) * rstdIn[r];
      sb += gv;
    }
    if (gw) gw[j] = sw;
    if (gb) gb[j] = sb;
  }
}

// ---- embedding ------------------------------------------------------------------------------------

__global__ void indexCheckKernel(unsigned long long* first, const int64_t* idx, int64_t count,
                                 int64_t limit) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (idx[i] < 0 || idx[i] >= limit) atomicMin(first, static_cast<unsigned long long>(i));
  }
}

template <typename T>
__global__ void gatherRowsKernel(T* out, const T* weight, const int64_t* idx, int64_t count,
                                 int64_t rowElems) {
  const int64_t total = count * rowElems;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[e] = weight[idx[e / rowElems] * rowElems + e % rowElems];
  }
}

__global__ void scatterAddRowsKernel(double* gw, const double* grad, const int64_t* idx, int64_t count,
                                     int64_t rowElems) {
  const int64_t total = count * rowElems;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    atomicAdd(&gw[idx[e / rowElems] * rowElems + e % rowElems], grad[e]);
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

}  // namespace

void sumRows(Device device, DType type, void* out, const void* in, int64_t rows, int64_t n) {
  if (rows == 0) return;
  DeviceGuard guard(device);
  cudaStream_t s = streamFor(device);
  switch (type) {
    case DType::Float32:
      sumRowsKernel<float, double>
          <<<gridForBlocks(rows), kThreads, 0, s>>>(static_cast<float*>(out), static_cast<const float*>(in), rows, n);
      break;
    case DType::Float64:
      sumRowsKernel<double, double><<<gridForBlocks(rows), kThreads, 0, s>>>(
          static_cast<double*>(out), static_cast<const double*>(in), rows, n);
      break;
    case DType::Int64:
      sumRowsKernel<int64_t, long long><<<gridForBlocks(rows), kThreads, 0, s>>>(
          static_cast<int64_t*>(out), static_cast<const int64_t*>(in), rows, n);
      break;
    default:
      throw InvalidArgument(str("sum: CUDA kernel sums float32/float64/int64, not ", type));
  }
  checkLaunch("sumRows", device);
}

void extremeRows(Device device, DType type, void* values, int64_t* indices, const void* in, int64_t rows,
                 int64_t n, bool isMax) {
  if (rows == 0) return;
  DeviceGuard guard(device);
  cudaStream_t s = streamFor(device);
  const unsigned blocks = gridForThreads(rows);
  switch (type) {
    case DType::Float32:
      extremeRowsKernel<float><<<blocks, kThreads, 0, s>>>(static_cast<float*>(values), indices,
                                                           static_cast<const float*>(in), rows, n, isMax);
      break;
    case DType::Float64:
      extremeRowsKernel<double><<<blocks, kThreads, 0, s>>>(static_cast<double*>(values), indices,
                                                            static_cast<const double*>(in), rows, n, isMax);
      break;
    case DType::Int32:
      extremeRowsKernel<int32_t><<<blocks, kThreads, 0, s>>>(static_cast<int32_t*>(values), indices,
                                                             static_cast<const int32_t*>(in), rows, n, isMax);
      break;
    case DType::Int64:
      extremeRowsKernel<int64_t><<<blocks, kThreads, 0, s>>>(static_cast<int64_t*>(values), indices,
                                                             static_cast<const int64_t*>(in), rows, n, isMax);
      break;
    default:
      throw InvalidArgument(str(isMax ? "max" : "min", ": CUDA kernel does not take ", type));
  }
  checkLaunch("extremeRows", device);
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

CrossEntropyStatus crossEntropyForward(Device device, DType type, double* losses, const void* lsm,
                                       const int64_t* target, int64_t n, int64_t c, int64_t ignoreIndex,
                                       double labelSmoothing) {
  CrossEntropyStatus result;
  if (n == 0) return result;
  DeviceGuard guard(device);
  cudaStream_t s = streamFor(device);
  unsigned long long* status = nullptr;
  checkCall(cudaMallocAsync(reinterpret_cast<void**>(&status), 2 * sizeof(unsigned long long), s), "malloc",
            device);
  const unsigned long long init[2] = {~0ull, 0ull};
  checkCall(cudaMemcpyAsync(status, init, sizeof(init), cudaMemcpyHostToDevice, s), "memcpy", device);
  dispatchFloat(type, "crossEntropy", [&](auto zero) {
    using T = decltype(zero);
    crossEntropyForwardKernel<T><<<gridForThreads(n), kThreads, 0, s>>>(
        losses, status, static_cast<const T*>(lsm), target, n, c, ignoreIndex, labelSmoothing);
  });
  checkLaunch("crossEntropyForward", device);
  unsigned long long host[2] = {0, 0};
  checkCall(cudaMemcpyAsync(host, status, sizeof(host), cudaMemcpyDeviceToHost, s), "memcpy", device);
  checkCall(cudaFreeAsync(status, s), "free", device);
  checkCall(cudaStreamSynchronize(s), "crossEntropy status", device);
  result.valid = static_cast<int64_t>(host[1]);
  if (host[0] != ~0ull) {
    result.badPosition = static_cast<int64_t>(host[0]);
    checkCall(
        cudaMemcpy(&result.badTarget, target + result.badPosition, sizeof(int64_t), cudaMemcpyDeviceToHost),
        "memcpy", device);
  }
  return result;
}

void crossEntropyBackward(Device device, DType type, void* out, const void* lsm, const int64_t* target,
                          const double* grad, bool perRow, double divisor, int64_t n, int64_t c,
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
      layerNormBackwardParamsKernel<T><<<gridForThreads(d), kThreads, 0, s>>>(
              gw, gb, static_cast<const T*>(x), static_cast<const T*>(grad), mean, rstd, rows, d);
    }
  });
  checkLaunch("layerNormBackward", device);
}

int64_t firstIndexOutOfRange(Device device, const int64_t* idx, int64_t count, int64_t limit,
                             int64_t* badValue) {
  if (count == 0) return -1;
  DeviceGuard guard(device);
  cudaStream_t s = streamFor(device);
  unsigned long long* first = nullptr;
  checkCall(cudaMallocAsync(reinterpret_cast<void**>(&first), sizeof(unsigned long long), s), "malloc",
            device);
  checkCall(cudaMemsetAsync(first, 0xff, sizeof(unsigned long long), s), "memset", device);
  indexCheckKernel<<<gridForThreads(count), kThreads, 0, s>>>(
      first, idx, count, limit);
  checkLaunch("indexCheck", device);
  unsigned long long host = 0;
  checkCall(cudaMemcpyAsync(&host, first, sizeof(host), cudaMemcpyDeviceToHost, s), "memcpy", device);
  checkCall(cudaFreeAsync(first, s), "free", device);
  checkCall(cudaStreamSynchronize(s), "index check", device);
  if (host == ~0ull) return -1;
  const auto position = static_cast<int64_t>(host);
  checkCall(cudaMemcpy(badValue, idx + position, sizeof(int64_t), cudaMemcpyDeviceToHost), "memcpy", device);
  return position;
}

void gatherRows(Device device, size_t itemSize, void* out, const void* weight, const int64_t* idx,
                int64_t count, int64_t rowElems) {
  if (count * rowElems == 0) return;
  DeviceGuard guard(device);
  const unsigned blocks = blocksFor(count * rowElems);
  cudaStream_t s = streamFor(device);
  switch (itemSize) {
    case 1:
      gatherRowsKernel<uint8_t><<<blocks, kThreads, 0, s>>>(
          static_cast<uint8_t*>(out), static_cast<const uint8_t*>(weight), idx, count, rowElems);
      break;
    case 2:
      gatherRowsKernel<uint16_t><<<blocks, kThreads, 0, s>>>(
          static_cast<uint16_t*>(out), static_cast<const uint16_t*>(weight), idx, count, rowElems);
      break;
    case 4:
      gatherRowsKernel<uint32_t><<<blocks, kThreads, 0, s>>>(
          static_cast<uint32_t*>(out), static_cast<const uint32_t*>(weight), idx, count, rowElems);
      break;
    default:
      gatherRowsKernel<uint64_t><<<blocks, kThreads, 0, s>>>(
          static_cast<uint64_t*>(out), static_cast<const uint64_t*>(weight), idx, count, rowElems);
      break;
  }
  checkLaunch("gatherRows", device);
}

void scatterAddRows(Device device, double* gw, const double* grad, const int64_t* idx, int64_t count,
                    int64_t rowElems) {
  if (count * rowElems == 0) return;
  DeviceGuard guard(device);
  scatterAddRowsKernel<<<blocksFor(count * rowElems), kThreads, 0, streamFor(device)>>>(gw, grad, idx, count,
                                                                                        rowElems);
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
