// Device-side helpers shared by the kernels_*.cu files (nvcc only).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/kernels.h"
#include "tensor/cuda/stream.h"

namespace dt::cuda::kern {

constexpr int kThreads = kBlockThreads;

inline cudaStream_t streamFor(Device device) {
  return static_cast<cudaStream_t>(currentStream(device).handle());
}

// A grid-stride loop covers what the capped grid does not (kernels.h).
inline unsigned blocksFor(int64_t n) { return gridForThreads(n); }

inline void checkLaunch(const char* kernel, Device device) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw BackendError(str("CUDA kernel ", kernel, " on ", device.str(), " failed to launch: ",
                           cudaGetErrorString(status), " (", static_cast<int>(status), ")"));
  }
}

inline void checkCall(cudaError_t status, const char* what, Device device) {
  if (status != cudaSuccess) {
    cudaGetLastError();
    throw BackendError(str("CUDA ", what, " on ", device.str(), " failed: ", cudaGetErrorString(status), " (",
                           static_cast<int>(status), ")"));
  }
}

// Offsets of element `linear` for each operand.
template <int N>
struct Offsets {
  int64_t at[N];
};

// Contiguous operands (and a broadcast scalar, stride 0) merge into one dim (makeGeometry), the
// common case of every elementwise op in a step: their offsets are one multiply each, without
// the 64-bit divide and modulo per element that the general walk costs (tens of instructions on
// a GPU, which has no 64-bit integer divider).
template <int N>
__device__ inline Offsets<N> offsetsOf(const Geometry& g, int64_t linear) {
  Offsets<N> o;
  if (g.ndim <= 1) {
    for (int k = 0; k < N; ++k) o.at[k] = g.ndim == 0 ? 0 : linear * g.strides[k][0];
    return o;
  }
  for (int k = 0; k < N; ++k) o.at[k] = 0;
  for (int d = g.ndim - 1; d >= 0; --d) {
    const int64_t size = g.sizes[d];
    const int64_t i = linear % size;
    linear /= size;
    for (int k = 0; k < N; ++k) o.at[k] += i * g.strides[k][d];
  }
  return o;
}

// 16-bit float formats, bit-compatible with tensor/dtype.h (round to nearest even, quiet NaN).
__device__ inline float bf16ToFloat(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}
__device__ inline uint16_t floatToBf16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  const uint32_t rounding = 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>((u + rounding) >> 16);
}
__device__ inline float halfToFloat(uint16_t bits) {
  __half_raw r;
  r.x = bits;
  return __half2float(__half(r));
}
__device__ inline uint16_t floatToHalf(float f) {
  __half_raw r = __half_raw(__float2half_rn(f));
  return r.x;
}

// Sum of `v` over the block (blockDim.x == kThreads); every thread gets the result.
template <typename T>
__device__ inline T blockSum(T v, T* shared) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? shared[lane] : T(0);
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const T total = shared[0];
  __syncthreads();  // shared is reused by the next call
  return total;
}

template <typename T>
__device__ inline T blockMax(T v, T* shared) {
  for (int off = 16; off > 0; off >>= 1) {
    const T o = __shfl_down_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? shared[lane] : shared[0];
    for (int off = 16; off > 0; off >>= 1) {
      const T o = __shfl_down_sync(0xffffffffu, v, off);
      v = o > v ? o : v;
    }
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const T total = shared[0];
  __syncthreads();
  return total;
}

}  // namespace dt::cuda::kern
