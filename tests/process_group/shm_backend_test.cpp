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
#include "tests/testing/processes.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::clientStore;
using testing::runProcesses;

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
  const auto results = runProcesses(3, [&](int rank, uint16_t port) -> std::string {
    ::setenv("DT_RUN_ID", runId.c_str(), 1);
    auto pg = ProcessGroup::create(clientStore(port, rank), rank, 3, shmOptions(30s));
    Tensor t = full({1 << 18}, rank + 1);
    pg->allreduce(t)->wait();
    const size_t visible = leftovers(runId).size();  // the group is live and working
    pg->barrier()->wait();
    return str("OK sum ", t.toVector<float>()[0], " visible ", visible);
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(results[r].text, "OK sum 6 visible 0") << "rank " << r;
  EXPECT_TRUE(leftovers(runId).empty());
}

// Ranks killed with SIGKILL at random points of a mixed sequence of
// collectives: every survivor fails promptly naming the killed rank, nothing
// hangs, and nothing of the job stays in /dev/shm.
TEST(ShmBackendProcesses, RanksKilledAtRandomPointsAreNamedAndLeaveNothingBehind) {
  constexpr int kWorld = 4;
  constexpr auto kTimeout = 20s;
  for (int trial = 0; trial < 6; ++trial) {
    std::mt19937 random(1234 + static_cast<unsigned>(trial));
    const int victim = (trial * 3 + 1) % kWorld;
    const int killAfterUs = static_cast<int>(random() % 200000);
    const std::string runId = uniqueRunId(str("kill", trial));
    const auto results = runProcesses(kWorld, [&](int rank, uint16_t port) -> std::string {
      ::setenv("DT_RUN_ID", runId.c_str(), 1);
      auto pg = ProcessGroup::create(clientStore(port, rank), rank, kWorld, shmOptions(kTimeout));
      if (rank == victim) {
        std::thread([killAfterUs] {
          std::this_thread::sleep_for(std::chrono::microseconds(killAfterUs));
          ::kill(::getpid(), SIGKILL);
        }).detach();
      }
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
    }, 90s);
    ASSERT_TRUE(results[victim].killed) << "trial " << trial << ": " << results[victim].text;
    for (int r = 0; r < kWorld; ++r) {
      if (r == victim) continue;
      const auto& text = results[r].text;
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
                victim == 0 ? 1 : 0, results[victim == 0 ? 1 : 0].text.c_str());
  }
}

TEST(ShmBackendProcesses, AFrozenRankIsNamedByItsStoppedHeartbeat) {
  const auto results = runProcesses(2, [&](int rank, uint16_t port) -> std::string {
    ShmBackendOptions o;
    o.timeout = 30s;
    o.progressInterval = 100ms;
    o.heartbeatTimeout = 1s;
    auto store = clientStore(port, rank);
    ShmBackend backend(std::make_shared<PrefixStore>("frozen", store), rank, 2, o);
    Tensor t = ones({1000});
    backend.allreduce({t})->wait();
    if (rank == 1) {
      store->set("frozen-pid", std::to_string(::getpid()));
      ::raise(SIGSTOP);  // frozen, not dead: only the heartbeat tells
    }
    const auto start = Clock::now();
    std::string outcome = "NO-FAILURE";
    try {
      backend.allreduce({t})->wait();
    } catch (const std::exception& e) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
      outcome = str("FAILED ", ms, " ", e.what());
    }
    ::kill(static_cast<pid_t>(std::stol(store->get("frozen-pid"))), SIGKILL);  // so the test can reap it
    return outcome;
  }, 30s);
  const auto& text = results[0].text;
  ASSERT_EQ(text.rfind("FAILED ", 0), 0u) << text;
  EXPECT_NE(text.find("rank 1"), std::string::npos) << text;
  EXPECT_NE(text.find("stopped its heartbeat"), std::string::npos) << text;
  EXPECT_LT(std::stol(text.substr(7)), 10000) << text;
}

TEST(ShmBackendProcesses, DesyncIsCaughtWithoutDebugChecks) {
  const auto results = runProcesses(3, [&](int rank, uint16_t port) -> std::string {
    auto pg = ProcessGroup::create(clientStore(port, rank), rank, 3, shmOptions(20s));
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
    const auto& text = results[r].text;
    ASSERT_EQ(text.rfind("DESYNC ", 0), 0u) << "rank " << r << ": " << text;
    EXPECT_NE(text.find("collective #2 mismatch"), std::string::npos) << text;
    EXPECT_NE(text.find("broadcast(float32[4096], root 0)"), std::string::npos) << text;
    EXPECT_NE(text.find("allreduce(float32[1024], sum)"), std::string::npos) << text;
  }
}

}  // namespace
}  // namespace dt
