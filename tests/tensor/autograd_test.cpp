// Autograd engine: ordering, hooks, callbacks, retain graph, in-place detection.
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "tensor/autograd/autograd.h"
#include "tensor/ops.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using testing::expectThrowsWith;

Tensor param(std::vector<float> v) { return fromVector<float>(v).setRequiresGrad(true); }

TEST(Autograd, SimpleChainAndAccumulation) {
  Tensor x = param({1, 2, 3});
  Tensor y = sum(mul(x, x));  // dy/dx = 2x
  y.backward();
  EXPECT_EQ(x.grad().toVector<float>(), (std::vector<float>{2, 4, 6}));
  // A second graph accumulates into .grad.
  sum(mul(x, 3.0)).backward();
  EXPECT_EQ(x.grad().toVector<float>(), (std::vector<float>{5, 7, 9}));
  EXPECT_TRUE(x.isLeaf());
  EXPECT_FALSE(y.isLeaf());
  EXPECT_EQ(y.gradFn()->name(), "SumBackward");
}

TEST(Autograd, DiamondRunsEachNodeOnceWithSummedGradient) {
  Tensor x = param({2});
  Tensor a = mul(x, 3.0);
  Tensor b = add(a, a);   // both edges into a's node
  Tensor c = mul(a, b);   // a used twice more
  sum(c).backward();      // c = 3x * 6x = 18x^2 -> 36x = 72
  EXPECT_FLOAT_EQ(x.grad().item<float>(), 72.0f);
}

TEST(Autograd, BackwardNeedsScalarOrGrad) {
  Tensor x = param({1, 2});
  Tensor y = mul(x, 2.0);
  expectThrowsWith<InvalidArgument>([&] { y.backward(); }, {"scalar outputs", "float32[2]"});
  y.backward(fromVector<float>({1, 10}));
  EXPECT_EQ(x.grad().toVector<float>(), (std::vector<float>{2, 20}));
  Tensor z = fromVector<float>({1});
  expectThrowsWith<InvalidArgument>([&] { z.backward(); }, {"does not require grad"});
}

TEST(Autograd, NoGradGuardAndDetach) {
  Tensor x = param({1, 2});
  {
    NoGradGuard ng;
    Tensor y = mul(x, 2.0);
    EXPECT_FALSE(y.requiresGrad());
  }
  Tensor d = x.detach();
  EXPECT_FALSE(d.requiresGrad());
  EXPECT_TRUE(d.storage().isSameAs(x.storage()));
  Tensor y = mul(d, x);
  sum(y).backward();
  EXPECT_EQ(x.grad().toVector<float>(), (std::vector<float>{1, 2}));
  expectThrowsWith<InvalidArgument>([] { fromVector<int64_t>({1}).setRequiresGrad(true); }, {"floating point"});
}

TEST(Autograd, RetainGraphAndSecondBackwardError) {
  Tensor x = param({3});
  Tensor y = sum(exp(x));
  y.backward(Tensor(), /*retainGraph=*/true);
  y.backward();
  EXPECT_NEAR(x.grad().item<float>(), 2 * std::exp(3.0f), 1e-3);
  expectThrowsWith<InvalidArgument>([&] { y.backward(); }, {"second time", "retainGraph"});
}

TEST(Autograd, RetainGradForNonLeaf) {
  Tensor x = param({1, 2});
  Tensor h = mul(x, 2.0);
  h.retainGrad();
  EXPECT_TRUE(h.retainsGrad());
  sum(mul(h, h)).backward();
  EXPECT_EQ(h.grad().toVector<float>(), (std::vector<float>{4, 8}));
  EXPECT_EQ(x.grad().toVector<float>(), (std::vector<float>{8, 16}));
}

