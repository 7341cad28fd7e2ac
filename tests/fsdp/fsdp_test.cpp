// The sharded wrapper and ZeRO on DDP's buckets against DDP (threads as ranks on shm): the
// GPT model trained 20 steps ends with DDP's parameters within float32 reassociation at
// world 1 to 4, with and without resharding after forward, with and without prefetch, with
// gradient accumulation, activation checkpointing and unused parameters; bfloat16 within its
// precision; uneven last shards; the bound on gathered units; the diagnostics (different
// units, units in different orders, late gradients); the profiler's tracks; anomaly mode.
#include <cmath>
#include <cstdio>
#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/anomaly.h"
#include "tensor/profiler.h"
#include "tests/fsdp/harness.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kSteps = 20;
// float32 reassociation (the bound): max |difference| / max |parameter|.
constexpr double kReassociation = 1e-5;

RunSpec spec(Wrapper wrapper) {
  RunSpec s;
  s.wrapper = wrapper;
  return s;
}

TEST(Sharded, GptMatchesDdpAtWorldOneToFour) {
  for (int world = 1; world <= 4; ++world) {
    const auto ddp = trainedParameters(spec(Wrapper::Ddp), world, kSteps);
    const auto sharded = trainedParameters(spec(Wrapper::Sharded), world, kSteps);
    const double difference = relativeDifference(ddp, sharded);
    std::printf("world %d: sharded vs DDP after %lld steps: max |difference| / max |parameter| = %.3g\n", world,
                static_cast<long long>(kSteps), difference);
    EXPECT_LT(difference, kReassociation) << "world " << world;
  }
}

TEST(Sharded, WithoutReshardAfterForwardWithoutAndWithMorePrefetchStillMatchDdp) {
  const auto ddp = trainedParameters(spec(Wrapper::Ddp), 4, kSteps);
  RunSpec keep = spec(Wrapper::Sharded);
  keep.sharded.reshardAfterForward = false;
  EXPECT_LT(relativeDifference(ddp, trainedParameters(keep, 4, kSteps)), kReassociation) << "reshardAfterForward off";
  RunSpec none = spec(Wrapper::Sharded);
  none.sharded.prefetch = 0;
  EXPECT_LT(relativeDifference(ddp, trainedParameters(none, 4, kSteps)), kReassociation) << "no prefetch";
  RunSpec more = spec(Wrapper::Sharded);
  more.sharded.prefetch = 2;
  more.sharded.maxGatheredUnits = 3;
  EXPECT_LT(relativeDifference(ddp, trainedParameters(more, 4, kSteps)), kReassociation) << "prefetch 2";
}

TEST(Sharded, Bfloat16ComputeStaysWithinTheFormatsPrecision) {
  const auto ddp = trainedParameters(spec(Wrapper::Ddp), 2, kSteps);
  RunSpec bf16 = spec(Wrapper::Sharded);
  bf16.sharded.mixedPrecision = {.paramDtype = DType::BFloat16, .reduceDtype = DType::Float32};
  const auto mixed = trainedParameters(bf16, 2, kSteps);
  // bfloat16 keeps 8 significant bits (2^-8 = 0.4 %): 20 AdamW steps of at most lr each move
  // the parameters by a few lr; the bfloat16 forward and backward change their direction
  // within that precision, not their size.
  const double difference = relativeDifference(ddp, mixed);
  std::printf("bfloat16 compute vs DDP in float32: %.3g\n", difference);
  EXPECT_GT(difference, kReassociation) << "the compute really ran in bfloat16";
  EXPECT_LT(difference, 0.02) << "but within bfloat16's precision of DDP in float32";
  RunSpec bf16Wire = bf16;
  bf16Wire.sharded.mixedPrecision.reduceDtype = DType::BFloat16;
  EXPECT_LT(relativeDifference(ddp, trainedParameters(bf16Wire, 2, kSteps)), 0.02) << "bfloat16 reduce too";
}

TEST(Sharded, UnevenLastShardsArePaddedAndThePaddingStaysZero) {
  withRanks(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    TrainingRank job(spec(Wrapper::Sharded), group);
    job.train(0, 2);
    const auto shards = job.sharded()->parameters();
    const Tensor& wte = shards.front();  // 61 rows: 21, 21, 19
    EXPECT_EQ(wte.sizes(), (Shape{21, 16}));
    EXPECT_EQ(job.model().wte->weight.sizes(), (Shape{rank == 2 ? 19 : 21, 16})) << "the model holds its rows";
    if (rank == 2) {
      EXPECT_EQ(max(abs(wte.narrow(0, 19, 2))).item<float>(), 0.0f) << "padding rows";
      EXPECT_EQ(max(abs(wte.grad().narrow(0, 19, 2))).item<float>(), 0.0f) << "padding gradients";
    }
  });
}

