// The GPT workload's tensor pieces: attention against the composed ops, the float32 fast
// kernels against float64 references, the model's structure and initialisation, sampling,
// gradient clipping, the learning-rate schedule and AdamW's decay groups.
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "tensor/nn/clip_grad.h"
#include "tensor/nn/gpt.h"
#include "tensor/optim/optim.h"
#include "tensor/optim/schedule.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using testing::expectThrowsWith;

bool equalBits(const Tensor& a, const Tensor& b) { return a.toVector<double>() == b.toVector<double>(); }

double maxAbs(const Tensor& a, const Tensor& b) {
  const auto x = a.toVector<double>(), y = b.toVector<double>();
  EXPECT_EQ(x.size(), y.size());
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(x[i] - y[i]));
  return m;
}

// softmax(q k^T * scale + mask) v from the plain ops.
Tensor composedAttention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.sizes().back()));
  Tensor s = mul(matmul(q, k.transpose(-2, -1)), scale);
  if (causal) {
    const int64_t t = q.sizes()[q.dim() - 2];
    std::vector<uint8_t> keep(static_cast<size_t>(t * t));
    for (int64_t i = 0; i < t; ++i) {
      for (int64_t j = 0; j <= i; ++j) keep[i * t + j] = 1;
    }
    Tensor mask = fromVector<bool>(std::vector<bool>(keep.begin(), keep.end()), {t, t});
    s = where(mask, s, full({t, t}, -std::numeric_limits<double>::infinity(), s.dtype()));
  }
  return matmul(softmax(s, -1), v);
}

TEST(Attention, MatchesTheComposedOpsForwardAndBackward) {
  for (DType dt : {DType::Float64, DType::Float32}) {
    for (bool causal : {true, false}) {
      Generator g(3);
      // 70 rows: three causal row blocks of the kernel, the last one short.
      Tensor q = randn({2, 3, 70, 8}, g, dt).setRequiresGrad(true);
      Tensor k = randn({2, 3, 70, 8}, g, dt).setRequiresGrad(true);
      Tensor v = randn({2, 3, 70, 5}, g, dt).setRequiresGrad(true);
      Tensor w = randn({2, 3, 70, 5}, g, dt);
      const double tol = dt == DType::Float64 ? 1e-12 : 2e-5;
      Tensor fused = scaledDotProductAttention(q, k, v, {.causal = causal});
      sum(mul(fused, w)).backward();
      const Tensor gq = q.grad(), gk = k.grad(), gv = v.grad();
      for (Tensor* t : {&q, &k, &v}) t->setGrad(Tensor());
      Tensor reference = composedAttention(q, k, v, causal);
      sum(mul(reference, w)).backward();
      EXPECT_LT(maxAbs(fused, reference), tol) << dt << " causal " << causal;
      EXPECT_LT(maxAbs(gq, q.grad()), tol * 10);
      EXPECT_LT(maxAbs(gk, k.grad()), tol * 10);
      EXPECT_LT(maxAbs(gv, v.grad()), tol * 10);
    }
  }
}

TEST(Attention, SelfAttentionIsSplitHeadsThenAttentionThenMerge) {
  Generator g(4);
  const int64_t b = 2, t = 40, c = 12, h = 3;
  Tensor qkv = randn({b, t, 3 * c}, g, DType::Float64).setRequiresGrad(true);
  Tensor w = randn({b, t, c}, g, DType::Float64);
  Tensor fused = selfAttention(qkv, h);
  sum(mul(fused, w)).backward();
  const Tensor fusedGrad = qkv.grad();
  qkv.setGrad(Tensor());
  auto heads = [&](int64_t third) { return qkv.narrow(2, third * c, c).reshape({b, t, h, c / h}).transpose(1, 2); };
  Tensor merged = composedAttention(heads(0), heads(1), heads(2), true).transpose(1, 2).reshape({b, t, c});
  sum(mul(merged, w)).backward();
  EXPECT_LT(maxAbs(fused, merged), 1e-12);
  EXPECT_LT(maxAbs(fusedGrad, qkv.grad()), 1e-11);
}

