// The fused attention core under bf16 autocast with dt::setAutocastAttention(true)
// (tensor/autocast.h): its products in bf16 with float32 accumulation, within bf16 tolerance of
// a float64 reference, forward and backward, causal and not, over row blocks cut unevenly;
// float32 gradients for float32 inputs; the backward keeps the forward's choice; and nothing
// changes outside a scope or with the switch off. The ISA-capped fallback is in
// matmul_isa_cap_test.cpp.
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "tensor/autocast.h"
#include "tensor/internal/gemm.h"
#include "tensor/matmul_backend.h"
#include "tensor/ops.h"

namespace dt {
namespace {

// These tests check bf16's kernels wherever the CPU has the instructions, also where auto would
// run float32 for speed (MatmulBackend.Bf16AutoRunsBf16OnlyWhereItIsFaster checks that choice).
[[maybe_unused]] const bool kBf16KernelsWhereverTheyExist = (setBf16Matmul(Bf16Matmul::Native), true);

constexpr double kBf16Unit = 1.0 / 256;  // bf16's unit roundoff (8 significant bits)

// Sets the process-wide switch for one test and restores it (a failed ASSERT returns early).
class AttentionSwitch {
 public:
  explicit AttentionSwitch(bool bf16) : previous_(autocastAttention()) { setAutocastAttention(bf16); }
  ~AttentionSwitch() { setAutocastAttention(previous_); }

 private:
  bool previous_;
};

bool bf16Runs() { return detail::gemmOperandType(DType::BFloat16, DType::Float32) == DType::BFloat16; }

bool sameBits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.sizes() == b.sizes() && allclose(a, b, 0.0, 0.0);
}

double maxAbs(const Tensor& t) {
  double m = 0;
  for (double v : t.toVector<double>()) m = std::max(m, std::abs(v));
  return m;
}

struct AttentionRun {
  Tensor out, dq, dk, dv;
};

// attention(q, k, v) and the gradients of sum(out * up), from float32 inputs (or float64 ones
// for the reference), inside a bf16 autocast scope or not.
AttentionRun runAttention(const Tensor& q0, const Tensor& k0, const Tensor& v0, const Tensor& up, bool causal, DType dtype,
                 bool inScope) {
  Tensor q = q0.to(dtype).clone().setRequiresGrad(true), k = k0.to(dtype).clone().setRequiresGrad(true),
         v = v0.to(dtype).clone().setRequiresGrad(true);
  Tensor out;
  {
    autocast scope(DType::BFloat16, inScope);
    out = scaledDotProductAttention(q, k, v, {.causal = causal});
  }
  sum(mul(out, up.to(dtype))).backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

// selfAttention(qkv, heads, options) and the gradient of sum(out * up), as runAttention; dropout
// draws from a generator seeded alike on every run, so all runs drop the same probabilities.
std::pair<Tensor, Tensor> runSelfAttention(const Tensor& qkv0, const Tensor& up, int64_t heads,
                                           const AttentionOptions& options, DType dtype, bool inScope) {
  Tensor qkv = qkv0.to(dtype).clone().setRequiresGrad(true);
  Generator drop(99);
  Tensor out;
  {
    autocast scope(DType::BFloat16, inScope);
    out = selfAttention(qkv, heads, options, drop);
  }
  sum(mul(out, up.to(dtype))).backward();
  return {out.detach(), qkv.grad()};
}

// The tests that need bf16 products to run natively (skipped elsewhere, saying why), with the
// attention switch on for their duration.
class AttentionAutocastBf16 : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!bf16Runs()) GTEST_SKIP() << "bf16 products do not run natively here: " << bf16MatmulFallbackReason();
    on_.emplace(true);
  }
  std::optional<AttentionSwitch> on_;
};

// The forward's bound, to first order in bf16's unit u: the scores' operands are rounded
// once each, so |dS_ij| <= 2u (scale |Q||K|^T)_ij =: E_ij, and softmax turns that into
// |dP_ij| <= P_ij (exp(2 max_j E_ij) - 1); P and V are rounded once each for O = P V, adding
// 2u |P||V|. Elementwise: |O - O64| <= (2u + exp(2 max_j E_ij) - 1) (|P||V|)_ij, plus float32's
// accumulation (k u32 of the same, far below). Rows of P come from the float64 reference.
Tensor forwardBound(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  const Tensor q64 = q.to(DType::Float64), k64 = k.to(DType::Float64), v64 = v.to(DType::Float64);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.sizes().back()));
  Tensor e = mul(matmul(abs(q64), abs(k64).transpose(-2, -1)), 2 * kBf16Unit * scale);
  Tensor s = mul(matmul(q64, k64.transpose(-2, -1)), scale);
  const int64_t tq = q.sizes()[q.dim() - 2], tk = k.sizes()[k.dim() - 2];
  if (causal) {
    std::vector<bool> keep(static_cast<size_t>(tq * tk));
    for (int64_t i = 0; i < tq; ++i) {
      for (int64_t j = 0; j <= i; ++j) keep[static_cast<size_t>(i * tk + j)] = true;
    }
    const Tensor mask = fromVector<bool>(keep, {tq, tk});
    s = where(mask, s, full({tq, tk}, -INFINITY, DType::Float64));
    e = where(mask, e, zeros({tq, tk}, DType::Float64));
  }
  const Tensor p = softmax(s, -1);
  const Tensor rowE = amax(e, {-1}, true);
  const Tensor factor = add(sub(exp(mul(rowE, 2.0)), 1.0), 2 * kBf16Unit);
  return mul(matmul(p, abs(v64)), factor);
}

