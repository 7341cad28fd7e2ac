// Forward values of the ops per dtype, broadcasting, BLAS paths, error
// messages, device checks, threads and the generator.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "common/sanitizers.h"
#include "tensor/autograd/gradcheck.h"
#include "tensor/ops.h"
#include "tensor/matmul_backend.h"
#include "tensor/parallel.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using testing::expectThrowsWith;

std::vector<double> vals(const Tensor& t) { return t.toVector<double>(); }

TEST(Ops, BinaryBroadcastAndPromotion) {
  Tensor a = fromVector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = fromVector<float>({10, 20, 30});
  EXPECT_EQ(vals(add(a, b)), (std::vector<double>{11, 22, 33, 14, 25, 36}));
  EXPECT_EQ(vals(sub(a, b, 0.5)), (std::vector<double>{-4, -8, -12, -1, -5, -9}));
  EXPECT_EQ(vals(mul(a, fromVector<float>({2, 3}, {2, 1}))), (std::vector<double>{2, 4, 6, 12, 15, 18}));
  EXPECT_EQ(vals(div(a, 2.0)), (std::vector<double>{0.5, 1, 1.5, 2, 2.5, 3}));
  EXPECT_EQ(vals(pow(a, 2.0)), (std::vector<double>{1, 4, 9, 16, 25, 36}));
  EXPECT_EQ(vals(maximum(a, fromVector<float>({3}))), (std::vector<double>{3, 3, 3, 4, 5, 6}));
  EXPECT_EQ(vals(minimum(a, fromVector<float>({3}))), (std::vector<double>{1, 2, 3, 3, 3, 3}));
  EXPECT_EQ(vals(a + 1.0), (std::vector<double>{2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(vals(2.0 * a - a), vals(a));
  EXPECT_EQ(vals(rsub(a, 1.0)), (std::vector<double>{0, -1, -2, -3, -4, -5}));
  // Promotion: int + float -> float; int / int -> float32; int64 stays int64.
  Tensor i = fromVector<int64_t>({7, -7});
  EXPECT_EQ(add(i, fromVector<float>({0.5f})).dtype(), DType::Float32);
  EXPECT_EQ(div(i, fromVector<int64_t>({2})).dtype(), DType::Float32);
  EXPECT_EQ(vals(div(i, fromVector<int64_t>({2}))), (std::vector<double>{3.5, -3.5}));
  EXPECT_EQ(mul(i, i).dtype(), DType::Int64);
  EXPECT_EQ(vals(mul(i, i)), (std::vector<double>{49, 49}));
  EXPECT_EQ(add(fromVector<float>({1}), fromVector<double>({1})).dtype(), DType::Float64);
  EXPECT_EQ(add(i, 2.5).dtype(), DType::Float32);  // float scalar with int tensor
  EXPECT_EQ(add(i, 2.0).dtype(), DType::Int64);
  EXPECT_EQ(mul(a, 2.0).dtype(), DType::Float32);  // float64 scalar does not promote float32
  expectThrowsWith<InvalidArgument>([&] { add(a, fromVector<float>({1, 2})); }, {"[2, 3]", "[2]", "broadcast"});
}

TEST(Ops, HalfAndBFloat16ComputeInFloatAndRoundOnce) {
  for (DType t : {DType::Float16, DType::BFloat16}) {
    Tensor a = fromVector<float>({1.0f, 2.0f, 3.0f}, {3}, t);
    Tensor r = add(a, a);
    EXPECT_EQ(r.dtype(), t);
    EXPECT_EQ(vals(r), (std::vector<double>{2, 4, 6}));
    EXPECT_EQ(vals(mul(a, 0.5)), (std::vector<double>{0.5, 1, 1.5}));
    EXPECT_EQ(mul(a, 0.5).dtype(), t);  // a scalar does not promote
    EXPECT_EQ(gt(a, 1.5).toVector<bool>(), (std::vector<bool>{false, true, true}));
    Tensor c = a.clone();
    mul_(c, 2.0);
    add_(c, 0.5);
    EXPECT_EQ(c.dtype(), t);
    EXPECT_EQ(vals(c), (std::vector<double>{2.5, 4.5, 6.5}));
    EXPECT_EQ(sum(a).dtype(), t);
    EXPECT_EQ(sum(a).item<float>(), 6.0f);
    EXPECT_NEAR(exp(a).toVector<float>()[0], 2.71875, 0.02);
    Tensor w = fromVector<float>({1, 0, 0, 1}, {2, 2}, t);
    EXPECT_EQ(vals(mm(w, fromVector<float>({3, 4}, {2, 1}, t))), (std::vector<double>{3, 4}));
  }
  // 1 + 2^-11 is not representable in half: the sum of two halves rounds to even once.
  Tensor h = fromVector<float>({1.0f}, {1}, DType::Float16);
  Tensor tiny = fromVector<float>({std::ldexp(1.0f, -11)}, {1}, DType::Float16);
  EXPECT_EQ(add(h, tiny).toVector<float>()[0], 1.0f);
  Tensor tiny3 = fromVector<float>({3 * std::ldexp(1.0f, -11)}, {1}, DType::Float16);
  EXPECT_EQ(add(h, tiny3).toVector<float>()[0], 1.0f + std::ldexp(1.0f, -9));
  // Overflow to inf and back.
  Tensor big = fromVector<float>({60000.0f}, {1}, DType::Float16);
  EXPECT_TRUE(std::isinf(add(big, big).toVector<float>()[0]));
}

TEST(Ops, UnaryFunctions) {
  Tensor x = fromVector<double>({-2, -0.5, 0, 0.5, 2});
  EXPECT_EQ(vals(neg(x)), (std::vector<double>{2, 0.5, 0, -0.5, -2}));
  EXPECT_EQ(vals(abs(x)), (std::vector<double>{2, 0.5, 0, 0.5, 2}));
  EXPECT_EQ(vals(relu(x)), (std::vector<double>{0, 0, 0, 0.5, 2}));
  EXPECT_EQ(vals(clamp(x, -1.0, 1.0)), (std::vector<double>{-1, -0.5, 0, 0.5, 1}));
  EXPECT_EQ(vals(clamp(x, std::nullopt, 0.0)), (std::vector<double>{-2, -0.5, 0, 0, 0}));
  const auto e = vals(exp(x));
  const auto th = vals(tanh(x));
  const auto sg = vals(sigmoid(x));
  const auto ge = vals(gelu(x));
  for (size_t i = 0; i < 5; ++i) {
    const double v = vals(x)[i];
    EXPECT_DOUBLE_EQ(e[i], std::exp(v));
    EXPECT_DOUBLE_EQ(th[i], std::tanh(v));
    EXPECT_NEAR(sg[i], 1 / (1 + std::exp(-v)), 1e-15);
    EXPECT_NEAR(ge[i], 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))), 1e-15);
  }
  EXPECT_DOUBLE_EQ(vals(log(fromVector<double>({std::exp(1.0)})))[0], 1.0);
  EXPECT_EQ(vals(sqrt(fromVector<float>({4, 9}))), (std::vector<double>{2, 3}));
  EXPECT_EQ(sqrt(fromVector<int64_t>({4})).dtype(), DType::Float32);
  EXPECT_EQ(vals(neg(fromVector<int32_t>({3}))), (std::vector<double>{-3}));
  EXPECT_EQ(neg(fromVector<int32_t>({3})).dtype(), DType::Int32);
}

