// nn::Module registration/state dicts, safetensors, optimizers against
// hand-computed updates, and a small MLP that learns a synthetic task.
#include <cmath>
#include <cstring>
#include <fstream>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "tensor/nn/module.h"
#include "tensor/nn/safetensors.h"
#include "tensor/optim/optim.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using testing::expectThrowsWith;
using testing::TempDir;

class Block : public nn::Module {
 public:
  Block() {
    fc1 = registerModule("fc1", std::make_shared<nn::Linear>(4, 3));
    norm = registerModule("norm", std::make_shared<nn::LayerNorm>(std::vector<int64_t>{3}));
    scale = registerParameter("scale", ones({1}));
    registerBuffer("steps", zeros({}, DType::Int64));
  }
  Tensor forward(const Tensor& x) override { return mul(norm->forward(fc1->forward(x)), scale); }
  std::shared_ptr<nn::Linear> fc1;
  std::shared_ptr<nn::LayerNorm> norm;
  Tensor scale;
};

TEST(Module, RegistrationOrderAndNames) {
  nn::Sequential seq;
  seq.pushBack(std::make_shared<Block>());
  seq.pushBack(std::make_shared<nn::ReLU>());
  seq.pushBack(std::make_shared<nn::Linear>(3, 2, false));
  std::vector<std::string> names;
  for (auto& [n, t] : seq.namedParameters()) names.push_back(n);
  // As in PyTorch: a module's own parameters first, then each child's, in registration order.
  EXPECT_EQ(names, (std::vector<std::string>{"0.scale", "0.fc1.weight", "0.fc1.bias", "0.norm.weight", "0.norm.bias",
                                             "2.weight"}));
  auto buffers = seq.namedBuffers();
  ASSERT_EQ(buffers.size(), 1u);
  EXPECT_EQ(buffers[0].first, "0.steps");
  EXPECT_EQ(seq.stateDict().size(), 7u);
  EXPECT_TRUE(seq.isTraining());
  seq.eval();
  EXPECT_FALSE(seq.child("0")->isTraining());
  Tensor y = seq.forward(ones({5, 4}));
  EXPECT_EQ(y.sizes(), (Shape{5, 2}));
  expectThrowsWith<InvalidArgument>([&] { seq.child("9"); }, {"\"9\""});
}

TEST(Module, LinearInitMatchesPyTorchBounds) {
  Generator g(3);
  nn::Linear lin(100, 50, true, g);
  const double bound = 1.0 / std::sqrt(100.0);
  auto w = lin.weight.toVector<float>();
  double lo = 1, hi = -1;
  for (float v : w) {
    lo = std::min<double>(lo, v);
    hi = std::max<double>(hi, v);
  }
  EXPECT_GE(lo, -bound);
  EXPECT_LE(hi, bound);
  EXPECT_LT(lo, -0.9 * bound);  // actually spans the range
  EXPECT_GT(hi, 0.9 * bound);
  for (float v : lin.bias.toVector<float>()) EXPECT_LE(std::abs(v), bound);
}

TEST(Module, ZeroGradAndDropoutModes) {
  nn::Linear lin(3, 2);
  sum(lin.forward(ones({4, 3}))).backward();
  EXPECT_TRUE(lin.weight.grad().defined());
  lin.zeroGrad(false);
  EXPECT_EQ(lin.weight.grad().toVector<float>(), std::vector<float>(6, 0.0f));
  lin.zeroGrad();
  EXPECT_FALSE(lin.weight.grad().defined());

  Generator g(1);
  nn::Dropout drop(0.5, g);
  Tensor x = ones({1000});
  Tensor y = drop.forward(x);
  const auto v = y.toVector<float>();
  int zerosCount = 0;
  for (float f : v) {
    EXPECT_TRUE(f == 0.0f || f == 2.0f);
    zerosCount += f == 0.0f;
  }
  EXPECT_GT(zerosCount, 400);
  EXPECT_LT(zerosCount, 600);
  drop.eval();
  EXPECT_TRUE(drop.forward(x).isSameAs(x));
}

TEST(Safetensors, RoundTripAllDTypesAndLayout) {
  TempDir dir;
  const auto path = dir.path() / "t.safetensors";
  NamedTensors in = {
      {"f32", fromVector<float>({1.5f, -2.0f, 3.0f, 4.0f}, {2, 2})},
      {"f64", fromVector<double>({1e-300})},
      {"f16", fromVector<float>({0.5f, 65504.0f}, {2}, DType::Float16)},
      {"bf16", fromVector<float>({1.0f, -3.0f}, {2}, DType::BFloat16)},
      {"i32", fromVector<int32_t>({-7})},
      {"i64", arange(6, DType::Int64).view({2, 3}).t()},  // non-contiguous: saved contiguous
      {"flag", fromVector<bool>({true, false})},
      {"scalar", scalarTensor(2.0)},
  };
  saveSafetensors(path, in, {{"note", "quote \" and newline \n"}});
  // Header layout: 8-byte LE length, JSON, data 8-byte aligned.
  std::ifstream f(path, std::ios::binary);
  unsigned char len[8];
  f.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  EXPECT_EQ(n % 8, 0u);
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  EXPECT_NE(header.find("\"f32\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}"), std::string::npos)
      << header;
  EXPECT_NE(header.find("\"BF16\""), std::string::npos);

  SafetensorsFile out = loadSafetensors(path);
  ASSERT_EQ(out.tensors.size(), in.size());
  EXPECT_EQ(out.metadata.at("note"), "quote \" and newline \n");
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(out.tensors[i].first, in[i].first);
    EXPECT_EQ(out.tensors[i].second.dtype(), in[i].second.dtype());
    EXPECT_EQ(out.tensors[i].second.sizes(), in[i].second.sizes());
    EXPECT_EQ(out.tensors[i].second.toVector<double>(), in[i].second.toVector<double>()) << in[i].first;
  }
}

