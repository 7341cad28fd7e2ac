// bfloat16 autocast (tensor/autocast.h): the products of mm, bmm, matmul and linear in bf16 with
// float32 results, within bf16 tolerance of float32, and their gradients likewise; everything
// else float32 and unchanged; the guard's scope rules.
#include <cmath>
#include <functional>
#include <string>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "tensor/autocast.h"
#include "tensor/internal/gemm.h"
#include "tensor/matmul_backend.h"
#include "tensor/ops.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

// These tests check bf16's kernels wherever the CPU has the instructions, also where auto would
// run float32 for speed (MatmulBackend.Bf16AutoRunsBf16OnlyWhereItIsFaster checks that choice).
[[maybe_unused]] const bool kBf16KernelsWhereverTheyExist = (setBf16Matmul(Bf16Matmul::Native), true);

using testing::expectThrowsWith;

constexpr double kEps32 = 1.0 / (1 << 24);

// bf16's unit roundoff is 2^-8 (8 significant bits): rounding both operands moves each product
// term by at most about 2^-7 of |a_i||b_i|, and float32 accumulation (both sides) adds 2 k u:
// |autocast - float32| <= (2^-7 + 2 k u) (|A||B|).
void expectBf16Tolerance(const Tensor& got, const Tensor& ref, const Tensor& absProduct, int64_t k,
                         const std::string& what) {
  ASSERT_EQ(got.dtype(), DType::Float32) << what;
  ASSERT_EQ(got.sizes(), ref.sizes()) << what;
  const auto gv = got.toVector<double>(), rv = ref.toVector<double>(), bv = absProduct.toVector<double>();
  ASSERT_EQ(gv.size(), bv.size()) << what;
  for (size_t i = 0; i < gv.size(); ++i) {
    const double tol = (1.0 / 128 + 2.0 * static_cast<double>(k) * kEps32) * bv[i] + 1e-30;
    ASSERT_LE(std::abs(gv[i] - rv[i]), tol) << what << " at " << i << ": " << gv[i] << " vs " << rv[i];
  }
}

Tensor abs64(const Tensor& t) { return abs(t.to(DType::Float64)); }

bool anyDiffers(const Tensor& a, const Tensor& b) {
  const auto av = a.toVector<float>(), bv = b.toVector<float>();
  for (size_t i = 0; i < av.size(); ++i) {
    if (av[i] != bv[i]) return true;
  }
  return false;
}

struct OpCase {
  std::string name;
  std::function<Tensor(const Tensor&, const Tensor&)> op;
  Shape aShape, bShape;
  int64_t k;
  // The two gradients' |.| products: |g| op' |b|, |a| op' |g| (float64).
  std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)> gradABound, gradBBound;
};

std::vector<OpCase> opCases() {
  auto mmCase = OpCase{"mm",
                       [](const Tensor& a, const Tensor& b) { return mm(a, b); },
                       {48, 96},
                       {96, 40},
                       96,
                       [](const Tensor& g, const Tensor&, const Tensor& b) { return mm(g, b.t()); },
                       [](const Tensor& g, const Tensor& a, const Tensor&) { return mm(a.t(), g); }};
  auto bmmCase = OpCase{"bmm",
                        [](const Tensor& a, const Tensor& b) { return bmm(a, b); },
                        {3, 20, 70},
                        {3, 70, 30},
                        70,
                        [](const Tensor& g, const Tensor&, const Tensor& b) { return bmm(g, b.transpose(1, 2)); },
                        [](const Tensor& g, const Tensor& a, const Tensor&) { return bmm(a.transpose(1, 2), g); }};
  // Broadcast batch: b's gradient sums over a's leading dim.
  auto matmulCase = OpCase{"matmul",
                           [](const Tensor& a, const Tensor& b) { return matmul(a, b); },
                           {2, 3, 24, 64},
                           {3, 64, 16},
                           64,
                           [](const Tensor& g, const Tensor&, const Tensor& b) { return matmul(g, b.transpose(1, 2)); },
                           [](const Tensor& g, const Tensor& a, const Tensor&) {
                             return sum(matmul(a.transpose(2, 3), g), {0});
                           }};
  // linear without bias: x W^T.
  auto linearCase = OpCase{"linear",
                           [](const Tensor& x, const Tensor& w) { return linear(x, w); },
                           {4, 16, 80},
                           {56, 80},
                           80,
                           [](const Tensor& g, const Tensor&, const Tensor& w) { return matmul(g, w); },
                           [](const Tensor& g, const Tensor& x, const Tensor&) {
                             return mm(g.reshape({-1, g.size(-1)}).t(), x.reshape({-1, x.size(-1)}));
                           }};
  return {mmCase, bmmCase, matmulCase, linearCase};
}

