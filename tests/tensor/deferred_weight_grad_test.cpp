// backwardDeferringWeights: input gradients first, weight gradients later (zero-bubble pipelines).
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "tensor/autograd/autograd.h"
#include "tensor/autograd/function.h"
#include "tensor/generator.h"
#include "tensor/nn/module.h"
#include "tensor/ops.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using testing::expectThrowsWith;

// A two-layer block with a LayerNorm: Linear (x and weight), GELU, Linear, LayerNorm.
struct Block {
  Generator gen{7};
  nn::Linear up{16, 32, true, gen};
  nn::Linear down{32, 16, true, gen};
  nn::LayerNorm norm{{16}};
  Tensor forward(const Tensor& x) { return norm.forward(down.forward(gelu(up.forward(x)))); }
  std::vector<Tensor> params() { return {up.weight, up.bias, down.weight, down.bias, norm.weight, norm.bias}; }
};

Tensor input(uint64_t seed) {
  Generator g(seed);
  return randn({3, 5, 16}, g).setRequiresGrad(true);
}

TEST(DeferredWeightGrad, InputGradientFirstWeightsAfterRunEqualFullBackward) {
  Block block;
  Generator g(3);
  const Tensor gradOut = randn({3, 5, 16}, g);

  Tensor x = input(11);
  backward({block.forward(x)}, {gradOut});
  const Tensor wantX = x.grad().clone();
  std::vector<Tensor> want;
  for (Tensor& p : block.params()) want.push_back(p.grad().clone());
  std::vector<Tensor> params = block.params();
  zeroGrads(params, /*setToNone=*/true);

  Tensor x2 = input(11);
  WeightGradients later = backwardDeferringWeights({block.forward(x2)}, {gradOut}, block.params());
  ASSERT_TRUE(x2.grad().defined());
  EXPECT_TRUE(allclose(x2.grad(), wantX, 0, 0)) << "the input gradient must not wait for the weights";
  // The Linears' weights wait; the LayerNorm's are column sums, computed with its input gradient
  // (keeping its input and output gradient for a later W would cost memory and save nothing).
  const std::vector<Tensor> params2 = block.params();
  for (size_t i = 0; i < 4; ++i) EXPECT_FALSE(params2[i].grad().defined()) << "a Linear's gradient ran early: " << i;
  for (size_t i = 4; i < 6; ++i) {
    ASSERT_TRUE(params2[i].grad().defined()) << "the LayerNorm's parameter " << i << " waited";
    EXPECT_TRUE(allclose(params2[i].grad(), want[i], 0, 0)) << "parameter " << i;
  }
  // The two Linears (each one node for its product and bias) wait.
  EXPECT_GE(later.pending(), 2u);

  later.run();
  EXPECT_EQ(later.pending(), 0u);
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(block.params()[i].grad().defined()) << "parameter " << i;
    EXPECT_TRUE(allclose(block.params()[i].grad(), want[i], 0, 0)) << "parameter " << i;
  }
  expectThrowsWith<InvalidArgument>([&] { later.run(); }, {"already computed"});
}

TEST(DeferredWeightGrad, TiedWeightAccumulatesOnceWhenItsLastContributionIsIn) {
  // One weight used by two products (a tied embedding and output head): its
  // post-accumulate hook must fire once, after run(), with the summed gradient.
  Generator g(5);
  Tensor w = randn({4, 4}, g).setRequiresGrad(true);
  Tensor x = randn({2, 4}, g).setRequiresGrad(true);
  int fired = 0;
  Tensor seen;
  w.registerPostAccumulateGradHook([&](Tensor& leaf) {
    ++fired;
    seen = leaf.grad().clone();
  });
  auto forward = [&](const Tensor& in) { return sum(mm(mm(in, w), w.t())); };

  Tensor xRef = x.detach().setRequiresGrad(true);
  forward(xRef).backward();
  const Tensor want = w.grad().clone();
  ASSERT_EQ(fired, 1);
  w.setGrad(Tensor());
  fired = 0;

  WeightGradients later = backwardDeferringWeights({forward(x)}, {}, {w});
  EXPECT_EQ(fired, 0);
  EXPECT_TRUE(allclose(x.grad(), xRef.grad(), 0, 0));
  later.run();
  EXPECT_EQ(fired, 1);
  EXPECT_TRUE(allclose(seen, want, 1e-6, 1e-6));
}

