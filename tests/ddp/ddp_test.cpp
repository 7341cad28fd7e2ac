// DistributedDataParallel with threads as ranks on the Gloo backend:
// equivalence with single-process training in every mode, overlap, errors,
// hooks, join, statistics.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/config.h"
#include "common/errors.h"
#include "common/strings.h"
#include "ddp/ddp.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"
#include "tensor/autograd/autograd.h"
#include "tensor/ops.h"
#include "tensor/optim/optim.h"
#include "tests/ddp/harness.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using testing::expectThrowsWith;
using testing::runRanks;
using testing::TrainSpec;
using ::testing::HasSubstr;

#if DT_HAVE_GLOO

std::shared_ptr<ProcessGroup> makeGroup(const StorePtr& store, int rank, int world,
                                        std::chrono::milliseconds timeout = 30s) {
  ProcessGroupOptions o;
  o.timeout = timeout;
  o.progressInterval = 100ms;
  return ProcessGroup::create(store, rank, world, o);
}

// Runs fn(rank, group) on `world` threads, each with its member of one fresh group.
void onGroup(int world, const std::function<void(int, const std::shared_ptr<ProcessGroup>&)>& fn,
             std::chrono::milliseconds timeout = 30s) {
  auto store = std::make_shared<HashStore>();
  runRanks(world, [&](int rank) { fn(rank, makeGroup(store, rank, world, timeout)); });
}

// Trains `spec` on spec.world threads and checks every rank against the
// single-process reference within `tolerance`.
void expectMatchesReference(const TrainSpec& spec, float tolerance = 2e-5f) {
  const auto reference = testing::referenceParameters(spec);
  auto store = std::make_shared<HashStore>();
  std::vector<std::vector<Tensor>> results(spec.world);
  runRanks(spec.world, [&](int rank) {
    auto group = makeGroup(store, rank, spec.world);
    results[rank] = testing::trainRank(spec, group);
    group->destroy();
  });
  for (int rank = 0; rank < spec.world; ++rank) {
    EXPECT_LE(testing::maxAbsDifference(results[rank], reference), tolerance) << "rank " << rank;
    // Every rank holds bitwise the same parameters.
    EXPECT_EQ(testing::maxAbsDifference(results[rank], results[0]), 0.0f) << "rank " << rank;
  }
}

class DdpEquivalence : public ::testing::TestWithParam<int> {
 protected:
  TrainSpec spec() const {
    TrainSpec s;
    s.world = GetParam();
    return s;
  }
  // Several buckets even for the small test model.
  TrainSpec smallBuckets() const {
    TrainSpec s = spec();
    s.ddp.bucketCapBytes = 300;
    s.ddp.firstBucketCapBytes = 100;
    return s;
  }
};

TEST_P(DdpEquivalence, DefaultOptions) { expectMatchesReference(spec()); }

TEST_P(DdpEquivalence, OneBucketPerParameter) {
  TrainSpec s = spec();
  s.ddp.bucketCapBytes = 0;
  s.ddp.firstBucketCapBytes = 0;
  expectMatchesReference(s);
}

TEST_P(DdpEquivalence, OneBucketForEverything) {
  TrainSpec s = spec();
  s.ddp.firstBucketCapBytes = size_t{1} << 30;
  expectMatchesReference(s);
}

TEST_P(DdpEquivalence, SmallBucketsWithoutGradientViews) {
  TrainSpec s = smallBuckets();
  s.ddp.gradientAsBucketView = false;
  expectMatchesReference(s);
}

TEST_P(DdpEquivalence, FindUnusedParametersWithABranchSomeRanksSkip) {
  TrainSpec s = smallBuckets();
  s.branchy = true;
  s.steps = 7;
  s.ddp.findUnusedParameters = true;
  expectMatchesReference(s);
  s.ddp.gradientAsBucketView = false;
  expectMatchesReference(s);
}

TEST_P(DdpEquivalence, StaticGraphWithAnUnusedLayer) {
  TrainSpec s = smallBuckets();
  s.deadLayer = true;
  s.ddp.staticGraph = true;
  expectMatchesReference(s);
}