TEST(Attention, RejectsBadShapesAndOptionsWithTheirValues) {
  const Tensor q = zeros({2, 4, 8}), k = zeros({2, 5, 8});
  expectThrowsWith<InvalidArgument>([&] { scaledDotProductAttention(q, k, k); }, {"causal", "[2, 5, 8]"});
  expectThrowsWith<InvalidArgument>([&] { scaledDotProductAttention(q, zeros({2, 4, 7}), q); }, {"do not fit"});
  expectThrowsWith<InvalidArgument>([&] { selfAttention(zeros({1, 4, 10}), 2); }, {"2 heads", "[1, 4, 10]"});
  expectThrowsWith<InvalidArgument>([&] { selfAttention(zeros({1, 4, 12}), 2, {.dropoutP = 1.0}); }, {"dropout", "1"});
}

TEST(FastKernels, Float32MatchesFloat64References) {
  Generator g(5);
  // GELU over [-8, 8] and its derivative (the erf polynomial is good to 1.5e-7).
  Tensor x = mul(sub(rand({4099}, g, DType::Float64), 0.5), 16.0);
  Tensor x32 = x.to(DType::Float32).setRequiresGrad(true);
  Tensor x64 = x.detach().setRequiresGrad(true);
  Tensor up = randn({4099}, g, DType::Float64);
  sum(mul(gelu(x32), up.to(DType::Float32))).backward();
  sum(mul(gelu(x64), up)).backward();
  EXPECT_LT(maxAbs(gelu(x32).detach(), gelu(x64).detach()), 2e-6);
  EXPECT_LT(maxAbs(x32.grad(), x64.grad()), 2e-5);

  // Softmax and log-softmax rows, a row with large magnitudes, and their backward.
  Tensor s = mul(randn({37, 300}, g, DType::Float64), 6.0);
  Tensor s32 = s.to(DType::Float32).setRequiresGrad(true), s64 = s.detach().setRequiresGrad(true);
  Tensor w = randn({37, 300}, g, DType::Float64);
  sum(mul(softmax(s32, -1), w.to(DType::Float32))).backward();
  sum(mul(softmax(s64, -1), w)).backward();
  EXPECT_LT(maxAbs(softmax(s32, -1), softmax(s64, -1)), 1e-6);
  EXPECT_LT(maxAbs(logSoftmax(s32, 1), logSoftmax(s64, 1)), 2e-5);
  EXPECT_LT(maxAbs(s32.grad(), s64.grad()), 1e-5);

  // Cross-entropy's gradient (exp of the saved log-probabilities).
  Tensor logits = randn({64, 256}, g, DType::Float64);
  Tensor target = randint(0, 256, {64}, g);
  Tensor l32 = logits.to(DType::Float32).setRequiresGrad(true), l64 = logits.detach().setRequiresGrad(true);
  crossEntropy(l32, target, {.labelSmoothing = 0.1}).backward();
  crossEntropy(l64, target, {.labelSmoothing = 0.1}).backward();
  EXPECT_LT(maxAbs(l32.grad(), l64.grad()), 1e-7);

  // Layer norm with affine parameters: outputs and all three gradients.
  Tensor a = add(mul(randn({300, 257}, g, DType::Float64), 3.0), 1.5);
  Tensor wt = randn({257}, g, DType::Float64), bs = randn({257}, g, DType::Float64);
  Tensor up2 = randn({300, 257}, g, DType::Float64);
  auto run = [&](DType dt) {
    Tensor xa = a.to(dt).setRequiresGrad(true), wa = wt.to(dt).setRequiresGrad(true), ba = bs.to(dt).setRequiresGrad(true);
    Tensor y = layerNorm(xa, {257}, wa, ba);
    sum(mul(y, up2.to(dt))).backward();
    return std::vector<Tensor>{y.detach(), xa.grad(), wa.grad(), ba.grad()};
  };
  const auto r32 = run(DType::Float32), r64 = run(DType::Float64);
  EXPECT_LT(maxAbs(r32[0], r64[0]), 2e-5);
  EXPECT_LT(maxAbs(r32[1], r64[1]), 2e-5);
  EXPECT_LT(maxAbs(r32[2], r64[2]), 1e-3);  // sums over 300 rows
  EXPECT_LT(maxAbs(r32[3], r64[3]), 1e-3);
}

