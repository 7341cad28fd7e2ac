#include "collectives/reduce_kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "common/errors.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

bool sameFloat(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b));
}

TEST(ReduceKernels, HalfToFloatMatchesDTypeForEveryBitPattern) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const float expected = toFloat(Half::fromBits(static_cast<uint16_t>(bits)));
    const float got = kernels::halfBitsToFloat(static_cast<uint16_t>(bits));
    ASSERT_TRUE(sameFloat(expected, got)) << "half bits 0x" << std::hex << bits << ": " << expected << " vs " << got;
  }
}

TEST(ReduceKernels, FloatToHalfRoundsLikeDType) {
  std::vector<float> samples = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.0f, 65520.0f, 1e6f, -1e6f,
                                std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                                std::numeric_limits<float>::quiet_NaN(), 5.9604645e-8f, 2.9802322e-8f,
                                2.98023259e-8f, 6.1035156e-5f, 6.0975552e-5f, 1e-10f, 0.1f, 1.00048828125f,
                                1.000732421875f, 2049.0f, 2051.0f};
  // Every half value and the midpoints between neighbours (ties to even).
  for (uint32_t bits = 0; bits < 0x7c00; ++bits) {
    const float v = kernels::halfBitsToFloat(static_cast<uint16_t>(bits));
    const float next = kernels::halfBitsToFloat(static_cast<uint16_t>(bits + 1));
    samples.push_back(v);
    samples.push_back(-v);
    samples.push_back((v + next) / 2);
    samples.push_back(std::nextafter((v + next) / 2, 0.0f));
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> anyBits;
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = anyBits(rng);
    float f;
    std::memcpy(&f, &u, 4);
    samples.push_back(f);
  }
  for (float f : samples) {
    const uint16_t expected = toHalf(f).bits;
    const uint16_t got = kernels::floatToHalfBits(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(kernels::halfBitsToFloat(got))) << f;
    } else {
      ASSERT_EQ(expected, got) << "float " << f;
    }
  }
}

TEST(ReduceKernels, BFloat16ConversionsMatchDType) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> anyBits;
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = anyBits(rng);
    float f;
    std::memcpy(&f, &u, 4);
    const uint16_t expected = toBFloat16(f).bits;
    ASSERT_EQ(expected, kernels::floatToBFloat16Bits(f)) << f;
    ASSERT_TRUE(sameFloat(toFloat(BFloat16::fromBits(expected)), kernels::bfloat16BitsToFloat(expected)));
  }
}

template <typename T>
std::vector<T> run(DType dtype, ReduceOp op, const std::vector<T>& a, const std::vector<T>& b) {
  std::vector<T> out(a.size());
  reduceBuffers(dtype, op, out.data(), a.data(), b.data(), a.size());
  return out;
}

TEST(ReduceKernels, ArithmeticTypes) {
  const std::vector<float> a = {1, -2, 3.5f, 0, 7};
  const std::vector<float> b = {4, 5, -1, 0, 7};
  EXPECT_EQ(run(DType::Float32, ReduceOp::Sum, a, b), (std::vector<float>{5, 3, 2.5f, 0, 14}));
  EXPECT_EQ(run(DType::Float32, ReduceOp::Avg, a, b), (std::vector<float>{5, 3, 2.5f, 0, 14}));  // sum; divide later
  EXPECT_EQ(run(DType::Float32, ReduceOp::Product, a, b), (std::vector<float>{4, -10, -3.5f, 0, 49}));
  EXPECT_EQ(run(DType::Float32, ReduceOp::Min, a, b), (std::vector<float>{1, -2, -1, 0, 7}));
  EXPECT_EQ(run(DType::Float32, ReduceOp::Max, a, b), (std::vector<float>{4, 5, 3.5f, 0, 7}));
  const std::vector<double> da = {1e300, -1}, db = {1e300, 2};
  EXPECT_EQ(run(DType::Float64, ReduceOp::Max, da, db), (std::vector<double>{1e300, 2}));
  const std::vector<int32_t> ia = {INT32_MAX, -7, 3}, ib = {1, 2, -3};
  EXPECT_EQ(run(DType::Int32, ReduceOp::Sum, ia, ib), (std::vector<int32_t>{INT32_MIN, -5, 0}));  // wraps
  EXPECT_EQ(run(DType::Int32, ReduceOp::Product, ia, ib), (std::vector<int32_t>{INT32_MAX, -14, -9}));
  const std::vector<int64_t> la = {int64_t(1) << 40, -3}, lb = {3, -4};
  EXPECT_EQ(run(DType::Int64, ReduceOp::Product, la, lb), (std::vector<int64_t>{int64_t(3) << 40, 12}));
  EXPECT_EQ(run(DType::Int64, ReduceOp::Min, la, lb), (std::vector<int64_t>{3, -4}));
}