TEST_P(DdpEquivalence, NoSyncAccumulatesOverThreeMicroBatches) {
  TrainSpec s = spec();
  s.accumulate = 3;
  expectMatchesReference(s);
  s.ddp.gradientAsBucketView = false;
  expectMatchesReference(s);
}

TEST_P(DdpEquivalence, Float16AndBFloat16Compression) {
  TrainSpec s = spec();
  s.ddp.commHook = fp16CompressHook();
  expectMatchesReference(s, 2e-3f);
  s.ddp.commHook = bf16CompressHook();
  expectMatchesReference(s, 2e-2f);
}

TEST_P(DdpEquivalence, JoinWithUnevenBatchCounts) {
  TrainSpec s = smallBuckets();
  for (int r = 0; r < s.world; ++r) s.stepsPerRank.push_back(5 - r);  // 5, 4, 3, 2
  expectMatchesReference(s);
  s.branchy = true;
  s.ddp.findUnusedParameters = true;
  expectMatchesReference(s);
}

INSTANTIATE_TEST_SUITE_P(World, DdpEquivalence, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return "world" + std::to_string(info.param); });

// CUDA parameters: buckets on the device, allreduce over NCCL, the reducer's
// copies on the caller's stream. One rank per GPU (NCCL 2.28 refuses two
// ranks on one GPU), so with one GPU this is world 1: the buckets, views and
// stream ordering are exercised, the cross-rank sum only with more GPUs.
TEST(Ddp, CudaParametersOverNcclMatchTheCpuReference) {
  if (!deviceAvailable(Device::cuda(0))) GTEST_SKIP() << "needs a CUDA device: " << deviceUnavailableReason(Device::cuda(0));
  for (bool views : {true, false}) {
    TrainSpec s;
    s.world = std::min(deviceCount(DeviceType::CUDA), 2);
    s.ddp.bucketCapBytes = 300;
    s.ddp.firstBucketCapBytes = 100;
    s.ddp.gradientAsBucketView = views;
    const auto reference = testing::referenceParameters(s);
    s.device = Device::cuda(0);
    auto store = std::make_shared<HashStore>();
    std::vector<std::vector<Tensor>> results(s.world);
    runRanks(s.world, [&](int rank) {
      TrainSpec mine = s;
      mine.device = Device::cuda(rank);
      setCurrentDevice(Device::cuda(rank));
      auto group = makeGroup(store, rank, s.world);
      results[rank] = testing::trainRank(mine, group);
      group->destroy();
    });
    // Different kernels (cuBLAS, CUDA reductions) round differently from the CPU's.
    for (int rank = 0; rank < s.world; ++rank) {
      EXPECT_LE(testing::maxAbsDifference(results[rank], reference), 1e-4f) << "rank " << rank << " views " << views;
    }
  }
}

TEST(Ddp, UserCommHookSeesEveryBucketInOrderAndItsResultIsUsed) {
  constexpr int kWorld = 3;
  TrainSpec s;
  s.world = kWorld;
  s.ddp.bucketCapBytes = 0;
  s.ddp.firstBucketCapBytes = 0;
  std::mutex mutex;
  std::vector<std::vector<size_t>> seen(kWorld);
  std::vector<std::string> firstNames(kWorld);
  // A user hook: allreduce, recording what it was given.
  s.ddp.commHook = [&](ProcessGroup& group, GradBucket& bucket) {
    std::lock_guard<std::mutex> lock(mutex);
    seen[group.rank()].push_back(bucket.index);
    EXPECT_EQ(bucket.parameters.size(), 1u);
    EXPECT_EQ(bucket.buffer.numel(), bucket.parameters[0].numel());
    if (bucket.index == 0 && firstNames[group.rank()].empty()) firstNames[group.rank()] = bucket.parameterNames.at(0);
    return group.allreduce(bucket.buffer);
  };
  expectMatchesReference(s);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(seen[r].size() % 6, 0u) << "6 buckets per iteration";
    for (size_t i = 0; i < seen[r].size(); ++i) EXPECT_EQ(seen[r][i], i % 6) << "rank " << r;
    EXPECT_EQ(firstNames[r], "output.bias") << "gradients are ready from the output back";
  }
}