TEST(Ops, ComparisonsAndWhere) {
  Tensor a = fromVector<float>({1, 5, 3});
  Tensor b = fromVector<float>({2, 5, 1});
  EXPECT_EQ(eq(a, b).toVector<bool>(), (std::vector<bool>{false, true, false}));
  EXPECT_EQ(ne(a, b).toVector<bool>(), (std::vector<bool>{true, false, true}));
  EXPECT_EQ(lt(a, b).toVector<bool>(), (std::vector<bool>{true, false, false}));
  EXPECT_EQ(le(a, b).toVector<bool>(), (std::vector<bool>{true, true, false}));
  EXPECT_EQ(gt(a, 2.0).toVector<bool>(), (std::vector<bool>{false, true, true}));
  EXPECT_EQ(ge(a, b).dtype(), DType::Bool);
  Tensor w = where(gt(a, b), a, fromVector<float>({0}));
  EXPECT_EQ(vals(w), (std::vector<double>{0, 0, 3}));
  expectThrowsWith<InvalidArgument>([&] { where(a, a, b); }, {"bool", "float32[3]"});
}

TEST(Ops, InplaceOpsBumpVersionAndWorkOnViews) {
  Tensor a = zeros({2, 3});
  const uint32_t v0 = a.version();
  Tensor col = a.select(1, 1);  // strided view
  add_(col, 5.0);
  EXPECT_GT(a.version(), v0);
  EXPECT_EQ(vals(a), (std::vector<double>{0, 5, 0, 0, 5, 0}));
  mul_(a, fromVector<float>({1, 2, 3}));
  EXPECT_EQ(vals(a), (std::vector<double>{0, 10, 0, 0, 10, 0}));
  sub_(a, ones({3}), 2.0);
  EXPECT_EQ(vals(a), (std::vector<double>{-2, 8, -2, -2, 8, -2}));
  relu_(a);
  EXPECT_EQ(vals(a), (std::vector<double>{0, 8, 0, 0, 8, 0}));
  clamp_(a, 1.0, 4.0);
  EXPECT_EQ(vals(a), (std::vector<double>{1, 4, 1, 1, 4, 1}));
  div_(a, fromVector<float>({2}));
  sqrt_(a);
  EXPECT_NEAR(vals(a)[1], std::sqrt(2.0), 1e-6);
  addcmul_(a, ones({2, 3}), full({2, 3}, 2.0), 0.5);
  addcdiv_(a, ones({2, 3}), full({2, 3}, 4.0), 4.0);
  EXPECT_NEAR(vals(a)[0], std::sqrt(0.5) + 1 + 1, 1e-6);
  expectThrowsWith<InvalidArgument>([&] { add_(col, ones({2, 2})); }, {"[2, 2]", "float32[2]"});
}

