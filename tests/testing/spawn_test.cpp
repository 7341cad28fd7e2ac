// dt::testing::spawn on its own: how each ending is told apart and reported,
// the plan's kill and freeze at a point, the test's own kill/freeze/resume,
// captured output, bad input, and that a rank's environment is a dtrun
// worker's (initProcessGroup works unchanged).
#include "testing/spawn.h"

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <thread>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "common/strings.h"
#include "process_group/init.h"
#include "testing/point.h"
#include "testing/spawn_gtest.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string envOf(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "(unset)" : value;
}



bool contains(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

TEST(Spawn, EveryRankReturnsItsValueAndSeesADtrunWorkersEnvironment) {
  SpawnedRanks run(3, [](RankContext& ctx) {
    ctx.store()->add("arrived", 1);
    ctx.store()->wait({"go"});
    return str(ctx.rank, "/", ctx.worldSize, " RANK=", envOf("RANK"), " WORLD_SIZE=", envOf("WORLD_SIZE"),
               " LOCAL_RANK=", envOf("LOCAL_RANK"), " LOCAL_WORLD_SIZE=", envOf("LOCAL_WORLD_SIZE"),
               " GROUP_RANK=", envOf("GROUP_RANK"), " MASTER_ADDR=", envOf("MASTER_ADDR"),
               " DT_STORE_ADDR=", envOf("DT_STORE_ADDR"), " DT_RESTART_COUNT=", envOf("DT_RESTART_COUNT"),
               " token ", envOf("DT_STORE_TOKEN") == ctx.storeToken ? "same" : "different");
  });
  run.store().wait({"arrived"});
  EXPECT_TRUE(eventually([&] { return run.store().get("arrived") == "3"; }));
  run.store().set("go", "1");
  const SpawnResult result = run.wait();
  ASSERT_TRUE(everyRankReturned(result));
  const std::string storeAddr = str("127.0.0.1:", run.store().port());
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(result[rank].value, str(rank, "/3 RANK=", rank, " WORLD_SIZE=3 LOCAL_RANK=", rank,
                                      " LOCAL_WORLD_SIZE=3 GROUP_RANK=0 MASTER_ADDR=127.0.0.1 DT_STORE_ADDR=",
                                      storeAddr, " DT_RESTART_COUNT=0 token same"));
    EXPECT_EQ(result[rank].exitCode, 0);
    EXPECT_EQ(result[rank].signal, 0);
    EXPECT_EQ(result[rank].describe(), str("rank ", rank, "/3 returned \"", result[rank].value, "\""));
  }
  EXPECT_EQ(result.firstFailure, -1);
  EXPECT_EQ(run.store().get("arrived"), "3") << "the store outlives the ranks";
}

TEST(Spawn, AThrowingRankIsNamedAndTheOthersAreKilled) {
  const auto result = spawn(3, [](RankContext& ctx) -> std::string {
    if (ctx.rank == 1) {
      std::printf("rank 1 is about to throw\n");
      throw InvalidArgument(str("bad value 7 on rank ", ctx.rank));
    }
    ctx.store()->get("never-set", 300s);
    return "not reached";
  });
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.firstFailure, 1);
  const RankOutcome& thrower = result[1];
  EXPECT_EQ(thrower.ending, Ending::Threw);
  EXPECT_TRUE(thrower.failed());
  EXPECT_EQ(thrower.error, "dt::InvalidArgument: bad value 7 on rank 1");
  EXPECT_EQ(thrower.exitCode, 1);
  EXPECT_EQ(thrower.describe(), "rank 1/3 threw dt::InvalidArgument: bad value 7 on rank 1");
  EXPECT_EQ(thrower.lastLines(1), std::vector<std::string>{"rank 1 is about to throw"});
  for (int rank : {0, 2}) {
    const RankOutcome& other = result[rank];
    EXPECT_EQ(other.ending, Ending::KilledAfterFailure) << other.describe();
    EXPECT_FALSE(other.failed());
    EXPECT_EQ(other.signal, SIGKILL);
    EXPECT_EQ(other.describe(), str("rank ", rank, "/3 was killed (SIGKILL) after rank 1 failed (", thrower.describe(), ")"));
  }
  const std::string summary = result.summary();
  EXPECT_TRUE(contains(summary, "first failure: rank 1")) << summary;
  EXPECT_TRUE(contains(summary, "last 1 lines of rank 1:\n    rank 1 is about to throw\n")) << summary;
}