TEST(Sharded, AtMostMaxGatheredUnitsAreGatheredAtOnce) {
  for (int prefetch : {1, 3}) {
    withRanks(2, [&](int, const std::shared_ptr<ProcessGroup>& group) {
      RunSpec s = spec(Wrapper::Sharded);
      s.model = smallGpt(4);
      s.sharded.prefetch = prefetch;
      s.sharded.maxGatheredUnits = 2;
      TrainingRank job(s, group);
      job.train(0, 3);
      const auto& stats = job.sharded()->lastIteration();
      EXPECT_LE(stats.peakGatheredUnits, 2u) << "prefetch " << prefetch;
      EXPECT_GE(stats.peakGatheredUnits, 2u) << "prefetch " << prefetch << " does gather ahead";
      // Per block: a gather in forward, one in backward, one reduce-scatter; the root once each.
      EXPECT_EQ(stats.gathers, 4u * 2 + 1);
      EXPECT_EQ(stats.reduceScatters, 4u + 1);
    });
  }
  withRanks(2, [&](int, const std::shared_ptr<ProcessGroup>& group) {
    RunSpec s = spec(Wrapper::Sharded);
    s.model = smallGpt(4);
    s.sharded.reshardAfterForward = false;
    TrainingRank job(s, group);
    job.train(0, 2);
    EXPECT_EQ(job.sharded()->lastIteration().peakGatheredUnits, 4u) << "every block stays gathered until its backward";
    EXPECT_EQ(job.sharded()->lastIteration().gathers, 4u + 1) << "and is gathered once";
  });
}

TEST(Sharded, GradientAccumulationWithNoSyncMatchesDdp) {
  RunSpec ddp = spec(Wrapper::Ddp), sharded = spec(Wrapper::Sharded);
  ddp.microBatches = sharded.microBatches = 3;
  EXPECT_LT(relativeDifference(trainedParameters(ddp, 2, 8), trainedParameters(sharded, 2, 8)), kReassociation);
}

// A pipeline's way (train/loop.h): the parameters gathered once for all of a step's
// micro-batches, the gradients accumulated whole and reduce-scattered once.
TEST(Sharded, WholeParametersAcrossMicroBatchesMatchDdpAndGatherOncePerStep) {
  RunSpec ddp = spec(Wrapper::Ddp), sharded = spec(Wrapper::Sharded);
  ddp.microBatches = sharded.microBatches = 3;
  sharded.wholeAcrossMicroBatches = true;
  EXPECT_LT(relativeDifference(trainedParameters(ddp, 2, 8), trainedParameters(sharded, 2, 8)), kReassociation);
  withRanks(2, [&](int, const std::shared_ptr<ProcessGroup>& group) {
    RunSpec s = sharded;
    s.model = smallGpt(4);
    TrainingRank job(s, group);
    job.train(0, 2);
    const auto& stats = job.sharded()->lastIteration();
    EXPECT_EQ(stats.gathers, 4u + 1) << "each block and the root once per step, not once per micro-batch (3)";
    EXPECT_EQ(stats.reduceScatters, 4u + 1);
    EXPECT_EQ(job.sharded()->totals().gathers, 2u * (4 + 1)) << "two steps";
  });
  withRanks(2, [&](int, const std::shared_ptr<ProcessGroup>& group) {
    TrainingRank job(sharded, group);
    EXPECT_THAT([&] { job.sharded()->reduceGradients(); },
                ::testing::ThrowsMessage<InvalidArgument>(HasSubstr("reduceGradients outside a gatherFullParameters() guard")));
  });
}

TEST(Sharded, ActivationCheckpointingMatchesAndGathersNothingMore) {
  RunSpec ddp = spec(Wrapper::Ddp), sharded = spec(Wrapper::Sharded);
  ddp.model.activationCheckpointing = sharded.model.activationCheckpointing = true;
  const auto reference = trainedParameters(spec(Wrapper::Ddp), 2, 8);
  EXPECT_LT(relativeDifference(reference, trainedParameters(ddp, 2, 8)), kReassociation) << "DDP with checkpointing";
  EXPECT_LT(relativeDifference(reference, trainedParameters(sharded, 2, 8)), kReassociation);
  withRanks(2, [&](int, const std::shared_ptr<ProcessGroup>& group) {
    TrainingRank job(sharded, group);
    job.train(0, 2);
    EXPECT_EQ(job.sharded()->lastIteration().gathers, 2u * 2 + 1) << "the recomputation runs while the block is gathered";
  });
}