TEST(Ops, ReductionsOverAnyDims) {
  Tensor x = arange(24, DType::Float32).view({2, 3, 4});
  EXPECT_EQ(sum(x).item<float>(), 276.0f);
  EXPECT_EQ(sum(x, {1}).sizes(), (Shape{2, 4}));
  EXPECT_EQ(vals(sum(x, {0, 2})), (std::vector<double>{60, 92, 124}));
  EXPECT_EQ(sum(x, {0, 2}, true).sizes(), (Shape{1, 3, 1}));
  EXPECT_EQ(vals(sum(x.transpose(0, 2), {-1})), vals(sum(x, {0}).t().contiguous()));
  EXPECT_EQ(vals(mean(x, {2})), (std::vector<double>{1.5, 5.5, 9.5, 13.5, 17.5, 21.5}));
  EXPECT_EQ(mean(x).item<float>(), 11.5f);
  EXPECT_EQ(sum(fromVector<bool>({true, true, false})).dtype(), DType::Int64);
  EXPECT_EQ(sum(fromVector<int32_t>({1, 2})).item<int64_t>(), 3);
  auto mx = max(x, 1, true);
  EXPECT_EQ(mx.values.sizes(), (Shape{2, 1, 4}));
  EXPECT_EQ(vals(mx.values), (std::vector<double>{8, 9, 10, 11, 20, 21, 22, 23}));
  EXPECT_EQ(mx.indices.toVector<int64_t>(), std::vector<int64_t>(8, 2));
  EXPECT_EQ(vals(min(x, -1).values), (std::vector<double>{0, 4, 8, 12, 16, 20}));
  EXPECT_EQ(max(x).item<float>(), 23.0f);
  EXPECT_EQ(min(x).item<float>(), 0.0f);
  EXPECT_EQ(argmax(fromVector<float>({1, 9, 3, 9})).item<int64_t>(), 1);  // first of ties
  EXPECT_EQ(argmin(fromVector<float>({4, 1, 1}, {1, 3}), 1).item<int64_t>(), 1);
  EXPECT_TRUE(std::isnan(max(fromVector<float>({1, NAN, 3})).item<float>()));  // NaN propagates
  EXPECT_EQ(vals(amax(x, {0, 2})), (std::vector<double>{15, 19, 23}));
  expectThrowsWith<InvalidArgument>([&] { sum(x, {3}); }, {"dimension 3"});
  expectThrowsWith<InvalidArgument>([&] { sum(x, {1, -2}); }, {"appears twice"});
  // Large float32 sums accumulate in double.
  Tensor many = full({1 << 20}, 0.1);
  EXPECT_NEAR(sum(many).item<float>(), 104857.6, 0.05);
}

// Naive reference matmul in double.
std::vector<double> refMm(const Tensor& a, const Tensor& b) {
  const int64_t n = a.size(0), k = a.size(1), m = b.size(1);
  auto av = vals(a.contiguous()), bv = vals(b.contiguous());
  std::vector<double> out(static_cast<size_t>(n * m), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j)
      for (int64_t p = 0; p < k; ++p) out[i * m + j] += av[i * k + p] * bv[p * m + j];
  return out;
}

void expectNear(const std::vector<double>& a, const std::vector<double>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], tol) << "at " << i;
}