TEST(ReduceKernels, NanPropagatesThroughMinMax) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto mx = run(DType::Float32, ReduceOp::Max, std::vector<float>{nan, 1}, std::vector<float>{1, nan});
  EXPECT_TRUE(std::isnan(mx[0]) && std::isnan(mx[1]));
  auto mn = run(DType::Float32, ReduceOp::Min, std::vector<float>{nan, 1}, std::vector<float>{1, nan});
  EXPECT_TRUE(std::isnan(mn[0]) && std::isnan(mn[1]));
}

TEST(ReduceKernels, SixteenBitFloatsAccumulateInFloat32) {
  for (DType dtype : {DType::Float16, DType::BFloat16}) {
    auto enc = [&](float f) { return dtype == DType::Float16 ? toHalf(f).bits : toBFloat16(f).bits; };
    auto dec = [&](uint16_t b) {
      return dtype == DType::Float16 ? toFloat(Half::fromBits(b)) : toFloat(BFloat16::fromBits(b));
    };
    std::vector<uint16_t> a, b;
    std::vector<float> fa = {1.5f, -2, 100, 0.25f, 3}, fb = {2.25f, 8, -100, 0.5f, 3};
    for (size_t i = 0; i < fa.size(); ++i) {
      a.push_back(enc(fa[i]));
      b.push_back(enc(fb[i]));
    }
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max}) {
      auto out = run(dtype, op, a, b);
      for (size_t i = 0; i < fa.size(); ++i) {
        const float x = dec(a[i]), y = dec(b[i]);
        float want = op == ReduceOp::Sum ? x + y : op == ReduceOp::Product ? x * y : op == ReduceOp::Min ? std::min(x, y) : std::max(x, y);
        EXPECT_EQ(out[i], enc(want)) << toString(dtype) << " " << toString(op) << " element " << i;
      }
    }
  }
}

TEST(ReduceKernels, InPlaceAliasingAndLongBuffers) {
  // Long enough for the vectorised main loop plus a remainder.
  std::vector<float> a(1027), b(1027);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>(i);
    b[i] = static_cast<float>(2 * i);
  }
  reduceBuffers(DType::Float32, ReduceOp::Sum, a.data(), a.data(), b.data(), a.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], static_cast<float>(3 * i));
}

TEST(ReduceKernels, BoolIsLogical) {
  std::vector<uint8_t> a = {0, 1, 0, 1}, b = {0, 0, 1, 1};
  EXPECT_EQ(run(DType::Bool, ReduceOp::Sum, a, b), (std::vector<uint8_t>{0, 1, 1, 1}));
  EXPECT_EQ(run(DType::Bool, ReduceOp::Product, a, b), (std::vector<uint8_t>{0, 0, 0, 1}));
  testing::expectThrowsWith<InvalidArgument>([] { reduceFunction(DType::Bool, ReduceOp::Avg); }, {"avg", "bool"});
}

TEST(ReduceKernels, DivideByForAverage) {
  std::vector<float> f = {3, 4};
  divideBy(DType::Float32, f.data(), f.size(), 2);
  EXPECT_EQ(f, (std::vector<float>{1.5f, 2}));
  std::vector<int32_t> i = {7, -7};
  divideBy(DType::Int32, i.data(), i.size(), 2);
  EXPECT_EQ(i, (std::vector<int32_t>{3, -3}));  // truncates toward zero
  std::vector<uint16_t> h = {toHalf(3.0f).bits};
  divideBy(DType::Float16, h.data(), 1, 4);
  EXPECT_EQ(h[0], toHalf(0.75f).bits);
  testing::expectThrowsWith<InvalidArgument>([&] { divideBy(DType::Float32, f.data(), 1, 0); }, {"divisor is 0"});
}

TEST(ReduceOp, NamesRoundTrip) {
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max, ReduceOp::Product}) {
    EXPECT_EQ(parseReduceOp(toString(op)), op);
  }
  testing::expectThrowsWith<InvalidArgument>([] { parseReduceOp("mean"); }, {"mean", "sum, avg"});
}

}  // namespace
}  // namespace dt
