// DistributedDataParallel with forked processes as ranks over a TcpStore:
// the same equivalence as the threads test, across address spaces.
#include <gtest/gtest.h>

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/config.h"
#include "common/strings.h"
#include "ddp/ddp.h"
#include "tests/ddp/harness.h"
#include "testing/spawn.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using testing::TrainSpec;

std::string readFile(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

#if DT_HAVE_GLOO

// Each child trains, computes the single-process reference itself and
// reports the largest difference.
void expectProcessesMatchReference(const TrainSpec& spec) {
  const auto results = testing::spawn(spec.world, [&](testing::RankContext& ctx) -> std::string {
    ProcessGroupOptions o;
    o.timeout = 30s;
    o.progressInterval = 100ms;
    auto group = ProcessGroup::create(ctx.store(), ctx.rank, spec.world, o);
    const auto mine = testing::trainRank(spec, group);
    group->barrier()->wait();
    group->destroy();
    const float difference = testing::maxAbsDifference(mine, testing::referenceParameters(spec));
    return str(difference <= 2e-5f ? "OK" : "DIFFERENT", " max difference ", difference);
  });
  for (int rank = 0; rank < spec.world; ++rank) {
    EXPECT_EQ(results[rank].exitCode, 0) << results[rank].describe();
    EXPECT_EQ(results[rank].value.rfind("OK", 0), 0u) << results[rank].describe();
  }
}

class DdpProcesses : public ::testing::TestWithParam<int> {};

TEST_P(DdpProcesses, MatchesOneProcessOnTheConcatenatedBatch) {
  TrainSpec spec;
  spec.world = GetParam();
  spec.ddp.bucketCapBytes = 300;
  spec.ddp.firstBucketCapBytes = 100;
  expectProcessesMatchReference(spec);
}

TEST_P(DdpProcesses, FindUnusedParametersAndJoin) {
  TrainSpec spec;
  spec.world = GetParam();
  spec.branchy = true;
  spec.ddp.findUnusedParameters = true;
  for (int r = 0; r < spec.world; ++r) spec.stepsPerRank.push_back(6 - r);
  expectProcessesMatchReference(spec);
}

// A bucket's allreduce carries its bucket in the flight recorder ("ddp bucket <i>").
TEST(DdpProcesses, FlightRecorderNamesTheBucketOfEachAllreduce) {
  char folder[] = "/tmp/dt-ddp-flight-XXXXXX";
  ASSERT_NE(::mkdtemp(folder), nullptr);
  testing::SpawnOptions options;
  options.env = {{"DT_FLIGHT_RECORDER_DIR", folder}};
  const auto results = testing::spawn(2, [&](testing::RankContext& ctx) -> std::string {
    auto group = ProcessGroup::create(ctx.store(), ctx.rank, 2);
    DistributedDataParallel ddp(std::make_shared<testing::TestNet>(1, false), group, {.bucketCapBytes = 300});
    for (int step = 0; step < 2; ++step) {
      ddp.zeroGrad();
      Tensor x, y;
      std::tie(x, y) = testing::batchFor(TrainSpec{}, step, 0, ctx.rank);
      crossEntropy(ddp(x), y).backward();
    }
    return readFile(dumpFlightRecorder("request"));
  }, options);
  std::filesystem::remove_all(folder);
  ASSERT_TRUE(results.ok()) << results.summary();
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(results[r].value.find("\"context\": \"ddp bucket 0\""), std::string::npos) << results[r].value;
    // DDP's own broadcasts (parameters at the start, buckets' layout) are not a bucket's.
    EXPECT_NE(results[r].value.find("\"op\": \"broadcast\", \"dtype\": \"float32\""), std::string::npos);
  }
}

INSTANTIATE_TEST_SUITE_P(World, DdpProcesses, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return "world" + std::to_string(info.param); });

#else

TEST(DdpProcesses, NeedsGloo) { GTEST_SKIP() << "this build has no Gloo backend (DT_HAVE_GLOO=0); DDP's tests need one"; }

#endif

}  // namespace
}  // namespace dt
