// Strided elementwise kernels: binary/unary ops with broadcasting, where, copy with dtype
// conversion, fill. One kernel per compute type with the op chosen at run time (the
// switch is uniform across a warp, so it costs little, and it keeps nvcc's work small).
#include <cmath>
#include <limits>

#include "tensor/cuda/kernels_common.cuh"

namespace dt::cuda {

using namespace kern;

unsigned gridForBlocks(int64_t items) {
  return static_cast<unsigned>(items < 1 ? 1 : items < kMaxGridBlocks ? items : kMaxGridBlocks);
}

unsigned gridForThreads(int64_t items) {
  return gridForBlocks(items / kBlockThreads + (items % kBlockThreads != 0 ? 1 : 0));
}

Geometry makeGeometry(const std::vector<int64_t>& sizes, const std::vector<std::vector<int64_t>>& strides,
                      const char* op) {
  Geometry g;
  g.operands = static_cast<int>(strides.size());
  if (g.operands > kMaxOperands) {
    throw InvalidArgument(
        str(op, ": ", g.operands, " operands exceed the CUDA kernels' limit of ", kMaxOperands));
  }
  g.numel = 1;
  for (int64_t s : sizes) g.numel *= s;
  // Keep dims of size > 1, outermost first, merging a dim into the previous kept one when
  // every operand steps over it as one run (stride[prev] == stride[d] * size[d]).
  std::vector<int64_t> keptSizes;
  std::vector<std::vector<int64_t>> keptStrides(strides.size());
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 1) continue;
    bool merge = !keptSizes.empty();
    for (size_t k = 0; merge && k < strides.size(); ++k)
      merge = keptStrides[k].back() == strides[k][d] * sizes[d];
    if (merge) {
      keptSizes.back() *= sizes[d];
      for (size_t k = 0; k < strides.size(); ++k) keptStrides[k].back() = strides[k][d];
    } else {
      keptSizes.push_back(sizes[d]);
      for (size_t k = 0; k < strides.size(); ++k) keptStrides[k].push_back(strides[k][d]);
    }
  }
  if (keptSizes.size() > static_cast<size_t>(kMaxDims)) {
    throw NotSupportedError(str(op, ": a strided view with ", keptSizes.size(),
                                " dims that cannot be merged exceeds the CUDA kernels' limit of ", kMaxDims,
                                "; call contiguous() first"));
  }
  g.ndim = static_cast<int>(keptSizes.size());
  for (int d = 0; d < g.ndim; ++d) {
    g.sizes[d] = keptSizes[static_cast<size_t>(d)];
    for (int k = 0; k < g.operands; ++k)
      g.strides[k][d] = keptStrides[static_cast<size_t>(k)][static_cast<size_t>(d)];
  }
  return g;
}

