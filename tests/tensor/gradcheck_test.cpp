// Runs gradcheck (float64 central differences) over every differentiable op,
// with broadcasting and non-contiguous inputs.
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tensor/autograd/gradcheck.h"
#include "tensor/ops.h"

namespace dt {
namespace {

Generator& gen() {
  static Generator g(42);
  return g;
}

Tensor leaf(Shape s, double lo = -1.0, double hi = 1.0) {
  Tensor t = rand(std::move(s), gen(), DType::Float64);
  {
    NoGradGuard ng;
    t = add(mul(t, hi - lo), lo);
  }
  return t.setRequiresGrad(true);
}

// A non-contiguous leaf: the transpose of a fresh [b, a] tensor.
Tensor leafT(int64_t a, int64_t b, double lo = -1.0, double hi = 1.0) {
  Tensor base = leaf({b, a}, lo, hi).detach();
  Tensor t = base.t();
  EXPECT_FALSE(t.isContiguous());
  return t.setRequiresGrad(true);
}

// Keeps values away from 0 so |x|, relu, division are differentiable where sampled.
Tensor leafAway(Shape s) {
  Tensor t = leaf(std::move(s), 0.2, 1.0).detach();
  {
    NoGradGuard ng;
    Tensor sign = where(gt(rand(t.sizes(), gen(), DType::Float64), 0.5), ones(t.sizes(), DType::Float64),
                        full(t.sizes(), -1.0, DType::Float64));
    t = mul(t, sign);
  }
  return t.setRequiresGrad(true);
}

struct Case {
  std::string name;
  std::function<Tensor(const TensorList&)> fn;
  std::function<TensorList()> inputs;
};

const std::vector<Case>& cases() {
  static std::vector<Case> c;
  if (!c.empty()) return c;
  auto add2 = [&](std::string n, std::function<Tensor(const TensorList&)> f, std::function<TensorList()> in) {
    c.push_back({std::move(n), std::move(f), std::move(in)});
  };
  add2("add_broadcast", [](const TensorList& x) { return add(x[0], x[1], 0.5); },
       [] { return TensorList{leaf({3, 4}), leaf({4})}; });
  add2("sub_noncontig", [](const TensorList& x) { return sub(x[0], x[1]); },
       [] { return TensorList{leafT(3, 4), leaf({3, 1})}; });
  add2("mul_broadcast", [](const TensorList& x) { return mul(x[0], x[1]); },
       [] { return TensorList{leaf({2, 1, 3}), leafT(4, 3)}; });
  add2("div", [](const TensorList& x) { return div(x[0], x[1]); },
       [] { return TensorList{leaf({3, 4}), leaf({1, 4}, 0.5, 2.0)}; });
  add2("pow_tensor", [](const TensorList& x) { return pow(x[0], x[1]); },
       [] { return TensorList{leaf({3, 4}, 0.5, 2.0), leaf({4})}; });
  add2("pow_scalar", [](const TensorList& x) { return pow(x[0], 3.0); }, [] { return TensorList{leafT(3, 2)}; });
  add2("maximum", [](const TensorList& x) { return maximum(x[0], x[1]); },
       [] { return TensorList{leaf({3, 4}), leaf({4})}; });
  add2("minimum", [](const TensorList& x) { return minimum(x[0], x[1]); },
       [] { return TensorList{leafT(4, 3), leaf({4, 3})}; });
  add2("neg", [](const TensorList& x) { return neg(x[0]); }, [] { return TensorList{leafT(2, 3)}; });
  add2("exp", [](const TensorList& x) { return exp(x[0]); }, [] { return TensorList{leafT(2, 3)}; });
  add2("log", [](const TensorList& x) { return log(x[0]); }, [] { return TensorList{leaf({5}, 0.5, 2.0)}; });
  add2("sqrt", [](const TensorList& x) { return sqrt(x[0]); }, [] { return TensorList{leaf({2, 3}, 0.5, 2.0)}; });
  add2("abs", [](const TensorList& x) { return abs(x[0]); }, [] { return TensorList{leafAway({2, 3})}; });
  add2("clamp", [](const TensorList& x) { return clamp(x[0], -0.5, 0.5); }, [] { return TensorList{leafAway({3, 3})}; });
  add2("relu", [](const TensorList& x) { return relu(x[0]); }, [] { return TensorList{leafAway({3, 3})}; });
  add2("gelu", [](const TensorList& x) { return gelu(x[0]); }, [] { return TensorList{leafT(3, 2)}; });
  add2("tanh", [](const TensorList& x) { return tanh(x[0]); }, [] { return TensorList{leafT(3, 2)}; });
  add2("sigmoid", [](const TensorList& x) { return sigmoid(x[0]); }, [] { return TensorList{leafT(3, 2)}; });
  add2("where", [](const TensorList& x) { return where(gt(x[0], 0.0), x[0], x[1]); },
       [] { return TensorList{leafAway({3, 4}), leaf({4})}; });
  add2("sum_all", [](const TensorList& x) { return sum(x[0]); }, [] { return TensorList{leafT(3, 4)}; });
  add2("sum_dims_keepdim", [](const TensorList& x) { return sum(x[0], {0, 2}, true); },
       [] { return TensorList{leaf({2, 3, 4})}; });
  add2("mean_dim", [](const TensorList& x) { return mean(x[0], {-1}); }, [] { return TensorList{leafT(3, 4)}; });
  add2("max_dim", [](const TensorList& x) { return max(x[0], 1, false).values; },
       [] { return TensorList{leaf({3, 5})}; });
  add2("min_dim_keepdim", [](const TensorList& x) { return min(x[0], 0, true).values; },
       [] { return TensorList{leafT(3, 5)}; });
  add2("amax", [](const TensorList& x) { return amax(x[0], {0, 1}); }, [] { return TensorList{leaf({3, 4, 2})}; });
  add2("mm_transposed", [](const TensorList& x) { return mm(x[0], x[1]); },
       [] { return TensorList{leafT(3, 4), leaf({4, 2})}; });
  add2("bmm", [](const TensorList& x) { return bmm(x[0], x[1]); },
       [] { return TensorList{leaf({2, 3, 4}), leaf({2, 4, 2})}; });
  add2("matmul_broadcast", [](const TensorList& x) { return matmul(x[0], x[1]); },
       [] { return TensorList{leaf({2, 1, 3, 4}), leaf({3, 4, 2})}; });
  add2("matmul_nd_2d", [](const TensorList& x) { return matmul(x[0], x[1]); },
       [] { return TensorList{leaf({2, 3, 4}), leafT(4, 2)}; });
  add2("matmul_vec", [](const TensorList& x) { return matmul(x[0], x[1]); },
       [] { return TensorList{leaf({3, 4}), leaf({4})}; });
  add2("linear", [](const TensorList& x) { return linear(x[0], x[1], x[2]); },
       [] { return TensorList{leaf({2, 3, 4}), leaf({5, 4}), leaf({5})}; });
  add2("linear_noncontig_input", [](const TensorList& x) { return linear(x[0], x[1]); },
       [] { return TensorList{leafT(3, 4), leafT(5, 4)}; });
  add2("softmax", [](const TensorList& x) { return softmax(x[0], 0); }, [] { return TensorList{leafT(4, 3)}; });
  add2("log_softmax", [](const TensorList& x) { return logSoftmax(x[0], -1); }, [] { return TensorList{leaf({3, 5})}; });
  add2("cross_entropy_smoothing_ignore",
       [](const TensorList& x) {
         CrossEntropyOptions o;
         o.labelSmoothing = 0.1;
         o.ignoreIndex = 1;
         return crossEntropy(x[0], fromVector<int64_t>({0, 1, 3, 2}), o);
       },
       [] { return TensorList{leaf({4, 5})}; });
  add2("cross_entropy_sum", [](const TensorList& x) {
         CrossEntropyOptions o;
         o.reduction = Reduction::Sum;
         return crossEntropy(x[0], fromVector<int64_t>({4, 0, 2}), o);
       },
       [] { return TensorList{leafT(3, 5)}; });
  add2("cross_entropy_none", [](const TensorList& x) {
         CrossEntropyOptions o;
         o.reduction = Reduction::None;
         return crossEntropy(x[0], fromVector<int64_t>({1, 2}), o);
       },
       [] { return TensorList{leaf({2, 3})}; });
  add2("cross_entropy_none_one_sample", [](const TensorList& x) {  // 0-dim loss
         CrossEntropyOptions o;
         o.reduction = Reduction::None;
         return crossEntropy(x[0], fromVector<int64_t>({2}, {}), o);
       },
       [] { return TensorList{leaf({4})}; });
  add2("mse", [](const TensorList& x) { return mseLoss(x[0], x[1]); }, [] { return TensorList{leafT(2, 3), leaf({2, 3})}; });
  add2("embedding", [](const TensorList& x) { return embedding(x[0], fromVector<int64_t>({2, 0, 2, 1}, {2, 2})); },
       [] { return TensorList{leaf({4, 3})}; });
  add2("layer_norm", [](const TensorList& x) { return layerNorm(x[0], {4}, x[1], x[2]); },
       [] { return TensorList{leaf({3, 4}), leaf({4}), leaf({4})}; });
  add2("layer_norm_2d_noncontig", [](const TensorList& x) { return layerNorm(x[0], {3, 2}); },
       [] { return TensorList{leaf({2, 2, 3}).transpose(1, 2)}; });
  add2("dropout_seeded", [](const TensorList& x) {
         Generator g(7);
         return dropout(x[0], 0.3, true, g);
       },
       [] { return TensorList{leaf({4, 4})}; });
  // Attention: causal over more rows than one block of the kernel (32), so the blocked gemms
  // and the masked tails of each block are covered; non-causal with Tq != Tk and Dv != D; the
  // fused multi-head form on a strided (non-contiguous) qkv; and dropout with a fixed seed.
  add2("sdpa_causal_blocks", [](const TensorList& x) { return scaledDotProductAttention(x[0], x[1], x[2]); },
       [] { return TensorList{leaf({1, 40, 2}), leaf({1, 40, 2}), leaf({1, 40, 3})}; });
  add2("sdpa_cross_scaled",
       [](const TensorList& x) {
         return scaledDotProductAttention(x[0], x[1], x[2], {.causal = false, .scale = 0.7});
       },
       [] { return TensorList{leaf({2, 2, 3, 4}), leaf({2, 2, 5, 4}), leaf({2, 2, 5, 2})}; });
  add2("sdpa_dropout_seeded",
       [](const TensorList& x) {
         Generator g(11);
         return scaledDotProductAttention(x[0], x[1], x[2], {.dropoutP = 0.3}, g);
       },
       [] { return TensorList{leaf({2, 6, 3}), leaf({2, 6, 3}), leaf({2, 6, 3})}; });
  add2("self_attention_heads_strided", [](const TensorList& x) { return selfAttention(x[0].transpose(0, 1), 2); },
       [] { return TensorList{leaf({35, 2, 12})}; });
  add2("self_attention_dropout_noncausal",
       [](const TensorList& x) {
         Generator g(5);
         return selfAttention(x[0], 3, {.causal = false, .dropoutP = 0.25}, g);
       },
       [] { return TensorList{leaf({2, 4, 18})}; });
  add2("cat", [](const TensorList& x) { return cat({x[0], x[1]}, 1); },
       [] { return TensorList{leafT(2, 3), leaf({2, 2})}; });
  add2("stack", [](const TensorList& x) { return stack({x[0], x[1]}, 0); },
       [] { return TensorList{leaf({2, 3}), leafT(2, 3)}; });
  add2("index_select", [](const TensorList& x) { return indexSelect(x[0], 1, fromVector<int64_t>({2, 0, 2})); },
       [] { return TensorList{leafT(2, 3)}; });
  add2("views", [](const TensorList& x) {
         return x[0].view({3, 4}).transpose(0, 1).narrow(0, 1, 2).unsqueeze(0).expand({2, 2, 3}).select(2, 1);
       },
       [] { return TensorList{leaf({12})}; });
  add2("permute_reshape_slice", [](const TensorList& x) {
         return x[0].permute({2, 0, 1}).reshape({4, 6}).slice(1, 0, 6, 2).squeeze();
       },
       [] { return TensorList{leaf({2, 3, 4})}; });
  add2("as_strided_overlapping", [](const TensorList& x) { return x[0].asStrided({3, 3}, {1, 1}, 0); },
       [] { return TensorList{leaf({6})}; });
  add2("clone_contiguous", [](const TensorList& x) { return x[0].contiguous().clone(); },
       [] { return TensorList{leafT(2, 3)}; });
  add2("inplace_add_on_nonleaf", [](const TensorList& x) {
         Tensor y = mul(x[0], 2.0);
         add_(y, x[1]);
         return y;
       },
       [] { return TensorList{leaf({2, 3}), leaf({3})}; });
  add2("inplace_chain_on_nonleaf", [](const TensorList& x) {
         Tensor y = mul(x[0], 1.0);
         mul_(y, x[1]);
         div_(y, x[2]);
         sub_(y, x[1], 0.5);
         clamp_(y, -0.8, 0.8);
         return y;
       },
       [] { return TensorList{leaf({3, 2}), leaf({2}), leaf({3, 1}, 0.5, 2.0)}; });
  add2("copy_into_fresh_tensor", [](const TensorList& x) {
         Tensor y = zeros({2, 3}, DType::Float64);
         y.copy_(x[0]);  // broadcasts [3] -> [2, 3]
         return mul(y, y);
       },
       [] { return TensorList{leaf({3})}; });
  add2("rsub_and_operators", [](const TensorList& x) { return (rsub(x[0], 2.0) * x[1] - x[0] / 3.0) + (-x[1]); },
       [] { return TensorList{leaf({2, 2}), leafT(2, 2)}; });
  return c;
}

class GradcheckSweep : public ::testing::TestWithParam<size_t> {};

TEST_P(GradcheckSweep, MatchesFiniteDifferences) {
  const Case& c = cases()[GetParam()];
  TensorList inputs = c.inputs();
  GradcheckResult r = gradcheck(c.fn, inputs, {1e-6, 1e-6, 1e-4});
  EXPECT_TRUE(r.ok) << c.name << ": " << r.message;
}

INSTANTIATE_TEST_SUITE_P(AllOps, GradcheckSweep, ::testing::Range<size_t>(0, cases().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) { return cases()[info.param].name; });

TEST(Gradcheck, DetectsAWrongGradient) {
  // A deliberately wrong backward (gradient of 2x reported for 3x) must be caught.
  Tensor x = leaf({3});
  auto fn = [](const TensorList& in) {
    Tensor y = mul(in[0], 3.0);
    // Replace the gradient flowing into x with 2/3 of itself.
    if (in[0].requiresGrad() && gradModeEnabled()) {
      y.registerHook([](const Tensor& g) { return mul(g, 2.0 / 3.0); });
    }
    return y;
  };
  GradcheckResult r = gradcheck(fn, {x});
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("analytical"), std::string::npos) << r.message;
}

}  // namespace
}  // namespace dt
