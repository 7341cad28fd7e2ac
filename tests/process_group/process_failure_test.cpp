// Processes as ranks (dt::testing::spawn: forked children over a TcpStore
// the parent hosts on port 0). Failure semantics that threads cannot show: a
// rank that is killed, ranks that disagree across address spaces,
// initProcessGroup from the environment.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/errors.h"
#include "common/strings.h"
#include "process_group/init.h"
#include "process_group/process_group.h"
#include "store/tcp_store.h"
#include "testing/point.h"
#include "testing/spawn.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using testing::Ending;
using testing::RankContext;
using testing::spawn;
using testing::SpawnOptions;

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

#if DT_HAVE_GLOO

// Failure semantics every CPU backend must have, run on each.
class ProcessFailureOnBackend : public ::testing::TestWithParam<std::string> {};

TEST_P(ProcessFailureOnBackend, KilledRankFailsEverySurvivorPromptlyAndIsNamed) {
  constexpr int kWorld = 3;
  constexpr auto kTimeout = 20s;
  SpawnOptions options;
  options.plan = {testing::killAt(2, "mid-allreduce")};
  options.deadline = 90s;
  const auto results = spawn(kWorld, [&](RankContext& ctx) -> std::string {
    const int rank = ctx.rank;
    ProcessGroupOptions o;
    o.backend = GetParam();
    o.timeout = kTimeout;
    o.progressInterval = 200ms;
    auto pg = ProcessGroup::create(ctx.store(), rank, kWorld, o);
    Tensor t = ones({4 << 20});  // 16 MiB
    pg->allreduce(t)->wait();     // everyone is connected and running
    if (rank == 2) {
      auto work = pg->allreduce(t);
      std::this_thread::sleep_for(30ms);  // in the middle of it
      testing::point("mid-allreduce");    // SIGKILLed here
    }
    for (int i = 0; i < 1000; ++i) {
      const auto start = Clock::now();
      auto work = pg->allreduce(t);
      try {
        work->wait();
      } catch (const BackendError& e) {
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
        return str("FAILED ", ms, " ", e.what());
      } catch (const TimeoutError& e) {
        // A survivor whose only outstanding transfer is a send to the dead
        // rank learns nothing from Gloo until its timeout (a Gloo limitation);
        // the error still has to name the dead rank.
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
        return str("FAILED ", ms, " ", e.what());
      } catch (const std::exception& e) {
        return str("WRONG-TYPE ", e.what());
      }
    }
    return "NO-FAILURE";
  }, options);
  ASSERT_EQ(results[2].ending, Ending::Killed) << results.summary();
  ASSERT_EQ(results[2].signal, SIGKILL) << results.summary();
  for (int r = 0; r < 2; ++r) {
    const auto& text = results[r].value;
    ASSERT_EQ(text.rfind("FAILED ", 0), 0u) << results[r].describe();
    const long ms = std::stol(text.substr(7));
    EXPECT_LT(ms, std::chrono::duration_cast<std::chrono::milliseconds>(kTimeout + 5s).count()) << text;
    const bool named = text.find("Rank 2 stopped responding") != std::string::npos ||
                       text.find("Rank 2 is gone") != std::string::npos ||
                       text.find("rank 2 never started") != std::string::npos ||
                       text.find("rank 2 is waiting") != std::string::npos;
    EXPECT_TRUE(named) << text;
    EXPECT_NE(text.find("allreduce"), std::string::npos) << text;
    EXPECT_NE(text.find(str("rank ", r, "/3")), std::string::npos) << text;
    std::printf("survivor %d after %ld ms: %s\n", r, ms, text.c_str());
  }
}

// Gloo writes with writev(2): a write to a peer that has exited raises
// SIGPIPE, whose default action would kill the survivor before any error
// could be reported. Here rank 1 exits in the middle of receiving 64 MiB.
TEST_P(ProcessFailureOnBackend, PeerExitingMidTransferFailsTheWorkInsteadOfKillingTheSender) {
  const auto results = spawn(2, [&](RankContext& ctx) -> std::string {
    const int rank = ctx.rank;
    ProcessGroupOptions o;
    o.backend = GetParam();
    o.timeout = 10s;
    auto pg = ProcessGroup::create(ctx.store(), rank, 2, o);
    pg->allreduce(ones({16}))->wait();
    Tensor big = ones({16 << 20});  // 64 MiB
    if (rank == 1) {
      auto work = pg->recv({big}, 0);
      std::this_thread::sleep_for(5ms);
      ::_exit(0);  // gone mid-transfer
    }
    try {
      SendOptions so;
      so.timeout = 3s;  // Gloo does not fail a send still being written when its peer goes: it times out
      for (int i = 0; i < 4; ++i) pg->send({big}, 1, so)->wait();
      return "NO-FAILURE";
    } catch (const BackendError& e) {
      return str("FAILED ", e.what());
    } catch (const TimeoutError& e) {
      return str("FAILED ", e.what());
    }
  });
  ASSERT_EQ(results[0].signal, 0) << results.summary();
  ASSERT_TRUE(results[0].returned()) << results.summary();
  EXPECT_EQ(results[0].value.rfind("FAILED ", 0), 0u) << results[0].value;
  EXPECT_NE(results[0].value.find("send to rank 1"), std::string::npos) << results[0].value;
  EXPECT_EQ(results[1].ending, Ending::Exited) << results.summary();
}

