// Custom autograd functions: gradients against finite differences, a training
// step, the context's marks and checks, and the errors a wrong backward gets.
#include <cmath>
#include <limits>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "tensor/autograd/anomaly.h"
#include "tensor/autograd/function.h"
#include "tensor/autograd/gradcheck.h"
#include "tensor/ops.h"
#include "tensor/optim/optim.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using autograd::Function;
using autograd::FunctionContext;
using testing::expectThrowsWith;

template <typename T>
void softplusLoop(const Tensor& in, Tensor& out) {
  const T* x = in.data<T>();
  T* y = out.data<T>();
  for (int64_t i = 0; i < in.numel(); ++i) {
    y[i] = std::max(x[i], T(0)) + std::log1p(std::exp(-std::abs(x[i])));
  }
}

// The docs' example (docs/tensor.md): log(1 + exp(x)) in one pass that never overflows.
struct StableSoftplus : Function<StableSoftplus> {
  static constexpr std::string_view name = "StableSoftplus";

  static Tensor forward(FunctionContext& ctx, const Tensor& x) {
    Tensor in = x.contiguous();
    Tensor out = emptyLike(in);
    if (in.dtype() == DType::Float64) {
      softplusLoop<double>(in, out);
    } else {
      softplusLoop<float>(in, out);
    }
    ctx.saveForBackward(x);
    return out;
  }

  static Tensor backward(FunctionContext& ctx, const TensorList& gradOutputs) {
    const Tensor x = ctx.savedTensors()[0];
    return mul(gradOutputs[0], sigmoid(x));
  }
};

// alpha * x * y^power: two tensor inputs between plain values; counts the
// gradients it computes so the tests can see needsInputGrad at work.
struct ScaledProduct : Function<ScaledProduct> {
  static constexpr std::string_view name = "ScaledProduct";
  static inline int gradientsComputed = 0;

  static Tensor forward(FunctionContext& ctx, const Tensor& x, double alpha, const Tensor& y, int64_t power) {
    ctx.saveForBackward(x, y);
    ctx.set("alpha", alpha);
    ctx.set("power", power);
    return mul(mul(x, pow(y, static_cast<double>(power))), alpha);
  }

  static TensorList backward(FunctionContext& ctx, const TensorList& gradOutputs) {
    const TensorList saved = ctx.savedTensors();
    const Tensor& x = saved[0];
    const Tensor& y = saved[1];
    const double alpha = ctx.get<double>("alpha");
    const auto power = static_cast<double>(ctx.get<int64_t>("power"));
    const Tensor& g = gradOutputs[0];
    TensorList grads(2);
    if (ctx.needsInputGrad(0)) {
      grads[0] = mul(mul(g, pow(y, power)), alpha);
      ++gradientsComputed;
    }
    if (ctx.needsInputGrad(1)) {
      grads[1] = mul(mul(mul(g, x), pow(y, power - 1)), alpha * power);
      ++gradientsComputed;
    }
    return grads;
  }
};

// (a + b, a - b): two outputs; records whether a gradient came in materialized.
struct SumAndDifference : Function<SumAndDifference> {
  static inline Shape lastGradShape;
  static inline bool lastGradWasDefined = false;

  static std::tuple<Tensor, Tensor> forward(FunctionContext&, const Tensor& a, const Tensor& b) {
    return {add(a, b), sub(a, b)};
  }
  static TensorList backward(FunctionContext&, const TensorList& gradOutputs) {
    lastGradWasDefined = gradOutputs[1].defined();
    if (lastGradWasDefined) lastGradShape = gradOutputs[1].sizes();
    return {add(gradOutputs[0], gradOutputs[1]), sub(gradOutputs[0], gradOutputs[1])};
  }
};

Tensor param(std::vector<double> values) { return fromVector<double>(values).setRequiresGrad(true); }
Tensor paramF(std::vector<float> values) { return fromVector<float>(values).setRequiresGrad(true); }