TEST(Ops, MatmulThroughBlasAllLayouts) {
  Generator g(5);
  for (DType t : {DType::Float32, DType::Float64}) {
    Tensor a = randn({5, 7}, g, t), b = randn({7, 3}, g, t);
    Tensor aT = randn({7, 5}, g, t).t(), bT = randn({3, 7}, g, t).t();
    Tensor aS = randn({5, 14}, g, t).slice(1, 0, 14, 2);  // unit-stride fails: copied
    const double tol = t == DType::Float32 ? 1e-4 : 1e-12;
    expectNear(vals(mm(a, b)), refMm(a, b), tol);
    expectNear(vals(mm(aT, b)), refMm(aT, b), tol);
    expectNear(vals(mm(a, bT)), refMm(a, bT), tol);
    expectNear(vals(mm(aT, bT)), refMm(aT, bT), tol);
    expectNear(vals(mm(aS, b)), refMm(aS, b), tol);
    expectNear(vals(mm(a.narrow(1, 0, 4), b.narrow(0, 0, 4))), refMm(a.narrow(1, 0, 4), b.narrow(0, 0, 4)), tol);
  }
  Tensor a = randn({2, 3, 4}, g), b = randn({2, 4, 5}, g);
  Tensor r = bmm(a, b);
  EXPECT_EQ(r.sizes(), (Shape{2, 3, 5}));
  expectNear(vals(r.select(0, 1)), refMm(a.select(0, 1), b.select(0, 1)), 1e-4);
  EXPECT_EQ(matmul(randn({4}, g), randn({4}, g)).dim(), 0);
  EXPECT_EQ(matmul(randn({3, 4}, g), randn({4}, g)).sizes(), (Shape{3}));
  EXPECT_EQ(matmul(randn({4}, g), randn({4, 2}, g)).sizes(), (Shape{2}));
  EXPECT_EQ(matmul(randn({6, 3, 4}, g), randn({4, 2}, g)).sizes(), (Shape{6, 3, 2}));
  EXPECT_EQ(matmul(randn({2, 1, 3, 4}, g), randn({5, 4, 2}, g)).sizes(), (Shape{2, 5, 3, 2}));
  // Linear = x W^T + b.
  Tensor x = randn({4, 3}, g), w = randn({2, 3}, g), bias = fromVector<float>({1, -1});
  Tensor y = linear(x, w, bias);
  auto ref = refMm(x, w.t());
  for (size_t i = 0; i < ref.size(); ++i) ref[i] += i % 2 == 0 ? 1 : -1;
  expectNear(vals(y), ref, 1e-5);
  EXPECT_EQ(linear(randn({2, 5, 3}, g), w).sizes(), (Shape{2, 5, 2}));
  expectThrowsWith<InvalidArgument>([&] { mm(randn({2, 3}, g), randn({4, 2}, g)); }, {"float32[2, 3]", "float32[4, 2]"});
  expectThrowsWith<InvalidArgument>([&] { matmul(randn({2, 3}, g), randn({2, 3}, g)); }, {"[2, 3]"});
  expectThrowsWith<InvalidArgument>([&] { linear(x, randn({2, 4}, g)); }, {"float32[4, 3]", "float32[2, 4]"});
  expectThrowsWith<InvalidArgument>([&] { mm(fromVector<int64_t>({1}, {1, 1}), fromVector<int64_t>({1}, {1, 1})); },
                                    {"int64"});
  expectThrowsWith<InvalidArgument>([&] { mm(randn({1, 1}, g), randn({1, 1}, g, DType::Float64)); },
                                    {"float32[1, 1]", "float64[1, 1]"});
}

TEST(Ops, SoftmaxIsStableAndLogSoftmaxConsistent) {
  Tensor x = fromVector<float>({1000, 1001, 1002, -5, 0, 5}, {2, 3});
  auto s = vals(softmax(x, 1));
  const double e0 = std::exp(-2.0), e1 = std::exp(-1.0), z = e0 + e1 + 1;
  EXPECT_NEAR(s[0], e0 / z, 1e-6);
  EXPECT_NEAR(s[2], 1 / z, 1e-6);
  auto ls = vals(logSoftmax(x, -1));
  for (size_t i = 0; i < 6; ++i) EXPECT_NEAR(std::exp(ls[i]), s[i], 1e-6);
  auto s0 = vals(softmax(x, 0));
  EXPECT_NEAR(s0[0] + s0[3], 1.0, 1e-6);
  Tensor neginf = fromVector<float>({-INFINITY, 0});
  EXPECT_EQ(vals(softmax(neginf, 0)), (std::vector<double>{0, 1}));
}