TEST(DeferredWeightGrad, CallbacksQueuedInThePassRunAfterTheWeights) {
  Block block;
  Tensor x = input(2);
  Tensor y = block.forward(x);
  std::vector<std::string> order;
  block.down.weight.registerPostAccumulateGradHook([&](Tensor&) { order.push_back("weight"); });
  y.registerHook([&](const Tensor& grad) {
    queueCallback([&] { order.push_back("callback"); });
    return grad;
  });
  WeightGradients later = backwardDeferringWeights({sum(y)}, {}, block.params());
  EXPECT_TRUE(order.empty()) << "the pass is not over until its weight gradients are";
  EXPECT_FALSE(inBackward());
  later.run();
  EXPECT_EQ(order, (std::vector<std::string>{"weight", "callback"}));
}

// A custom Function that records which halves of its backward ran.
struct Scale : autograd::Function<Scale> {
  static constexpr std::string_view name = "Scale";
  static inline std::vector<std::string> calls;
  static Tensor forward(autograd::FunctionContext& ctx, const Tensor& x, const Tensor& s) {
    ctx.saveForBackward({x, s});
    return mul(x, s);
  }
  static TensorList backward(autograd::FunctionContext& ctx, const TensorList& grads) {
    const TensorList saved = ctx.savedTensors();
    calls.push_back(std::string(ctx.needsInputGrad(0) ? "x" : "") + (ctx.needsInputGrad(1) ? "s" : ""));
    return {mul(grads[0], saved[1]), sum(mul(grads[0], saved[0])).reshape({1})};
  }
};

TEST(DeferredWeightGrad, CustomFunctionsSplitThroughNeedsInputGrad) {
  Scale::calls.clear();
  Tensor s = fromVector<float>({3}).setRequiresGrad(true);
  Tensor x = fromVector<float>({1, 2}).setRequiresGrad(true);
  WeightGradients later = backwardDeferringWeights({sum(Scale::apply(x, s))}, {}, {s});
  EXPECT_EQ(x.grad().toVector<float>(), (std::vector<float>{3, 3}));
  EXPECT_FALSE(s.grad().defined()) << "backward returned s's gradient too, and it must wait for run()";
  later.run();
  EXPECT_FLOAT_EQ(s.grad().item<float>(), 3.0f);
  EXPECT_EQ(Scale::calls, (std::vector<std::string>{"x", "s"}));
}

// A hand-written node cannot split: it runs whole in the first pass.
class Doubling final : public Node {
 public:
  TensorList apply(TensorList&& grads) override { return {mul(grads[0], 2.0)}; }
  std::string name() const override { return "Doubling"; }
};

TEST(DeferredWeightGrad, NodesThatCannotSplitRunWholeInTheFirstPass) {
  Tensor w = fromVector<float>({1, 2}).setRequiresGrad(true);
  Tensor y = fromVector<float>({5, 5});
  autograd::recordNode(std::make_shared<Doubling>(), {w}, {&y});
  WeightGradients later = backwardDeferringWeights({sum(y)}, {}, {w});
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().toVector<float>(), (std::vector<float>{2, 2}));
  EXPECT_EQ(later.pending(), 0u);
  later.run();
  EXPECT_EQ(w.grad().toVector<float>(), (std::vector<float>{2, 2}));
}

TEST(DeferredWeightGrad, RefusesANonLeafWeightByName) {
  Tensor w = fromVector<float>({1, 2}).setRequiresGrad(true);
  Tensor notLeaf = mul(w, 2.0);
  notLeaf.setName("doubled");
  expectThrowsWith<InvalidArgument>([&] { backwardDeferringWeights({sum(notLeaf)}, {}, {notLeaf}); },
                                    {"weight", "'doubled'", "is not a leaf", "MulBackward"});
}

TEST(DeferredWeightGrad, DroppedWithoutRunLeavesNoGradientAndFreesTheGraph) {
  Block block;
  std::weak_ptr<Node> node;
  {
    Tensor y = block.forward(input(4));
    node = y.gradFn();
    WeightGradients later = backwardDeferringWeights({sum(y)}, {}, block.params());
    EXPECT_GT(later.pending(), 0u);
  }
  EXPECT_TRUE(node.expired()) << "the deferred nodes outlived their WeightGradients";
  // The Linears' gradients are lost; the LayerNorm's came with the input gradients.
  const std::vector<Tensor> params = block.params();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i].grad().defined(), i >= 4) << "parameter " << i;
}

}  // namespace
}  // namespace dt