nn::GptConfig tiny() { return {.vocabSize = 256, .contextLength = 16, .layers = 2, .heads = 2, .width = 16}; }

TEST(Gpt, ParametersAreNamedLikeGpt2AndTheTiedWeightIsListedOnce) {
  Generator g(0);
  nn::Gpt model(tiny(), g);
  std::vector<std::string> names;
  int64_t count = 0;
  for (const auto& [name, p] : model.namedParameters()) {
    names.push_back(name);
    count += p.numel();
  }
  const std::vector<std::string> expectedStart{"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.ln_1.bias",
                                               "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias",
                                               "h.0.attn.c_proj.weight", "h.0.attn.c_proj.bias",
                                               "h.0.ln_2.weight", "h.0.ln_2.bias", "h.0.mlp.c_fc.weight",
                                               "h.0.mlp.c_fc.bias", "h.0.mlp.c_proj.weight", "h.0.mlp.c_proj.bias"};
  ASSERT_GE(names.size(), expectedStart.size());
  EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + 14), expectedStart);
  EXPECT_EQ(names.back(), "ln_f.bias");
  EXPECT_EQ(names.size(), 2u + 2 * 12 + 2);
  EXPECT_EQ(count, tiny().parameterCount());
  Tensor logits = model(randint(0, 256, {3, 16}, g));
  EXPECT_EQ(logits.sizes(), (Shape{3, 16, 256}));
  expectThrowsWith<InvalidArgument>([&] { model(zeros({1, 17}, DType::Int64)); }, {"17 tokens", "context length is 16"});
}

// What tensor parallelism builds on: a child put in another's place keeps every name and the
// registration order, runs in that place through Module, and the typed handle follows it (null
// for another type); the tied output layer follows wte; to(DType) converts the model in place.
TEST(Gpt, AReplacedChildKeepsNamesAndOrderAndRunsInItsPlace) {
  // c_fc doubled: a module of another type with the same parameters.
  struct DoubledLinear : nn::Module {
    explicit DoubledLinear(const nn::Linear& from) {
      weight = registerParameter("weight", from.weight.detach().clone());
      bias = registerParameter("bias", from.bias.detach().clone());
    }
    Tensor forward(const Tensor& x) override { return mul(linear(x, weight, bias), 2.0); }
    Tensor weight, bias;
  };
  Generator g(0);
  nn::Gpt model(tiny(), g);
  std::vector<std::string> before;
  for (const auto& [name, p] : model.namedParameters()) before.push_back(name);
  auto& block = dynamic_cast<nn::TransformerBlock&>(*model.h->child("0"));
  const auto replacement = std::make_shared<DoubledLinear>(*block.mlp->c_fc);
  const auto old = block.mlp->replaceChild("c_fc", replacement);
  EXPECT_EQ(block.mlp->c_fc, nullptr) << "the typed handle of a child of another type";
  EXPECT_NE(old, nullptr);
  std::vector<std::string> after;
  for (const auto& [name, p] : model.namedParameters()) after.push_back(name);
  EXPECT_EQ(after, before);
  EXPECT_TRUE(model.namedParameters()[10].second.isSameAs(replacement->weight));
  Generator data(1);
  const Tensor tokens = randint(0, 256, {2, 16}, data);
  // The replacement runs in c_fc's place: the model equals a plain one whose c_fc is doubled.
  Generator again(0);
  nn::Gpt reference(tiny(), again);
  auto& doubledBlock = dynamic_cast<nn::TransformerBlock&>(*reference.h->child("0"));
  EXPECT_GT(maxAbs(model(tokens), reference(tokens)), 1e-3);
  {
    NoGradGuard noGrad;
    for (Tensor t : {doubledBlock.mlp->c_fc->weight, doubledBlock.mlp->c_fc->bias}) t.copy_(mul(t, 2.0));
  }
  EXPECT_TRUE(equalBits(model(tokens), reference(tokens)));
  // The same type: the typed handle follows; wte's table is the output layer's weight.
  const auto table = std::make_shared<nn::Embedding>(256, 16, data);
  model.replaceChild("wte", table);
  EXPECT_EQ(model.wte, table);
  {
    NoGradGuard noGrad;
    Tensor t = table->weight;
    t.zero_();
  }
  EXPECT_EQ(max(abs(model(tokens))).item<double>(), 0.0) << "the tied output layer still uses the old table";
  expectThrowsWith<InvalidArgument>([&] { model.replaceChild("nothing", table); }, {"no submodule named \"nothing\""});
  // A table without "weight" is refused and the old one stays.
  expectThrowsWith<InvalidArgument>([&] { model.replaceChild("wte", std::make_shared<nn::GELU>()); },
                                    {"replacement for wte (GELU) has no parameter \"weight\""});
  EXPECT_EQ(model.child("wte"), table);
  model.to(DType::Float64);
  EXPECT_EQ(model(tokens).dtype(), DType::Float64);
  EXPECT_EQ(table->weight.dtype(), DType::Float64) << "converted in place";
}