// Batches are unpacked with std::tie rather than structured bindings: Clang before 16 cannot
// capture a structured binding in a lambda, and the sanitizer builds use Clang.
TEST(Ddp, FirstBucketIsOnTheWireBeforeBackwardReachesTheFirstLayer) {
  constexpr int kWorld = 2;
  onGroup(kWorld, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto model = std::make_shared<testing::TestNet>(42, false);
    Tensor firstWeight = model->child("input")->namedParameters()[0].second;
    bool firstLayerHadGradient = true;
    bool duringBackward = false;
    DdpOptions options;
    options.bucketCapBytes = 0;
    options.firstBucketCapBytes = 0;
    options.commHook = [&](ProcessGroup& g, GradBucket& bucket) {
      if (bucket.index == 0) {
        firstLayerHadGradient = firstWeight.grad().defined();
        duringBackward = inBackward();
      }
      return g.allreduce(bucket.buffer);
    };
    DistributedDataParallel ddp(model, group, options);
    for (int step = 0; step < 3; ++step) {
      ddp.zeroGrad();
      Tensor x, y;
      std::tie(x, y) = testing::batchFor(TrainSpec{}, step, 0, rank);
      crossEntropy(ddp(x), y).backward();
      EXPECT_TRUE(duringBackward) << "step " << step;
      EXPECT_FALSE(firstLayerHadGradient) << "bucket 0 waited for the whole backward (step " << step << ")";
      EXPECT_EQ(ddp.lastIteration().bucketsLaunchedInBackward, ddp.buckets().size());
      EXPECT_TRUE(firstWeight.grad().defined());
    }
    EXPECT_EQ(ddp.lastIteration().iteration, 3u);
    EXPECT_GT(ddp.lastIteration().commMs, 0.0);
    EXPECT_GT(ddp.lastIteration().backwardMs, 0.0);
    EXPECT_GE(ddp.lastIteration().exposedCommMs, 0.0);
  });
}

TEST(Ddp, GradientsAreBucketViewsAndStayInPlaceAcrossIterations) {
  onGroup(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto model = std::make_shared<testing::TestNet>(42, false);
    DistributedDataParallel ddp(model, group);
    optim::SGD sgd(ddp.parameters(), {.lr = 0.1});
    std::vector<const void*> before;
    for (int step = 0; step < 3; ++step) {
      sgd.zeroGrad();  // set to none: the next backward fills the same views
      Tensor x, y;
      std::tie(x, y) = testing::batchFor(TrainSpec{}, step, 0, rank);
      crossEntropy(ddp(x), y).backward();
      std::vector<const void*> now;
      for (const auto& p : model->parameters()) now.push_back(p.grad().dataPtr());
      if (step > 0) {
        EXPECT_EQ(now, before) << "step " << step;
      }
      before = now;
      sgd.step();
    }
    // One bucket (the model is small): every gradient lives in one storage.
    ASSERT_EQ(ddp.buckets().size(), 1u);
    const void* storage = model->parameters()[0].grad().storage().data();
    for (const auto& p : model->parameters()) EXPECT_EQ(p.grad().storage().data(), storage);
    // zeroGrad(false) zeroes the views in place.
    ddp.zeroGrad(false);
    for (const auto& p : model->parameters()) EXPECT_EQ(max(abs(p.grad())).item<float>(), 0.0f);
  });
}

TEST(Ddp, BucketsAreRebuiltFromRankZerosObservedOrder) {
  // "head" is registered first but used last, so reverse registration order
  // is wrong; after the first iteration the buckets follow the real order.
  class HeadFirst : public nn::Module {
   public:
    HeadFirst() {
      Generator g(3);
      registerModule("head", std::make_shared<nn::Linear>(12, 3, true, g));
      registerModule("body", std::make_shared<nn::Linear>(6, 12, true, g));
    }
    Tensor forward(const Tensor& x) override { return (*child("head"))(relu((*child("body"))(x))); }
  };
  std::vector<std::vector<std::string>> layouts(3);
  onGroup(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    DistributedDataParallel ddp(std::make_shared<HeadFirst>(), group,
                                {.bucketCapBytes = 0, .firstBucketCapBytes = 0});
    EXPECT_EQ(ddp.buckets().front().parameters, std::vector<std::string>{"body.bias"});
    EXPECT_FALSE(ddp.bucketsRebuilt());
    for (int step = 0; step < 2; ++step) {
      ddp.zeroGrad();
      Tensor x, y;
      std::tie(x, y) = testing::batchFor(TrainSpec{}, step, 0, rank);
      crossEntropy(ddp(x), y).backward();
    }
    EXPECT_TRUE(ddp.bucketsRebuilt());
    for (const auto& b : ddp.buckets()) layouts[rank].push_back(b.parameters.at(0));
  });
  // The engine finishes a layer's weight before its bias.
  EXPECT_EQ(layouts[0], (std::vector<std::string>{"head.weight", "head.bias", "body.weight", "body.bias"}));
  EXPECT_EQ(layouts[1], layouts[0]);
  EXPECT_EQ(layouts[2], layouts[0]);
}

