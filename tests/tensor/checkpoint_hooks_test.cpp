// What the sharded wrapper needs from the core: activation checkpointing (gradients equal
// to the plain run's, dropout masks replayed, parameter hooks firing inside the recomputation),
// module forward hooks, a storage that frees and regains its bytes under every handle, and
// safetensors in memory and read piece by piece.
#include <cstring>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/checkpoint.h"
#include "tensor/nn/gpt.h"
#include "tensor/nn/safetensors.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using testing::expectThrowsWith;
using testing::TempDir;

bool equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.sizes() != b.sizes()) return false;
  const Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.dataPtr(), y.dataPtr(), x.nbytes()) == 0;
}

nn::GptConfig config(bool checkpointed, double dropout) {
  return {.vocabSize = 64, .contextLength = 8, .layers = 2, .heads = 2, .width = 16, .dropout = dropout,
          .activationCheckpointing = checkpointed};
}

std::vector<Tensor> gptGradients(bool checkpointed, double dropout, int* hookCalls = nullptr) {
  Generator init(3), drop(11);
  nn::Gpt model(config(checkpointed, dropout), init, &drop);
  if (hookCalls != nullptr) {
    for (Tensor p : model.parameters()) p.registerPostAccumulateGradHook([hookCalls](Tensor&) { ++*hookCalls; });
  }
  Generator data(5);
  const Tensor tokens = randint(0, 64, {3, 9}, data);
  const Tensor loss = nn::Gpt::loss(model(tokens.narrow(1, 0, 8).contiguous()), tokens.narrow(1, 1, 8).contiguous());
  loss.backward();
  std::vector<Tensor> grads;
  for (const Tensor& p : model.parameters()) grads.push_back(p.grad());
  grads.push_back(fromVector<int64_t>({static_cast<int64_t>(drop.state().counter)}));  // where dropout's stream ended
  return grads;
}

TEST(ActivationCheckpoint, GptGradientsEqualThePlainRunWithAndWithoutDropout) {
  for (double dropout : {0.0, 0.2}) {
    int plainHooks = 0, checkpointedHooks = 0;
    const auto plain = gptGradients(false, dropout, &plainHooks);
    const auto checkpointed = gptGradients(true, dropout, &checkpointedHooks);
    ASSERT_EQ(plain.size(), checkpointed.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      // The recomputation runs the same kernels on the same values: the same bits.
      EXPECT_TRUE(equal(plain[i], checkpointed[i])) << "dropout " << dropout << " tensor " << i;
    }
    EXPECT_EQ(plainHooks, checkpointedHooks) << "each parameter's hook fires once, inside the recomputation";
  }
}

TEST(ActivationCheckpoint, KeepsNothingInsideAndRefusesASecondBackward) {
  Generator gen(1);
  Tensor w = randn({4, 4}, gen).setRequiresGrad(true);
  int runs = 0;
  const Tensor x = randn({2, 4}, gen).setRequiresGrad(true);
  const Tensor y = autograd::checkpoint([&](const Tensor& in) {
    ++runs;
    return relu(matmul(in, w));
  }, x);
  EXPECT_EQ(y.gradFn()->name(), "CheckpointBackward");
  EXPECT_EQ(y.gradFn()->nextEdges().size(), 1u) << "one edge, to the input: the inside left no graph";
  sum(y).backward(Tensor(), /*retainGraph=*/false);
  EXPECT_EQ(runs, 2);
  EXPECT_TRUE(w.grad().defined());
  EXPECT_TRUE(x.grad().defined());
  expectThrowsWith<InvalidArgument>([&] { sum(y).backward(); }, {"CheckpointBackward"});

  // Without grad there is nothing to recompute: one run, no node.
  NoGradGuard noGrad;
  const Tensor z = autograd::checkpoint([&](const Tensor& in) { return mul(in, 2.0); }, x);
  EXPECT_EQ(z.gradFn(), nullptr);
}

TEST(ModuleForwardHooks, RunAroundForwardInOrderAndMayReplace) {
  nn::Sequential seq;
  seq.pushBack(std::make_shared<nn::ReLU>());
  std::vector<std::string> calls;
  const int pre = seq.registerForwardPreHook([&](nn::Module&, const Tensor& x) {
    calls.push_back("pre");
    return sub(x, 1.0);
  });
  seq.registerForwardHook([&](nn::Module&, const Tensor& in, const Tensor& out) {
    calls.push_back(str("post(", in.toVector<float>()[0], ")"));
    return add(out, 10.0);
  });
  EXPECT_EQ(seq(fromVector<float>({2.0f})).toVector<float>()[0], 11.0f);
  EXPECT_EQ(seq.forward(fromVector<float>({2.0f})).toVector<float>()[0], 2.0f) << "forward() runs no hooks";
  seq.removeForwardHook(pre);
  EXPECT_EQ(seq(fromVector<float>({2.0f})).toVector<float>()[0], 12.0f);
  EXPECT_EQ(calls, (std::vector<std::string>{"pre", "post(1)", "post(2)"})) << "post-hooks see the replaced input";
}

TEST(StorageResize, EveryHandleSeesTheNewBytes) {
  Tensor t = full({1024}, 3.0);
  Tensor saved = t.view({32, 32});  // another handle over the same storage
  Storage s = t.storage();
  s.resizeBytes(0);
  EXPECT_EQ(saved.storage().nbytes(), 0u);
  s.resizeBytes(1024 * sizeof(float));
  t.fill_(7.0);
  EXPECT_EQ(saved.toVector<float>()[1023], 7.0f);
}

TEST(SafetensorsPieces, EncodeDecodeAndReadElementRanges) {
  const NamedTensors tensors{{"a", arange(10, DType::Float32)}, {"b", fromVector<int64_t>({5, 6, 7})}};
  const std::string bytes = encodeSafetensors(tensors, {{"k", "v"}});
  const SafetensorsFile decoded = decodeSafetensors(bytes);
  EXPECT_EQ(decoded.metadata.at("k"), "v");
  EXPECT_TRUE(equal(decoded.tensors.at(0).second, tensors[0].second));
  TempDir dir;
  saveSafetensors(dir.path() / "t.safetensors", tensors);
  const SafetensorsReader reader(dir.path() / "t.safetensors");
  float piece[3];
  reader.readElements(reader.entry("a"), 4, 3, piece);
  EXPECT_EQ(piece[0], 4.0f);
  EXPECT_EQ(piece[2], 6.0f);
  EXPECT_EQ(reader.read(reader.entry("b")).toVector<int64_t>(), (std::vector<int64_t>{5, 6, 7}));
  expectThrowsWith<InvalidArgument>([&] { reader.readElements(reader.entry("a"), 8, 3, piece); }, {"\"a\"", "[8, 11)"});
  expectThrowsWith<InvalidArgument>([&] { decodeSafetensors(bytes.substr(0, 20), "the message"); }, {"the message"});
}

}  // namespace
}  // namespace dt