TEST(Safetensors, RejectsCorruptFiles) {
  TempDir dir;
  const auto path = dir.path() / "bad.safetensors";
  {
    std::ofstream f(path, std::ios::binary);
    const uint64_t n = 1000;
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << "{}";
  }
  expectThrowsWith<InvalidArgument>([&] { loadSafetensors(path); }, {"bad.safetensors", "1000"});
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    std::string h = "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,8]}}";
    const uint64_t n = h.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << h << std::string(8, '\0');
  }
  expectThrowsWith<InvalidArgument>([&] { loadSafetensors(path); }, {"\"a\"", "float32[4]", "16 bytes"});
}

TEST(Module, StateDictSaveLoadKeepsParameterIdentity) {
  TempDir dir;
  Block a, b;
  {
    NoGradGuard ng;
    a.fc1->weight.fill_(0.25);
  }
  a.save(dir.path() / "m.safetensors");
  Tensor before = b.fc1->weight;
  b.load(dir.path() / "m.safetensors");
  EXPECT_TRUE(before.isSameAs(b.fc1->weight));
  EXPECT_EQ(b.fc1->weight.toVector<float>(), std::vector<float>(12, 0.25f));
  EXPECT_EQ(b.fc1->bias.toVector<float>(), a.fc1->bias.toVector<float>());
  NamedTensors partial = {{"fc1.weight", zeros({3, 4})}, {"extra", zeros({1})}};
  expectThrowsWith<InvalidArgument>([&] { b.loadStateDict(partial); }, {"Missing", "fc1.bias", "Unexpected", "extra"});
  NamedTensors wrongShape = {{"fc1.weight", zeros({4, 3})}};
  expectThrowsWith<InvalidArgument>([&] { b.loadStateDict(wrongShape, false); }, {"[4, 3]", "[3, 4]"});
}

TEST(Module, ToMovesEveryTensorInPlaceOrNothing) {
  Block block;
  block.fc1->weight.setGrad(full({3, 4}, 0.5));
  const Tensor weight = block.fc1->weight;  // a handle taken before the move
  const std::vector<float> values = weight.toVector<float>();
  const void* memory = weight.storage().data();
  block.to(Device::cpu());
  EXPECT_EQ(weight.storage().data(), memory) << "moving to where it already is copies nothing";

  if (!deviceAvailable(Device::cuda(0))) {
    // No device to move to: the error names it and nothing moved.
    EXPECT_THROW(block.to(Device::cuda(0)), Error);
    for (const auto& [name, t] : block.stateDict()) EXPECT_TRUE(t.device().isCpu()) << name;
    EXPECT_EQ(weight.storage().data(), memory);
    EXPECT_EQ(weight.toVector<float>(), values);
    GTEST_SKIP() << "moving to cuda:0 needs a CUDA device: " << deviceUnavailableReason(Device::cuda(0));
  }
  block.to(Device::cuda(0));
  EXPECT_TRUE(weight.isSameAs(block.fc1->weight));
  for (const auto& [name, t] : block.stateDict()) EXPECT_EQ(t.device(), Device::cuda(0)) << name;
  EXPECT_EQ(weight.grad().device(), Device::cuda(0));
  block.to(Device::cpu());
  EXPECT_EQ(weight.toVector<float>(), values);
  EXPECT_EQ(weight.grad().toVector<float>(), std::vector<float>(12, 0.5f));
}