TEST(Function, OneInputMatchesFiniteDifferences) {
  Generator gen(3);
  Tensor x = mul(randn({4, 3}, gen, DType::Float64), 4.0).setRequiresGrad(true);
  const GradcheckResult r = gradcheck([](const TensorList& in) { return StableSoftplus::apply(in[0]); }, {x});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(Function, TwoInputsWithPlainArgumentsMatchFiniteDifferences) {
  Generator gen(5);
  Tensor x = randn({3, 2}, gen, DType::Float64).setRequiresGrad(true);
  Tensor y = add(randn({3, 2}, gen, DType::Float64), 3.0).setRequiresGrad(true);  // away from 0 for y^(power-1)
  auto fn = [](const TensorList& in) { return ScaledProduct::apply(in[0], 0.5, in[1], int64_t{3}); };
  const GradcheckResult r = gradcheck(fn, {x, y});
  EXPECT_TRUE(r.ok) << r.message;

  // Non-contiguous input.
  Tensor xt = randn({2, 3}, gen, DType::Float64).transpose(0, 1).setRequiresGrad(true);
  const GradcheckResult rt = gradcheck(fn, {xt, y});
  EXPECT_TRUE(rt.ok) << rt.message;
}

TEST(Function, NeedsInputGradFollowsTheInputs) {
  Tensor x = param({1, 2});
  Tensor y = fromVector<double>({3, 4});  // no grad: backward need not compute its gradient
  ScaledProduct::gradientsComputed = 0;
  Tensor out = ScaledProduct::apply(x, 2.0, y, int64_t{2});
  sum(out).backward();
  EXPECT_EQ(ScaledProduct::gradientsComputed, 1);
  EXPECT_EQ(x.grad().toVector<double>(), (std::vector<double>{18, 32}));  // 2 * y^2
  EXPECT_FALSE(y.grad().defined());
}

TEST(Function, SeveralOutputsAndMaterializedZeroGradients) {
  Tensor a = param({1, 2, 3});
  Tensor b = param({10, 20, 30});
  auto [s, d] = SumAndDifference::apply(a, b);
  EXPECT_EQ(s.toVector<double>(), (std::vector<double>{11, 22, 33}));
  EXPECT_EQ(d.toVector<double>(), (std::vector<double>{-9, -18, -27}));
  ASSERT_NE(s.gradFn(), nullptr);
  EXPECT_EQ(s.gradFn(), d.gradFn());
  EXPECT_EQ(s.gradFn()->name(), std::string(Function<SumAndDifference>::functionName()) + "Backward");

  // Only s reaches the loss: d's gradient arrives as zeros of d's shape.
  sum(s).backward();
  EXPECT_TRUE(SumAndDifference::lastGradWasDefined);
  EXPECT_EQ(SumAndDifference::lastGradShape, (Shape{3}));
  EXPECT_EQ(a.grad().toVector<double>(), (std::vector<double>{1, 1, 1}));
  EXPECT_EQ(b.grad().toVector<double>(), (std::vector<double>{1, 1, 1}));

  const GradcheckResult r = gradcheck(
      [](const TensorList& in) {
        auto [sum, difference] = SumAndDifference::apply(in[0], in[1]);
        return mul(sum, difference);
      },
      {a, b});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(Function, DefaultNameIsTheTypeName) {
  const std::string fn = Function<SumAndDifference>::functionName();
  EXPECT_NE(fn.find("SumAndDifference"), std::string::npos) << fn;
  EXPECT_EQ(Function<StableSoftplus>::functionName(), "StableSoftplus");
}

// A tiny regression model whose hidden activation is the custom softplus, and
// its twin built from log(1 + exp(.)) with the same weights.
struct TinyModel {
  Tensor w1, b1, w2, b2;
  explicit TinyModel(Generator& gen)
      : w1(mul(randn({8, 4}, gen), 0.5).setRequiresGrad(true)),
        b1(zeros({8}).setRequiresGrad(true)),
        w2(mul(randn({1, 8}, gen), 0.5).setRequiresGrad(true)),
        b2(zeros({1}).setRequiresGrad(true)) {}
  TensorList parameters() const { return {w1, b1, w2, b2}; }
  Tensor forward(const Tensor& x, bool builtIn) const {
    Tensor h = linear(x, w1, b1);
    Tensor a = builtIn ? log(add(exp(h), 1.0)) : StableSoftplus::apply(h);
    return linear(a, w2, b2);
  }
};

TEST(Function, TrainsAndMatchesTheBuiltInComposition) {
  Generator gen(7);
  Tensor x = randn({32, 4}, gen);
  Tensor target = sum(mul(x, x), {1}, true);  // a smooth target a softplus layer can fit
  TinyModel model(gen);

  // Same weights, gradients from the built-in composition.
  TinyModel twin = model;
  {
    NoGradGuard noGrad;
    twin.w1 = model.w1.clone().setRequiresGrad(true);
    twin.b1 = model.b1.clone().setRequiresGrad(true);
    twin.w2 = model.w2.clone().setRequiresGrad(true);
    twin.b2 = model.b2.clone().setRequiresGrad(true);
  }
  mseLoss(model.forward(x, false), target).backward();
  mseLoss(twin.forward(x, true), target).backward();
  const TensorList ours = model.parameters();
  const TensorList theirs = twin.parameters();
  for (size_t i = 0; i < ours.size(); ++i) {
    const std::vector<float> g = ours[i].grad().toVector<float>();
    const std::vector<float> want = theirs[i].grad().toVector<float>();
    ASSERT_EQ(g.size(), want.size());
    for (size_t k = 0; k < g.size(); ++k) EXPECT_NEAR(g[k], want[k], 1e-4 * (1 + std::abs(want[k]))) << i << "/" << k;
  }

  std::vector<Tensor> params = model.parameters();
  optim::SGD sgd(params, {0.02});
  double first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    sgd.zeroGrad();
    Tensor loss = mseLoss(model.forward(x, false), target);
    loss.backward();
    sgd.step();
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  EXPECT_LT(last, 0.5 * first) << "first loss " << first << ", last " << last;
}

TEST(Function, StableSoftplusAtLargeMagnitudes) {
  for (DType dtype : {DType::Float32, DType::Float64}) {
    Tensor x = fromVector<double>({-100, 100}, {2}, dtype).setRequiresGrad(true);
    Tensor y = StableSoftplus::apply(x);
    sum(y).backward();
    const std::vector<double> values = y.to(DType::Float64).toVector<double>();
    const std::vector<double> grads = x.grad().to(DType::Float64).toVector<double>();
    SCOPED_TRACE(std::string(toString(dtype)));
    for (double v : values) EXPECT_TRUE(std::isfinite(v)) << v;
    for (double g : grads) EXPECT_TRUE(std::isfinite(g)) << g;
    // softplus(-100) = log1p(e^-100) ~ e^-100 = 3.7e-44 (0 or a subnormal in float32); softplus(100) = 100.
    EXPECT_NEAR(values[0], 0.0, 1e-40);
    EXPECT_DOUBLE_EQ(values[1], 100.0);
    EXPECT_NEAR(grads[0], 0.0, 1e-40);
    EXPECT_DOUBLE_EQ(grads[1], 1.0);
    if (dtype == DType::Float64) {
      EXPECT_NEAR(values[0] / std::exp(-100.0), 1.0, 1e-12);
    }
  }
  // The naive composition overflows where the fused one does not.
  Tensor naive = log(add(exp(fromVector<float>({100})), 1.0));
  EXPECT_TRUE(std::isinf(naive.item<float>()));

  Tensor wide = param({-100, -30, -1, 0, 1, 30, 100});
  const GradcheckResult r = gradcheck([](const TensorList& in) { return StableSoftplus::apply(in[0]); }, {wide});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(Function, SavedTensorModifiedInPlaceIsCaught) {
  Tensor x = paramF({1, 2, 3});
  Tensor h = mul(x, 2.0);
  h.setName("hidden");
  Tensor y = StableSoftplus::apply(h);
  h.mul_(3.0);  // recorded in-place op on a non-leaf: allowed, but y's saved h is now stale
  expectThrowsWith<InvalidArgument>([&] { sum(y).backward(); },
                                    {"modified by an inplace operation", "named 'hidden'", "StableSoftplusBackward",
                                     "is at version 1; expected version 0"});
}

struct ValueAndMask : Function<ValueAndMask> {
  static constexpr std::string_view name = "ValueAndMask";
  static TensorList forward(FunctionContext& ctx, const Tensor& x) {
    Tensor value = mul(x, 2.0);
    Tensor mask = gt(x, 0.0).to(x.dtype());
    Tensor index = argmax(x);
    ctx.markNonDifferentiable(mask);
    return {value, mask, index};
  }
  static Tensor backward(FunctionContext&, const TensorList& gradOutputs) { return mul(gradOutputs[0], 2.0); }
};

TEST(Function, NonDifferentiableOutputsHaveNoHistory) {
  Tensor x = paramF({-1, 2, 3});
  TensorList out = ValueAndMask::apply(x);
  ASSERT_EQ(out.size(), 3u);
  ASSERT_NE(out[0].gradFn(), nullptr);
  EXPECT_EQ(out[0].gradFn()->name(), "ValueAndMaskBackward");
  EXPECT_EQ(out[1].gradFn(), nullptr);
  EXPECT_FALSE(out[1].requiresGrad());
  EXPECT_EQ(out[1].toVector<float>(), (std::vector<float>{0, 1, 1}));
  EXPECT_EQ(out[2].gradFn(), nullptr);  // int64: never differentiable
  EXPECT_FALSE(out[2].requiresGrad());
  sum(out[0]).backward();
  EXPECT_EQ(x.grad().toVector<float>(), (std::vector<float>{2, 2, 2}));
}

// x *= alpha in place, the PyTorch way: modify, mark dirty, return the input.
struct ScaleInPlace : Function<ScaleInPlace> {
  static constexpr std::string_view name = "ScaleInPlace";
  static Tensor forward(FunctionContext& ctx, Tensor x, double alpha) {
    x.mul_(alpha);
    ctx.markDirty(x);
    ctx.set("alpha", alpha);
    return x;
  }
  static Tensor backward(FunctionContext& ctx, const TensorList& gradOutputs) {
    return mul(gradOutputs[0], ctx.get<double>("alpha"));
  }
};

TEST(Function, DirtyInputBecomesAnOutputOfTheNode) {
  Tensor a = paramF({1, 2});
  Tensor h = mul(a, 1.0);
  const uint32_t before = h.version();
  Tensor out = ScaleInPlace::apply(h, 3.0);
  EXPECT_TRUE(out.isSameAs(h));
  EXPECT_GT(h.version(), before);
  ASSERT_NE(h.gradFn(), nullptr);
  EXPECT_EQ(h.gradFn()->name(), "ScaleInPlaceBackward");
  EXPECT_EQ(h.toVector<float>(), (std::vector<float>{3, 6}));
  sum(mul(h, h)).backward();  // d/da (3a)^2 = 18a
  EXPECT_EQ(a.grad().toVector<float>(), (std::vector<float>{18, 36}));

  // A tensor some op saved before the in-place change is caught as with built-in in-place ops.
  Tensor b = paramF({1, 2});
  Tensor g = mul(b, 1.0);
  Tensor z = mul(g, g);
  ScaleInPlace::apply(g, 2.0);
  expectThrowsWith<InvalidArgument>([&] { sum(z).backward(); }, {"modified by an inplace operation", "MulBackward"});

  // Leaves that require grad are refused, as by built-in in-place ops.
  Tensor leaf = paramF({1});
  expectThrowsWith<InvalidArgument>([&] { ScaleInPlace::apply(leaf, 2.0); },
                                    {"ScaleInPlace", "leaf Variable", "float32[1]", "NoGradGuard"});
  // Under NoGradGuard it is a plain in-place update (an optimizer's step).
  Tensor weight = paramF({1});
  const uint32_t weightVersion = weight.version();
  {
    NoGradGuard noGrad;
    ScaleInPlace::apply(weight, 2.0);
  }
  EXPECT_EQ(weight.item<float>(), 2.0f);
  EXPECT_TRUE(weight.isLeaf());
  EXPECT_GT(weight.version(), weightVersion);
}

struct DirtyButNotReturned : Function<DirtyButNotReturned> {
  static constexpr std::string_view name = "DirtyButNotReturned";
  static Tensor forward(FunctionContext& ctx, Tensor x) {
    x.mul_(2.0);
    ctx.markDirty(x);
    return mul(x, 1.0);
  }
  static Tensor backward(FunctionContext&, const TensorList& gradOutputs) { return gradOutputs[0]; }
};

TEST(Function, MarksMustNameInputsAndOutputs) {
  Tensor h = mul(paramF({1}), 1.0);
  expectThrowsWith<InvalidArgument>([&] { DirtyButNotReturned::apply(h); },
                                    {"DirtyButNotReturned", "tensor input 0 (float32[1])", "marked dirty",
                                     "must be returned"});
}

// The same forward with a backward that is wrong in one of two ways.
enum class Mistake { TooFewGradients, WrongShape };
struct FaultyBackward : Function<FaultyBackward> {
  static constexpr std::string_view name = "FaultyBackward";
  static Tensor forward(FunctionContext& ctx, const Tensor& x, const Tensor& y, Mistake mistake) {
    ctx.set("mistake", mistake);
    return add(x, sum(y));
  }
  static TensorList backward(FunctionContext& ctx, const TensorList& gradOutputs) {
    if (ctx.get<Mistake>("mistake") == Mistake::TooFewGradients) return {gradOutputs[0]};
    return {gradOutputs[0], gradOutputs[0]};  // y is [2, 2], the gradient [3]
  }
};

TEST(Function, WrongGradientsFromBackwardAreClearErrors) {
  Tensor x = paramF({1, 2, 3});
  Tensor y = fromVector<float>({1, 2, 3, 4}, {2, 2}).setRequiresGrad(true);
  Tensor few = FaultyBackward::apply(x, y, Mistake::TooFewGradients);
  expectThrowsWith<InvalidArgument>([&] { sum(few).backward(); },
                                    {"FaultyBackward.backward returned 1 gradient(s)", "2 tensor input(s)"});
  Tensor badShape = FaultyBackward::apply(x, y, Mistake::WrongShape);
  expectThrowsWith<InvalidArgument>([&] { sum(badShape).backward(); },
                                    {"FaultyBackward.backward", "tensor input 1", "shape [3]", "shape [2, 2]"});
}

TEST(Function, ContextValuesNameTheKeyAndTypes) {
  FunctionContext ctx("Probe", {true});
  ctx.set("alpha", 0.5);
  ctx.set("label", "relu");
  EXPECT_EQ(ctx.get<double>("alpha"), 0.5);
  EXPECT_EQ(ctx.get<std::string>("label"), "relu");
  EXPECT_TRUE(ctx.has("alpha"));
  expectThrowsWith<InvalidArgument>([&] { ctx.get<float>("alpha"); }, {"Probe", "'alpha'", "double", "float"});
  expectThrowsWith<InvalidArgument>([&] { ctx.get<double>("beta"); }, {"Probe", "'beta'", "alpha, label"});
  expectThrowsWith<InvalidArgument>([&] { ctx.savedTensors(); }, {"Probe", "savedTensors() is for backward"});
  expectThrowsWith<InvalidArgument>([&] { ctx.needsInputGrad(1); }, {"Probe", "needsInputGrad(1)", "1 tensor input"});
}

TEST(Function, RecordsOnlyWhenAnInputRequiresGrad) {
  Tensor plain = fromVector<float>({1, 2});
  Tensor y = StableSoftplus::apply(plain);
  EXPECT_EQ(y.gradFn(), nullptr);
  EXPECT_FALSE(y.requiresGrad());

  Tensor x = paramF({1, 2});
  {
    NoGradGuard noGrad;
    EXPECT_EQ(StableSoftplus::apply(x).gradFn(), nullptr);
  }
  // The ops inside forward record nothing: the node is the function's own.
  Tensor z = ScaledProduct::apply(x, 2.0, x, int64_t{1});
  ASSERT_NE(z.gradFn(), nullptr);
  EXPECT_EQ(z.gradFn()->name(), "ScaledProductBackward");
  EXPECT_EQ(z.gradFn()->nextEdges().size(), 2u);
  EXPECT_EQ(z.gradFn()->nextEdges()[0].node, z.gradFn()->nextEdges()[1].node);  // both are x's accumulator
}

struct Identity : Function<Identity> {
  static constexpr std::string_view name = "Identity";
  static Tensor forward(FunctionContext&, const Tensor& x) { return x; }
  static Tensor backward(FunctionContext&, const TensorList& gradOutputs) { return gradOutputs[0]; }
};

TEST(Function, ReturnedInputIsANewHandleWithTheNodesHistory) {
  Tensor x = paramF({1, 2});
  Tensor y = Identity::apply(x);
  EXPECT_FALSE(y.isSameAs(x));
  EXPECT_EQ(y.dataPtr(), x.dataPtr());
  EXPECT_TRUE(x.isLeaf());
  ASSERT_NE(y.gradFn(), nullptr);
  EXPECT_EQ(y.gradFn()->name(), "IdentityBackward");
  sum(mul(y, 5.0)).backward();
  EXPECT_EQ(x.grad().toVector<float>(), (std::vector<float>{5, 5}));
}

TEST(Function, SecondBackwardWithoutRetainGraphSaysSo) {
  Tensor x = paramF({1, 2});
  Tensor y = sum(StableSoftplus::apply(x));
  y.backward({}, true);
  y.backward();  // the graph was retained once
  expectThrowsWith<InvalidArgument>([&] { y.backward(); }, {"second time", "retainGraph"});
}

// sqrt by a raw loop (float32 only); its backward divides by the output, so x = 0 gives inf.
struct CustomSqrt : Function<CustomSqrt> {
  static constexpr std::string_view name = "CustomSqrt";
  static Tensor forward(FunctionContext& ctx, const Tensor& x) {
    Tensor in = x.contiguous();
    Tensor out = emptyLike(in);
    const float* src = in.data<float>();
    float* dst = out.data<float>();
    for (int64_t i = 0; i < in.numel(); ++i) dst[i] = std::sqrt(src[i]);
    ctx.saveForBackward(out);
    return out;
  }
  static Tensor backward(FunctionContext& ctx, const TensorList& gradOutputs) {
    return div(mul(gradOutputs[0], 0.5), ctx.savedTensors()[0]);
  }
};

TEST(Function, AnomalyModeNamesTheFunction) {
  Tensor x = paramF({0, 1, 4});
  AnomalyMode anomaly;
  Tensor y = CustomSqrt::apply(x);
  expectThrowsWith<AnomalyError>([&] { sum(y).backward(); },
                                 {"CustomSqrtBackward returned inf", "in gradient 0", "of CustomSqrt(float32[3])",
                                  "CustomSqrtBackward itself produced the inf"});

  AnomalyMode forwardCheck(AnomalyOptions{true, true});
  expectThrowsWith<AnomalyError>([&] { CustomSqrt::apply(paramF({1, -1})); },
                                 {"forward check", "CustomSqrt(float32[2]) outside any module", "returned nan",
                                  "from finite inputs"});
}

}  // namespace
}  // namespace dt
