#include "collectives/reduce_kernels.h"

#include <cstring>

#include "common/errors.h"
#include "common/strings.h"

namespace dt {
namespace {

inline uint32_t asBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float asFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Half -> float without branches: shifting the 15 exponent+mantissa bits into
// float position and scaling by 2^112 rebiases the exponent (15 -> 127) and
// also turns half subnormals into the right float value, because the float
// multiply normalises them. Only inf/NaN (exponent all ones) need a select.
inline float halfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t magnitude = h & 0x7fffu;
  const uint32_t shifted = magnitude << 13;
  const float scaled = asFloat(shifted) * 0x1.0p112f;
  const uint32_t infNan = shifted | 0x7f800000u;
  const uint32_t bits = magnitude >= 0x7c00u ? infNan : asBits(scaled);
  return asFloat(bits | sign);
}

// Float -> half, round to nearest even, without branches. Adding a power of
// two chosen from the input's exponent (13 mantissa bits above it) makes the
// FPU round the mantissa exactly as half precision would; the rounded half
// exponent+mantissa are then read off the sum's low bits. Inputs below half's
// normal range share one fixed addend, which lands them in half's subnormal
// encoding. Scaling up by 2^112 then down by 2^-110 first makes values past
// half's range overflow to inf (and re-biases the exponent).
inline uint16_t floatToHalf(float f) {
  const uint32_t w = asBits(f);
  const uint32_t sign = (w >> 16) & 0x8000u;
  const uint32_t twice = w + w;  // drops the sign
  // Magnitude pushed through a huge then tiny scale: overflow becomes inf,
  // everything else is unchanged up to exponent re-bias.
  float base = (asFloat(w & 0x7fffffffu) * 0x1.0p112f) * 0x1.0p-110f;
  uint32_t exponentBias = twice & 0xff000000u;
  exponentBias = exponentBias < 0x71000000u ? 0x71000000u : exponentBias;
  base = asFloat((exponentBias >> 1) + 0x07800000u) + base;
  const uint32_t bits = asBits(base);
  const uint32_t exponentBits = (bits >> 13) & 0x7c00u;
  const uint32_t mantissaBits = bits & 0x0fffu;
  const uint32_t finite = exponentBits + mantissaBits;
  const uint32_t result = twice > 0xff000000u ? 0x7e00u : finite;  // NaN -> quiet NaN
  return static_cast<uint16_t>(sign | result);
}

inline float bf16ToFloat(uint16_t h) { return asFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t floatToBf16(float f) {
  const uint32_t u = asBits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quietNan = (u >> 16) | 0x40u;
  const bool isNan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(isNan ? quietNan : rounded);
}

struct SumOp {
  template <typename T> static T apply(T a, T b) { return a + b; }
};
struct ProductOp {
  template <typename T> static T apply(T a, T b) { return a * b; }
};
struct MinOp {
  // NaN propagates (either operand NaN -> NaN) like torch.minimum.
  template <typename T> static T apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
      return (a < b || a != a) ? a : b;
    } else {
      return a < b ? a : b;
    }
  }
};
struct MaxOp {
  template <typename T> static T apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
      return (a > b || a != a) ? a : b;
    } else {
      return a > b ? a : b;
    }
  }
};

// Plain arithmetic types. Integer sum/product wrap (computed unsigned, so no
// undefined behaviour on overflow).
template <typename T, typename Op>
void kernelArith(void* out, const void* a, const void* b, size_t count) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  if constexpr (std::is_integral_v<T> && (std::is_same_v<Op, SumOp> || std::is_same_v<Op, ProductOp>)) {
    using U = std::make_unsigned_t<T>;
    for (size_t i = 0; i < count; ++i) {
      o[i] = static_cast<T>(Op::apply(static_cast<U>(x[i]), static_cast<U>(y[i])));
    }
  } else {
    for (size_t i = 0; i < count; ++i) o[i] = Op::apply(x[i], y[i]);
  }
}

// 16-bit floats: widen, combine in float32, round back.
template <bool IsHalf, typename Op>
void kernel16(void* out, const void* a, const void* b, size_t count) {
  uint16_t* o = static_cast<uint16_t*>(out);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < count; ++i) {
    if constexpr (IsHalf) {
      o[i] = floatToHalf(Op::apply(halfToFloat(x[i]), halfToFloat(y[i])));
    } else {
      o[i] = floatToBf16(Op::apply(bf16ToFloat(x[i]), bf16ToFloat(y[i])));
    }
  }
}