TEST(Autograd, TensorHooksReplaceGradients) {
  Tensor x = param({1, 1});
  Tensor h = mul(x, 2.0);
  int calls = 0;
  h.registerHook([&](const Tensor& g) {
    ++calls;
    return mul(g, 10.0);
  });
  int leafCalls = 0;
  x.registerHook([&](const Tensor& g) {
    ++leafCalls;
    EXPECT_EQ(g.toVector<float>(), (std::vector<float>{20, 20}));
    return Tensor();  // keep
  });
  sum(h).backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(leafCalls, 1);
  EXPECT_EQ(x.grad().toVector<float>(), (std::vector<float>{20, 20}));
}

TEST(Autograd, PostAccumulateHooksRunInReverseOrderOnceEachAndCallbacksAfter) {
  // Three "layers": parameters are used in order w0, w1, w2, so their grads
  // are ready in reverse order; callbacks run after every hook.
  std::vector<Tensor> ws = {param({1}), param({2}), param({3})};
  std::vector<std::string> events;
  for (int i = 0; i < 3; ++i) {
    ws[i].registerPostAccumulateGradHook([&, i](Tensor& p) {
      events.push_back("hook" + std::to_string(i) + "=" + std::to_string(p.grad().item<float>()));
      if (i == 2) {
        queueCallback([&] {
          events.push_back("callback");
          queueCallback([&] { events.push_back("nested"); });
        });
      }
    });
  }
  Tensor h = fromVector<float>({1});
  for (auto& w : ws) h = mul(h, w);  // h = w0 * w1 * w2
  sum(h).backward();
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0], "hook2=2.000000");
  EXPECT_EQ(events[1], "hook1=3.000000");
  EXPECT_EQ(events[2], "hook0=6.000000");
  EXPECT_EQ(events[3], "callback");
  EXPECT_EQ(events[4], "nested");
  expectThrowsWith<InvalidArgument>([] { queueCallback([] {}); }, {"no backward pass"});
  expectThrowsWith<InvalidArgument>([&] { h.registerPostAccumulateGradHook([](Tensor&) {}); }, {"leaf"});
}

TEST(Autograd, RemoveHookAlsoRemovesPostAccumulateHooks) {
  Tensor x = param({1});
  int calls = 0;
  const int handle = x.registerPostAccumulateGradHook([&](Tensor&) { ++calls; });
  sum(mul(x, 2.0)).backward();
  EXPECT_EQ(calls, 1);
  x.removeHook(handle);
  sum(mul(x, 2.0)).backward();
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(x.autogradMeta()->postAccumulateHooks.empty());
}

TEST(Autograd, ThrowingCallbackPropagatesRunsTheOthersAndLeavesTheEngineClean) {
  Tensor x = param({1});
  std::vector<std::string> ran;
  bool fail = true;
  x.registerPostAccumulateGradHook([&](Tensor&) {
    queueCallback([&] {
      ran.push_back("first");
      if (fail) throw InvalidArgument("parameter 'x' got no gradient");
    });
    queueCallback([&] { ran.push_back("second"); });
  });
  expectThrowsWith<InvalidArgument>([&] { sum(mul(x, 2.0)).backward(); }, {"parameter 'x'"});
  EXPECT_EQ(ran, (std::vector<std::string>{"first", "second"}));
  EXPECT_FALSE(inBackward());
  expectThrowsWith<InvalidArgument>([] { queueCallback([] {}); }, {"no backward pass"});
  // The next backward is a fresh pass.
  fail = false;
  ran.clear();
  sum(mul(x, 2.0)).backward();
  EXPECT_EQ(ran, (std::vector<std::string>{"first", "second"}));
  EXPECT_EQ(x.grad().item<float>(), 4.0f);
}

// A node whose backward runs a second, inner backward pass, as activation
// checkpointing does when it recomputes a segment.
class InnerBackwardNode final : public Node {
 public:
  explicit InnerBackwardNode(std::function<void()> inner) : inner_(std::move(inner)) {}
  TensorList apply(TensorList&& grads) override {
    inner_();
    return {grads.at(0)};
  }
  std::string name() const override { return "InnerBackwardNode"; }

 private:
  std::function<void()> inner_;
};