TEST(Ops, CrossEntropyIgnoreIndexAndLabelSmoothing) {
  Tensor logits = fromVector<double>({2, 1, 0, 0, 0, 3, 1, 1, 1}, {3, 3});
  Tensor target = fromVector<int64_t>({0, 2, -100});
  auto lse = [](double a, double b, double c) { return std::log(std::exp(a) + std::exp(b) + std::exp(c)); };
  const double l0 = lse(2, 1, 0) - 2, l1 = lse(0, 0, 3) - 3;
  EXPECT_NEAR(crossEntropy(logits, target).item<double>(), (l0 + l1) / 2, 1e-12);  // ignored row excluded
  CrossEntropyOptions sum;
  sum.reduction = Reduction::Sum;
  EXPECT_NEAR(crossEntropy(logits, target, sum).item<double>(), l0 + l1, 1e-12);
  CrossEntropyOptions none;
  none.reduction = Reduction::None;
  EXPECT_EQ(crossEntropy(logits, target, none).sizes(), (Shape{3}));
  EXPECT_EQ(vals(crossEntropy(logits, target, none))[2], 0.0);
  // One sample ([C] logits, [] target) without reduction is a 0-dim loss, as in PyTorch.
  Tensor oneSample = crossEntropy(logits.select(0, 0), fromVector<int64_t>({0}, {}), none);
  EXPECT_EQ(oneSample.sizes(), Shape{});
  EXPECT_NEAR(oneSample.item<double>(), l0, 1e-12);
  // Label smoothing eps: (1 - eps) * nll + eps * mean_j(-log p_j).
  CrossEntropyOptions smooth;
  smooth.labelSmoothing = 0.2;
  const double lsRow0 = ((lse(2, 1, 0) - 2) + (lse(2, 1, 0) - 1) + (lse(2, 1, 0) - 0)) / 3;
  const double lsRow1 = ((lse(0, 0, 3) - 0) * 2 + (lse(0, 0, 3) - 3)) / 3;
  EXPECT_NEAR(crossEntropy(logits, target, smooth).item<double>(),
              (0.8 * l0 + 0.2 * lsRow0 + 0.8 * l1 + 0.2 * lsRow1) / 2, 1e-12);
  expectThrowsWith<InvalidArgument>([&] { crossEntropy(logits, fromVector<int64_t>({0, 3, 1})); },
                                    {"target 3", "3 classes"});
  expectThrowsWith<InvalidArgument>([&] { crossEntropy(logits, fromVector<int64_t>({0, 1})); },
                                    {"float64[3, 3]", "int64[2]"});
  EXPECT_NEAR(mseLoss(fromVector<float>({1, 2}), fromVector<float>({3, 2})).item<float>(), 2.0f, 1e-6);
  EXPECT_NEAR(mseLoss(fromVector<float>({1, 2}), fromVector<float>({3, 2}), Reduction::Sum).item<float>(), 4.0f, 1e-6);
}

TEST(Ops, EmbeddingLayerNormDropout) {
  Tensor w = arange(12, DType::Float32).view({4, 3});
  Tensor e = embedding(w, fromVector<int64_t>({3, 0, 3, 1}, {2, 2}));
  EXPECT_EQ(e.sizes(), (Shape{2, 2, 3}));
  EXPECT_EQ(vals(e.select(0, 0)), (std::vector<double>{9, 10, 11, 0, 1, 2}));
  expectThrowsWith<InvalidArgument>([&] { embedding(w, fromVector<int64_t>({4})); }, {"index 4", "float32[4, 3]"});

  Tensor x = fromVector<double>({1, 2, 3, 4, 2, 2, 2, 2}, {2, 4});
  Tensor y = layerNorm(x, {4}, fromVector<double>({1, 1, 2, 2}), fromVector<double>({0, 0, 0, 1}), 1e-5);
  const double sd = std::sqrt(1.25 + 1e-5);
  auto yv = vals(y);
  EXPECT_NEAR(yv[0], -1.5 / sd, 1e-12);
  EXPECT_NEAR(yv[3], 2 * 1.5 / sd + 1, 1e-12);
  EXPECT_NEAR(yv[7], 1.0, 1e-12);  // zero-variance row: x - mean = 0, so only the bias remains
  expectThrowsWith<InvalidArgument>([&] { layerNorm(x, {3}); }, {"[3]", "float64[2, 4]"});

  Generator g1(9), g2(9);
  Tensor ones10 = ones({10000});
  Tensor d1 = dropout(ones10, 0.25, true, g1), d2 = dropout(ones10, 0.25, true, g2);
  EXPECT_EQ(vals(d1), vals(d2));  // seeded: same mask
  const double kept = sum(gt(d1, 0.0).to(DType::Float32)).item<float>();
  EXPECT_NEAR(kept / 10000.0, 0.75, 0.02);
  EXPECT_NEAR(mean(d1).item<float>(), 1.0, 0.03);  // scaled by 1/(1-p)
  EXPECT_TRUE(dropout(ones10, 0.25, false).isSameAs(ones10));
  expectThrowsWith<InvalidArgument>([&] { dropout(ones10, 1.5, true); }, {"1.5"});
}