// A saved layout plans the buckets at once: no rebuild, no settling
// iteration, the same buckets as the run that saved it.
TEST(Ddp, ASavedBucketOrderPlansTheSameBucketsWithoutARebuild) {
  std::vector<std::string> saved;
  std::vector<std::vector<std::string>> first;
  onGroup(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    DistributedDataParallel ddp(std::make_shared<testing::TestNet>(1, false), group, {.bucketCapBytes = 300});
    for (int step = 0; step < 2; ++step) {
      ddp.zeroGrad();
      Tensor x, y;
      std::tie(x, y) = testing::batchFor(TrainSpec{}, step, 0, rank);
      crossEntropy(ddp(x), y).backward();
    }
    if (rank == 0) {
      saved = ddp.bucketOrder();
      for (const auto& b : ddp.buckets()) first.push_back(b.parameters);
    }
  });
  onGroup(2, [&](int, const std::shared_ptr<ProcessGroup>& group) {
    DistributedDataParallel ddp(std::make_shared<testing::TestNet>(1, false), group,
                                {.bucketCapBytes = 300, .bucketOrder = saved});
    EXPECT_TRUE(ddp.bucketsRebuilt()) << "a saved layout is final";
    std::vector<std::vector<std::string>> now;
    for (const auto& b : ddp.buckets()) now.push_back(b.parameters);
    EXPECT_EQ(now, first);
  });
  // An order that does not fit the model reads as the caller's problem.
  onGroup(1, [&](int, const std::shared_ptr<ProcessGroup>& group) {
    expectThrowsWith<InvalidArgument>(
        [&] {
          DistributedDataParallel ddp(std::make_shared<testing::TestNet>(1, false), group,
                                      {.bucketOrder = {"no.such.weight"}});
        },
        {"bucket order", "\"no.such.weight\"", "another model"});
    expectThrowsWith<InvalidArgument>(
        [&] {
          DistributedDataParallel ddp(std::make_shared<testing::TestNet>(1, false), group,
                                      {.bucketOrder = {saved.front()}});
        },
        {"bucket order lists 1 parameter indices", "permutation"});
  });
}