TEST(Autograd, OutermostCallbacksWaitForTheWholeReentrantBackward) {
  Tensor x = param({1});
  Tensor w = param({3});
  std::vector<std::string> events;
  w.registerPostAccumulateGradHook([&](Tensor&) {
    events.push_back("w ready");
    queueCallback([&] { events.push_back("innermost callback"); });
    queueCallback([&] { events.push_back("outermost callback"); }, CallbackPass::Outermost);
  });
  auto node = std::make_shared<InnerBackwardNode>([&] {
    EnableGradGuard grad;
    sum(mul(w, 2.0)).backward();
    events.push_back("inner pass returned");
  });
  Tensor out = mul(x, 1.0).detach();
  autograd::recordNode(node, {x}, {&out});
  x.registerPostAccumulateGradHook([&](Tensor&) { events.push_back("x ready"); });
  sum(mul(out, 5.0)).backward();
  EXPECT_EQ(events, (std::vector<std::string>{"w ready", "innermost callback", "inner pass returned", "x ready",
                                              "outermost callback"}));
  EXPECT_EQ(w.grad().item<float>(), 2.0f);
  EXPECT_EQ(x.grad().item<float>(), 5.0f);
  EXPECT_FALSE(inBackward());
}

TEST(Autograd, HeldGradAccumulatorIsTheNodeOfEveryLaterGraph) {
  Tensor w = param({1, 2});
  std::shared_ptr<Node> held = autograd::gradAccumulator(w);
  for (int i = 0; i < 3; ++i) {
    Tensor y = mul(w, 2.0);
    ASSERT_GE(y.gradFn()->nextEdges().size(), 1u);
    EXPECT_EQ(y.gradFn()->nextEdges()[0].node, held) << "graph " << i;
  }
  EXPECT_EQ(autograd::gradAccumulator(w), held);
  expectThrowsWith<InvalidArgument>([&] { autograd::gradAccumulator(mul(w, 1.0)); }, {"not a leaf"});
  expectThrowsWith<InvalidArgument>([&] { autograd::gradAccumulator(fromVector<float>({1})); },
                                    {"does not require grad"});
}

TEST(Autograd, GradBufferIsReusedAfterSetToNoneWithoutAllocating) {
  Tensor w = param({1, 2, 3});
  Tensor bucket = zeros({5});
  Tensor view = bucket.narrow(0, 1, 3);
  autograd::setGradBuffer(w, view);
  std::vector<Tensor> params = {w};
  for (int step = 1; step <= 3; ++step) {
    zeroGrads(params, /*setToNone=*/true);
    EXPECT_FALSE(w.grad().defined());
    sum(mul(w, static_cast<double>(step))).backward();
    ASSERT_TRUE(w.grad().defined());
    EXPECT_EQ(w.grad().dataPtr(), view.dataPtr()) << "step " << step;
    EXPECT_EQ(bucket.toVector<float>(), (std::vector<float>{0, float(step), float(step), float(step), 0}));
  }
  // Without zeroing, accumulation adds into the same view.
  sum(mul(w, 10.0)).backward();
  EXPECT_EQ(bucket.toVector<float>(), (std::vector<float>{0, 13, 13, 13, 0}));
  zeroGrads(params, /*setToNone=*/false);
  EXPECT_EQ(bucket.toVector<float>(), (std::vector<float>{0, 0, 0, 0, 0}));
  autograd::setGradBuffer(w, Tensor());
  zeroGrads(params, true);
  sum(mul(w, 1.0)).backward();
  EXPECT_NE(w.grad().dataPtr(), view.dataPtr());
  expectThrowsWith<InvalidArgument>([&] { autograd::setGradBuffer(w, zeros({4})); }, {"does not match"});
}

TEST(Autograd, CallbackRunsOnBackwardThread) {
  Tensor x = param({1});
  std::thread::id ran;
  x.registerPostAccumulateGradHook([&](Tensor&) { queueCallback([&] { ran = std::this_thread::get_id(); }); });
  std::thread t([&] { sum(mul(x, 2.0)).backward(); });
  const auto id = t.get_id();
  t.join();
  EXPECT_EQ(ran, id);
}