TEST(Gpt, InitialisesLikeGpt2) {
  Generator g(1);
  const nn::GptConfig config{.vocabSize = 256, .contextLength = 64, .layers = 8, .heads = 4, .width = 128};
  nn::Gpt model(config, g);
  auto stdOf = [](const Tensor& t) {
    const auto v = t.toVector<double>();
    double s = 0, s2 = 0;
    for (double x : v) s += x, s2 += x * x;
    const double mean = s / static_cast<double>(v.size());
    return std::sqrt(s2 / static_cast<double>(v.size()) - mean * mean);
  };
  const auto params = model.namedParameters();
  std::map<std::string, Tensor> byName(params.begin(), params.end());
  EXPECT_NEAR(stdOf(byName.at("wte.weight")), 0.02, 0.001);
  EXPECT_NEAR(stdOf(byName.at("h.3.attn.c_attn.weight")), 0.02, 0.001);
  EXPECT_NEAR(stdOf(byName.at("h.3.mlp.c_proj.weight")), 0.02 / std::sqrt(16.0), 0.0005);
  EXPECT_NEAR(stdOf(byName.at("h.3.attn.c_proj.weight")), 0.02 / std::sqrt(16.0), 0.0005);
  EXPECT_EQ(sum(abs(byName.at("h.3.mlp.c_fc.bias"))).item<double>(), 0.0);
  EXPECT_EQ(byName.at("h.3.ln_2.weight").toVector<float>(), std::vector<float>(128, 1.0f));
  // A seed gives the same model.
  Generator again(1);
  nn::Gpt twin(config, again);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(equalBits(params[i].second, twin.namedParameters()[i].second));
}

TEST(Gpt, TheTiedWeightAccumulatesBothUsesInOneHookCall) {
  Generator g(2);
  nn::Gpt model(tiny(), g);
  int hookCalls = 0;
  model.wte->weight.registerPostAccumulateGradHook([&](Tensor&) { ++hookCalls; });
  // Tokens 0..9 only: rows 10.. of wte get gradient from the output layer alone.
  std::vector<int64_t> ids(32);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i % 10);
  Tensor tokens = fromVector<int64_t>(ids, {2, 16});
  nn::Gpt::loss(model(tokens), tokens).backward();
  EXPECT_EQ(hookCalls, 1);
  const Tensor grad = model.wte->weight.grad();
  EXPECT_GT(sum(abs(grad.narrow(0, 100, 1))).item<double>(), 0.0);  // the output layer's use
  // The embedding's use: an untied copy of the rows 0..9 changes them.
  EXPECT_GT(sum(abs(grad.narrow(0, 0, 10))).item<double>(), sum(abs(grad.narrow(0, 100, 10))).item<double>());
}

