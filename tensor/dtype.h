// Element types of tensors.
//
// Contract: everything here is a pure value function, thread-safe, never
// allocates on the hot path. Half/BFloat16 conversions round to nearest even
// and preserve inf, NaN (quiet) and subnormals. Arithmetic on Half/BFloat16 is
// done by converting to float; these types are storage formats.
#pragma once

#include <cstdint>
#include <cstring>
#include <ostream>
#include <string_view>
#include <type_traits>

namespace dt {

enum class DType : uint8_t { Float32, Float64, Float16, BFloat16, Int32, Int64, Bool };

size_t itemSize(DType dtype);
std::string_view toString(DType dtype);
std::ostream& operator<<(std::ostream& out, DType dtype);
bool isFloatingPoint(DType dtype);
// The dtype an op between a and b computes in (PyTorch-like promotion:
// bool < int32 < int64 < float16/bfloat16 < float32 < float64; f16+bf16 -> f32).
DType promoteTypes(DType a, DType b);

struct Half {
  uint16_t bits = 0;
  Half() = default;
  static constexpr Half fromBits(uint16_t b) {
    Half h;
    h.bits = b;
    return h;
  }
};

struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  static constexpr BFloat16 fromBits(uint16_t b) {
    BFloat16 h;
    h.bits = b;
    return h;
  }
};

inline uint32_t floatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float toFloat(BFloat16 h) { return bitsToFloat(static_cast<uint32_t>(h.bits) << 16); }

inline BFloat16 toBFloat16(float f) {
  uint32_t u = floatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force a quiet mantissa bit
    return BFloat16::fromBits(static_cast<uint16_t>((u >> 16) | 0x40));
  }
  // Round to nearest even on the 16 dropped bits.
  uint32_t rounding = 0x7fff + ((u >> 16) & 1);
  return BFloat16::fromBits(static_cast<uint16_t>((u + rounding) >> 16));
}

float toFloat(Half h);
Half toHalf(float f);

// C++ type <-> DType.
template <typename T>
struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::Float32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::Float64; };
template <> struct DTypeOf<Half> { static constexpr DType value = DType::Float16; };
template <> struct DTypeOf<BFloat16> { static constexpr DType value = DType::BFloat16; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::Int32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::Int64; };
template <> struct DTypeOf<bool> { static constexpr DType value = DType::Bool; };

template <DType D> struct CppTypeOf;
template <> struct CppTypeOf<DType::Float32> { using type = float; };
template <> struct CppTypeOf<DType::Float64> { using type = double; };
template <> struct CppTypeOf<DType::Float16> { using type = Half; };
template <> struct CppTypeOf<DType::BFloat16> { using type = BFloat16; };
template <> struct CppTypeOf<DType::Int32> { using type = int32_t; };
template <> struct CppTypeOf<DType::Int64> { using type = int64_t; };
template <> struct CppTypeOf<DType::Bool> { using type = bool; };
template <DType D>
using CppType = typename CppTypeOf<D>::type;

// Scalar conversions between any two element types, through float for the
// 16-bit formats and with C++ semantics otherwise (bool: != 0).
template <typename To, typename From>
inline To convertScalar(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<From, Half> || std::is_same_v<From, BFloat16>) {
    return convertScalar<To>(toFloat(v));
  } else if constexpr (std::is_same_v<To, Half>) {
    return toHalf(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, BFloat16>) {
    return toBFloat16(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else {
    return static_cast<To>(v);
  }
}

[[noreturn]] void throwUnknownDType(DType dtype);

// Calls fn.template operator()<T>() with T the C++ type of `dtype`.
// Use in .cpp files only: every call instantiates fn seven times.
template <typename Fn>
decltype(auto) dispatchDType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::Float32: return fn.template operator()<float>();
    case DType::Float64: return fn.template operator()<double>();
    case DType::Float16: return fn.template operator()<Half>();
    case DType::BFloat16: return fn.template operator()<BFloat16>();
    case DType::Int32: return fn.template operator()<int32_t>();
    case DType::Int64: return fn.template operator()<int64_t>();
    case DType::Bool: return fn.template operator()<bool>();
  }
  throwUnknownDType(dtype);
}

}  // namespace dt