// Hand-computed reference values from the published update rules.
TEST(Optim, SGDPlainAndMomentumNesterovWeightDecay) {
  Tensor p = fromVector<float>({1.0f, -2.0f}).setRequiresGrad(true);
  optim::SGD plain({p}, {0.1});
  p.setGrad(fromVector<float>({0.5f, 1.0f}));
  plain.step();
  EXPECT_EQ(p.toVector<float>(), (std::vector<float>{0.95f, -2.1f}));

  // momentum 0.9, dampening 0.1, wd 0.01, lr 0.1, grad 1.0 constant, p0 = 1.
  Tensor q = fromVector<double>({1.0}).setRequiresGrad(true);
  optim::SGD sgd({q}, {0.1, 0.9, 0.1, 0.01, false});
  double pv = 1.0, buf = 0.0;
  for (int step = 0; step < 3; ++step) {
    q.setGrad(fromVector<double>({1.0}));
    sgd.step();
    double d = 1.0 + 0.01 * pv;
    buf = step == 0 ? d : 0.9 * buf + 0.9 * d;
    pv -= 0.1 * buf;
    EXPECT_NEAR(q.item<double>(), pv, 1e-12) << "step " << step;
  }
  // Nesterov: d + momentum * buf.
  Tensor r = fromVector<double>({2.0}).setRequiresGrad(true);
  optim::SGD nest({r}, {0.5, 0.5, 0.0, 0.0, true});
  r.setGrad(fromVector<double>({1.0}));
  nest.step();  // buf = 1, d = 1 + 0.5 = 1.5, p = 2 - 0.75
  EXPECT_NEAR(r.item<double>(), 1.25, 1e-12);
  r.setGrad(fromVector<double>({1.0}));
  nest.step();  // buf = 0.5 + 1 = 1.5, d = 1 + 0.75 = 1.75, p = 1.25 - 0.875
  EXPECT_NEAR(r.item<double>(), 0.375, 1e-12);
  auto st = nest.stateDict();
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].first, "state.0.momentum_buffer");
  EXPECT_DOUBLE_EQ(st[0].second.item<double>(), 1.5);
  expectThrowsWith<InvalidArgument>([&] { optim::SGD({r}, {0.1, 0.0, 0.0, 0.0, true}); }, {"nesterov"});
}

TEST(Optim, AdamWMatchesHandComputedSteps) {
  Tensor p = fromVector<double>({1.0, -1.0}).setRequiresGrad(true);
  optim::AdamWOptions o;
  o.lr = 0.1;
  o.weightDecay = 0.1;
  optim::AdamW adam({p}, o);
  const double grads[3][2] = {{0.5, -1.0}, {0.1, 2.0}, {-0.3, 0.0}};
  double pv[2] = {1.0, -1.0}, m[2] = {0, 0}, v[2] = {0, 0};
  for (int t = 1; t <= 3; ++t) {
    p.setGrad(fromVector<double>({grads[t - 1][0], grads[t - 1][1]}));
    adam.step();
    for (int i = 0; i < 2; ++i) {
      const double g = grads[t - 1][i];
      pv[i] *= 1 - 0.1 * 0.1;
      m[i] = 0.9 * m[i] + 0.1 * g;
      v[i] = 0.999 * v[i] + 0.001 * g * g;
      const double mhat = m[i] / (1 - std::pow(0.9, t));
      const double denom = std::sqrt(v[i]) / std::sqrt(1 - std::pow(0.999, t)) + 1e-8;
      pv[i] -= 0.1 * mhat / denom * 1.0;
      EXPECT_NEAR(p.toVector<double>()[i], pv[i], 1e-12) << "step " << t << " elem " << i;
    }
  }
  // State round trip: a fresh optimizer continues identically.
  TempDir dir;
  saveSafetensors(dir.path() / "opt.safetensors", adam.stateDict());
  Tensor p2 = p.detach().clone().setRequiresGrad(true);
  optim::AdamW adam2({p2}, o);
  adam2.loadStateDict(loadSafetensors(dir.path() / "opt.safetensors").tensors);
  p.setGrad(fromVector<double>({1.0, 1.0}));
  p2.setGrad(fromVector<double>({1.0, 1.0}));
  adam.step();
  adam2.step();
  EXPECT_EQ(p.toVector<double>(), p2.toVector<double>());
  auto names = adam.stateDict();
  EXPECT_EQ(names.size(), 3u);
}

TEST(Training, SmallMlpLearnsSyntheticTask) {
  // Two interleaved classes from a fixed teacher: label = argmax(x W_t).
  Generator g(11);
  const int64_t n = 256, d = 8, classes = 3;
  Tensor x = randn({n, d}, g);
  Tensor teacher = randn({d, classes}, g);
  Tensor y = argmax(matmul(x, teacher), 1);
  auto model = std::make_shared<nn::Sequential>();
  model->pushBack(std::make_shared<nn::Linear>(d, 32, true, g));
  model->pushBack(std::make_shared<nn::GELU>());
  model->pushBack(std::make_shared<nn::Linear>(32, classes, true, g));
  optim::AdamW opt(model->parameters(), {0.02, 0.9, 0.999, 1e-8, 0.0});
  double first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    opt.zeroGrad();
    Tensor loss = crossEntropy(model->forward(x), y);
    loss.backward();
    opt.step();
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  // Stated target: from ~1.1 (chance for 3 classes) to below 0.1.
  EXPECT_GT(first, 0.8);
  EXPECT_LT(last, 0.1) << "first loss " << first;
  Tensor acc = mean(eq(argmax(model->forward(x), 1), y).to(DType::Float32));
  EXPECT_GT(acc.item<float>(), 0.97f);
}

}  // namespace
}  // namespace dt