TEST(Sampling, TemperatureZeroIsArgmaxAndTopKKeepsTheLikeliest) {
  const Tensor logits = fromVector<float>({0.1f, 2.0f, 1.9f, -1.0f, 2.0f});
  Generator g(9);
  EXPECT_EQ(nn::sampleToken(logits, {.temperature = 0.0}, g), 1);  // ties: the lower token
  std::map<int64_t, int> seen;
  for (int i = 0; i < 3000; ++i) ++seen[nn::sampleToken(logits, {.temperature = 1.0, .topK = 2}, g)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_NEAR(seen[1] / 3000.0, 0.5, 0.05);
  std::map<int64_t, int> all;
  for (int i = 0; i < 4000; ++i) ++all[nn::sampleToken(logits, {.temperature = 1.0}, g)];
  const double z = std::exp(0.1) + 2 * std::exp(2.0) + std::exp(1.9) + std::exp(-1.0);
  EXPECT_NEAR(all[2] / 4000.0, std::exp(1.9) / z, 0.03);
  Generator a(5), b(5), m(0);
  nn::Gpt model(tiny(), m);
  const auto s1 = model.generate({72, 105}, 20, {.temperature = 0.8, .topK = 10}, a);
  const auto s2 = model.generate({72, 105}, 20, {.temperature = 0.8, .topK = 10}, b);
  EXPECT_EQ(s1, s2);
  EXPECT_EQ(s1.size(), 22u);
  EXPECT_EQ(s1[0], 72);
}

TEST(ClipGradNorm, ClipsToTheGlobalNormAndReturnsItBeforeClipping) {
  Tensor a = zeros({3}).setRequiresGrad(true), b = zeros({2, 2}).setRequiresGrad(true), none = zeros({2}).setRequiresGrad(true);
  a.setGrad(fromVector<float>({3, 0, 4}));
  b.setGrad(fromVector<float>({0, 0, 12, 0}, {2, 2}));
  EXPECT_NEAR(nn::clipGradNorm({a, b, none}, 100.0), 13.0, 1e-9);  // below: unchanged
  EXPECT_EQ(a.grad().toVector<float>(), (std::vector<float>{3, 0, 4}));
  EXPECT_NEAR(nn::clipGradNorm({a, b}, 1.3), 13.0, 1e-9);
  EXPECT_NEAR(a.grad().toVector<float>()[2], 0.4f, 1e-6);
  EXPECT_NEAR(b.grad().toVector<float>()[2], 1.2f, 1e-6);
  EXPECT_NEAR(nn::clipGradNorm({a, b}, 10.0, {.normType = std::numeric_limits<double>::infinity()}), 1.2, 1e-6);
  b.setGrad(fromVector<float>({0, NAN, 0, 0}, {2, 2}));
  expectThrowsWith<InvalidArgument>([&] { nn::clipGradNorm({a, b}, 1.0, {.errorIfNonfinite = true}); },
                                    {"parameter 1", "non-finite"});
  expectThrowsWith<NotSupportedError>([&] { nn::clipGradNorm({a}, 1.0, {.normType = 1.0}); }, {"norm type 1"});
}

TEST(ClipGradNorm, ShardsAgreeOnTheWholeNormThroughReducePartial) {
  // One vector [3, 4, 12, 0] held as two shards by two "ranks"; the hook adds the other's partial.
  Tensor first = zeros({2}).setRequiresGrad(true), second = zeros({2}).setRequiresGrad(true);
  first.setGrad(fromVector<float>({3, 4}));
  second.setGrad(fromVector<float>({12, 0}));
  const double partialOfSecond = 144.0, partialOfFirst = 25.0;
  int calls = 0;
  auto plus = [&](double other) {
    return [&calls, other](Tensor& partial, bool isMax) {
      ++calls;
      EXPECT_FALSE(isMax);
      partial.fill_(partial.item<double>() + other);
    };
  };
  EXPECT_NEAR(nn::clipGradNorm({first}, 1.3, {.reducePartial = plus(partialOfSecond)}), 13.0, 1e-9);
  EXPECT_NEAR(nn::clipGradNorm({second}, 1.3, {.reducePartial = plus(partialOfFirst)}), 13.0, 1e-9);
  EXPECT_EQ(calls, 2);
  EXPECT_NEAR(first.grad().toVector<float>()[1], 0.4f, 1e-6);
  EXPECT_NEAR(second.grad().toVector<float>()[0], 1.2f, 1e-6);
}

TEST(Schedule, WarmsUpLinearlyThenFollowsTheCosineToTheFloor) {
  const optim::WarmupCosineSchedule s(1e-3, 10, 110, 1e-4);
  EXPECT_DOUBLE_EQ(s.at(0), 1e-4);
  EXPECT_DOUBLE_EQ(s.at(4), 5e-4);
  EXPECT_DOUBLE_EQ(s.at(9), 1e-3);
  EXPECT_DOUBLE_EQ(s.at(10), 1e-3);
  EXPECT_NEAR(s.at(60), 1e-4 + 0.5 * 9e-4, 1e-15);
  EXPECT_NEAR(s.at(109), 1e-4, 1e-6);  // one step before the end: just above the floor
  EXPECT_DOUBLE_EQ(s.at(500), 1e-4);
  EXPECT_GT(s.at(30), s.at(31));
  expectThrowsWith<InvalidArgument>([] { optim::WarmupCosineSchedule(1e-3, 20, 10); }, {"20 warm-up steps of 10"});
  expectThrowsWith<InvalidArgument>([] { optim::WarmupCosineSchedule(1e-3, 0, 10, 1e-2); }, {"minLr"});
}

TEST(DecayGroups, OnlyLinearWeightsDecayAndAdamWHonoursTheGroups) {
  Generator g(3);
  nn::Gpt model(tiny(), g);
  const auto groups = optim::decayGroups(model, 0.1);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].weightDecay, 0.1);
  EXPECT_EQ(groups[1].weightDecay, 0.0);
  std::set<const void*> decayed;
  for (const Tensor& p : groups[0].params) decayed.insert(p.id());
  size_t total = 0;
  for (const auto& [name, p] : model.namedParameters()) {
    ++total;
    const bool linearWeight = name.ends_with(".weight") && name.find("ln_") == std::string::npos && !name.starts_with("w");
    EXPECT_EQ(decayed.count(p.id()) == 1, linearWeight) << name;
  }
  EXPECT_EQ(groups[0].params.size() + groups[1].params.size(), total);
  // Zero gradients: AdamW's step moves only the decayed group (p *= 1 - lr * wd).
  optim::AdamW adamw(groups, {.lr = 0.5});
  for (Tensor p : model.parameters()) p.setGrad(zerosLike(p));
  const Tensor before = model.wte->weight.clone();
  const Tensor linearBefore = groups[0].params[0].clone();
  adamw.step();
  EXPECT_TRUE(equalBits(model.wte->weight, before));
  EXPECT_NEAR(maxAbs(groups[0].params[0], mul(linearBefore, 0.95)), 0.0, 1e-7);
  expectThrowsWith<InvalidArgument>(
      [&] { optim::AdamW({{{model.wte->weight}, {}}, {{model.wte->weight}, 0.0}}); }, {"appear once"});
}

}  // namespace
}  // namespace dt