TEST(Autograd, InplaceModificationOfSavedTensorIsDetected) {
  Tensor x = param({1, 2});
  Tensor a = mul(x, 1.0);
  a.setName("activations");
  Tensor y = mul(a, a);  // saves a
  add_(a, 1.0);          // version bump
  std::string msg = expectThrowsWith<InvalidArgument>(
      [&] { sum(y).backward(); },
      {"modified by an inplace operation", "MulBackward", "float32[2]", "activations", "version 1", "expected version 0"});
  EXPECT_FALSE(msg.empty());
}

TEST(Autograd, InplaceOnLeafRequiringGradIsRejected) {
  Tensor x = param({1, 2});
  expectThrowsWith<InvalidArgument>([&] { add_(x, 1.0); }, {"leaf Variable", "in-place"});
  {
    NoGradGuard ng;
    add_(x, 1.0);  // what optimizers do
  }
  EXPECT_EQ(x.toVector<float>(), (std::vector<float>{2, 3}));
}

TEST(Autograd, InplaceOnNonLeafKeepsGradientCorrect) {
  Tensor x = param({1, 2});
  Tensor y = mul(x, 3.0);
  mul_(y, fromVector<float>({2, 2}));
  relu_(y);
  sum(y).backward();
  EXPECT_EQ(x.grad().toVector<float>(), (std::vector<float>{6, 6}));
}

TEST(Autograd, GradientsFlowThroughDtypeConversions) {
  // float32 leaf used in float64 (and float16) math gets a float32 gradient.
  Tensor x = param({1.5f, -2.0f});
  Tensor y = sum(mul(x.to(DType::Float64), fromVector<double>({2.0, 4.0})));
  Tensor z = sum(mul(x.to(DType::Float16), 3.0).to(DType::Float32));
  add(y.to(DType::Float32), z).backward();
  EXPECT_EQ(x.grad().dtype(), DType::Float32);
  EXPECT_EQ(x.grad().toVector<float>(), (std::vector<float>{5, 7}));
}

TEST(Autograd, GradFunctionLeavesDotGradAlone) {
  Tensor x = param({1, 2});
  Tensor y = sum(mul(x, x));
  TensorList g = grad({y}, {x});
  EXPECT_EQ(g[0].toVector<float>(), (std::vector<float>{2, 4}));
  EXPECT_FALSE(x.grad().defined());
}

TEST(Autograd, AccumulateGradStealsFreshGradient) {
  // The first gradient of a parameter is adopted without a copy.
  Tensor w = fromVector<float>({1, 2, 3, 4}, {2, 2}).setRequiresGrad(true);
  Tensor x = fromVector<float>({1, 1}, {1, 2});
  sum(linear(x, w)).backward();
  EXPECT_EQ(w.grad().toVector<float>(), (std::vector<float>{1, 1, 1, 1}));
  EXPECT_EQ(w.grad().storage().useCount(), 1);
}

TEST(Autograd, IndependentGraphsOnSeveralThreadsAtOnce) {
  // Threads as ranks: each thread trains its own copy; kernels share the intra-op pool.
  auto run = [](std::vector<float>* out) {
    Generator g(5);
    Tensor w = randn({256, 256}, g).setRequiresGrad(true);
    Tensor x = randn({64, 256}, g);
    std::vector<std::string> order;
    w.registerPostAccumulateGradHook([&](Tensor&) { queueCallback([&] { order.push_back("callback"); }); });
    for (int step = 0; step < 3; ++step) {
      Tensor loss = mean(mul(relu(linear(x, w)), 2.0));
      loss.backward();
      NoGradGuard ng;
      addInPlace(w, w.grad(), -0.1);
      w.setGrad(Tensor());
    }
    EXPECT_EQ(order.size(), 3u);
    *out = w.toVector<float>();
  };
  std::vector<float> serial;
  run(&serial);
  std::vector<std::vector<float>> results(4);
  testing::runRanks(4, [&](int rank) { run(&results[rank]); });
  for (auto& r : results) EXPECT_EQ(r, serial);
}

}  // namespace
}  // namespace dt