void expectWithin(const Tensor& got, const Tensor& ref, const Tensor& bound, const std::string& what) {
  ASSERT_EQ(got.dtype(), DType::Float32) << what;
  ASSERT_EQ(got.sizes(), ref.sizes()) << what;
  const auto g = got.toVector<double>(), r = ref.toVector<double>(), b = bound.toVector<double>();
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_LE(std::abs(g[i] - r[i]), b[i] + 1e-6 * std::abs(r[i]) + 1e-30) << what << " at " << i << ": " << g[i]
                                                                           << " vs " << r[i];
  }
}

// The gradients chain three rounded products (the scores, then dP = dO V^T, then dS K or
// dS^T Q; dV = P^T dO has two), each moving its result by about 2u of its |.| product, and the
// softmax's backward mixes rows; normwise, 4u of the largest gradient entry holds them (measured
// 0.5-1.9u on these cases) while a result of the wrong products is off by O(1).
void expectGradientWithin(const Tensor& got, const Tensor& ref, const std::string& what) {
  ASSERT_EQ(got.dtype(), DType::Float32) << what << ": a float32 input gets a float32 gradient";
  ASSERT_EQ(got.sizes(), ref.sizes()) << what;
  const double worst = maxAbs(sub(got.to(DType::Float64), ref));
  EXPECT_LE(worst, 4 * kBf16Unit * maxAbs(ref)) << what << ": max |float32 autocast - float64| = " << worst
                                                 << " against max |float64| = " << maxAbs(ref);
}

TEST_F(AttentionAutocastBf16, ForwardAndBackwardAreWithinBf16ToleranceOfFloat64) {
  struct Case {
    bool causal;
    int64_t tq, tk, d, dv;
  };
  // Causal row blocks of 128 rows with bf16 operands (32 in float32): 150 rows are 128 and 22,
  // 70 one short block; cross attention with Tq != Tk and Dv != D.
  for (const Case c : {Case{true, 150, 150, 24, 20}, Case{true, 70, 70, 24, 20}, Case{false, 70, 70, 24, 20},
                       Case{false, 45, 71, 16, 40}}) {
    const std::string what = std::string(c.causal ? "causal" : "full") + " Tq=" + std::to_string(c.tq);
    Generator g(11);
    const Tensor q = randn({2, 3, c.tq, c.d}, g), k = randn({2, 3, c.tk, c.d}, g), v = randn({2, 3, c.tk, c.dv}, g);
    const Tensor up = randn({2, 3, c.tq, c.dv}, g);
    const int64_t before = detail::onednn::productsRun();
    const AttentionRun bf = runAttention(q, k, v, up, c.causal, DType::Float32, true);
    const int64_t products = detail::onednn::productsRun() - before;
    const AttentionRun fp = runAttention(q, k, v, up, c.causal, DType::Float32, false);
    const AttentionRun ref = runAttention(q, k, v, up, c.causal, DType::Float64, false);
    // Per head (six), forward 2 and backward 4 products at least.
    EXPECT_GE(products, 6 * 6) << what << ": the products ran on oneDNN's bf16 kernels";
    EXPECT_FALSE(sameBits(bf.out, fp.out)) << what << ": identical to float32, so no bf16 rounding happened";
    expectWithin(bf.out, ref.out, forwardBound(q, k, v, c.causal), what + " forward");
    expectGradientWithin(bf.dq, ref.dq, what + " dq");
    expectGradientWithin(bf.dk, ref.dk, what + " dk");
    expectGradientWithin(bf.dv, ref.dv, what + " dv");
  }
}

TEST_F(AttentionAutocastBf16, FusedHeadsAreWithinBf16ToleranceOfFloat64) {
  const int64_t b = 2, t = 137, heads = 3, c = 48;  // row blocks of 128 and 9
  Generator g(12);
  const Tensor qkv0 = randn({b, t, 3 * c}, g), up = randn({b, t, c}, g);
  const auto [out, grad] = runSelfAttention(qkv0, up, heads, {}, DType::Float32, true);
  const auto [out64, grad64] = runSelfAttention(qkv0, up, heads, {}, DType::Float64, false);
  EXPECT_EQ(out.dtype(), DType::Float32);
  // The same bound as scaledDotProductAttention's, head by head.
  auto split = [&](const Tensor& t, int64_t third) {
    return t.narrow(2, third * c, c).reshape({b, t.size(1), heads, c / heads}).transpose(1, 2);
  };
  const Tensor bound = forwardBound(split(qkv0, 0), split(qkv0, 1), split(qkv0, 2), true).transpose(1, 2).reshape({b, t, c});
  expectWithin(out, out64, bound, "selfAttention forward");
  expectGradientWithin(grad, grad64, "selfAttention dqkv");
}