namespace {

constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;

template <typename T>
__device__ inline T binaryValue(BinaryOp op, T a, T b, T alpha, bool unitAlpha) {
  switch (op) {
    case BinaryOp::Add:
      return unitAlpha ? static_cast<T>(a + b) : static_cast<T>(a + alpha * b);
    case BinaryOp::Sub:
      return unitAlpha ? static_cast<T>(a - b) : static_cast<T>(a - alpha * b);
    case BinaryOp::Mul:
      return static_cast<T>(a * b);
    case BinaryOp::Div:
      // A kernel cannot throw: integer division by zero gives 0 here (the cpu kernel throws).
      if constexpr (std::is_integral_v<T>)
        return b == 0 ? T(0) : static_cast<T>(a / b);
      else
        return a / b;
    case BinaryOp::Pow:
      return static_cast<T>(::pow(static_cast<double>(a), static_cast<double>(b)));
    case BinaryOp::Max:
      return (a != a) ? a : (a > b ? a : b);
    case BinaryOp::Min:
      return (a != a) ? a : (a < b ? a : b);
    case BinaryOp::ReluGrad:
      return b > T(0) ? a : T(0);
    case BinaryOp::GeluGrad: {
      const double xd = static_cast<double>(b);
      const double cdf = 0.5 * (1.0 + ::erf(xd * kInvSqrt2));
      const double pdf = kInvSqrt2Pi * ::exp(-0.5 * xd * xd);
      return static_cast<T>(static_cast<double>(a) * (cdf + xd * pdf));
    }
    case BinaryOp::TanhGrad:
      return static_cast<T>(a * (T(1) - b * b));
    case BinaryOp::SigmoidGrad:
      return static_cast<T>(a * b * (T(1) - b));
    case BinaryOp::SqrtGrad:
      return static_cast<T>(a / (T(2) * b));
    case BinaryOp::AbsGrad:
      return b > T(0) ? a : (b < T(0) ? static_cast<T>(-a) : T(0));
    default:
      return T(0);
  }
}

template <typename T>
__device__ inline bool compareValue(BinaryOp op, T a, T b) {
  switch (op) {
    case BinaryOp::Eq:
      return a == b;
    case BinaryOp::Ne:
      return a != b;
    case BinaryOp::Lt:
      return a < b;
    case BinaryOp::Le:
      return a <= b;
    case BinaryOp::Gt:
      return a > b;
    default:
      return a >= b;
  }
}

template <typename T>
__global__ void binaryKernel(BinaryOp op, char* out, const char* a, const char* b, Geometry g, T alpha,
                             bool unitAlpha, bool compare) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < g.numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Offsets<3> o = offsetsOf<3>(g, i);
    const T x = reinterpret_cast<const T*>(a)[o.at[1]];
    const T y = reinterpret_cast<const T*>(b)[o.at[2]];
    if (compare) {
      reinterpret_cast<bool*>(out)[o.at[0]] = compareValue(op, x, y);
    } else {
      reinterpret_cast<T*>(out)[o.at[0]] = binaryValue(op, x, y, alpha, unitAlpha);
    }
  }
}

template <typename T>
__device__ inline T unaryValue(UnaryOp op, T x, T lo, T hi) {
  switch (op) {
    case UnaryOp::Neg:
      return static_cast<T>(-x);
    case UnaryOp::Abs:
      return x < T(0) ? static_cast<T>(-x) : x;
    case UnaryOp::Relu:
      return x > T(0) ? x : T(0);
    case UnaryOp::Clamp:
      return x != x ? x : (x < lo ? lo : (x > hi ? hi : x));
    default:
      break;
  }
  if constexpr (std::is_floating_point_v<T>) {
    switch (op) {
      case UnaryOp::Exp:
        return ::exp(x);
      case UnaryOp::Log:
        return ::log(x);
      case UnaryOp::Sqrt:
        return ::sqrt(x);
      case UnaryOp::Tanh:
        return ::tanh(x);
      case UnaryOp::Sigmoid:
        return static_cast<T>(T(1) / (T(1) + ::exp(-x)));
      case UnaryOp::Gelu:
        return static_cast<T>(0.5 * static_cast<double>(x) *
                              (1.0 + ::erf(static_cast<double>(x) * kInvSqrt2)));
      default:
        break;
    }
  }
  return x;
}

template <typename T>
__global__ void unaryKernel(UnaryOp op, char* out, const char* a, Geometry g, T lo, T hi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < g.numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Offsets<2> o = offsetsOf<2>(g, i);
    reinterpret_cast<T*>(out)[o.at[0]] = unaryValue(op, reinterpret_cast<const T*>(a)[o.at[1]], lo, hi);
  }
}

template <typename T>
__global__ void whereKernel(char* out, const bool* cond, const char* a, const char* b, Geometry g) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < g.numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Offsets<4> o = offsetsOf<4>(g, i);
    reinterpret_cast<T*>(out)[o.at[0]] =
        cond[o.at[1]] ? reinterpret_cast<const T*>(a)[o.at[2]] : reinterpret_cast<const T*>(b)[o.at[3]];
  }
}

// Copies and fills move raw items of 1, 2, 4 or 8 bytes; conversions go through a float64
// carrier, or an int64 one when both ends are integral (exact for every int64).
template <typename T>
__global__ void rawCopyKernel(char* dst, const char* src, Geometry g) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < g.numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Offsets<2> o = offsetsOf<2>(g, i);
    reinterpret_cast<T*>(dst)[o.at[0]] = reinterpret_cast<const T*>(src)[o.at[1]];
  }
}

