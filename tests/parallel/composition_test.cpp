// Tensor parallelism composed with DDP on a 2-D mesh (threads as ranks on shm): 4 ranks as
// {dp: 2, tp: 2}, nn::Gpt parallelized over mesh["tp"], DDP over mesh["dp"] wrapping it. Ten
// AdamW steps' losses equal one process's on the same global batch (float64: 1e-10 relative;
// float32: 1e-4), with and without sequence parallelism; DDP's buckets hold the TP shards as
// ordinary parameters, in the same order on both ranks of each dp group, and the replicas end
// with bitwise equal shards. The same mesh with the state sharded over dp and TP inside: ZeRO-1/2
// (on DDP over mesh["dp"]) or the fully sharded wrapper over mesh["dp"], gradients clipped by
// clipTensorParallelGradNorm over the wrapper's per-parameter leaves: ten AdamW steps' norms before
// clipping and losses equal one process's clipped the same way (same bars), SP on and off.
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/strings.h"
#include "ddp/ddp.h"
#include "ddp/zero.h"
#include "fsdp/fully_shard.h"
#include "parallel/clip_grad.h"
#include "parallel/mesh.h"
#include "parallel/parallelize.h"
#include "tensor/nn/clip_grad.h"
#include "tensor/optim/optim.h"
#include "tests/fsdp/harness.h"
#include "tests/parallel/harness.h"