TEST(Spawn, ASegfaultingRankIsReportedWithItsSignalAndLastLines) {
  const auto result = spawn(2, [](RankContext& ctx) -> std::string {
    if (ctx.rank == 0) {
      std::printf("step 1\n");
      std::fprintf(stderr, "about to crash\n");
      const rlimit noCore{0, 0};
      ::setrlimit(RLIMIT_CORE, &noCore);
      ::signal(SIGSEGV, SIG_DFL);  // past a sanitizer's handler
      ::raise(SIGSEGV);
    }
    ctx.store()->get("never-set", 300s);
    return "not reached";
  });
  const RankOutcome& crashed = result[0];
  EXPECT_EQ(crashed.ending, Ending::Signaled);
  EXPECT_EQ(crashed.signal, SIGSEGV);
  EXPECT_EQ(crashed.exitCode, -1);
  EXPECT_TRUE(crashed.failed());
  EXPECT_EQ(crashed.describe(), "rank 0/2 died of SIGSEGV, a signal neither the plan nor the test sent");
  EXPECT_EQ(crashed.lastLines(2), (std::vector<std::string>{"step 1", "about to crash"}));
  EXPECT_EQ(result[1].ending, Ending::KilledAfterFailure);
  EXPECT_EQ(result.firstFailure, 0);
}

TEST(Spawn, WithoutKillAllOnFailureTheOthersRunOn) {
  SpawnOptions options;
  options.killAllOnFailure = false;
  const auto result = spawn(3, [](RankContext& ctx) -> std::string {
    if (ctx.rank == 1) ::kill(::getpid(), SIGKILL);  // not planned: a failure
    if (ctx.rank == 2) ::_exit(3);
    // Still running after the others died, then returns.
    return std::string(1 << 20, 'v');
  }, options);
  EXPECT_EQ(result[1].ending, Ending::Signaled);
  EXPECT_EQ(result[1].signal, SIGKILL);
  EXPECT_EQ(result[1].describe(), "rank 1/3 died of SIGKILL, a signal neither the plan nor the test sent");
  EXPECT_EQ(result[2].ending, Ending::Exited);
  EXPECT_EQ(result[2].exitCode, 3);
  EXPECT_TRUE(result[2].failed());
  EXPECT_EQ(result[2].describe(), "rank 2/3 exited with code 3 before its function returned");
  ASSERT_TRUE(result[0].returned()) << result.summary();
  EXPECT_EQ(result[0].value, std::string(1 << 20, 'v')) << "a 1 MiB value comes back whole";
  EXPECT_TRUE(result.firstFailure == 1 || result.firstFailure == 2) << result.firstFailure;
}

TEST(Spawn, AHangIsKilledAtTheDeadline) {
  SpawnOptions options;
  options.deadline = 2s;  // long enough for the ranks to start and print on a loaded machine
  const auto result = spawn(2, [](RankContext& ctx) {
    std::printf("rank %d waits for a key nobody sets\n", ctx.rank);
    ctx.store()->get("never-set", 300s);
  }, options);
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.firstFailure, -1);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(result[rank].ending, Ending::KilledAtDeadline);
    EXPECT_EQ(result[rank].describe(), str("rank ", rank, "/2 was killed (SIGKILL) at the 2000 ms deadline, still running"));
    EXPECT_EQ(result[rank].lastLines(5), std::vector<std::string>{str("rank ", rank, " waits for a key nobody sets")});
  }
}

