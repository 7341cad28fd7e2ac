// A user's gtest of their own distributed code, with ranks as forked processes.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "process_group/init.h"
#include "testing/point.h"
#include "testing/spawn.h"
#include "testing/spawn_gtest.h"

using namespace std::chrono_literals;
using dt::testing::RankContext;

// The code under test: the mean of one value over all ranks.
float meanOverRanks(dt::ProcessGroup& group, float value) {
  dt::Tensor t = dt::full({1}, value);
  dt::testing::point("before-allreduce");  // where a test may kill or freeze this rank
  group.allreduce(t)->wait();
  return t.toVector<float>()[0] / static_cast<float>(group.size());
}

TEST(MeanOverRanks, EveryRankGetsTheMean) {
  auto result = dt::testing::spawn(4, [](RankContext& ctx) {
    auto group = dt::initProcessGroup();  // the environment is what dtrun gives a worker
    return std::to_string(meanOverRanks(*group, static_cast<float>(ctx.rank)));
  });
  ASSERT_TRUE(dt::testing::everyRankReturned(result));
  for (const auto& rank : result.ranks) EXPECT_EQ(rank.value, std::to_string(1.5f));
}

TEST(MeanOverRanks, ALostRankFailsTheOthersWithAnErrorNamingIt) {
  dt::testing::SpawnOptions options;
  options.plan = {dt::testing::killAt(2, "before-allreduce")};
  options.killAllOnFailure = false;  // the survivors' errors are what this test is about
  options.deadline = 60s;
  auto result = dt::testing::spawn(3, [](RankContext&) {
    dt::InitOptions init;
    init.timeout = 20s;
    auto group = dt::initProcessGroup(init);
    meanOverRanks(*group, 1.0f);
    return std::string("no error");
  }, options);
  EXPECT_EQ(result[2].ending, dt::testing::Ending::Killed) << result.summary();
  for (int rank : {0, 1}) {
    ASSERT_EQ(result[rank].ending, dt::testing::Ending::Threw) << result.summary();
    EXPECT_NE(result[rank].error.find("rank 2"), std::string::npos) << result[rank].error;
  }
}

TEST(MeanOverRanks, ARankFrozenForAWhileOnlyDelaysTheOthers) {
  dt::testing::SpawnOptions options;
  options.plan = {dt::testing::freezeAt(1, "before-allreduce", 500ms)};
  auto result = dt::testing::spawn(3, [](RankContext&) {
    auto group = dt::initProcessGroup();
    return std::to_string(meanOverRanks(*group, 3.0f));
  }, options);
  ASSERT_TRUE(dt::testing::everyRankReturned(result));
  for (const auto& rank : result.ranks) EXPECT_EQ(rank.value, std::to_string(3.0f));
}

TEST(MeanOverRanks, ATestCanDriveTheTimingItself) {
  dt::testing::SpawnedRanks run(2, [](RankContext& ctx) {
    auto group = dt::initProcessGroup();
    ctx.store()->set("ready/" + std::to_string(ctx.rank), "1");
    ctx.store()->wait({"go"});
    return std::to_string(meanOverRanks(*group, 2.0f));
  });
  run.store().wait({"ready/0", "ready/1"});
  run.freeze(1);               // rank 1 stops (SIGSTOP) ...
  run.store().set("go", "1");  // ... while rank 0 goes ahead and waits for it
  std::this_thread::sleep_for(200ms);
  run.resume(1);
  auto result = run.wait();
  ASSERT_TRUE(dt::testing::everyRankReturned(result));
  EXPECT_EQ(result[0].value, std::to_string(2.0f));
}