namespace dt::testing {
namespace {

const nn::GptConfig kConfig{.vocabSize = 32, .contextLength = 8, .layers = 2, .heads = 4, .width = 16};
constexpr int kSteps = 10;
constexpr int64_t kGlobalBatch = 4;  // rows per step; each dp replica takes half

std::shared_ptr<nn::Gpt> buildGpt(DType dtype) {
  Generator init(99);
  auto model = std::make_shared<nn::Gpt>(kConfig, init);
  model->to(dtype);
  return model;
}

// Step s's global batch: tokens [4, T + 1], the same on every rank.
Tensor globalBatch(int step) {
  Generator data(500 + step);
  return randint(0, kConfig.vocabSize, {kGlobalBatch, kConfig.contextLength + 1}, data);
}
Tensor inputsOf(const Tensor& rows) { return rows.narrow(1, 0, kConfig.contextLength).contiguous(); }
Tensor targetsOf(const Tensor& rows) { return rows.narrow(1, 1, kConfig.contextLength).contiguous(); }

// One process on the whole global batch; with maxNorm > 0 its gradients clipped to it.
struct Curve {
  std::vector<double> losses, norms;
};

Curve singleProcess(DType dtype, double maxNorm = 0.0) {
  auto model = buildGpt(dtype);
  optim::AdamW optimizer(model->parameters(), {.lr = 1e-2});
  Curve curve;
  for (int step = 0; step < kSteps; ++step) {
    optimizer.zeroGrad();
    const Tensor rows = globalBatch(step);
    const Tensor loss = nn::Gpt::loss((*model)(inputsOf(rows)), targetsOf(rows));
    loss.backward();
    if (maxNorm > 0) curve.norms.push_back(nn::clipGradNorm(model->parameters(), maxNorm));
    optimizer.step();
    curve.losses.push_back(loss.item<double>());
  }
  return curve;
}

void checkTensorParallelUnderDdp(DType dtype, bool sequenceParallel) {
  const std::string label = str("TP=2 x DP=2", sequenceParallel ? " SP " : " ", toString(dtype));
  const std::vector<double> expected = singleProcess(dtype).losses;
  std::vector<std::vector<double>> losses(4);
  std::vector<std::vector<std::string>> bucketOrders(4);
  std::vector<std::vector<Tensor>> finalShards(4);
  withRanks(4, [&](int rank, const ProcessGroupPtr& world) {
    const DeviceMesh mesh = DeviceMesh::create(world, {{"dp", 2}, {"tp", 2}});
    auto model = buildGpt(dtype);
    parallelize(*model, mesh, gptParallelPlan({.sequenceParallel = sequenceParallel}));
    // Small buckets, so that there is an order to agree on.
    DistributedDataParallel ddp(model, mesh["dp"], DdpOptions{.bucketCapBytes = 2048, .firstBucketCapBytes = 1024});
    optim::AdamW optimizer(model->parameters(), {.lr = 1e-2});
    const int64_t rowsPerReplica = kGlobalBatch / mesh.size("dp");
    for (int step = 0; step < kSteps; ++step) {
      optimizer.zeroGrad();
      const Tensor rows = globalBatch(step).narrow(0, mesh.coordinate("dp") * rowsPerReplica, rowsPerReplica);
      const Tensor loss = model->nextTokenLoss(ddp(inputsOf(rows)), targetsOf(rows));
      loss.backward();
      optimizer.step();
      // The global batch's loss: the mean of the replicas' (equal halves), with a plain all-reduce.
      Tensor total = loss.detach().clone();
      mesh["dp"]->allreduce(total)->wait();
      losses[static_cast<size_t>(rank)].push_back(total.item<double>() / mesh.size("dp"));
    }
    bucketOrders[static_cast<size_t>(rank)] = ddp.bucketOrder();
    // Every parameter, shards included, is in a bucket exactly once.
    std::vector<std::string> bucketed = ddp.bucketOrder(), names;
    for (const auto& [name, unused] : model->namedParameters()) names.push_back(name);
    std::sort(bucketed.begin(), bucketed.end());
    std::sort(names.begin(), names.end());
    EXPECT_EQ(bucketed, names) << label << " rank " << rank;
    EXPECT_GT(ddp.buckets().size(), 1u) << label;
    for (const Tensor& p : model->parameters()) finalShards[static_cast<size_t>(rank)].push_back(p.detach().clone());
  });
  const double bar = dtype == DType::Float64 ? 1e-10 : 1e-4;
  for (int rank = 0; rank < 4; ++rank) {
    ASSERT_EQ(losses[static_cast<size_t>(rank)].size(), expected.size());
    for (int step = 0; step < kSteps; ++step) {
      const double actual = losses[static_cast<size_t>(rank)][static_cast<size_t>(step)];
      EXPECT_LE(std::abs(actual - expected[static_cast<size_t>(step)]), bar * std::abs(expected[static_cast<size_t>(step)]))
          << label << " rank " << rank << " step " << step << ": " << actual << " vs one process's "
          << expected[static_cast<size_t>(step)];
    }
  }
  // The mesh [dp=2, tp=2] puts ranks 0 and 2 (tp coordinate 0), 1 and 3 in the dp groups.
  for (const auto& [a, b] : {std::pair{0, 2}, std::pair{1, 3}}) {
    EXPECT_FALSE(bucketOrders[static_cast<size_t>(a)].empty()) << label;
    EXPECT_EQ(bucketOrders[static_cast<size_t>(a)], bucketOrders[static_cast<size_t>(b)])
        << label << ": DDP's bucket order differs between ranks " << a << " and " << b << " of one dp group";
    const auto& mine = finalShards[static_cast<size_t>(a)];
    const auto& theirs = finalShards[static_cast<size_t>(b)];
    ASSERT_EQ(mine.size(), theirs.size());
    for (size_t i = 0; i < mine.size(); ++i) {
      EXPECT_EQ(max(abs(mine[i] - theirs[i])).item<double>(), 0.0)
          << label << ": parameter " << i << " differs between the replicas " << a << " and " << b;
    }
  }
}

TEST(TensorParallelComposition, TensorParallelGptUnderDdpOnATwoByTwoMeshMatchesOneProcess) {
  for (bool sequenceParallel : {false, true}) {
    checkTensorParallelUnderDdp(DType::Float64, sequenceParallel);
    checkTensorParallelUnderDdp(DType::Float32, sequenceParallel);
  }
}

constexpr double kMaxNorm = 0.5;     // below the first steps' norms: clipping acts

enum class Sharding { Zero1, Zero2, Full };
const char* shardingName(Sharding s) { return s == Sharding::Zero1 ? "ZeRO-1" : s == Sharding::Zero2 ? "ZeRO-2" : "fully sharded"; }

void expectClose(const std::vector<double>& actual, const std::vector<double>& expected, double bar,
                 const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_LE(std::abs(actual[i] - expected[i]), bar * std::abs(expected[i]))
        << what << " step " << i << ": " << actual[i] << " vs one process's " << expected[i];
  }
}

void checkSharded(Sharding sharding, DType dtype, bool sequenceParallel) {
  const std::string label = str("TP=2 x ", shardingName(sharding), " dp=2", sequenceParallel ? " SP " : " ", toString(dtype));
  const Curve expected = singleProcess(dtype, kMaxNorm);
  ASSERT_GT(expected.norms.front(), kMaxNorm) << "the reference must clip";
  std::vector<Curve> curves(4);
  withRanks(4, [&](int rank, const ProcessGroupPtr& world) {
    const DeviceMesh mesh = DeviceMesh::create(world, {{"dp", 2}, {"tp", 2}});
    auto model = buildGpt(dtype);
    parallelize(*model, mesh, gptParallelPlan({.sequenceParallel = sequenceParallel}));
    const int64_t rowsPerReplica = kGlobalBatch / mesh.size("dp");
    auto rowsAt = [&](int step) {
      return globalBatch(step).narrow(0, mesh.coordinate("dp") * rowsPerReplica, rowsPerReplica);
    };
    std::unique_ptr<DistributedDataParallel> ddp;
    std::unique_ptr<ZeroRedundancy> zero;
    std::unique_ptr<FullyShardedDataParallel> fsdp;
    std::function<Tensor(const Tensor&)> forward;
    if (sharding == Sharding::Full) {
      std::vector<std::shared_ptr<nn::Module>> blocks;
      for (const auto& [name, block] : model->h->namedChildren()) blocks.push_back(block);
      FullyShardOptions options{.units = blocks};
      options.mixedPrecision = {.paramDtype = dtype, .reduceDtype = dtype};  // the reference's precision throughout
      fsdp = std::make_unique<FullyShardedDataParallel>(model, mesh["dp"], options);
      forward = [&](const Tensor& x) { return (*fsdp)(x); };
    } else {
      ddp = std::make_unique<DistributedDataParallel>(model, mesh["dp"],
                                                      DdpOptions{.bucketCapBytes = 2048, .firstBucketCapBytes = 1024});
      forward = [&](const Tensor& x) { return (*ddp)(x); };
      // DDP settles its buckets after one iteration; ZeRO needs them settled (train::Loop does the same).
      const Tensor rows = rowsAt(0);
      model->nextTokenLoss(forward(inputsOf(rows)), targetsOf(rows)).backward();
      model->zeroGrad();
      zero = std::make_unique<ZeroRedundancy>(*ddp, ZeroOptions{.stage = sharding == Sharding::Zero1 ? 1 : 2});
    }
    const std::vector<Tensor> holders = fsdp ? fsdp->parameters() : zero->parameters();
    optim::AdamW optimizer(holders, {.lr = 1e-2});
    Curve& curve = curves[static_cast<size_t>(rank)];
    for (int step = 0; step < kSteps; ++step) {
      optimizer.zeroGrad();
      const Tensor rows = rowsAt(step);
      const Tensor loss = model->nextTokenLoss(forward(inputsOf(rows)), targetsOf(rows));
      loss.backward();
      curve.norms.push_back(clipTensorParallelGradNorm(
          *model, holders, kMaxNorm, mesh["tp"],
          {.reducePartial = fsdp ? fsdp->gradNormReducer() : zero->gradNormReducer()}));
      optimizer.step();
      Tensor total = loss.detach().clone();
      mesh["dp"]->allreduce(total)->wait();
      curve.losses.push_back(total.item<double>() / mesh.size("dp"));
    }
    if (zero) zero->synchronize();
  });
  const double bar = dtype == DType::Float64 ? 1e-10 : 1e-4;
  for (int rank = 0; rank < 4; ++rank) {
    expectClose(curves[static_cast<size_t>(rank)].norms, expected.norms, bar, str(label, " rank ", rank, " norm"));
    expectClose(curves[static_cast<size_t>(rank)].losses, expected.losses, bar, str(label, " rank ", rank, " loss"));
  }
}

TEST(TensorParallelShardedComposition, ZeroOneAndTwoWithTensorParallelClipAndTrainLikeOneProcess) {
  for (Sharding sharding : {Sharding::Zero1, Sharding::Zero2}) {
    for (bool sequenceParallel : {false, true}) {
      checkSharded(sharding, DType::Float64, sequenceParallel);
      checkSharded(sharding, DType::Float32, sequenceParallel);
    }
  }
}

TEST(TensorParallelShardedComposition, FullyShardedOverDpWithTensorParallelInsideClipsAndTrainsLikeOneProcess) {
  for (bool sequenceParallel : {false, true}) {
    checkSharded(Sharding::Full, DType::Float64, sequenceParallel);
    checkSharded(Sharding::Full, DType::Float32, sequenceParallel);
  }
}

}  // namespace
}  // namespace dt::testing