TEST(Autocast, ProductsAndTheirGradientsAreWithinBf16ToleranceOfFloat32) {
  Generator g(17);
  for (const OpCase& c : opCases()) {
    const Tensor a0 = randn(c.aShape, g), b0 = randn(c.bShape, g);
    const Tensor y32 = c.op(a0, b0);
    const Tensor up = randn(y32.sizes(), g);
    auto run = [&](bool withAutocast) {
      Tensor a = a0.clone().setRequiresGrad(true), b = b0.clone().setRequiresGrad(true);
      Tensor y;
      {
        autocast scope(DType::BFloat16, withAutocast);
        y = c.op(a, b);
      }
      sum(mul(y, up)).backward();
      return std::vector<Tensor>{y.detach(), a.grad(), b.grad()};
    };
    const int64_t runBefore = detail::onednn::productsRun();
    const std::vector<Tensor> ac = run(true);
    const int64_t acProducts = detail::onednn::productsRun() - runBefore;
    const std::vector<Tensor> fp = run(false);
    expectBf16Tolerance(ac[0], fp[0], c.op(abs64(a0), abs64(b0)), c.k, c.name + " forward");
    const Tensor up64 = abs64(up);
    expectBf16Tolerance(ac[1], fp[1], c.gradABound(up64, abs64(a0), abs64(b0)), c.k, c.name + " gradient of a");
    expectBf16Tolerance(ac[2], fp[2], c.gradBBound(up64, abs64(a0), abs64(b0)), c.k, c.name + " gradient of b");
    if (detail::gemmOperandType(DType::BFloat16, DType::Float32) == DType::BFloat16) {
      EXPECT_GE(acProducts, 3) << c.name << ": forward and both gradients on oneDNN's bf16 kernels";
      EXPECT_TRUE(anyDiffers(ac[0], fp[0])) << c.name << ": identical to float32, so no bf16 rounding happened";
    } else {
      std::printf("%s: bf16 products run in float32 here (%s)\n", c.name.c_str(), bf16MatmulFallbackReason().c_str());
    }
  }
}

TEST(Autocast, LinearWithBiasKeepsFloat32ParametersAndBias) {
  Generator g(2);
  const Tensor x0 = randn({32, 64}, g), w0 = randn({48, 64}, g), b0 = randn({48}, g), up = randn({32, 48}, g);
  auto run = [&](bool withAutocast) {
    Tensor x = x0.clone().setRequiresGrad(true), w = w0.clone().setRequiresGrad(true), b = b0.clone().setRequiresGrad(true);
    Tensor y;
    {
      autocast scope(DType::BFloat16, withAutocast);
      y = linear(x, w, b);
    }
    sum(mul(y, up)).backward();
    return std::vector<Tensor>{y.detach(), x.grad(), w.grad(), b.grad()};
  };
  const auto ac = run(true), fp = run(false);
  for (const Tensor& t : ac) EXPECT_EQ(t.dtype(), DType::Float32);
  expectBf16Tolerance(ac[0], fp[0], add(mm(abs64(x0), abs64(w0).t()), abs64(b0)), 65, "linear forward");
  expectBf16Tolerance(ac[1], fp[1], mm(abs64(up), abs64(w0)), 48, "linear input gradient");
  expectBf16Tolerance(ac[2], fp[2], mm(abs64(up).t(), abs64(x0)), 32, "linear weight gradient");
  // The bias gradient sums the float32 upstream gradient: no bf16 anywhere.
  EXPECT_TRUE(ac[3].allclose(fp[3], 1e-6, 1e-6));
}

