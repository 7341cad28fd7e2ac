// The shared-memory backend with forked processes as ranks: what threads
// cannot show. Ranks killed at random points, a frozen rank, a desync without
// debug checks, and /dev/shm left clean.
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "common/strings.h"
#include "process_group/process_group.h"
#include "process_group/shm/shm_backend.h"
#include "store/prefix_store.h"
#include "testing/point.h"
#include "testing/spawn.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::Ending;
using testing::RankContext;
using testing::spawn;
using testing::SpawnOptions;

// Names in /dev/shm that belong to run `runId`.
std::vector<std::string> leftovers(const std::string& runId) {
  std::vector<std::string> found;
  const std::string prefix = "dtrain-" + runId + "-";
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (dirent* entry = ::readdir(dir)) {
      if (std::string(entry->d_name).rfind(prefix, 0) == 0) found.emplace_back(entry->d_name);
    }
    ::closedir(dir);
  }
  return found;
}

std::string uniqueRunId(const std::string& what) { return str("test-", ::getpid(), "-", what); }

ProcessGroupOptions shmOptions(std::chrono::milliseconds timeout) {
  ProcessGroupOptions o;
  o.backend = "shm";
  o.timeout = timeout;
  o.progressInterval = 100ms;
  return o;
}

TEST(ShmBackendProcesses, TheSegmentLeavesDevShmOnceEveryRankMappedIt) {
  const std::string runId = uniqueRunId("unlink");
  const auto results = spawn(3, [&](RankContext& ctx) -> std::string {
    const int rank = ctx.rank;
    ::setenv("DT_RUN_ID", runId.c_str(), 1);
    auto pg = ProcessGroup::create(ctx.store(), rank, 3, shmOptions(30s));
    Tensor t = full({1 << 18}, rank + 1);
    pg->allreduce(t)->wait();
    const size_t visible = leftovers(runId).size();  // the group is live and working
    pg->barrier()->wait();
    return str("OK sum ", t.toVector<float>()[0], " visible ", visible);
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(results[r].value, "OK sum 6 visible 0") << results[r].describe();
  EXPECT_TRUE(leftovers(runId).empty());
}

// Ranks killed with SIGKILL at random points of a mixed sequence of
// collectives: every survivor fails promptly naming the killed rank, nothing
// hangs, and nothing of the job stays in /dev/shm. The test kills the victim
// a random time after every rank has its group.
TEST(ShmBackendProcesses, RanksKilledAtRandomPointsAreNamedAndLeaveNothingBehind) {
  constexpr int kWorld = 4;
  constexpr auto kTimeout = 20s;
  for (int trial = 0; trial < 6; ++trial) {
    std::mt19937 random(1234 + static_cast<unsigned>(trial));
    const int victim = (trial * 3 + 1) % kWorld;
    const int killAfterUs = static_cast<int>(random() % 200000);
    const std::string runId = uniqueRunId(str("kill", trial));
    SpawnOptions options;
    options.deadline = 90s;
    testing::SpawnedRanks run(kWorld, [&](RankContext& ctx) -> std::string {
      const int rank = ctx.rank;
      ::setenv("DT_RUN_ID", runId.c_str(), 1);
      auto pg = ProcessGroup::create(ctx.store(), rank, kWorld, shmOptions(kTimeout));
      ctx.store()->set(str("created/", rank), "1");
      const auto start = Clock::now();
      try {
        for (int i = 0;; ++i) {
          Tensor big = full({(1 << 20) + i}, rank);
          Tensor small = full({7}, rank);
          pg->allreduce(big)->wait();
          pg->broadcast(small, {.root = i % kWorld})->wait();
          std::vector<Tensor> gathered;
          for (int r = 0; r < kWorld; ++r) gathered.push_back(empty({7}));
          pg->allgather(gathered, small)->wait();
          pg->allreduce(small, {.reduceOp = ReduceOp::Max})->wait();
          if (Clock::now() - start > 60s) return std::string("NO-FAILURE");
        }
      } catch (const std::exception& e) {
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
        return str("FAILED ", ms, " ", describe(e));
      }
    }, options);
    std::vector<std::string> created;
    for (int r = 0; r < kWorld; ++r) created.push_back(str("created/", r));
    run.store().wait(created);
    std::this_thread::sleep_for(std::chrono::microseconds(killAfterUs));
    run.kill(victim);
    const auto results = run.wait();
    ASSERT_EQ(results[victim].ending, Ending::Killed) << "trial " << trial << ": " << results.summary();
    for (int r = 0; r < kWorld; ++r) {
      if (r == victim) continue;
      const auto& text = results[r].value;
      ASSERT_EQ(text.rfind("FAILED ", 0), 0u) << "trial " << trial << " rank " << r << ": " << text;
      const long ms = std::stol(text.substr(7));
      // Named directly (pid gone) or through a peer's report.
      const bool named = text.find(str("rank ", victim)) != std::string::npos ||
                         text.find(str("Rank ", victim)) != std::string::npos;
      EXPECT_TRUE(named) << "trial " << trial << ": " << text;
      EXPECT_LT(ms, killAfterUs / 1000 + 10000) << "trial " << trial << ": " << text;
    }
    EXPECT_TRUE(leftovers(runId).empty()) << "trial " << trial << " left " << join(leftovers(runId), ", ");
    std::printf("trial %d: killed rank %d after %d us; rank %d saw: %s\n", trial, victim, killAfterUs,
                victim == 0 ? 1 : 0, results[victim == 0 ? 1 : 0].value.c_str());
  }
}

// Rank 1 freezes (SIGSTOP, the plan's freeze with no end) after the first
// allreduce; once rank 0 has reported, the harness kills it.
TEST(ShmBackendProcesses, AFrozenRankIsNamedByItsStoppedHeartbeat) {
  SpawnOptions options;
  options.plan = {testing::freezeAt(1, "after-first-allreduce")};
  options.deadline = 30s;
  const auto results = spawn(2, [&](RankContext& ctx) -> std::string {
    const int rank = ctx.rank;
    ShmBackendOptions o;
    o.timeout = 30s;
    o.progressInterval = 100ms;
    o.heartbeatTimeout = 1s;
    ShmBackend backend(std::make_shared<PrefixStore>("frozen", ctx.store()), rank, 2, o);
    Tensor t = ones({1000});
    backend.allreduce({t})->wait();
    if (rank == 1) testing::point("after-first-allreduce");  // frozen, not dead: only the heartbeat tells
    const auto start = Clock::now();
    std::string outcome = "NO-FAILURE";
    try {
      backend.allreduce({t})->wait();
    } catch (const std::exception& e) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
      outcome = str("FAILED ", ms, " ", e.what());
    }
    return outcome;
  }, options);
  EXPECT_EQ(results[1].ending, Ending::Killed) << results.summary();
  const auto& text = results[0].value;
  ASSERT_EQ(text.rfind("FAILED ", 0), 0u) << text;
  EXPECT_NE(text.find("rank 1"), std::string::npos) << text;
  EXPECT_NE(text.find("stopped its heartbeat"), std::string::npos) << text;
  EXPECT_LT(std::stol(text.substr(7)), 10000) << text;
}

TEST(ShmBackendProcesses, DesyncIsCaughtWithoutDebugChecks) {
  const auto results = spawn(3, [&](RankContext& ctx) -> std::string {
    const int rank = ctx.rank;
    auto pg = ProcessGroup::create(ctx.store(), rank, 3, shmOptions(20s));
    pg->allreduce(ones({16}))->wait();
    try {
      if (rank == 2) {
        pg->broadcast(ones({4096}), {.root = 0})->wait();
      } else {
        pg->allreduce(ones({1 << 10}))->wait();
      }
      return std::string("NO-ERROR");
    } catch (const DesyncError& e) {
      return str("DESYNC ", e.what());
    } catch (const std::exception& e) {
      return str("OTHER ", describe(e));
    }
  });
  for (int r = 0; r < 3; ++r) {
    const auto& text = results[r].value;
    ASSERT_EQ(text.rfind("DESYNC ", 0), 0u) << results[r].describe();
    EXPECT_NE(text.find("collective #2 mismatch"), std::string::npos) << text;
    EXPECT_NE(text.find("broadcast(float32[4096], root 0)"), std::string::npos) << text;
    EXPECT_NE(text.find("allreduce(float32[1024], sum)"), std::string::npos) << text;
  }
}

}  // namespace
}  // namespace dt