TEST(Spawn, ThePlanKillsARankTheNthTimeItReachesAPoint) {
  SpawnOptions options;
  options.plan = {killAt(2, "step", 3)};
  const auto result = spawn(3, [](RankContext& ctx) {
    for (int i = 0; i < 5; ++i) {
      std::printf("rank %d step %d\n", ctx.rank, i);
      point("step");
    }
    return std::string("done 5");
  }, options);
  EXPECT_EQ(result[2].ending, Ending::Killed);
  EXPECT_EQ(result[2].signal, SIGKILL);
  EXPECT_FALSE(result[2].failed()) << "a planned kill is not a failure";
  EXPECT_EQ(result[2].describe(), "rank 2/3 was killed (SIGKILL) at point \"step\" (hit 3), as planned");
  EXPECT_EQ(result[2].lastLines(1), std::vector<std::string>{"rank 2 step 2"}) << "stdio is flushed before the kill";
  for (int rank : {0, 1}) EXPECT_EQ(result[rank].value, "done 5") << result[rank].describe();
  EXPECT_EQ(result.firstFailure, -1);
  EXPECT_TRUE(result.planNotFired.empty());
}

TEST(Spawn, ThePlanFreezesARankAtAPointForAWhile) {
  SpawnOptions options;
  options.plan = {freezeAt(1, "commit", 300ms)};
  const auto result = spawn(2, [](RankContext& ctx) {
    const auto before = Clock::now();
    point("commit");
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - before).count();
    return str("away ", ms >= 300 ? "at least" : "less than", " 300 ms");
  }, options);
  ASSERT_TRUE(everyRankReturned(result));
  EXPECT_EQ(result[1].value, "away at least 300 ms");
  EXPECT_EQ(result[0].value, "away less than 300 ms") << "rank 0 has no plan step";
  EXPECT_EQ(result[1].events, (std::vector<std::string>{"frozen at point \"commit\" (hit 1) for 300 ms, as planned",
                                                         "resumed as planned"}));
  EXPECT_EQ(result[1].describe(), str("rank 1/2 returned \"", result[1].value,
                                      "\" [frozen at point \"commit\" (hit 1) for 300 ms, as planned; resumed as planned]"));
}

TEST(Spawn, ARankFrozenUntilResumedWaitsForTheTest) {
  SpawnOptions options;
  options.plan = {freezeAt(0, "hold")};
  SpawnedRanks run(1, [](RankContext&) {
    point("hold");
    return std::string("resumed");
  }, options);
  ASSERT_TRUE(eventually([&] { return run.state(0) == RankState::Frozen; }));
  EXPECT_TRUE(eventually([&] { return processState(run.pid(0)) == 'T'; }));
  EXPECT_TRUE(run.resume(0));
  const auto result = run.wait();
  EXPECT_EQ(result[0].value, "resumed");
  EXPECT_EQ(result[0].events, (std::vector<std::string>{"frozen at point \"hold\" (hit 1) until resumed, as planned",
                                                         "resumed by the test"}));
  EXPECT_EQ(run.state(0), RankState::Ended);
  EXPECT_FALSE(run.resume(0));
}

TEST(Spawn, ARankFrozenForGoodIsKilledOnceTheOthersHaveEnded) {
  SpawnOptions options;
  options.plan = {freezeAt(1, "stuck")};
  const auto result = spawn(2, [](RankContext& ctx) {
    if (ctx.rank == 1) point("stuck");
    return std::string("done");
  }, options);
  EXPECT_EQ(result[0].value, "done");
  EXPECT_EQ(result[1].ending, Ending::Killed) << "not left to the 60 s deadline";
  EXPECT_EQ(result[1].describe(),
            "rank 1/2 was killed (SIGKILL) while frozen for good, once every other rank had ended (nobody could resume "
            "it) [frozen at point \"stuck\" (hit 1) until resumed, as planned]");
}