TEST(Ops, CatStackIndexSelect) {
  Tensor a = fromVector<float>({1, 2, 3, 4}, {2, 2});
  Tensor b = fromVector<float>({5, 6}, {2, 1});
  EXPECT_EQ(vals(cat({a, b}, 1)), (std::vector<double>{1, 2, 5, 3, 4, 6}));
  EXPECT_EQ(vals(cat({a, a.t()}, 0)), (std::vector<double>{1, 2, 3, 4, 1, 3, 2, 4}));
  EXPECT_EQ(stack({a, a}, 1).sizes(), (Shape{2, 2, 2}));
  EXPECT_EQ(vals(stack({a, a}, 1).select(1, 1)), vals(a));
  EXPECT_EQ(vals(indexSelect(a, 0, fromVector<int64_t>({1, 1, 0}))), (std::vector<double>{3, 4, 3, 4, 1, 2}));
  EXPECT_EQ(vals(indexSelect(a, 1, fromVector<int32_t>({1}))), (std::vector<double>{2, 4}));
  expectThrowsWith<InvalidArgument>([&] { cat({a, b}, 0); }, {"float32[2, 1]", "float32[2, 2]"});
  expectThrowsWith<InvalidArgument>([&] { cat({a, a.to(DType::Float64)}, 0); }, {"float64[2, 2]"});
  expectThrowsWith<InvalidArgument>([&] { indexSelect(a, 0, fromVector<int64_t>({2})); }, {"index 2", "size 2"});
  expectThrowsWith<InvalidArgument>([&] { stack({a, b}); }, {"float32[2, 1]"});
}

TEST(Ops, GeneratorIsDeterministicWithSaneMoments) {
  Generator g1(123), g2(123), g3(124);
  Tensor a = randn({20000}, g1), b = randn({20000}, g2), c = randn({20000}, g3);
  EXPECT_EQ(vals(a), vals(b));
  EXPECT_NE(vals(a), vals(c));
  EXPECT_NEAR(mean(a).item<float>(), 0.0, 0.03);
  EXPECT_NEAR(mean(mul(a, a)).item<float>(), 1.0, 0.05);
  Tensor u = rand({20000}, g1, DType::Float64);
  EXPECT_GE(min(u).item<double>(), 0.0);
  EXPECT_LT(max(u).item<double>(), 1.0);
  EXPECT_NEAR(mean(u).item<double>(), 0.5, 0.01);
  Tensor r = randint(3, 7, {1000}, g1);
  EXPECT_EQ(min(r).item<int64_t>(), 3);
  EXPECT_EQ(max(r).item<int64_t>(), 6);
  Tensor h = empty({100}, DType::BFloat16);
  normal_(h, 5.0, 0.1, g1);
  EXPECT_NEAR(mean(h.to(DType::Float32)).item<float>(), 5.0, 0.05);
  manualSeed(77);
  Tensor d1 = randn({4});
  manualSeed(77);
  EXPECT_EQ(vals(randn({4})), vals(d1));
}

// A fake CUDA allocator lends host memory so that tensors can claim to be on
// cuda:0; every op must then refuse with NotSupportedError naming op and device.
class FakeCudaAllocator : public Allocator {
 public:
  DataPtr allocate(size_t bytes) override {
    return DataPtr(std::malloc(bytes + 1), nullptr, [](void*, void* p) { std::free(p); }, Device::cuda(0));
  }
  DeviceType deviceType() const override { return DeviceType::CUDA; }
};

TEST(Ops, UnsupportedDeviceNamesOpAndDevice) {
  // The fake hands out host memory: where a GPU exists the ops would launch
  // real kernels on it.
  if (deviceAvailable(Device::cuda(0))) {
    GTEST_SKIP() << "this machine has a CUDA device, so the ops run there (tensor_cuda_ops_test); this test checks "
                    "the errors where they cannot";
  }
  FakeCudaAllocator fake;
  registerAllocator(DeviceType::CUDA, &fake);
  Tensor c = empty({2, 2}, DType::Float32, Device::cuda(0));
  Tensor h = ones({2, 2});
  EXPECT_EQ(c.device(), Device::cuda(0));
  expectThrowsWith<NotSupportedError>([&] { exp(c); }, {"exp", "cuda:0"});
  expectThrowsWith<NotSupportedError>([&] { sum(c); }, {"sum", "cuda:0"});
  expectThrowsWith<NotSupportedError>([&] { relu(c); }, {"relu", "cuda:0"});
  expectThrowsWith<NotSupportedError>([&] { c.fill_(1.0); }, {"fill_", "cuda:0"});
  // Attention has no CUDA kernel on any machine: it names itself and the device.
  Tensor qkv = empty({1, 2, 6}, DType::Float32, Device::cuda(0));
  expectThrowsWith<NotSupportedError>([&] { selfAttention(qkv, 1); }, {"selfAttention", "cuda:0"});
  expectThrowsWith<NotSupportedError>([&] { scaledDotProductAttention(c, c, c); },
                                      {"scaledDotProductAttention", "cuda:0"});
  expectThrowsWith<InvalidArgument>([&] { add(c, h); }, {"different devices", "cuda:0", "cpu"});
  expectThrowsWith<InvalidArgument>([&] { mm(h, c); }, {"cuda:0", "cpu"});
  Tensor leaf = empty({2}, DType::Float64, Device::cuda(0)).setRequiresGrad(true);
  expectThrowsWith<InvalidArgument>([&] { gradcheck([](const TensorList& in) { return in[0]; }, {leaf}); },
                                    {"gradcheck: input 0", "cuda:0", "runs on cpu inputs"});
  registerAllocator(DeviceType::CUDA, nullptr);
  expectThrowsWith<NotSupportedError>([] { empty({1}, DType::Float32, Device::cuda(0)); }, {"cuda:0"});
}