// A unit with a layer its forward never uses: its shards get zero gradients, the rest
// trains as DDP with findUnusedParameters does.
class Branchy : public nn::Module {
 public:
  explicit Branchy(Generator& g) {
    used = registerModule("used", std::make_shared<nn::Linear>(4, 4, true, g));
    unused = registerModule("unused", std::make_shared<nn::Linear>(4, 4, true, g));
  }
  Tensor forward(const Tensor& x) override { return add(x, relu((*used)(x))); }
  std::shared_ptr<nn::Linear> used, unused;
};

class TwoBlocks : public nn::Module {
 public:
  explicit TwoBlocks(Generator& g) {
    a = registerModule("a", std::make_shared<Branchy>(g));
    b = registerModule("b", std::make_shared<Branchy>(g));
    head = registerModule("head", std::make_shared<nn::Linear>(4, 2, true, g));
  }
  Tensor forward(const Tensor& x) override { return (*head)((*b)((*a)(x))); }
  std::shared_ptr<Branchy> a, b;
  std::shared_ptr<nn::Linear> head;
};

TEST(Sharded, UnusedParametersGetZeroGradientsAndTheRestMatchesDdp) {
  std::vector<std::vector<Tensor>> grads(2);
  for (int mode = 0; mode < 2; ++mode) {
    withRanks(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
      Generator g(3);
      auto model = std::make_shared<TwoBlocks>(g);
      Generator data(10 + static_cast<uint64_t>(rank));
      const Tensor x = randn({3, 4}, data);
      std::vector<Tensor> out;
      if (mode == 0) {
        DistributedDataParallel ddp(model, group, {.findUnusedParameters = true});
        sum(ddp(x)).backward();
        for (const auto& [name, p] : model->namedParameters()) {
          out.push_back(p.grad().defined() ? p.grad().clone() : zerosLike(p));
        }
      } else {
        FullyShardedDataParallel fsdp(model, group, {.units = {model->a, model->b}});
        sum(fsdp(x)).backward();
        out = gatherShards(*group, fsdp.parameters(), fsdp.parameterMap(), [](const Tensor& s) { return s.grad(); });
        const auto names = model->namedParameters();
        for (size_t i = 0; i < names.size(); ++i) {
          if (names[i].first.find("unused") != std::string::npos) {
            EXPECT_EQ(max(abs(out[i])).item<float>(), 0.0f) << names[i].first;
          }
        }
      }
      if (rank == 0) grads[static_cast<size_t>(mode)] = out;
    });
  }
  EXPECT_LT(relativeDifference(grads[0], grads[1]), kReassociation);
}

TEST(Sharded, RanksThatWrapDifferentUnitsAreToldWhichAndWho) {
  std::vector<std::string> messages(2);
  withRanks(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    Generator g(3);
    auto model = std::make_shared<TwoBlocks>(g);
    std::vector<std::shared_ptr<nn::Module>> units{model->a};
    if (rank == 0) units.push_back(model->b);
    try {
      FullyShardedDataParallel fsdp(model, group, {.units = units});
    } catch (const InvalidArgument& e) {
      messages[static_cast<size_t>(rank)] = e.what();
    }
  });
  for (const auto& m : messages) {
    EXPECT_THAT(m, HasSubstr("the ranks' sharded models differ"));
    EXPECT_THAT(m, HasSubstr("rank 0 has unit 'b'"));
    EXPECT_THAT(m, HasSubstr("rank 1 has unit '(root)'"));
  }
}

TEST(Sharded, UnitsSwappedAcrossRanksAreADesyncNamingBoth) {
  std::vector<std::string> messages(2);
  withRanks(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    Generator g(3);
    auto model = std::make_shared<TwoBlocks>(g);
    FullyShardedDataParallel fsdp(model, group, {.units = {model->a, model->b}, .prefetch = 0});
    Generator data(1);
    const Tensor x = randn({3, 4}, data);
    try {
      // Rank 1 runs b before a: the same shapes, another order.
      Tensor h = rank == 0 ? (*model->a)(x) : (*model->b)(x);
      h = rank == 0 ? (*model->b)(h) : (*model->a)(h);
      (void)h;
    } catch (const DesyncError& e) {
      messages[static_cast<size_t>(rank)] = e.what();
    }
  });
  for (const auto& m : messages) {
    EXPECT_THAT(m, HasSubstr("gathered different units in one collective"));
    EXPECT_THAT(m, HasSubstr("rank 0 gathered unit 'a' (forward)"));
    EXPECT_THAT(m, HasSubstr("rank 1 gathered unit 'b' (forward)"));
  }
}