// The harness tells a stop it did not ask for from a freeze, and sees the
// continue that ends it: rank 1 is not killed as frozen for good.
TEST(Spawn, ARankStoppedAndContinuedByAnotherRankRunsOn) {
  const auto result = spawn(2, [](RankContext& ctx) {
    if (ctx.rank == 1) {
      ctx.store()->set("pid", std::to_string(::getpid()));
      ctx.store()->wait({"continued"});
      std::this_thread::sleep_for(200ms);  // rank 0 has ended by now
      return std::string("ran on");
    }
    const auto peer = static_cast<pid_t>(std::stol(ctx.store()->get("pid")));
    ::kill(peer, SIGSTOP);
    std::this_thread::sleep_for(50ms);
    ::kill(peer, SIGCONT);
    ctx.store()->set("continued", "1");
    return std::string("done");
  });
  ASSERT_TRUE(everyRankReturned(result));
  EXPECT_EQ(result[1].value, "ran on");
}

TEST(Spawn, TheTestFreezesResumesAndKillsRanksWhenItChooses) {
  SpawnedRanks run(2, [](RankContext& ctx) {
    ctx.store()->set(str("ready/", ctx.rank), "1");
    ctx.store()->wait({"go"});
    return std::string("went");
  });
  run.store().wait({"ready/0", "ready/1"});
  ASSERT_TRUE(run.freeze(1));
  EXPECT_EQ(run.state(1), RankState::Frozen);
  EXPECT_EQ(processState(run.pid(1)), 'T') << "freeze() returns once the rank is stopped";
  EXPECT_TRUE(run.resume(1));
  EXPECT_EQ(run.state(1), RankState::Running);
  EXPECT_TRUE(run.kill(0));
  EXPECT_TRUE(eventually([&] { return run.state(0) == RankState::Ended; }));
  EXPECT_FALSE(run.kill(0)) << "already gone";
  run.store().set("go", "1");
  const auto result = run.wait();
  EXPECT_EQ(result[0].ending, Ending::Killed);
  EXPECT_EQ(result[0].describe(), "rank 0/2 was killed (SIGKILL) by the test (SpawnedRanks::kill)");
  EXPECT_EQ(result[1].value, "went") << "a kill the test asked for is not a failure";
  EXPECT_EQ(result[1].events, (std::vector<std::string>{"frozen by the test", "resumed by the test"}));
}

TEST(Spawn, OutputIsCapturedInOrderAndBounded) {
  SpawnOptions options;
  options.logBytes = 4096;
  options.echo = false;
  constexpr int kLines = 2000;
  const auto result = spawn(1, [](RankContext&) {
    for (int i = 0; i < kLines; ++i) {
      if (i % 3 == 0) std::printf("line %d on stdout\n", i);
      if (i % 3 == 1) std::fprintf(stderr, "line %d on stderr\n", i);
      if (i % 3 == 2) std::cout << "line " << i << " on cout" << std::endl;
    }
    return std::string("printed");
  }, options);
  ASSERT_TRUE(everyRankReturned(result));
  const RankOutcome& o = result[0];
  EXPECT_EQ(o.lastLines(3), (std::vector<std::string>{"line 1997 on cout", "line 1998 on stdout", "line 1999 on stderr"}));
  EXPECT_EQ(o.log.size(), 4096u);
  size_t total = 0;
  for (int i = 0; i < kLines; ++i) total += str("line ", i, i % 3 == 0 ? " on stdout\n" : i % 3 == 1 ? " on stderr\n" : " on cout\n").size();
  EXPECT_EQ(o.logBytesDropped + o.log.size(), total);
  const auto lines = o.lastLines(100);
  for (size_t i = 1; i + 1 < lines.size(); ++i) {  // whole lines, in the order they were written
    const int number = std::stoi(lines[i].substr(5));
    EXPECT_EQ(std::stoi(lines[i + 1].substr(5)), number + 1) << lines[i] << " / " << lines[i + 1];
  }
}

