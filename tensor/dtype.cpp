#include "tensor/dtype.h"

#include <string>

#include "common/errors.h"

namespace dt {

size_t itemSize(DType dtype) {
  switch (dtype) {
    case DType::Float32: return 4;
    case DType::Float64: return 8;
    case DType::Float16: return 2;
    case DType::BFloat16: return 2;
    case DType::Int32: return 4;
    case DType::Int64: return 8;
    case DType::Bool: return 1;
  }
  throwUnknownDType(dtype);
}

std::string_view toString(DType dtype) {
  switch (dtype) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::Bool: return "bool";
  }
  throwUnknownDType(dtype);
}

std::ostream& operator<<(std::ostream& out, DType dtype) { return out << toString(dtype); }

bool isFloatingPoint(DType dtype) {
  return dtype == DType::Float32 || dtype == DType::Float64 || dtype == DType::Float16 ||
         dtype == DType::BFloat16;
}

namespace {
int rank(DType d) {
  switch (d) {
    case DType::Bool: return 0;
    case DType::Int32: return 1;
    case DType::Int64: return 2;
    case DType::Float16: return 3;
    case DType::BFloat16: return 3;
    case DType::Float32: return 4;
    case DType::Float64: return 5;
  }
  throwUnknownDType(d);
}
}  // namespace

DType promoteTypes(DType a, DType b) {
  if (a == b) return a;
  if ((a == DType::Float16 && b == DType::BFloat16) || (a == DType::BFloat16 && b == DType::Float16)) {
    return DType::Float32;
  }
  return rank(a) >= rank(b) ? a : b;
}

void throwUnknownDType(DType dtype) {
  throw InvalidArgument("unknown dtype value " + std::to_string(static_cast<int>(dtype)));
}

float toFloat(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1f;
  uint32_t mant = h.bits & 0x3ff;
  if (exp == 0x1f) {  // inf / NaN
    return bitsToFloat(sign | 0x7f800000u | (mant << 13) | (mant ? 0x00400000u : 0));
  }
  if (exp == 0) {
    if (mant == 0) return bitsToFloat(sign);
    // Subnormal half: value = mant * 2^-24, exact in float.
    float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bitsToFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

Half toHalf(float f) {
  const uint32_t u = floatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t absBits = u & 0x7fffffffu;
  if (absBits > 0x7f800000u) {  // NaN -> quiet NaN
    return Half::fromBits(static_cast<uint16_t>(sign | 0x7e00 | ((absBits >> 13) & 0x3ff)));
  }
  if (absBits >= 0x477ff000u) {  // >= 65520 rounds to inf (incl. inf itself)
    return Half::fromBits(static_cast<uint16_t>(sign | 0x7c00));
  }
  if (absBits < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // Units of 2^-24, rounded to nearest even. Exact: the float value times 2^24
    // has at most 24 significant bits and we round once via integer arithmetic.
    const uint32_t exp = absBits >> 23;
    if (exp < 102) return Half::fromBits(sign);  // < 2^-25: rounds to zero
    const uint32_t mant = (absBits & 0x7fffff) | 0x800000;
    const uint32_t shift = 126 - exp;  // value = mant * 2^(exp-150); want units of 2^-24
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;
    return Half::fromBits(static_cast<uint16_t>(sign | q));
  }
  // Normal: rebias exponent, round the 13 dropped mantissa bits to nearest even.
  uint32_t v = absBits - (112u << 23);
  v += 0x0fff + ((v >> 13) & 1);
  return Half::fromBits(static_cast<uint16_t>(sign | (v >> 13)));
}

}  // namespace dt