TEST(Sharded, TheProfilerShowsGathersAndReduceScattersOnTracksOfTheirOwn) {
  Profiler profiler;
  withRanks(2, [&](int, const std::shared_ptr<ProcessGroup>& group) {
    TrainingRank job(spec(Wrapper::Sharded), group);
    job.train(0, 1);
  });
  profiler.stop();
  size_t gathers = 0, reduces = 0;
  std::set<std::string> tracks;
  for (const ProfileEvent& e : profiler.events()) {
    if (e.category != EventCategory::Sharded) continue;
    (e.name == "sharded gather" ? gathers : reduces) += 1;
    tracks.insert(e.trackName);
    EXPECT_THAT(e.args, HasSubstr("\"unit\": "));
  }
  EXPECT_EQ(gathers, 2u * (2 * 2 + 1)) << "two ranks: two blocks twice, the root once";
  EXPECT_EQ(reduces, 2u * 3);
  EXPECT_TRUE(tracks.count("sharded gather h.0") && tracks.count("sharded reduce-scatter (root)"));
}

TEST(Sharded, AnomalyModeNamesTheOpAndTheModuleInsideAUnit) {
  std::vector<std::string> messages(2);
  withRanks(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    TrainingRank job(spec(Wrapper::Sharded), group);
    job.train(0, 1);
    {
      NoGradGuard noGrad;
      // Rank 0 holds row 0 of block 1's MLP input layer: a huge (finite) weight there makes
      // that layer's product overflow on both ranks.
      if (rank == 0) job.sharded()->parameters()[2 + 12 + 8].narrow(0, 0, 1).fill_(3e38);
    }
    AnomalyMode anomaly({.checkForward = true});
    try {
      job.train(1, 2);
    } catch (const AnomalyError& e) {
      messages[static_cast<size_t>(rank)] = e.what();
    }
  });
  for (const auto& m : messages) EXPECT_THAT(m, HasSubstr("h.1.mlp.c_fc"));
}

TEST(Zero, StagesOneAndTwoMatchDdpAndShardTheOptimizerState) {
  for (int world : {2, 3}) {
    const auto ddp = trainedParameters(spec(Wrapper::Ddp), world, kSteps);
    EXPECT_LT(relativeDifference(ddp, trainedParameters(spec(Wrapper::Zero1), world, kSteps)), kReassociation)
        << "ZeRO-1 at world " << world;
    EXPECT_LT(relativeDifference(ddp, trainedParameters(spec(Wrapper::Zero2), world, kSteps)), kReassociation)
        << "ZeRO-2 at world " << world;
  }
  withRanks(3, [&](int, const std::shared_ptr<ProcessGroup>& group) {
    TrainingRank job(spec(Wrapper::Zero2), group);
    job.train(0, 2);
    int64_t state = 0, total = 0;
    for (const auto& [name, t] : job.optimizer().stateDict()) state += t.numel() > 1 ? t.numel() : 0;
    for (const Tensor& p : job.model().parameters()) total += p.numel();
    EXPECT_LE(state, 2 * (total / 3 + 64)) << "AdamW's two moments exist for this rank's third only";
    EXPECT_GT(job.zero()->stats().releasedBuckets, 0u) << "stage 2 frees the gradient buckets";
    EXPECT_EQ(job.zero()->stats().steps, 1u) << "the parameters were gathered before the second step's forward";
  });
  // Without the thrown-away iteration DDP rebuilds its buckets after the first real one:
  // ZeRO's parts follow, with that iteration's gradients.
  RunSpec unsettled = spec(Wrapper::Zero1), unsettledDdp = spec(Wrapper::Ddp);
  unsettled.settle = unsettledDdp.settle = false;
  const auto unsettledReference = trainedParameters(unsettledDdp, 3, 6);
  EXPECT_LT(relativeDifference(unsettledReference, trainedParameters(unsettled, 3, 6)), kReassociation)
      << "ZeRO across DDP's rebuild";
  // ZeRO-2 across DDP's rebuild too, over many small buckets (GptE2e.EveryShardingMode... is
  // the case whose rebuild moves parameters between buckets).
  unsettled.wrapper = Wrapper::Zero2;
  unsettled.ddp.bucketCapBytes = unsettled.ddp.firstBucketCapBytes = unsettledDdp.ddp.bucketCapBytes =
      unsettledDdp.ddp.firstBucketCapBytes = 2048;
  EXPECT_LT(relativeDifference(trainedParameters(unsettledDdp, 3, 6), trainedParameters(unsettled, 3, 6)), kReassociation)
      << "ZeRO-2 across DDP's rebuild";
  RunSpec accumulate = spec(Wrapper::Zero2), reference = spec(Wrapper::Ddp);
  accumulate.microBatches = reference.microBatches = 2;
  EXPECT_LT(relativeDifference(trainedParameters(reference, 2, 6), trainedParameters(accumulate, 2, 6)), kReassociation)
      << "ZeRO-2 with noSync accumulation";
}

}  // namespace
}  // namespace dt::testing
