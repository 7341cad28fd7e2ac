// The profiler sees process-group collectives and DDP buckets (tensor/profiler.h):
// threads as ranks, each rank its own pid in the trace.
#include <algorithm>
#include <map>
#include <string>

#include <gtest/gtest.h>

#include "common/config.h"
#include "ddp/ddp.h"
#include "process_group/process_group.h"
#include "store/hash_store.h"
#include "tensor/nn/module.h"
#include "tensor/ops.h"
#include "tensor/profiler.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;

std::shared_ptr<ProcessGroup> makeGroup(const StorePtr& store, int rank, int world) {
  ProcessGroupOptions o;
  o.timeout = 30s;
  o.progressInterval = 100ms;
  return ProcessGroup::create(store, rank, world, o);
}

std::vector<const ProfileEvent*> eventsOf(const Profiler& profiler, EventCategory category, int rank) {
  std::vector<const ProfileEvent*> out;
  for (const auto& e : profiler.events()) {
    if (e.category == category && e.rank == rank) out.push_back(&e);
  }
  return out;
}

TEST(ProfilerCollectives, EachRankRecordsItsCollectivesWithSeqAndBytes) {
  auto store = std::make_shared<HashStore>();
  Profiler profiler;
  testing::runRanks(2, [&](int rank) {
    auto group = makeGroup(store, rank, 2);
    Tensor t = full({1024}, rank + 1.0);
    group->allreduce(t)->wait();
    group->broadcast(t)->wait();
    group->barrier()->wait();
    group->destroy();
  });
  profiler.stop();
  for (int rank = 0; rank < 2; ++rank) {
    const auto collectives = eventsOf(profiler, EventCategory::Collective, rank);
    std::map<std::string, std::string> argsByName;
    for (const ProfileEvent* e : collectives) argsByName[e->name] = e->args;
    ASSERT_TRUE(argsByName.count("allreduce")) << "rank " << rank;
    ASSERT_TRUE(argsByName.count("broadcast")) << "rank " << rank;
    EXPECT_NE(argsByName["allreduce"].find("\"seq\": 1"), std::string::npos) << argsByName["allreduce"];
    EXPECT_NE(argsByName["allreduce"].find("\"bytes\": 4096"), std::string::npos) << argsByName["allreduce"];
    EXPECT_NE(argsByName["broadcast"].find("\"seq\": 2"), std::string::npos) << argsByName["broadcast"];
  }
  const std::string trace = profiler.chromeTrace();
  EXPECT_NE(trace.find("\"name\": \"rank 1\""), std::string::npos);
}

TEST(ProfilerCollectives, DdpBucketsAreRecordedFromLaunchToDoneOnTracksOfTheirOwn) {
  auto store = std::make_shared<HashStore>();
  Profiler profiler;
  std::vector<size_t> bucketCount(2);
  testing::runRanks(2, [&](int rank) {
    auto group = makeGroup(store, rank, 2);
    Generator gen(5);
    auto model = std::make_shared<nn::Sequential>();
    model->pushBack(std::make_shared<nn::Linear>(32, 64, true, gen));
    model->pushBack(std::make_shared<nn::ReLU>());
    model->pushBack(std::make_shared<nn::Linear>(64, 4, true, gen));
    DdpOptions options;
    options.bucketCapBytes = 4096;
    options.firstBucketCapBytes = 1024;
    DistributedDataParallel ddp(model, group, options);
    bucketCount[rank] = ddp.buckets().size();
    Tensor x = randn({8, 32}, gen);
    for (int step = 0; step < 2; ++step) {
      Tensor loss = sum(ddp.forward(x));
      loss.backward();
    }
    group->destroy();
  });
  profiler.stop();
  auto bytesOf = [](const ProfileEvent& e) {
    const size_t at = e.args.find("\"bytes\": ");
    return at == std::string::npos ? std::string() : e.args.substr(at, e.args.find(',', at) - at);
  };
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_GE(bucketCount[rank], 2u);
    const auto buckets = eventsOf(profiler, EventCategory::Ddp, rank);
    // Two steps, each launching every bucket (the plan may be rebuilt after the first).
    EXPECT_GE(buckets.size(), 2 * bucketCount[rank]) << "rank " << rank;
    const auto collectives = eventsOf(profiler, EventCategory::Collective, rank);
    for (const ProfileEvent* bucket : buckets) {
      EXPECT_EQ(bucket->name, "ddp bucket");
      EXPECT_EQ(bucket->trackName.rfind("ddp bucket ", 0), 0u) << bucket->trackName;
      ASSERT_FALSE(bytesOf(*bucket).empty()) << bucket->args;
      // Its allreduce (same bytes) ran between the bucket's launch and done.
      const bool reducedInside = std::any_of(collectives.begin(), collectives.end(), [&](const ProfileEvent* c) {
        return c->name == "allreduce" && bytesOf(*c) == bytesOf(*bucket) && c->startNs >= bucket->startNs &&
               c->startNs + c->durationNs <= bucket->startNs + bucket->durationNs;
      });
      EXPECT_TRUE(reducedInside) << "rank " << rank << " bucket " << bucket->args;
    }
  }
  EXPECT_FALSE(eventsOf(profiler, EventCategory::Backward, 0).empty());
}

}  // namespace
}  // namespace dt