// A CPU newer than OpenBLAS gets its SSE3 fallback kernels: the warning names
// the kernels, the CPU's vector width and the OPENBLAS_CORETYPE that fits.
TEST(Threads, OpenBlasFallbackKernelsOnAModernCpuAreNamedWithTheFix) {
  EXPECT_EQ(blasKernelWarning("SkylakeX", true, true), "");
  EXPECT_EQ(blasKernelWarning("Haswell", false, true), "");
  EXPECT_EQ(blasKernelWarning("Zen", false, true), "");
  EXPECT_EQ(blasKernelWarning("Prescott", false, false), "") << "an old CPU gets the kernels it can run";
  const std::string avx512 = blasKernelWarning("Prescott", true, true);
  for (const char* part : {"\"Prescott\" kernels", "AVX-512", "OPENBLAS_CORETYPE=SkylakeX"}) {
    EXPECT_NE(avx512.find(part), std::string::npos) << part << " missing from: " << avx512;
  }
  const std::string avx2 = blasKernelWarning("Nehalem", false, true);
  for (const char* part : {"\"Nehalem\" kernels", "AVX2", "OPENBLAS_CORETYPE=Haswell"}) {
    EXPECT_NE(avx2.find(part), std::string::npos) << part << " missing from: " << avx2;
  }
}

// AVX2 kernels on an AVX-512 CPU (OPENBLAS_CORETYPE=Haswell forced, or a model OpenBLAS does not
// know): about half speed, so one line says why, the fix, and what oneDNN takes over.
TEST(Threads, OpenBlasAvx2KernelsOnAnAvx512CpuAreNamedWithTheCauseAndOneDnnsShare) {
  EXPECT_EQ(blasKernelWarning("SkylakeX", true, true, "SkylakeX", true), "");
  EXPECT_EQ(blasKernelWarning("Cooperlake", true, true, "", false), "");
  EXPECT_EQ(blasKernelWarning("Haswell", false, true, "Haswell", true), "") << "AVX2 kernels fit an AVX2 CPU";
  EXPECT_EQ(blasKernelWarning("Prescott", true, true, "Prescott", false), "") << "the user forced SSE kernels on purpose";
  const std::string forced = blasKernelWarning("Haswell", true, true, "Haswell", true);
  for (const char* part : {"\"Haswell\" kernels (AVX2)", "AVX-512", "because OPENBLAS_CORETYPE=Haswell is set", "half the speed",
                           "unset OPENBLAS_CORETYPE", "oneDNN"}) {
    EXPECT_NE(forced.find(part), std::string::npos) << part << " missing from: " << forced;
  }
  EXPECT_EQ(forced.find('\n'), std::string::npos) << "one line: " << forced;
  const std::string unknown = blasKernelWarning("Zen", true, true, "", false);
  for (const char* part : {"\"Zen\" kernels (AVX2)", "does not know this CPU model", "OPENBLAS_CORETYPE=SkylakeX"}) {
    EXPECT_NE(unknown.find(part), std::string::npos) << part << " missing from: " << unknown;
  }
  EXPECT_EQ(unknown.find("oneDNN"), std::string::npos) << "a build without oneDNN: " << unknown;
  EXPECT_NE(blasKernelWarning("Prescott", true, true, "", true).find("oneDNN"), std::string::npos);
}

// CPU time the other threads of this process have used so far (/proc's schedstat), and how many
// threads it has.
int64_t otherThreadsCpuNs() {
  int64_t ns = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    if (task.path().filename() == std::to_string(::gettid())) continue;
    std::ifstream in(task.path() / "schedstat");
    int64_t onCpu = 0;
    if (in >> onCpu) ns += onCpu;
  }
  return ns;
}
int threadCount() {
  return static_cast<int>(std::distance(std::filesystem::directory_iterator("/proc/self/task"),
                                        std::filesystem::directory_iterator()));
}