// An elastic job that lost a member continues on a smaller group with the
// same buckets: after rebind, the survivors' steps are those of a fresh DDP
// over the smaller group (every rank's batch averaged over the new world).
TEST(Ddp, RebindContinuesOnANewGroupWithTheSameBuckets) {
  auto store = std::make_shared<HashStore>();
  std::vector<std::vector<Tensor>> rebound(2), fresh(2);
  runRanks(3, [&](int rank) {
    auto group = makeGroup(std::make_shared<PrefixStore>("epoch0", store), rank, 3);
    auto model = std::make_shared<testing::TestNet>(7, false);
    DistributedDataParallel ddp(model, group, {.bucketCapBytes = 300});
    optim::SGD sgd(ddp.parameters(), {.lr = 0.1});
    auto step = [&](DistributedDataParallel& d, int s) {
      sgd.zeroGrad();
      Tensor x, y;
      std::tie(x, y) = testing::batchFor(TrainSpec{}, s, 0, rank);
      crossEntropy(d(x), y).backward();
      sgd.step();
    };
    step(ddp, 0);
    step(ddp, 1);
    if (rank == 2) return;  // "dies" between steps
    const auto buckets = ddp.bucketOrder();
    auto smaller = makeGroup(std::make_shared<PrefixStore>("epoch1", store), rank, 2);
    ddp.rebind(smaller);
    EXPECT_EQ(ddp.bucketOrder(), buckets);
    EXPECT_EQ(ddp.processGroup().size(), 2);
    std::vector<Tensor> before;
    for (const auto& p : model->parameters()) before.push_back(p.clone());
    step(ddp, 2);
    for (const auto& p : model->parameters()) rebound[rank].push_back(p.clone());
    // The same step by a DDP built on the smaller group from the same values.
    auto twin = std::make_shared<testing::TestNet>(7, false);
    {
      NoGradGuard noGrad;
      auto params = twin->parameters();
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(before[i]);
    }
    auto twinGroup = makeGroup(std::make_shared<PrefixStore>("twin", store), rank, 2);
    DistributedDataParallel other(twin, twinGroup, {.bucketCapBytes = 300, .bucketOrder = buckets});
    optim::SGD twinSgd(other.parameters(), {.lr = 0.1});
    twinSgd.zeroGrad();
    Tensor x, y;
    std::tie(x, y) = testing::batchFor(TrainSpec{}, 2, 0, rank);
    crossEntropy(other(x), y).backward();
    twinSgd.step();
    for (const auto& p : twin->parameters()) fresh[rank].push_back(p.clone());
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(testing::maxAbsDifference(rebound[rank], fresh[rank]), 0.0f) << "rank " << rank;
  }
}

TEST(Ddp, MismatchedModelsNameTheParameterAndTheRanksOnEveryRank) {
  onGroup(4, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    Generator g(1);
    const int64_t hidden = rank >= 2 ? 17 : 16;
    auto model = std::make_shared<nn::Sequential>(std::vector<std::shared_ptr<nn::Module>>{
        std::make_shared<nn::Linear>(8, 16, true, g), std::make_shared<nn::ReLU>(),
        std::make_shared<nn::Linear>(16, hidden, true, g)});
    expectThrowsWith<InvalidArgument>(
        [&] { DistributedDataParallel ddp(model, group); },
        {"differ at parameter #2", "rank 0 has 2.weight: float32[16, 16] on cpu",
         "ranks 2-3 have 2.weight: float32[17, 16] on cpu", str("[rank ", rank, "/4 pg=default]")});
  });
  // A rank with one parameter more.
  onGroup(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto model = std::make_shared<testing::TestNet>(42, rank == 1);
    expectThrowsWith<InvalidArgument>([&] { DistributedDataParallel ddp(model, group); },
                                      {"differ at parameter #6", "rank 0 has no parameter #6 (it has 6)",
                                       "rank 1 has dead.weight: float32[2, 12] on cpu"});
  });
}

TEST(Ddp, ParameterWithoutGradientIsNamedAtTheEndOfThatBackward) {
  onGroup(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto model = std::make_shared<testing::TestNet>(42, /*deadLayer=*/true);
    DistributedDataParallel ddp(model, group);
    Tensor x, y;
    std::tie(x, y) = testing::batchFor(TrainSpec{}, 0, 0, rank);
    const std::string message = expectThrowsWith<InvalidArgument>(
        [&] { crossEntropy(ddp(x), y).backward(); },
        {"iteration 1) ended but 2 of 8 parameters got no gradient: dead.weight, dead.bias",
         "findUnusedParameters = true", str("rank ", rank, "/2")});
    EXPECT_FALSE(inBackward());
  });
}

TEST(Ddp, UnusedParametersKeepTheirGradientUntouched) {
  onGroup(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto model = std::make_shared<testing::TestNet>(42, true);
    DistributedDataParallel ddp(model, group, {.findUnusedParameters = true});
    Tensor deadWeight = model->child("dead")->namedParameters()[0].second;
    Tensor x, y;
    std::tie(x, y) = testing::batchFor(TrainSpec{}, 0, 0, rank);
    crossEntropy(ddp(x), y).backward();
    EXPECT_FALSE(deadWeight.grad().defined()) << "undefined stays undefined";
    EXPECT_EQ(ddp.lastIteration().unusedParameters, 2u);
    // A defined gradient (accumulated by hand) survives a backward that did not use it.
    NoGradGuard noGrad;
    deadWeight.setGrad(full(deadWeight.sizes(), 0.25 + rank));
    EnableGradGuard grad;
    crossEntropy(ddp(x), y).backward();
    EXPECT_EQ(deadWeight.grad().toVector<float>(), std::vector<float>(24, 0.25f + rank));
  });
}

