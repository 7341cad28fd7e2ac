// Checkpoints across tensor-parallel shapes (threads as ranks on shm, float64, dropout off): a
// GPT trained under DDP over mesh["dp"] with TP over mesh["tp"] saves its model and AdamW state
// through tensorParallelModelState / tensorParallelParameterMap at TP=2 x DP=2; the checkpoint
// loads at TP=1 x DP=4 (the plain model, replicated state, as train::Loop holds it) and at
// TP=4 x DP=1 (sequence parallel), and one written at TP=1 x DP=4 loads at TP=4: the next
// steps' losses equal the continued run's (1e-10 relative), and every AdamW moment and
// parameter arrives exactly (assembled whole from the shards). consolidateCheckpoint (what
// `dtckpt consolidate` runs) writes the whole tensors of the strided shards (c_attn's q/k/v
// parts, the row layers' columns). And the strided placement itself, against a hand count.
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "checkpoint/checkpoint_dir.h"
#include "common/errors.h"
#include "common/strings.h"
#include "ddp/ddp.h"
#include "parallel/checkpoint.h"
#include "parallel/mesh.h"
#include "parallel/parallelize.h"
#include "tensor/nn/safetensors.h"
#include "tensor/optim/optim.h"
#include "tests/fsdp/harness.h"
#include "tests/parallel/harness.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

namespace fs = std::filesystem;

const nn::GptConfig kConfig{.vocabSize = 32, .contextLength = 8, .layers = 2, .heads = 4, .width = 16};
constexpr int64_t kGlobalRows = 4;

struct MeshShape {
  int tp = 1, dp = 1;
  bool sequenceParallel = false;
};

Tensor globalBatch(int step) {
  Generator data(900 + step);
  return randint(0, kConfig.vocabSize, {kGlobalRows, kConfig.contextLength + 1}, data);
}

struct RunRecord {
  std::map<int, double> losses;             // by step: the global batch's mean loss
  std::map<std::string, Tensor> atLoad;     // whole parameters and moments right after loading
  std::map<std::string, Tensor> atSave;     // and when saving
};

// Copies of every parameter and AdamW moment, whole ("model.<name>", "optim.<name>.<state>").
std::map<std::string, Tensor> wholeState(ProcessGroup& tp, const nn::Gpt& model, const optim::AdamW& adam) {
  std::map<std::string, Tensor> out;
  const std::vector<ParameterShard> shards = parameterShardsOf(model);
  const NamedTensors params = model.namedParameters();
  const NamedTensors state = adam.stateDict();
  for (size_t i = 0; i < params.size(); ++i) {
    out["model." + params[i].first] = wholeParameter(tp, params[i].second.detach(), shards[i]).clone();
    for (const char* moment : {"exp_avg", "exp_avg_sq"}) {
      for (const auto& [key, value] : state) {
        if (key == str("state.", i, ".", moment)) {
          out[str("optim.", params[i].first, ".", moment)] = wholeParameter(tp, value, shards[i]).clone();
        }
      }
    }
  }
  return out;
}

// Trains steps [first, last) at `shape`, after loading the newest checkpoint of `loadFrom`, and
// saves into `saveTo` once `saveAt` steps are done.
RunRecord train(const MeshShape& shape, const std::optional<fs::path>& loadFrom, int first, int last,
          const std::optional<fs::path>& saveTo = std::nullopt, int saveAt = -1) {
  RunRecord run;
  withRanks(shape.tp * shape.dp, [&](int rank, const ProcessGroupPtr& world) {
    const DeviceMesh mesh = DeviceMesh::create(world, {{"dp", shape.dp}, {"tp", shape.tp}});
    Generator init(77);
    auto model = std::make_shared<nn::Gpt>(kConfig, init);
    model->to(DType::Float64);
    const bool parallel = shape.tp > 1;
    if (parallel) parallelize(*model, mesh, gptParallelPlan({.sequenceParallel = shape.sequenceParallel}));
    DistributedDataParallel ddp(model, mesh["dp"]);
    optim::AdamW adam(model->parameters(), {.lr = 1e-2});
    TrainingState state(world->rank(), world->size());
    const int replica = mesh.coordinate("dp");
    if (parallel) {
      state.add("model", tensorParallelModelState(*model, replica));
      state.addOptimizer("optim", adam, tensorParallelParameterMap(*model, replica));
    } else {
      state.addModule("model", *model);
      state.addOptimizer("optim", adam, ParameterMap::replicated(*model));
    }
    if (loadFrom) {
      const CheckpointDir dir(*loadFrom);
      dir.load(*dir.latest(), state, world.get());
      EXPECT_EQ(state.step, first);
      auto whole = wholeState(*mesh["tp"], *model, adam);
      if (rank == 0) run.atLoad = std::move(whole);
    }
    const int64_t rows = kGlobalRows / shape.dp;
    for (int step = first; step < last; ++step) {
      adam.zeroGrad();
      const Tensor batch = globalBatch(step).narrow(0, replica * rows, rows);
      const Tensor inputs = batch.narrow(1, 0, kConfig.contextLength).contiguous();
      const Tensor targets = batch.narrow(1, 1, kConfig.contextLength).contiguous();
      const Tensor loss = model->nextTokenLoss(ddp(inputs), targets);
      loss.backward();
      adam.step();
      Tensor total = loss.detach().clone();
      mesh["dp"]->allreduce(total)->wait();
      if (rank == 0) run.losses[step] = total.item<double>() / shape.dp;
      if (saveTo && step + 1 == saveAt) {
        state.step = saveAt;
        CheckpointDir(*saveTo).save(state, world.get());
        auto whole = wholeState(*mesh["tp"], *model, adam);
        if (rank == 0) run.atSave = std::move(whole);
      }
    }
  });
  return run;
}