size_t openDescriptors() {
  size_t count = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++count;
  return count;
}

TEST(Spawn, LeavesNoThreadOrDescriptorBehind) {
  const size_t descriptors = openDescriptors();
  for (int i = 0; i < 3; ++i) {
    SpawnOptions options;
    options.plan = {killAt(1, "x")};
    SpawnedRanks run(3, [](RankContext& ctx) {
      point("x");
      if (ctx.rank == 2) {
        ctx.store()->wait({"rank 1 is gone"});
        throw Error("boom");
      }
      ctx.store()->get("never-set", 300s);
    }, options);
    ASSERT_TRUE(eventually([&] { return run.state(1) == RankState::Ended; }));
    run.store().set("rank 1 is gone", "1");
    const auto result = run.wait();
    EXPECT_EQ(result[0].ending, Ending::KilledAfterFailure);
    EXPECT_EQ(result[1].ending, Ending::Killed);
    EXPECT_EQ(result[2].ending, Ending::Threw);
  }
  EXPECT_EQ(openDescriptors(), descriptors);
  // No thread of the runs is left either: another run needs no allowThreads.
  EXPECT_TRUE(spawn(2, [](RankContext&) {}).ok());
}

TEST(Spawn, BadInputIsRefusedBeforeAnythingIsForked) {
  const auto nothing = [](RankContext&) {};
  expectThrowsWith<InvalidArgument>([&] { spawn(0, nothing); }, {"spawn: world size must be 1..4096, got 0"});
  auto withPlan = [&](PlanStep step) {
    SpawnOptions options;
    options.plan = {std::move(step)};
    spawn(4, nothing, options);
  };
  expectThrowsWith<InvalidArgument>([&] { withPlan(killAt(5, "x")); },
                                    {"spawn: plan step 'kill rank 5 the 1st time it reaches \"x\"' names rank 5, but "
                                     "the world has ranks 0-3"});
  expectThrowsWith<InvalidArgument>([&] { withPlan(killAt(1, "in-backward", 0)); },
                                    {"rank 1 at \"in-backward\" has hit 0; hits count from 1"});
  expectThrowsWith<InvalidArgument>([&] { withPlan(freezeAt(2, "")); }, {"plan step 0 (for rank 2) has an empty point name"});
  expectThrowsWith<InvalidArgument>([&] { withPlan(freezeAt(2, "commit", -5ms)); },
                                    {"'freeze rank 2 for -5 ms the 1st time it reaches \"commit\"' freezes for -5 ms"});
  SpawnOptions twice;
  twice.plan = {killAt(1, "commit", 2), freezeAt(1, "commit", 1s, 2)};
  expectThrowsWith<InvalidArgument>([&] { spawn(2, nothing, twice); },
                                    {"'kill rank 1 the 2nd time it reaches \"commit\"' and 'freeze rank 1 for 1000 ms the "
                                     "2nd time it reaches \"commit\"' both act on the same moment"});
  SpawnOptions noTime;
  noTime.deadline = 0ms;
  expectThrowsWith<InvalidArgument>([&] { spawn(2, nothing, noTime); }, {"deadline must be positive, got 0 ms"});
  SpawnOptions badEnv;
  badEnv.env = {{"A=B", "1"}};
  expectThrowsWith<InvalidArgument>([&] { spawn(2, nothing, badEnv); }, {"environment variable name \"A=B\""});

  struct sigaction ignore {}, before {};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGCHLD, &ignore, &before);
  expectThrowsWith<InvalidArgument>([&] { spawn(1, nothing); }, {"spawn: this process ignores SIGCHLD"});
  ::sigaction(SIGCHLD, &before, nullptr);

  SpawnedRanks run(2, nothing);
  expectThrowsWith<InvalidArgument>([&] { run.kill(7); }, {"SpawnedRanks::kill(7): no such rank; the world has ranks 0-1"});
  expectThrowsWith<InvalidArgument>([&] { run.freeze(-1); }, {"SpawnedRanks::freeze(-1): no such rank"});
  EXPECT_TRUE(run.wait().ok());
}