TEST(Ddp, ReentrantBackwardNeedsStaticGraph) {
  // A checkpoint-like node recomputes the skip layer in an inner backward pass;
  // the skip layer is also used outside it, so its hooks fire twice.
  class Recompute final : public Node {
   public:
    Recompute(std::shared_ptr<nn::Module> layer, Tensor input) : layer_(std::move(layer)), input_(std::move(input)) {}
    TensorList apply(TensorList&& grads) override {
      EnableGradGuard grad;
      Tensor x = input_.detach().setRequiresGrad(true);
      Tensor out = (*layer_)(x);
      backward({out}, {grads.at(0)});
      return {x.grad()};
    }
    std::string name() const override { return "Recompute"; }

   private:
    std::shared_ptr<nn::Module> layer_;
    Tensor input_;
  };
  class Checkpointed : public nn::Module {
   public:
    Checkpointed() {
      Generator g(9);
      registerModule("body", std::make_shared<nn::Linear>(6, 6, true, g));
      registerModule("head", std::make_shared<nn::Linear>(6, 3, true, g));
    }
    Tensor forward(const Tensor& x) override {
      auto body = child("body");
      Tensor inner;
      {
        NoGradGuard noGrad;
        inner = (*body)(x);
      }
      autograd::recordNode(std::make_shared<Recompute>(body, x), {x.detach().setRequiresGrad(true)}, {&inner});
      return (*child("head"))(relu((*body)(relu(inner))));  // body used again outside the checkpoint
    }
  };
  for (bool staticGraph : {false, true}) {
    std::vector<std::vector<Tensor>> grads(2);
    onGroup(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
      auto model = std::make_shared<Checkpointed>();
      DistributedDataParallel ddp(model, group, {.staticGraph = staticGraph});
      for (int step = 0; step < 3; ++step) {
        ddp.zeroGrad();
        Tensor x, y;
        std::tie(x, y) = testing::batchFor(TrainSpec{}, step, 0, rank);
        if (!staticGraph) {
          expectThrowsWith<InvalidArgument>([&] { crossEntropy(ddp(x), y).backward(); },
                                            {"body.", "second gradient in one backward", "staticGraph = true"});
          return;
        }
        crossEntropy(ddp(x), y).backward();
      }
      for (const auto& p : model->parameters()) grads[rank].push_back(p.grad().clone());
    });
    if (!staticGraph) continue;
    // Against the same three steps' gradients computed without DDP.
    auto reference = std::make_shared<Checkpointed>();
    reference->zeroGrad();
    for (int rank = 0; rank < 2; ++rank) {
      Tensor x, y;
      std::tie(x, y) = testing::batchFor(TrainSpec{}, 2, 0, rank);
      mul(crossEntropy((*reference)(x), y), 0.5).backward();
    }
    std::vector<Tensor> expected;
    for (const auto& p : reference->parameters()) expected.push_back(p.grad());
    EXPECT_LE(testing::maxAbsDifference(grads[0], expected), 1e-6f);
    EXPECT_EQ(testing::maxAbsDifference(grads[1], grads[0]), 0.0f);
  }
}

TEST(Ddp, RankThatSkipsABackwardIsNamedByTheTimeout) {
  std::mutex mutex;
  std::condition_variable cv;
  bool rank0Done = false;
  onGroup(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto model = std::make_shared<testing::TestNet>(42, false);
    DistributedDataParallel ddp(model, group);
    Tensor x, y;
    std::tie(x, y) = testing::batchFor(TrainSpec{}, 0, 0, rank);
    crossEntropy(ddp(x), y).backward();  // step 1: both
    if (rank == 1) {
      Tensor out = ddp(x);  // step 2: forward, then no backward
      std::unique_lock<std::mutex> lock(mutex);
      cv.wait(lock, [&] { return rank0Done; });
      return;
    }
    expectThrowsWith<TimeoutError>([&] { crossEntropy(ddp(x), y).backward(); },
                                   {"DDP bucket 0 of 1", "allreduce", "rank 1"});
    std::lock_guard<std::mutex> lock(mutex);
    rank0Done = true;
    cv.notify_all();
  }, 2s);
}