void expectSameLosses(const RunRecord& resumed, const RunRecord& continued, const std::string& label) {
  ASSERT_FALSE(resumed.losses.empty()) << label;
  for (const auto& [step, loss] : resumed.losses) {
    ASSERT_TRUE(continued.losses.count(step)) << label << " step " << step;
    const double expected = continued.losses.at(step);
    EXPECT_LE(std::abs(loss - expected), 1e-10 * std::abs(expected))
        << label << " step " << step << ": " << loss << " vs the continued run's " << expected;
  }
}

void expectExactly(const std::map<std::string, Tensor>& actual, const std::map<std::string, Tensor>& expected,
                   const std::string& label) {
  ASSERT_EQ(actual.size(), expected.size()) << label;
  int moments = 0;
  for (const auto& [name, tensor] : expected) {
    ASSERT_TRUE(actual.count(name)) << label << ": " << name << " missing";
    ASSERT_EQ(actual.at(name).sizes(), tensor.sizes()) << label << " " << name;
    EXPECT_EQ(max(abs(actual.at(name) - tensor)).item<double>(), 0.0) << label << ": " << name << " changed";
    moments += name.ends_with(".exp_avg_sq") ? 1 : 0;
  }
  Generator init(1);
  EXPECT_EQ(moments, static_cast<int>(nn::Gpt(kConfig, init).parameters().size())) << label << ": moments missing";
}

TEST(TensorParallelCheckpoint, SavedAtOneShapeContinuesAtAnother) {
  TempDir atTwoByTwo, atOneByFour, consolidated;
  // The run every other one is held to: TP=2 x DP=2, six steps, saved after three.
  const RunRecord continued = train({.tp = 2, .dp = 2}, std::nullopt, 0, 6, atTwoByTwo.path(), 3);

  const RunRecord toOne = train({.tp = 1, .dp = 4}, atTwoByTwo.path(), 3, 6, atOneByFour.path(), 5);
  expectSameLosses(toOne, continued, "TP=2 x DP=2 -> TP=1 x DP=4");
  expectExactly(toOne.atLoad, continued.atSave, "TP=2 x DP=2 -> TP=1 x DP=4");

  const RunRecord toFour = train({.tp = 4, .dp = 1, .sequenceParallel = true}, atTwoByTwo.path(), 3, 6);
  expectSameLosses(toFour, continued, "TP=2 x DP=2 -> TP=4 x DP=1 (SP)");
  expectExactly(toFour.atLoad, continued.atSave, "TP=2 x DP=2 -> TP=4 x DP=1 (SP)");

  const RunRecord oneToFour = train({.tp = 4, .dp = 1}, atOneByFour.path(), 5, 6);
  expectSameLosses(oneToFour, continued, "TP=1 x DP=4 -> TP=4 x DP=1");
  expectExactly(oneToFour.atLoad, toOne.atSave, "TP=1 x DP=4 -> TP=4 x DP=1");

  // One file of whole tensors from the TP=2 x DP=2 checkpoint: the strided shards reassembled.
  const CheckpointDir dir(atTwoByTwo.path());
  const fs::path file = consolidated.path() / "whole.safetensors";
  consolidateCheckpoint(dir, *dir.latest(), file, "");
  const SafetensorsFile whole = loadSafetensors(file);
  std::map<std::string, Tensor> read;
  for (const auto& [name, tensor] : whole.tensors) {
    if (continued.atSave.count(name)) read[name] = tensor;
  }
  expectExactly(read, continued.atSave, "consolidated TP=2 x DP=2 checkpoint");
}

TEST(TensorParallelCheckpoint, StridedPlacementOfEachStyle) {
  // Row layer [8, 12] split on dim 1 at t=2, rank 1: 8 runs of 6 elements, every 12, from 6.
  const ParameterLayout row = tensorParallelLayout({"w", {8, 12}, 1, 6, 1}, {8, 6}, false);
  EXPECT_EQ(row.placement, Placement::Sharded);
  EXPECT_EQ(row.offset, 6);
  EXPECT_EQ(row.stride, 12);
  EXPECT_EQ(row.repeats, 8);
  // Fused q/k/v [12, 4] (parts 3) at t=2, rank 1: rows 2-3 of each part of 4 rows: 3 runs of 8.
  const ParameterLayout qkv = tensorParallelLayout({"c_attn", {12, 4}, 0, 2, 3}, {6, 4}, false);
  EXPECT_EQ(qkv.offset, 8);
  EXPECT_EQ(qkv.stride, 16);
  EXPECT_EQ(qkv.repeats, 3);
  // Column layer [8, 4] on dim 0, rank 1 of 2: one run, rows 4-7.
  const ParameterLayout column = tensorParallelLayout({"fc", {8, 4}, 0, 4, 1}, {4, 4}, true);
  EXPECT_EQ(column.offset, 16);
  EXPECT_EQ(column.repeats, 1);
  EXPECT_TRUE(column.savedByAnotherRank);
  // Held whole (TP=1): one run of everything.
  const ParameterLayout whole = tensorParallelLayout({"c_attn", {12, 4}, 0, 0, 3}, {12, 4}, false);
  EXPECT_EQ(whole.offset, 0);
  EXPECT_EQ(whole.repeats, 1);
  EXPECT_EQ(tensorParallelLayout({"ln", {4}, -1, 0, 1}, {4}, false).placement, Placement::Replicated);
  EXPECT_THROW(tensorParallelLayout({"w", {8, 12}, 1, 0, 1}, {8, 5, 1}, false), InvalidArgument);
}

}  // namespace
}  // namespace dt::testing