// Bool as bytes 0/1: or for Sum/Max, and for Product/Min.
template <bool IsOr>
void kernelBool(void* out, const void* a, const void* b, size_t count) {
  uint8_t* o = static_cast<uint8_t*>(out);
  const uint8_t* x = static_cast<const uint8_t*>(a);
  const uint8_t* y = static_cast<const uint8_t*>(b);
  for (size_t i = 0; i < count; ++i) {
    if constexpr (IsOr) {
      o[i] = static_cast<uint8_t>((x[i] | y[i]) != 0);
    } else {
      o[i] = static_cast<uint8_t>((x[i] != 0) & (y[i] != 0));
    }
  }
}

template <typename Op>
ReduceFn pick(DType dtype) {
  switch (dtype) {
    case DType::Float32: return &kernelArith<float, Op>;
    case DType::Float64: return &kernelArith<double, Op>;
    case DType::Int32: return &kernelArith<int32_t, Op>;
    case DType::Int64: return &kernelArith<int64_t, Op>;
    case DType::Float16: return &kernel16<true, Op>;
    case DType::BFloat16: return &kernel16<false, Op>;
    case DType::Bool:
      return std::is_same_v<Op, SumOp> || std::is_same_v<Op, MaxOp> ? &kernelBool<true> : &kernelBool<false>;
  }
  throw NotSupportedError(str("no reduction kernel for dtype ", static_cast<int>(dtype)));
}

}  // namespace

ReduceFn reduceFunction(DType dtype, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return pick<SumOp>(dtype);
    case ReduceOp::Avg:
      if (dtype == DType::Bool) {
        throw InvalidArgument("reduce op avg is not defined for bool tensors; use sum (logical or) or min/max");
      }
      return pick<SumOp>(dtype);
    case ReduceOp::Min: return pick<MinOp>(dtype);
    case ReduceOp::Max: return pick<MaxOp>(dtype);
    case ReduceOp::Product: return pick<ProductOp>(dtype);
  }
  throw InvalidArgument(str("unknown reduce op ", static_cast<int>(op)));
}

void reduceBuffers(DType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t count) {
  reduceFunction(dtype, op)(out, a, b, count);
}

void divideBy(DType dtype, void* data, size_t count, int64_t divisor) {
  if (divisor == 1) return;
  if (divisor == 0) throw InvalidArgument("divideBy: divisor is 0");
  switch (dtype) {
    case DType::Float32: {
      float* p = static_cast<float*>(data);
      const float d = static_cast<float>(divisor);
      for (size_t i = 0; i < count; ++i) p[i] /= d;
      return;
    }
    case DType::Float64: {
      double* p = static_cast<double*>(data);
      const double d = static_cast<double>(divisor);
      for (size_t i = 0; i < count; ++i) p[i] /= d;
      return;
    }
    case DType::Int32: {
      int32_t* p = static_cast<int32_t*>(data);
      for (size_t i = 0; i < count; ++i) p[i] = static_cast<int32_t>(p[i] / divisor);
      return;
    }
    case DType::Int64: {
      int64_t* p = static_cast<int64_t*>(data);
      for (size_t i = 0; i < count; ++i) p[i] /= divisor;
      return;
    }
    case DType::Float16: {
      uint16_t* p = static_cast<uint16_t*>(data);
      const float d = static_cast<float>(divisor);
      for (size_t i = 0; i < count; ++i) p[i] = floatToHalf(halfToFloat(p[i]) / d);
      return;
    }
    case DType::BFloat16: {
      uint16_t* p = static_cast<uint16_t*>(data);
      const float d = static_cast<float>(divisor);
      for (size_t i = 0; i < count; ++i) p[i] = floatToBf16(bf16ToFloat(p[i]) / d);
      return;
    }
    case DType::Bool:
      throw InvalidArgument("reduce op avg is not defined for bool tensors");
  }
  throw NotSupportedError(str("divideBy: unknown dtype ", static_cast<int>(dtype)));
}

namespace kernels {
float halfBitsToFloat(uint16_t bits) { return halfToFloat(bits); }
uint16_t floatToHalfBits(float value) { return floatToHalf(value); }
float bfloat16BitsToFloat(uint16_t bits) { return bf16ToFloat(bits); }
uint16_t floatToBFloat16Bits(float value) { return floatToBf16(value); }
}  // namespace kernels

}  // namespace dt