// A peer that is already known to be gone: posting a recv must return a
// failed Work, not throw Gloo's exception from the call.
TEST_P(ProcessFailureOnBackend, PostingToAnExitedPeerReturnsAFailedWork) {
  const auto results = spawn(2, [&](RankContext& ctx) -> std::string {
    const int rank = ctx.rank;
    ProcessGroupOptions o;
    o.backend = GetParam();
    o.timeout = 10s;
    auto pg = ProcessGroup::create(ctx.store(), rank, 2, o);
    pg->allreduce(ones({16}))->wait();
    if (rank == 1) ::_exit(0);  // gone, without a word
    std::this_thread::sleep_for(300ms);
    std::vector<WorkPtr> works;
    for (int tag = 0; tag < 8; ++tag) {
      RecvOptions ro;
      ro.tag = static_cast<uint32_t>(tag);
      ro.timeout = 3s;
      works.push_back(pg->recv({zeros({16})}, 1, ro));
      std::this_thread::sleep_for(20ms);  // the first write draws the reset, the next ones EPIPE
    }
    int failed = 0;
    for (auto& w : works) {
      try {
        w->wait();
      } catch (const std::exception&) {
        ++failed;
      }
    }
    return str("SURVIVED ", failed, " of ", works.size(), " recvs failed");
  });
  EXPECT_EQ(results[0].signal, 0) << results.summary();
  EXPECT_EQ(results[0].value, "SURVIVED 8 of 8 recvs failed") << results.summary();
}

TEST_P(ProcessFailureOnBackend, DesyncAcrossProcessesRaisesOnEveryRank) {
  const auto results = spawn(2, [&](RankContext& ctx) -> std::string {
    const int rank = ctx.rank;
    ProcessGroupOptions o;
    o.backend = GetParam();
    o.timeout = 30s;
    o.checkFingerprints = true;
    auto pg = ProcessGroup::create(ctx.store(), rank, 2, o);
    Tensor small = ones({16});
    pg->allreduce(small)->wait();
    WorkPtr work;
    if (rank == 0) {
      work = pg->allreduce(ones({1 << 20}));
    } else {
      BroadcastOptions bo;
      bo.root = 0;
      work = pg->broadcast(ones({4096}), bo);
    }
    try {
      work->wait();
      return "NO-ERROR";
    } catch (const DesyncError& e) {
      return str("DESYNC ", e.what());
    }
  });
  for (int r = 0; r < 2; ++r) {
    const auto& text = results[r].value;
    ASSERT_EQ(text.rfind("DESYNC ", 0), 0u) << results[r].describe();
    EXPECT_NE(text.find("collective #2 mismatch"), std::string::npos) << text;
    EXPECT_NE(text.find("allreduce(float32[1048576], sum)"), std::string::npos) << text;
    EXPECT_NE(text.find("broadcast(float32[4096], root 0)"), std::string::npos) << text;
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, ProcessFailureOnBackend, ::testing::Values("gloo", "shm"),
                         [](const auto& info) { return info.param; });

TEST(ProcessFailure, InitFromTorchrunEnvironmentRankZeroHostsTheStore) {
  const dt::testing::PortReservation reservation;
  const uint16_t masterPort = reservation.port();
  const auto results = spawn(3, [&](RankContext& ctx) -> std::string {
    const int rank = ctx.rank;
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", "3", 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(masterPort).c_str(), 1);
    ::unsetenv("DT_STORE_ADDR");
    InitOptions io;
    io.timeout = 30s;
    auto pg = initProcessGroup(io);
    Tensor t = full({10}, rank);
    pg->allreduce(t)->wait();
    pg->barrier()->wait();
    return str("SUM ", t.toVector<float>()[0]);
  });
  for (const auto& r : results.ranks) EXPECT_EQ(r.value, "SUM 3") << r.describe();
}

TEST(ProcessFailure, InitFromLauncherStoreWritesTheWatchdogKeys) {
  testing::SpawnedRanks run(2, [&](RankContext& ctx) -> std::string {
    const int rank = ctx.rank;
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", "2", 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", "1", 1);  // must not be used: the launcher's store wins
    ::setenv("DT_STORE_ADDR", str("127.0.0.1:", ctx.storePort).c_str(), 1);
    ::setenv("DT_RESTART_COUNT", "1", 1);  // a restarted incarnation gets its own key space
    auto pg = initProcessGroup();
    Tensor t = ones({10});
    for (int i = 0; i < 3; ++i) pg->allreduce(t)->wait();
    pg->destroy();  // flushes the last progress value
    return "OK";
  });
  const auto results = run.wait();
  TcpStore& store = run.store();
  EXPECT_TRUE(store.check({"restart1/pg/default/instances"}));
  EXPECT_FALSE(store.check({"pg/default/instances"}));
  for (int r = 0; r < 2; ++r) {
    const std::string key = str("dt/progress/", r);
    ASSERT_TRUE(store.check({key})) << key;
    EXPECT_EQ(store.get(key), "3 allreduce") << key;
  }
  for (const auto& r : results.ranks) EXPECT_EQ(r.value, "OK") << r.describe();
}

#endif  // DT_HAVE_GLOO

TEST(ProcessFailure, MissingEnvironmentVariableIsNamed) {
  const auto results = spawn(1, [&](RankContext&) -> std::string {
    ::unsetenv("RANK");
    ::unsetenv("SLURM_PROCID");
    ::unsetenv("DT_STORE_ADDR");
    try {
      initProcessGroup();
      return "NO-ERROR";
    } catch (const InvalidArgument& e) {
      return str("INVALID ", e.what());
    }
  });
  const auto& text = results[0].value;
  EXPECT_EQ(text.rfind("INVALID ", 0), 0u) << results[0].describe();
  EXPECT_NE(text.find("RANK is not set"), std::string::npos) << text;
  EXPECT_NE(text.find("dtrun and torchrun set it"), std::string::npos) << text;
}

}  // namespace
}  // namespace dt