TEST(AttentionAutocast, OutsideAScopeOrSwitchedOffTheFloat32PathIsUnchanged) {
  Generator g(13);
  const Tensor q = randn({2, 2, 40, 16}, g), k = randn({2, 2, 40, 16}, g), v = randn({2, 2, 40, 16}, g);
  const Tensor up = randn({2, 2, 40, 16}, g);
  AttentionRun off;
  {
    AttentionSwitch sw(false);
    off = runAttention(q, k, v, up, true, DType::Float32, true);  // in a scope, switched off
  }
  AttentionSwitch on(true);
  const int64_t before = detail::onednn::productsRun();
  const AttentionRun outside = runAttention(q, k, v, up, true, DType::Float32, false);
  EXPECT_EQ(detail::onednn::productsRun(), before) << "float32 attention outside a scope called oneDNN";
  EXPECT_TRUE(sameBits(outside.out, off.out));
  EXPECT_TRUE(sameBits(outside.dq, off.dq));
  EXPECT_TRUE(sameBits(outside.dk, off.dk));
  EXPECT_TRUE(sameBits(outside.dv, off.dv));
  // float64 inside a scope is untouched too.
  const AttentionRun in64 = runAttention(q, k, v, up, true, DType::Float64, true);
  const AttentionRun out64 = runAttention(q, k, v, up, true, DType::Float64, false);
  EXPECT_TRUE(sameBits(in64.out, out64.out));
  EXPECT_TRUE(sameBits(in64.dq, out64.dq));
}

TEST_F(AttentionAutocastBf16, BackwardKeepsTheForwardsChoiceOutsideTheScopeAndAfterTheSwitch) {
  Generator g(14);
  const Tensor qkv0 = randn({2, 33, 3 * 32}, g), up = randn({2, 33, 32}, g);
  auto grad = [&](bool backwardInScope, bool switchOffBeforeBackward) {
    Tensor qkv = qkv0.clone().setRequiresGrad(true);
    std::optional<autocast> scope(std::in_place);
    Tensor loss = sum(mul(selfAttention(qkv, 4, {.causal = true}), up));
    if (!backwardInScope) scope.reset();
    if (switchOffBeforeBackward) setAutocastAttention(false);
    loss.backward();
    setAutocastAttention(true);
    return qkv.grad();
  };
  const Tensor inside = grad(true, false);
  EXPECT_EQ(inside.dtype(), DType::Float32);
  EXPECT_TRUE(sameBits(grad(false, false), inside));
  EXPECT_TRUE(sameBits(grad(true, true), inside));
  // And it was the bf16 backward: the float32 one differs.
  Tensor qkv = qkv0.clone().setRequiresGrad(true);
  sum(mul(selfAttention(qkv, 4, {.causal = true}), up)).backward();
  EXPECT_FALSE(sameBits(qkv.grad(), inside));
}

// oneDNN's primitives are cached per shape: a second step of the same shapes creates none.
TEST_F(AttentionAutocastBf16, ASecondStepCreatesNoPrimitives) {
  Generator g(16);
  const Tensor qkv0 = randn({2, 150, 3 * 32}, g), up = randn({2, 150, 32}, g);
  runSelfAttention(qkv0, up, 2, {}, DType::Float32, true);
  const int64_t created = detail::onednn::primitivesCreated();
  const int64_t run = detail::onednn::productsRun();
  runSelfAttention(qkv0, up, 2, {}, DType::Float32, true);
  EXPECT_GT(detail::onednn::productsRun(), run) << "the second step ran no bf16 products on oneDNN";
  EXPECT_EQ(detail::onednn::primitivesCreated(), created);
}

TEST_F(AttentionAutocastBf16, DropoutDrawsTheSameMaskAndStaysWithinTolerance) {
  Generator g(15);
  const Tensor qkv0 = randn({1, 40, 3 * 24}, g), up = randn({1, 40, 24}, g);
  const AttentionOptions options{.causal = true, .dropoutP = 0.2};
  const auto [out, grad] = runSelfAttention(qkv0, up, 2, options, DType::Float32, true);
  const auto [out64, grad64] = runSelfAttention(qkv0, up, 2, options, DType::Float64, false);
  // Both draw one mask from the same seed (a different mask would be off by O(1)); dropout
  // scales the kept probabilities by 1 / 0.8, so the forward is checked normwise here.
  expectGradientWithin(out, out64, "dropout forward");
  expectGradientWithin(grad, grad64, "dropout dqkv");
}

}  // namespace
}  // namespace dt