TEST(Ddp, BackwardOutsideAnIterationIsAnErrorUnlessInNoSync) {
  onGroup(1, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto model = std::make_shared<testing::TestNet>(42, false);
    DistributedDataParallel ddp(model, group);
    Tensor x, y;
    std::tie(x, y) = testing::batchFor(TrainSpec{}, 0, 0, rank);
    expectThrowsWith<InvalidArgument>([&] { crossEntropy((*model)(x), y).backward(); },
                                      {"outside a DDP iteration", "call ddp(input), not the wrapped module"});
    EXPECT_FALSE(inBackward());
    {
      auto guard = ddp.noSync();
      crossEntropy((*model)(x), y).backward();  // local accumulation is fine here
    }
    // Evaluation under NoGradGuard issues no collectives and needs no backward.
    NoGradGuard noGrad;
    EXPECT_EQ(ddp(x).sizes(), (Shape{4, 3}));
  });
}

TEST(Ddp, DestroyingDdpRemovesItsHooksAndGradientBuffers) {
  onGroup(1, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto model = std::make_shared<testing::TestNet>(42, false);
    {
      DistributedDataParallel ddp(model, group);
      Tensor x, y;
      std::tie(x, y) = testing::batchFor(TrainSpec{}, 0, 0, rank);
      crossEntropy(ddp(x), y).backward();
    }
    for (const auto& p : model->parameters()) {
      EXPECT_TRUE(p.autogradMeta()->postAccumulateHooks.empty());
      EXPECT_FALSE(p.autogradMeta()->gradBuffer.defined());
    }
    model->zeroGrad();
    Tensor x, y;
    std::tie(x, y) = testing::batchFor(TrainSpec{}, 1, 0, rank);
    crossEntropy((*model)(x), y).backward();  // a plain backward again
  });
}

TEST(Ddp, LogPrintsTheBucketTableAndSummaries) {
  testing::ScopedEnv log("DT_DDP_LOG", "1");
  testing::ScopedEnv every("DT_DDP_LOG_EVERY", "2");
  ::testing::internal::CaptureStderr();
  onGroup(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    DistributedDataParallel ddp(std::make_shared<testing::TestNet>(42, false), group,
                                {.bucketCapBytes = 300, .firstBucketCapBytes = 100});
    for (int step = 0; step < 4; ++step) {
      ddp.zeroGrad();
      Tensor x, y;
      std::tie(x, y) = testing::batchFor(TrainSpec{}, step, 0, rank);
      crossEntropy(ddp(x), y).backward();
    }
  });
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr("[ddp] [rank 0/2 pg=default] 4 buckets (rebuilt from the observed gradient order)"));
  EXPECT_THAT(err, HasSubstr("output.weight .. output.weight"));
  EXPECT_THAT(err, HasSubstr("iteration 2: forward"));
  EXPECT_THAT(err, HasSubstr("iteration 4: forward"));
  EXPECT_THAT(err, ::testing::Not(HasSubstr("rank 1/2"))) << "rank 0 only";
}