// OpenBLAS starts its workers when it loads, and an idle one polls with sched_yield for about
// 0.13 s: before this library stopped them, each process began with a busy core per worker
// (measured: 120 ms of CPU in the first 130 ms), which every rank's first collectives then shared.
// Each test runs in a process of its own, started just before.
TEST(Threads, NoBlasWorkerSpinsWhileAProcessStarts) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one core: OpenBLAS starts no workers here";
  const int64_t before = otherThreadsCpuNs();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const int64_t used = otherThreadsCpuNs() - before;
  std::printf("other threads: %d, their CPU time: %.1f ms so far, %.1f ms in the last 30 ms\n", threadCount() - 1,
              static_cast<double>(before + used) / 1e6, static_cast<double>(used) / 1e6);
  EXPECT_LT(used, 5'000'000) << "another thread of this process kept a core busy while nothing ran";
}

// Stopped workers come back for the next BLAS call that uses them, and it computes the same.
TEST(Threads, StoppedBlasWorkersComeBackForTheNextThreadedCall) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one core: OpenBLAS starts no workers here";
#if defined(DT_THREAD_SANITIZER)
  GTEST_SKIP() << "under ThreadSanitizer BLAS runs on the calling thread (TSan cannot see OpenBLAS's own locks)";
#endif
  const int before = numThreads();
  setNumThreads(2);
  // The products must reach OpenBLAS's pool, whatever the auto rule would pick (tensor/matmul_backend.h).
  setMatmulBackend(MatmulBackend::OpenBlas);
  const Tensor a = full({384, 384}, 0.5);
  const Tensor b = full({384, 384}, 2.0);
  const Tensor expected = full({384, 384}, 384.0);
  EXPECT_TRUE(mm(a, b).allclose(expected));
  const int withWorkers = threadCount();
  if (!stopIdleBlasWorkers()) {
    setNumThreads(before);
    setMatmulBackend(MatmulBackend::Auto);
    GTEST_SKIP() << "this BLAS library has no worker pool of its own to stop";
  }
  EXPECT_EQ(threadCount(), withWorkers - 1) << "the one OpenBLAS worker of a 2-thread call stopped";
  const Tensor c = mm(a, b);
  EXPECT_EQ(threadCount(), withWorkers) << "and came back for the next one";
  EXPECT_TRUE(c.allclose(expected));
  setNumThreads(before);
  setMatmulBackend(MatmulBackend::Auto);
}

TEST(Threads, KnobAndParallelForCoverage) {
  {
    testing::ScopedEnv env("DT_NUM_THREADS", "3");
    EXPECT_EQ(defaultNumThreads(), 3);
  }
  {
    testing::ScopedEnv env("DT_NUM_THREADS", "many");
    expectThrowsWith<InvalidArgument>([] { defaultNumThreads(); }, {"DT_NUM_THREADS", "many"});
  }
  {
    testing::ScopedEnv env("DT_NUM_THREADS", "0");
    expectThrowsWith<InvalidArgument>([] { defaultNumThreads(); }, {"DT_NUM_THREADS=0"});
  }
  const int before = numThreads();
  setNumThreads(4);
  EXPECT_EQ(numThreads(), 4);
  std::vector<std::atomic<int>> hits(100000);
  parallelFor(0, 100000, 1000, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[i]++;
  });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  // Kernels give the same answers with several threads.
  Generator g(2);
  Tensor a = randn({300, 300}, g);
  Tensor r4 = add(exp(a), a.t());
  setNumThreads(1);
  Tensor r1 = add(exp(a), a.t());
  EXPECT_EQ(vals(r4), vals(r1));
  EXPECT_THROW(parallelFor(0, 100000, 10, [](int64_t, int64_t) { throw InvalidArgument("boom"); }), InvalidArgument);
  setNumThreads(before);
}

TEST(Threads, ParallelKernelsWorkAfterFork) {
#if defined(DT_THREAD_SANITIZER)
  GTEST_SKIP() << "ThreadSanitizer cannot start threads in a child forked from a multi-threaded process";
#endif
  // The pool's workers do not survive fork(); a child must still run big kernels.
  const int before = numThreads();
  setNumThreads(2);
  Tensor big = ones({1 << 18});
  EXPECT_EQ(sum(add(big, big)).item<float>(), 2.0f * (1 << 18));  // starts the pool
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    alarm(20);  // a hang becomes a failure
    Tensor r = add(big, big);
    _exit(sum(r).item<float>() == 2.0f * (1 << 18) ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status)) << "child did not exit normally (status " << status << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0);
  setNumThreads(before);
}

}  // namespace
}  // namespace dt