__device__ inline double loadDouble(DType t, const char* p, int64_t i) {
  switch (t) {
    case DType::Float32:
      return reinterpret_cast<const float*>(p)[i];
    case DType::Float64:
      return reinterpret_cast<const double*>(p)[i];
    case DType::Float16:
      return halfToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
    case DType::BFloat16:
      return bf16ToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
    case DType::Int32:
      return reinterpret_cast<const int32_t*>(p)[i];
    case DType::Int64:
      return static_cast<double>(reinterpret_cast<const int64_t*>(p)[i]);
    case DType::Bool:
      return reinterpret_cast<const bool*>(p)[i] ? 1.0 : 0.0;
  }
  return 0.0;
}

__device__ inline int64_t loadInt(DType t, const char* p, int64_t i) {
  switch (t) {
    case DType::Int32:
      return reinterpret_cast<const int32_t*>(p)[i];
    case DType::Int64:
      return reinterpret_cast<const int64_t*>(p)[i];
    case DType::Bool:
      return reinterpret_cast<const bool*>(p)[i] ? 1 : 0;
    default:
      return 0;
  }
}

__device__ inline void storeDouble(DType t, char* p, int64_t i, double v) {
  switch (t) {
    case DType::Float32:
      reinterpret_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case DType::Float64:
      reinterpret_cast<double*>(p)[i] = v;
      break;
    case DType::Float16:
      reinterpret_cast<uint16_t*>(p)[i] = floatToHalf(static_cast<float>(v));
      break;
    case DType::BFloat16:
      reinterpret_cast<uint16_t*>(p)[i] = floatToBf16(static_cast<float>(v));
      break;
    case DType::Int32:
      reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
      break;
    case DType::Int64:
      reinterpret_cast<int64_t*>(p)[i] = static_cast<int64_t>(v);
      break;
    case DType::Bool:
      reinterpret_cast<bool*>(p)[i] = v != 0.0;
      break;
  }
}

__device__ inline void storeInt(DType t, char* p, int64_t i, int64_t v) {
  switch (t) {
    case DType::Int32:
      reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
      break;
    case DType::Int64:
      reinterpret_cast<int64_t*>(p)[i] = v;
      break;
    case DType::Bool:
      reinterpret_cast<bool*>(p)[i] = v != 0;
      break;
    default:
      break;
  }
}

__global__ void convertKernel(DType dt, char* dst, DType st, const char* src, Geometry g, bool integral) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < g.numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Offsets<2> o = offsetsOf<2>(g, i);
    if (integral) {
      storeInt(dt, dst, o.at[0], loadInt(st, src, o.at[1]));
    } else {
      storeDouble(dt, dst, o.at[0], loadDouble(st, src, o.at[1]));
    }
  }
}

template <typename T>
__global__ void fillKernel(char* dst, Geometry g, T value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < g.numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    reinterpret_cast<T*>(dst)[offsetsOf<1>(g, i).at[0]] = value;
  }
}

bool isIntegral(DType t) { return t == DType::Int32 || t == DType::Int64 || t == DType::Bool; }

template <typename Fn>
void dispatchCompute(DType t, const char* op, Fn&& fn) {
  switch (t) {
    case DType::Float32:
      return fn(float{});
    case DType::Float64:
      return fn(double{});
    case DType::Int32:
      return fn(int32_t{});
    case DType::Int64:
      return fn(int64_t{});
    default:
      break;
  }
  throw InvalidArgument(str(op, ": CUDA kernels compute in float32/float64/int32/int64, not ", t));
}

template <typename T>
T clampLimit(double v) {
  if (v <= static_cast<double>(std::numeric_limits<T>::lowest())) return std::numeric_limits<T>::lowest();
  if (v >= static_cast<double>(std::numeric_limits<T>::max())) return std::numeric_limits<T>::max();
  return static_cast<T>(v);
}

}  // namespace

void binary(Device device, BinaryOp op, DType compute, void* out, const void* a, const void* b,
            const Geometry& g, double alpha) {
  if (g.numel == 0) return;
  DeviceGuard guard(device);
  const bool compare = op >= BinaryOp::Eq && op <= BinaryOp::Ge;
  dispatchCompute(compute, "binary op", [&](auto zero) {
    using T = decltype(zero);
    binaryKernel<T><<<blocksFor(g.numel), kThreads, 0, streamFor(device)>>>(
        op, static_cast<char*>(out), static_cast<const char*>(a), static_cast<const char*>(b), g,
        static_cast<T>(alpha), alpha == 1.0, compare);
  });
  checkLaunch("binary", device);
}

