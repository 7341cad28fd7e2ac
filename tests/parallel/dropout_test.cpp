// Dropout under tensor and sequence parallelism (threads as ranks on shm): a sequence block draws
// exactly its block of the single process's mask; the replicated stream's masks (the embeddings,
// both residual branches) are the single process's, bitwise, with and without SP, while each
// rank's heads draw their own; a TP=2 GPT with dropout trains, and one seed repeats the run
// bitwise.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/strings.h"
#include "parallel/mesh.h"
#include "parallel/parallelize.h"
#include "tensor/optim/optim.h"
#include "tests/fsdp/harness.h"
#include "tests/parallel/harness.h"

namespace dt::testing {
namespace {

const nn::GptConfig kConfig{.vocabSize = 32, .contextLength = 8, .layers = 2, .heads = 4, .width = 16,
                            .dropout = 0.2};
constexpr int64_t kBatch = 2;
constexpr uint64_t kInitSeed = 2024;
constexpr uint64_t kDropoutSeed = 99;

void expectBitwiseEqual(const Tensor& actual, const Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_EQ(actual.to(DType::Float64).toVector<double>(), expected.to(DType::Float64).toVector<double>()) << what;
}

// 1 where the tensor is exactly zero: where dropout dropped (the inputs here are never zero).
Tensor droppedAt(const Tensor& t) {
  std::vector<double> zeros;
  for (double v : t.to(DType::Float64).toVector<double>()) zeros.push_back(v == 0.0 ? 1.0 : 0.0);
  return fromVector(zeros, t.sizes());
}

TEST(TensorParallelDropout, SequenceBlockDrawsTheRanksBlockOfTheSingleProcessMask) {
  for (int degree : {2, 4}) {
    withRanks(degree, [&](int rank, const ProcessGroupPtr& world) {
      Generator data(11);
      const Tensor whole = randn({3, 8, 5}, data);
      Generator single(kDropoutSeed);
      const Tensor expected = dropout(whole, 0.3, true, single);
      Generator mine(kDropoutSeed);
      const int64_t block = 8 / degree;
      const Tensor local = whole.narrow(1, rank * block, block).contiguous();
      const Tensor dropped = sequenceBlockDropout(local, 0.3, true, mine, *world);
      const std::string what = str("t=", degree, " rank ", rank);
      expectBitwiseEqual(dropped, expected.narrow(1, rank * block, block).contiguous(), what + " block");
      expectBitwiseEqual(gatherBlocks(*world, dropped, 1), expected, what + " gathered");
      EXPECT_EQ(mine.state(), single.state()) << what << ": the stream must end where the whole draw ends";
      // Evaluation draws nothing.
      const Tensor evaluated = sequenceBlockDropout(local, 0.3, false, mine, *world);
      expectBitwiseEqual(evaluated, local, what + " eval");
      EXPECT_EQ(mine.state(), single.state()) << what;
    });
  }
}

TEST(TensorParallelDropout, ShardStreamsDifferPerRankAndPositionAndRepeatWithTheSeed) {
  withRanks(2, [&](int, const ProcessGroupPtr& world) {
    Generator replicated(kDropoutSeed);
    Generator here = shardDropoutStream(replicated, *world);
    Generator again = shardDropoutStream(replicated, *world);
    const double first = here.nextDouble();
    EXPECT_EQ(first, again.nextDouble()) << "same position, same rank: the same stream";
    const Tensor firsts = gatherBlocks(*world, fromVector(std::vector<double>{first}, {1}), 0);
    EXPECT_NE(firsts.toVector<double>()[0], firsts.toVector<double>()[1]) << "ranks of one group draw alike";
    skipDraws(replicated, 10);
    EXPECT_NE(shardDropoutStream(replicated, *world).nextDouble(), first) << "a later position repeats the stream";
  });
}

struct Captured {
  Tensor embeddings;  // "drop"'s output
  Tensor mlpDropout;  // h.0.mlp.dropout's output
  Tensor attnOut;     // h.0.attn's output (after its dropout)
  Tensor blockOut;    // h.0's output: the residual stream
};

void capture(nn::Gpt& model, Captured& into) {
  auto keep = [](Tensor& slot) {
    return [&slot](nn::Module&, const Tensor&, const Tensor& output) {
      slot = output.detach();
      return Tensor();
    };
  };
  const std::shared_ptr<nn::Module> block = model.h->child("0");
  model.child("drop")->registerForwardHook(keep(into.embeddings));
  block->child("mlp")->child("dropout")->registerForwardHook(keep(into.mlpDropout));
  block->child("attn")->registerForwardHook(keep(into.attnOut));
  block->registerForwardHook(keep(into.blockOut));
}

// The replicated regions' masks of a TP=2 model equal the single process's (SP: gathered);
// the residual stream is bitwise equal across the group without SP.
void checkMasks(bool sequenceParallel) {
  withRanks(2, [&](int rank, const ProcessGroupPtr& world) {
    const std::string label = str(sequenceParallel ? "TP=2 SP" : "TP=2", " rank ", rank);
    Generator referenceInit(kInitSeed), referenceDropout(kDropoutSeed);
    nn::Gpt reference(kConfig, referenceInit, &referenceDropout);
    Generator init(kInitSeed), dropping(kDropoutSeed);
    nn::Gpt model(kConfig, init, &dropping);
    parallelize(model, world, gptParallelPlan({.sequenceParallel = sequenceParallel}));
    Captured expected, actual;
    capture(reference, expected);
    capture(model, actual);
    Generator data(5);
    const Tensor tokens = randint(0, kConfig.vocabSize, {kBatch, kConfig.contextLength}, data);
    reference(tokens);
    model(tokens);
    EXPECT_EQ(dropping.state(), referenceDropout.state())
        << label << ": the replicated stream must end where the single process's does";
    auto whole = [&](const Tensor& t) { return sequenceParallel ? gatherBlocks(*world, t, 1) : t; };
    // The embeddings' sum is exact under the vocab-parallel lookup, so the dropped values are too.
    expectBitwiseEqual(whole(actual.embeddings), expected.embeddings, label + " embeddings after dropout");
    expectBitwiseEqual(droppedAt(whole(actual.mlpDropout)), droppedAt(expected.mlpDropout),
                       label + " MLP residual dropout mask");
    expectBitwiseEqual(droppedAt(whole(actual.attnOut)), droppedAt(expected.attnOut),
                       label + " attention residual dropout mask");
    if (!sequenceParallel) {
      const Tensor blocks = gatherBlocks(*world, actual.blockOut, 0);
      expectBitwiseEqual(blocks.narrow(0, 0, kBatch), blocks.narrow(0, kBatch, kBatch),
                         label + " residual stream on rank 0 and rank 1");
    }
  });
}

TEST(TensorParallelDropout, ReplicatedMasksAreTheSingleProcessesAndEqualAcrossTheGroup) { checkMasks(false); }

TEST(TensorParallelDropout, SequenceParallelMasksAreTheSingleProcessesBlocks) { checkMasks(true); }

// Per step: the loss, then every parameter after the run.
struct TrainingRun {
  std::vector<double> losses;
  std::vector<std::vector<double>> parameters;
};

TrainingRun train(const ProcessGroupPtr& tp, bool sequenceParallel, bool checkpointing) {
  nn::GptConfig config = kConfig;
  config.activationCheckpointing = checkpointing;
  Generator init(kInitSeed), dropping(kDropoutSeed);
  nn::Gpt model(config, init, &dropping);
  parallelize(model, tp, gptParallelPlan({.sequenceParallel = sequenceParallel}));
  optim::AdamW optimizer(model.parameters(), {.lr = 1e-2});
  Generator data(6);
  const Tensor tokens = randint(0, kConfig.vocabSize, {kBatch, kConfig.contextLength + 1}, data);
  const Tensor inputs = tokens.narrow(1, 0, kConfig.contextLength).contiguous();
  const Tensor targets = tokens.narrow(1, 1, kConfig.contextLength).contiguous();
  TrainingRun run;
  for (int step = 0; step < 20; ++step) {
    optimizer.zeroGrad();
    const Tensor loss = model.nextTokenLoss(model(inputs), targets);
    loss.backward();
    optimizer.step();
    run.losses.push_back(loss.item<double>());
  }
  for (const Tensor& p : model.parameters()) run.parameters.push_back(p.detach().to(DType::Float64).toVector<double>());
  return run;
}

TEST(TensorParallelDropout, GptWithDropoutTrainsAtTpTwoAndOneSeedRepeatsTheRunBitwise) {
  for (bool sequenceParallel : {false, true}) {
    withRanks(2, [&](int rank, const ProcessGroupPtr& world) {
      const std::string label = str(sequenceParallel ? "TP=2 SP" : "TP=2", " rank ", rank);
      const TrainingRun first = train(world, sequenceParallel, false);
      const TrainingRun second = train(world, sequenceParallel, false);
      EXPECT_LT(first.losses.back(), 0.5 * first.losses.front()) << label << ": one batch, 20 steps, no learning";
      EXPECT_EQ(first.losses, second.losses) << label;
      EXPECT_EQ(first.parameters, second.parameters) << label;
      // Activation checkpointing rewinds the replicated stream for the recomputation, and the
      // heads' streams derive from its position: the same masks both times, the same run.
      const TrainingRun recomputed = train(world, sequenceParallel, true);
      EXPECT_EQ(first.losses, recomputed.losses) << label << " with activation checkpointing";
      EXPECT_EQ(first.parameters, recomputed.parameters) << label << " with activation checkpointing";
    });
  }
}

}  // namespace
}  // namespace dt::testing