TEST(Spawn, RefusesToForkWhileAnotherThreadRuns) {
  std::promise<void> release;
  std::thread other([future = release.get_future()]() mutable { future.wait(); });
  ::pthread_setname_np(other.native_handle(), "spawn-test-bg");
  expectThrowsWith<InvalidArgument>([] { spawn(2, [](RankContext&) {}); },
                                    {"spawn(2 ranks): this process has started 1 other thread(s) (spawn-test-bg)",
                                     "SpawnOptions::allowThreads"});
  SpawnOptions options;
  options.allowThreads = true;  // this thread holds no lock the ranks need
  EXPECT_TRUE(spawn(2, [](RankContext&) {}, options).ok());
  release.set_value();
  other.join();
}

TEST(Spawn, PointsCostNothingWithoutAPlanAndUnreachedStepsAreListed) {
  point("in-the-parent");  // no plan in this process: nothing happens
  EXPECT_EQ(detail::pointHook.load(), nullptr);
  SpawnOptions options;
  options.plan = {killAt(1, "step", 2)};
  const auto result = spawn(2, [](RankContext& ctx) {
    const bool hooked = detail::pointHook.load() != nullptr;
    for (int i = 0; i < 1000; ++i) point("step");  // rank 0 has no step; rank 1 dies at its 2nd
    return str("hooked ", hooked);
  }, options);
  EXPECT_EQ(result[0].value, "hooked 0") << "a rank without plan steps installs no hook";
  EXPECT_EQ(result[1].ending, Ending::Killed);

  options.plan = {killAt(1, "step", 5), freezeAt(0, "elsewhere")};
  const auto unreached = spawn(2, [](RankContext&) {
    for (int i = 0; i < 3; ++i) point("step");
  }, options);
  EXPECT_TRUE(unreached.ok());
  EXPECT_EQ(unreached.planNotFired, (std::vector<std::string>{"kill rank 1 the 5th time it reaches \"step\"",
                                                               "freeze rank 0 until resumed the 1st time it reaches \"elsewhere\""}));
  EXPECT_TRUE(contains(unreached.summary(), "plan step never reached: kill rank 1 the 5th time it reaches \"step\""));
}

TEST(Spawn, GtestFailuresInsideARankReachTheTest) {
  const auto result = spawn(1, reportGtestFailures([](RankContext& ctx) {
    EXPECT_EQ(ctx.worldSize, 2) << "a check that fails inside the rank";
  }));
  ASSERT_EQ(result[0].ending, Ending::Threw);
  EXPECT_TRUE(contains(result[0].error, "dt::Error: rank 0: 1 gtest failure(s): ")) << result[0].error;
  EXPECT_TRUE(contains(result[0].error, "spawn_test.cpp:")) << result[0].error;
  EXPECT_TRUE(contains(result[0].error, "a check that fails inside the rank")) << result[0].error;
  EXPECT_FALSE(everyRankReturned(result));
}

TEST(Spawn, InitProcessGroupWorksInARankUnchanged) {
  SpawnedRanks run(2, [](RankContext& ctx) {
    auto group = initProcessGroup();
    Tensor t = full({4}, static_cast<float>(ctx.rank + 1));
    group->allreduce(t)->wait();
    group->destroy();
    return str("sum ", t.toVector<float>()[0], " rank ", group->rank(), "/", group->size());
  });
  const auto result = run.wait();
  ASSERT_TRUE(everyRankReturned(result));
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(result[rank].value, str("sum 3 rank ", rank, "/2"));
    // initProcessGroup took DT_STORE_ADDR: the launcher's watchdog key is there.
    EXPECT_EQ(run.store().get(str("dt/progress/", rank)), "1 allreduce");
  }
}

}  // namespace
}  // namespace dt::testing