void unary(Device device, UnaryOp op, DType compute, void* out, const void* a, const Geometry& g, double p0,
           double p1) {
  if (g.numel == 0) return;
  DeviceGuard guard(device);
  dispatchCompute(compute, "unary op", [&](auto zero) {
    using T = decltype(zero);
    unaryKernel<T><<<blocksFor(g.numel), kThreads, 0, streamFor(device)>>>(
        op, static_cast<char*>(out), static_cast<const char*>(a), g, clampLimit<T>(p0), clampLimit<T>(p1));
  });
  checkLaunch("unary", device);
}

void where(Device device, DType type, void* out, const void* cond, const void* a, const void* b,
           const Geometry& g) {
  if (g.numel == 0) return;
  DeviceGuard guard(device);
  const unsigned blocks = blocksFor(g.numel);
  cudaStream_t s = streamFor(device);
  char* o = static_cast<char*>(out);
  const bool* c = static_cast<const bool*>(cond);
  const char *x = static_cast<const char*>(a), *y = static_cast<const char*>(b);
  switch (itemSize(type)) {
    case 1:
      whereKernel<uint8_t><<<blocks, kThreads, 0, s>>>(o, c, x, y, g);
      break;
    case 2:
      whereKernel<uint16_t><<<blocks, kThreads, 0, s>>>(o, c, x, y, g);
      break;
    case 4:
      whereKernel<uint32_t><<<blocks, kThreads, 0, s>>>(o, c, x, y, g);
      break;
    default:
      whereKernel<uint64_t><<<blocks, kThreads, 0, s>>>(o, c, x, y, g);
      break;
  }
  checkLaunch("where", device);
}

void copy(Device device, DType dstType, void* dst, DType srcType, const void* src, const Geometry& g) {
  if (g.numel == 0) return;
  DeviceGuard guard(device);
  const unsigned blocks = blocksFor(g.numel);
  cudaStream_t s = streamFor(device);
  char* d = static_cast<char*>(dst);
  const char* p = static_cast<const char*>(src);
  if (dstType == srcType) {
    switch (itemSize(dstType)) {
      case 1:
        rawCopyKernel<uint8_t><<<blocks, kThreads, 0, s>>>(d, p, g);
        break;
      case 2:
        rawCopyKernel<uint16_t><<<blocks, kThreads, 0, s>>>(d, p, g);
        break;
      case 4:
        rawCopyKernel<uint32_t><<<blocks, kThreads, 0, s>>>(d, p, g);
        break;
      default:
        rawCopyKernel<uint64_t><<<blocks, kThreads, 0, s>>>(d, p, g);
        break;
    }
  } else {
    convertKernel<<<blocks, kThreads, 0, s>>>(dstType, d, srcType, p, g,
                                              isIntegral(dstType) && isIntegral(srcType));
  }
  checkLaunch("copy", device);
}

void fill(Device device, DType type, void* dst, const Geometry& g, double value) {
  if (g.numel == 0) return;
  DeviceGuard guard(device);
  const unsigned blocks = blocksFor(g.numel);
  cudaStream_t s = streamFor(device);
  char* d = static_cast<char*>(dst);
  // The value is converted on the host with the cpu's rules, then stored as raw bits.
  dispatchDType(type, [&]<typename T>() {
    const T v = convertScalar<T>(value);
    if constexpr (sizeof(T) == 1) {
      uint8_t bits;
      std::memcpy(&bits, &v, 1);
      fillKernel<uint8_t><<<blocks, kThreads, 0, s>>>(d, g, bits);
    } else if constexpr (sizeof(T) == 2) {
      uint16_t bits;
      std::memcpy(&bits, &v, 2);
      fillKernel<uint16_t><<<blocks, kThreads, 0, s>>>(d, g, bits);
    } else if constexpr (sizeof(T) == 4) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      fillKernel<uint32_t><<<blocks, kThreads, 0, s>>>(d, g, bits);
    } else {
      uint64_t bits;
      std::memcpy(&bits, &v, 8);
      fillKernel<uint64_t><<<blocks, kThreads, 0, s>>>(d, g, bits);
    }
  });
  checkLaunch("fill", device);
}

}  // namespace dt::cuda