TEST(Autocast, EverythingElseStaysFloat32AndUnchanged) {
  Generator g(9);
  const Tensor x = randn({8, 32}, g), gamma = ones({32}), beta = zeros({32});
  const Tensor d = randn({16, 16}, g, DType::Float64);
  const std::vector<Tensor> outside = {relu(x), softmax(x, 1), layerNorm(x, {32}, gamma, beta), add(x, x), mm(d, d)};
  autocast scope;
  const std::vector<Tensor> inside = {relu(x), softmax(x, 1), layerNorm(x, {32}, gamma, beta), add(x, x), mm(d, d)};
  for (size_t i = 0; i < inside.size(); ++i) {
    EXPECT_EQ(inside[i].dtype(), outside[i].dtype()) << i;
    EXPECT_TRUE(allclose(inside[i], outside[i], 0.0, 0.0)) << i;
  }
}

TEST(Autocast, BackwardOutsideTheScopeUsesTheForwardsChoice) {
  Generator g(4);
  const Tensor a0 = randn({40, 50}, g), b0 = randn({50, 30}, g);
  auto grads = [&](bool backwardInside) {
    Tensor a = a0.clone().setRequiresGrad(true), b = b0.clone().setRequiresGrad(true);
    std::optional<autocast> scope(std::in_place);
    Tensor loss = sum(mm(a, b));
    if (!backwardInside) scope.reset();
    loss.backward();
    return std::pair<Tensor, Tensor>(a.grad(), b.grad());
  };
  const auto [ai, bi] = grads(true);
  const auto [ao, bo] = grads(false);
  EXPECT_TRUE(allclose(ai, ao, 0.0, 0.0));
  EXPECT_TRUE(allclose(bi, bo, 0.0, 0.0));
}

TEST(Autocast, ScopesAreThreadLocalAndNest) {
  EXPECT_FALSE(autocastDType().has_value());
  {
    autocast outer;
    EXPECT_EQ(autocastDType(), DType::BFloat16);
    std::optional<DType> seenByOtherThread = DType::Float64;
    std::thread([&] { seenByOtherThread = autocastDType(); }).join();
    EXPECT_FALSE(seenByOtherThread.has_value());
    {
      autocast off(DType::BFloat16, false);
      EXPECT_FALSE(autocastDType().has_value());
      EXPECT_EQ(mm(ones({2, 2}), ones({2, 2})).dtype(), DType::Float32);
    }
    EXPECT_EQ(autocastDType(), DType::BFloat16);
  }
  EXPECT_FALSE(autocastDType().has_value());
  expectThrowsWith<InvalidArgument>([] { autocast half(DType::Float16); }, {"float16", "bfloat16"});
}

TEST(Autocast, MixedFloat32AndBFloat16OperandsMultiplyInsideTheScope) {
  Generator g(6);
  const Tensor a = randn({20, 30}, g), b = randn({30, 10}, g).to(DType::BFloat16);
  expectThrowsWith<InvalidArgument>([&] { mm(a, b); }, {"dtypes differ"});
  autocast scope;
  const Tensor r = mm(a, b);
  EXPECT_EQ(r.dtype(), DType::Float32);
  expectBf16Tolerance(r, mm(a, b.to(DType::Float32)), mm(abs64(a), abs64(b)), 30, "mixed mm");
}

}  // namespace
}  // namespace dt