TEST(Ddp, BuffersFollowRankZeroBeforeEveryTrainingForwardButNotInEvaluation) {
  // A running statistic each rank updates from its own data, as batch norm does.
  class WithRunningMean : public nn::Module {
   public:
    explicit WithRunningMean(int rank) {
      Generator g(5);
      registerModule("layer", std::make_shared<nn::Linear>(6, 3, true, g));
      running = registerBuffer("running", full({6}, 100.0 + rank));
    }
    Tensor forward(const Tensor& x) override {
      NoGradGuard noGrad;
      mul_(running, 0.5);
      add_(running, mean(x, {0}), 0.5);
      EnableGradGuard grad;
      return (*child("layer"))(x);
    }
    Tensor running;
  };
  std::vector<std::vector<float>> seen(3);
  onGroup(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto model = std::make_shared<WithRunningMean>(rank);
    DistributedDataParallel ddp(model, group);
    EXPECT_EQ(model->running.toVector<float>(), std::vector<float>(6, 100.0f)) << "rank 0's at construction";
    for (int step = 0; step < 3; ++step) {
      Tensor x, y;
      std::tie(x, y) = testing::batchFor(TrainSpec{}, step, 0, rank);
      crossEntropy(ddp(x), y).backward();
      // The forward started from rank 0's buffer: undo this rank's own update to see it.
      Tensor started = sub(mul(model->running, 2.0), mean(x, {0}));
      seen[rank] = started.toVector<float>();
    }
    // Evaluation forwards issue no collectives: each rank keeps its own update.
    NoGradGuard noGrad;
    Tensor x, y;
    std::tie(x, y) = testing::batchFor(TrainSpec{}, 9, 0, rank);
    const Tensor before = model->running.clone();
    ddp(x);
    EXPECT_LE(max(abs(sub(model->running, add(mul(before, 0.5), mean(x, {0}), 0.5)))).item<float>(), 1e-6f);
  });
  for (int r = 1; r < 3; ++r) {
    ASSERT_EQ(seen[r].size(), seen[0].size());
    for (size_t i = 0; i < seen[0].size(); ++i) EXPECT_NEAR(seen[r][i], seen[0][i], 1e-5) << "rank " << r;
  }
}

TEST(Ddp, JoinWithStaticGraphIsNotSupported) {
  onGroup(1, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    DistributedDataParallel ddp(std::make_shared<testing::TestNet>(42, false), group, {.staticGraph = true});
    expectThrowsWith<NotSupportedError>([&] { ddp.join([] {}); }, {"join", "staticGraph"});
  });
}

// A zero-bubble pipeline's split backward under DDP (dt::backwardDeferringWeights): the first
// pass computes no weight gradient, so no bucket is ready and nothing is reduced; run() computes
// them, each parameter's post-accumulate hook marks it ready (DDP reduces its buckets then), and
// DDP's end-of-backward callback, queued in the first pass, finalizes after them. The averaged
// gradients equal a plain backward's, and the next iteration starts cleanly.
TEST(Ddp, SplitBackwardReducesWhenTheWeightGradientsAreComputed) {
  onGroup(2, [](int rank, const std::shared_ptr<ProcessGroup>& group) {
    Generator init(17);
    auto model = std::make_shared<nn::Sequential>();
    model->pushBack(std::make_shared<nn::Linear>(8, 16, true, init));
    model->pushBack(std::make_shared<nn::GELU>());
    model->pushBack(std::make_shared<nn::Linear>(16, 4, true, init));
    DistributedDataParallel ddp(model, group, DdpOptions{.bucketCapBytes = 256, .firstBucketCapBytes = 128});
    std::vector<Tensor> params = model->parameters();
    Generator data(100 + static_cast<uint64_t>(rank));
    const Tensor x = randn({5, 8}, data);
    auto lossOf = [&] {
      const Tensor y = ddp(x);
      return sum(mul(y, y.detach()));
    };

    lossOf().backward();
    std::vector<Tensor> expected;
    for (const Tensor& p : params) expected.push_back(p.grad().clone());
    zeroGrads(params, /*setToNone=*/true);

    WeightGradients later = backwardDeferringWeights({lossOf()}, {}, params);
    for (const Tensor& p : params) EXPECT_FALSE(p.grad().defined()) << "rank " << rank << ": a gradient before run()";
    later.run();
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(params[i].grad().defined()) << "rank " << rank << " parameter " << i;
      EXPECT_TRUE(allclose(params[i].grad(), expected[i], 0, 0)) << "rank " << rank << " parameter " << i;
    }
    // DDP finalized the split iteration: a plain one follows without complaint.
    zeroGrads(params, true);
    lossOf().backward();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(allclose(params[i].grad(), expected[i], 0, 0));
  });
}

#else

TEST(Ddp, NeedsGloo) { GTEST_SKIP() << "this build has no Gloo backend (DT_HAVE_GLOO=0); DDP's tests need one"; }

#endif

}  // namespace
}  // namespace dt
