// Who runs a small op, and how ranks wait for each other: every scheduling
// path the runner (collective_runner.h) and the shared-memory segment
// (shm_segment.h, core_placement.h) keep, checked by what ran where and by the
// counters they keep, never by time.
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "process_group/collective_runner.h"
#include "process_group/shm/core_placement.h"
#include "process_group/shm/shm_segment.h"
#include "process_group/shm/wait_rules.h"
#include "common/strings.h"
#include "store/hash_store.h"
#include "testing/point.h"
#include "testing/spawn.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using Millis = std::chrono::milliseconds;

bool eventually(const std::function<bool()>& done, std::chrono::seconds limit = 30s) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
  return done();
}

CollectiveFingerprint floats(int64_t count) {
  CollectiveFingerprint fp;
  fp.tensors.push_back({DType::Float32, {count}});
  return fp;
}

// A one-rank runner whose ops record the thread that ran them.
struct Recorder {
  std::unique_ptr<CollectiveRunner> runner;
  std::mutex mutex;
  std::vector<std::thread::id> ranOn;  // by op, in run order
  std::atomic<int> ran{0};

  Recorder() {
    CollectiveRunnerOptions options;
    options.backendName = "test";
    runner = std::make_unique<CollectiveRunner>(std::make_shared<HashStore>(), 0, 1, options, [] {});
  }
  WorkPtr issue(int64_t count = 1024) {
    return runner->enqueue(0, "allreduce", floats(count), std::nullopt, [this](Millis, const CollectiveFingerprint&) {
      std::lock_guard<std::mutex> lock(mutex);
      ranOn.push_back(std::this_thread::get_id());
      ++ran;
    });
  }
  std::thread::id thread(size_t op) {
    std::lock_guard<std::mutex> lock(mutex);
    return ranOn.at(op);
  }
};

// A body's failure (on the caller) and an elastic watcher's abort (on its own thread) can
// shut the same sub-backend down at once: every caller returns, the worker is joined once.
TEST(Scheduling, ShutdownFromSeveralThreadsAtOnceReturnsEverywhere) {
  for (int round = 0; round < 20; ++round) {
    Recorder r;
    r.issue()->wait();
    std::atomic<int> ready{0}, returned{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        ++ready;
        while (ready.load() < 4) std::this_thread::yield();
        r.runner->shutdown();
        ++returned;
      });
    }
    ASSERT_TRUE(eventually([&] { return returned.load() == 4; }, 10s)) << "round " << round << ": "
                                                                         << returned.load() << " of 4 returned";
    for (auto& t : threads) t.join();
    EXPECT_TRUE(r.runner->stopping());
  }
}

TEST(Scheduling, ASmallOpItsCallerWaitsForRunsOnTheCallerWithNoWakeUp) {
  Recorder r;
  for (int i = 0; i < 50; ++i) r.issue()->wait();
  for (size_t i = 0; i < 50; ++i) EXPECT_EQ(r.thread(i), std::this_thread::get_id()) << "op " << i;
  EXPECT_EQ(r.runner->stats().ranByCaller, 50u);
  EXPECT_EQ(r.runner->stats().ranByWorker, 0u);
}

TEST(Scheduling, AnOpNobodyTouchesStartsOnTheWorkerAtItsSecondTick) {
  Recorder r;
  WorkPtr work = r.issue();
  // Nothing is asked of the Work: only the worker's tick can start it.
  ASSERT_TRUE(eventually([&] { return r.ran.load() == 1; }));
  EXPECT_NE(r.thread(0), std::this_thread::get_id());
  work->wait();  // a late waiter finds it done and runs nothing
  EXPECT_EQ(r.runner->stats().ranByWorker, 1u);
  EXPECT_EQ(r.runner->stats().ranByCaller, 0u);
}

TEST(Scheduling, UsingTheWorkOtherwiseHandsItToTheWorkerAtOnce) {
  for (int hint = 0; hint < 4; ++hint) {
    Recorder r;
    WorkPtr work = r.issue();
    std::atomic<bool> called{false};
    switch (hint) {
      case 0: EXPECT_FALSE(work->isCompleted() && r.ran.load() == 0); break;
      case 1: work->then([&](Work&) { called = true; }); break;
      case 2: (void)work->future(); break;
      case 3: work->wait(30s); break;  // a wait with a timeout does not run it here
    }
    ASSERT_TRUE(eventually([&] { return r.ran.load() == 1; })) << "hint " << hint;
    EXPECT_NE(r.thread(0), std::this_thread::get_id()) << "hint " << hint;
    work->wait();
    if (hint == 1) {
      EXPECT_TRUE(eventually([&] { return called.load(); }));
    }
  }
}

TEST(Scheduling, IssuingAnotherOpHandsTheEarlierOneToTheWorker) {
  Recorder r;
  WorkPtr first = r.issue();
  WorkPtr second = r.issue();
  second->wait();
  first->wait();
  EXPECT_NE(r.thread(0), std::this_thread::get_id()) << "the caller moved on: the first op was the worker's";
  EXPECT_EQ(r.runner->stats().ranByCaller + r.runner->stats().ranByWorker, 2u);
}

TEST(Scheduling, LargeOpsStartOnTheWorkerWithoutAnyHint) {
  Recorder r;
  WorkPtr work = r.issue(int64_t{1} << 20);  // 4 MiB: what a caller overlaps with compute
  ASSERT_TRUE(eventually([&] { return r.ran.load() == 1; }, 5s));
  EXPECT_NE(r.thread(0), std::this_thread::get_id());
  work->wait();
}

// The worker completes an op (waking its caller) only after it is done with it: a caller that
// issues its next op at once and waits for it runs it itself. Completing first left a window
// where the woken caller found the worker still busy and handed it the op, and then the next,
// and so on: on a host where a wake-up costs 5 us, every small op after one large op cost 6-9 us
// instead of 1.3 in half the launches. The then-inline callback holds the worker in that window.
TEST(Scheduling, TheOpAfterOneTheWorkerRanRunsOnItsCallerWhileTheWorkerFinishesUp) {
  Recorder r;
  std::atomic<bool> started{false}, registered{false};
  WorkPtr large = r.runner->enqueue(0, "allreduce", floats(int64_t{1} << 20), std::nullopt,
                                    [&](Millis, const CollectiveFingerprint&) {
                                      started = true;
                                      while (!registered.load()) std::this_thread::yield();
                                    });
  ASSERT_TRUE(eventually([&] { return started.load(); })) << "a large op starts on the worker by itself";
  large->thenInline([](Work&) { std::this_thread::sleep_for(200ms); });  // on the worker, completing it
  registered = true;
  large->wait();
  r.issue()->wait();
  EXPECT_EQ(r.thread(0), std::this_thread::get_id());
  EXPECT_EQ(r.runner->stats().ranByWorker, 1u);
  EXPECT_EQ(r.runner->stats().ranByCaller, 1u);
}

TEST(Scheduling, OpsIssuedFromTwoThreadsAllRunOnceInIssueOrder) {
  Recorder r;
  std::mutex issueOrder;
  std::vector<uint64_t> issued;
  auto caller = [&] {
    for (int i = 0; i < 200; ++i) {
      WorkPtr work;
      {
        std::lock_guard<std::mutex> lock(issueOrder);
        work = r.issue();
      }
      work->wait();
    }
  };
  std::thread a(caller), b(caller);
  a.join();
  b.join();
  EXPECT_EQ(r.ran.load(), 400);
  const auto stats = r.runner->stats();
  EXPECT_EQ(stats.ranByCaller + stats.ranByWorker, 400u);
}

TEST(Scheduling, ABrokenGroupFailsAnOpLeftToItsCallerAtOnce) {
  Recorder r;
  WorkPtr work = r.issue();
  r.runner->fail(std::make_exception_ptr(BackendError("peer 1 is gone")));
  testing::expectThrowsWith<BackendError>([&] { work->wait(); }, {"not started", "peer 1 is gone"});
  EXPECT_EQ(r.ran.load(), 0);
}

// ---- shared memory: how ranks wait for each other ------------------------------------------

void pinThisThreadTo(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  ASSERT_EQ(::pthread_setaffinity_np(::pthread_self(), sizeof set, &set), 0);
}

// Two threads as ranks of one segment, each pinned to `coreOf(rank)`, run
// `rounds` exchanges (calling beforeRound(rank, round) first, when given,
// outside the collective) and return each rank's wait statistics. Each round
// is a collective as the backend runs one: between enterCollective() and
// leaveCollective(), which tells a waiting peer that this rank is working.
std::vector<shm::ShmSegment::WaitStats> exchange(int rounds, const std::function<int(int)>& coreOf,
                                                 const std::function<void(int, int)>& beforeRound = {}) {
  auto store = std::make_shared<HashStore>();
  std::vector<shm::ShmSegment::WaitStats> stats(2);
  testing::runRanks(2, [&](int rank) {
    pinThisThreadTo(coreOf(rank));
    shm::SegmentOptions options;
    options.name = "scheduling";
    options.rank = rank;
    options.size = 2;
    options.slotBytes = 4096;
    shm::ShmSegment segment(store, options);
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    for (int i = 0; i < rounds; ++i) {
      if (beforeRound) beforeRound(rank, i);
      segment.enterCollective();
      *reinterpret_cast<int*>(segment.slot(rank, i & 1)) = i * 10 + rank;
      segment.arrive();
      segment.waitForAll(deadline);
      EXPECT_EQ(*reinterpret_cast<int*>(segment.slot(1 - rank, i & 1)), i * 10 + 1 - rank) << "round " << i;
      // Nobody rewrites a slot before every rank has read it (the backend's rule).
      segment.arrive();
      segment.waitForAll(deadline);
      segment.leaveCollective();
    }
    stats[rank] = segment.waitStats();
  });
  for (int r = 0; r < 2; ++r) {
    std::printf("rank %d: spun %llu (%llu for a peer it had woken), slept %llu (%llu for a peer it had woken), "
                "for a core mate %llu (spun on a core of its own after moving %llu, slept %llu), stepped aside %llu\n",
                r, static_cast<unsigned long long>(stats[r].spun), static_cast<unsigned long long>(stats[r].spunForWaking),
                static_cast<unsigned long long>(stats[r].slept), static_cast<unsigned long long>(stats[r].sleptForWoken),
                static_cast<unsigned long long>(stats[r].forCoreMate),
                static_cast<unsigned long long>(stats[r].spunOnOwnCore),
                static_cast<unsigned long long>(stats[r].sleptForCoreMate),
                static_cast<unsigned long long>(stats[r].steppedAside));
  }
  return stats;
}

TEST(Scheduling, RanksSharingACoreNeverSpinForEachOther) {
  const auto stats = exchange(500, [](int) { return 0; });
  for (int rank = 0; rank < 2; ++rank) {
    // Every wait that was not over at once found its peer on its own core.
    EXPECT_GT(stats[rank].forCoreMate, 0u) << "rank " << rank;
    EXPECT_EQ(stats[rank].spun, 0u) << "rank " << rank;
    EXPECT_EQ(stats[rank].steppedAside, 0u) << "rank " << rank << ": pinned to one core, nowhere to go";
  }
}

TEST(Scheduling, RanksOnTwoCoresSpinForEachOther) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "needs two cores, this machine has one";
  const auto stats = exchange(2000, [](int rank) { return rank; });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_GT(stats[rank].spun, 0u) << "rank " << rank;
    EXPECT_EQ(stats[rank].forCoreMate, 0u) << "rank " << rank;
  }
}

// ---- wait rules: the decisions, fed the observations they react to ------------------------
// What the kernel then does with them (where it puts threads, how fast it wakes them) is
// measured by bench/scheduling_bench.cpp, not asserted here.

using shm::MateWait;
using shm::SpinCheck;
using shm::ThenWait;
using shm::YieldCheck;

YieldCheck yielded(std::chrono::nanoseconds took, std::chrono::nanoseconds yielding) {
  YieldCheck check;
  check.yieldTook = took;
  check.yielding = yielding;
  return check;
}

SpinCheck spinning(std::chrono::nanoseconds spun) {
  SpinCheck check;
  check.spinning = spun;
  return check;
}

// A stacked rank that gets a core of its own in the middle of a wait (it steps aside, or the
// kernel moves it, or its mate leaves the core) waits there as a rank on a free core does: it
// spins, for as long as a working peer is worth spinning for, and only then sleeps.
TEST(WaitRules, AStackedRankThatGetsACoreOfItsOwnSpinsThereInsteadOfSleeping) {
  YieldCheck moved = yielded(2us, 50us);
  moved.movedOffCore = true;
  EXPECT_EQ(shm::afterYield(moved), MateWait::kOwnCore) << "the kernel moved it";
  YieldCheck mateLeft = yielded(2us, 50us);
  mateLeft.coreStillNeededByGroup = false;
  EXPECT_EQ(shm::afterYield(mateLeft), MateWait::kOwnCore) << "its mate moved off the core";
  EXPECT_EQ(shm::afterMateWait(MateWait::kOwnCore), ThenWait::kSpinOnOwnCore) << "also after a step aside";

  SpinCheck onOwnCore = spinning(500us);
  onOwnCore.peerInCollective = true;
  EXPECT_TRUE(shm::keepSpinning(onOwnCore)) << "the peer works on its own core";
  onOwnCore.spinning = shm::kSpinForWorkingPeer;
  EXPECT_FALSE(shm::keepSpinning(onOwnCore)) << "past the bound the peer is probably descheduled: sleep";
}

TEST(WaitRules, YieldingToACoreMateGoesOnUntilItRunsOrTheYieldsShowABusyProcess) {
  EXPECT_EQ(shm::afterYield(yielded(2us, 100us)), MateWait::kYieldAgain);
  YieldCheck done = yielded(2us, 100us);
  done.peerReached = true;
  done.movedOffCore = true;
  EXPECT_EQ(shm::afterYield(done), MateWait::kReached) << "reaching wins over anything else seen";
  EXPECT_EQ(shm::afterYield(yielded(shm::kForeignSlice + 1us, 600us)), MateWait::kGaveUp)
      << "one yield that kept this thread away past a slice: a busy process took the core";
  YieldCheck longAndMoved = yielded(shm::kForeignSlice + 1us, 600us);
  longAndMoved.movedOffCore = true;
  EXPECT_EQ(shm::afterYield(longAndMoved), MateWait::kGaveUp) << "a long yield is judged before a move";
  EXPECT_EQ(shm::afterYield(yielded(shm::kForeignSlice, shm::kYieldToMateFor - 1ns)), MateWait::kYieldAgain);
  EXPECT_EQ(shm::afterYield(yielded(2us, shm::kYieldToMateFor)), MateWait::kGaveUp) << "2 ms of yields: sleep";
  EXPECT_EQ(shm::afterMateWait(MateWait::kGaveUp), ThenWait::kSleep);
  EXPECT_EQ(shm::afterMateWait(MateWait::kReached), ThenWait::kDone);
}

TEST(WaitRules, ASpinForAPeerOnAnotherCoreStopsAtOnceWhenTheGroupNeedsThisCore) {
  SpinCheck check = spinning(0ns);
  check.peerInCollective = true;
  check.coreNeededByGroup = true;
  EXPECT_FALSE(shm::keepSpinning(check)) << "spinning would keep the rank that needs this core off it";
}

TEST(WaitRules, AnIdlePeerIsSpunForAboutWhatSleepingCostsAWorkingOneUpTo1Ms) {
  EXPECT_TRUE(shm::keepSpinning(spinning(shm::kSpinBeforeSleeping - 1ns)));
  EXPECT_FALSE(shm::keepSpinning(spinning(shm::kSpinBeforeSleeping))) << "outside any collective: sleep";
  SpinCheck working = spinning(shm::kSpinForWorkingPeer - 1ns);
  working.peerInCollective = true;
  EXPECT_TRUE(shm::keepSpinning(working));
  working.peerAsleep = true;
  EXPECT_FALSE(shm::keepSpinning(working)) << "asleep in a wait of its own, and not woken by this rank";
}

// A rank that wakes a sleeping peer spins for that peer's next arrival instead of sleeping as
// well (up to 1 ms): otherwise, where waking a thread takes longer than the 10 us spin (25-30 us
// in the development VM, 50-170 us on a busier day), every later exchange would cost two
// wake-ups.
TEST(WaitRules, ARankThatWokeItsPeerSpinsForItInsteadOfSleepingToo) {
  SpinCheck woken = spinning(300us);
  woken.peerAsleep = true;
  woken.sinceWokeSleepers = 300us;
  EXPECT_TRUE(shm::keepSpinning(woken)) << "woken 300 us ago: still on its way";
  woken.sinceWokeSleepers = shm::kSpinForWakingPeer;
  EXPECT_FALSE(shm::keepSpinning(woken)) << "woken longer ago than the bound";
  SpinCheck neverWoke = spinning(300us);
  neverWoke.peerAsleep = true;
  EXPECT_FALSE(shm::keepSpinning(neverWoke)) << "this rank never woke it: it sleeps for something else";
}

// Two forked ranks (a stopped thread of this process would stop the test), each pinned to
// coreOf(rank) unless that is -1, run 1000 exchanges; rank 1 freezes at round 100 for 300 ms (SIGSTOP, as a
// preempted or paused process is), well under the 5 s heartbeat timeout. Each rank's value:
// "wrong <exchanges that read a wrong value> slept <waits that slept> for-mate <of them, waits
// for a core mate that slept> ".
testing::SpawnResult exchangeWithAStop(const std::function<int(int)>& coreOf) {
  testing::SpawnOptions spawnOptions;
  spawnOptions.plan = {testing::freezeAt(1, "round-100", 300ms)};
  auto results = testing::spawn(2, [&](testing::RankContext& ctx) -> std::string {
    const int rank = ctx.rank;
    if (coreOf(rank) >= 0) pinThisThreadTo(coreOf(rank));
    auto store = ctx.store();
    shm::SegmentOptions options;
    options.name = "stopped";
    options.rank = rank;
    options.size = 2;
    options.slotBytes = 4096;
    shm::ShmSegment segment(store, options);
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    int wrong = 0;
    for (int round = 0; round < 1000; ++round) {
      if (round == 100) testing::point("round-100");
      *reinterpret_cast<int*>(segment.slot(rank, round & 1)) = round * 10 + rank;
      segment.arrive();
      segment.waitForAll(deadline);
      wrong += *reinterpret_cast<int*>(segment.slot(1 - rank, round & 1)) != round * 10 + 1 - rank;
      segment.arrive();
      segment.waitForAll(deadline);
    }
    const auto stats = segment.waitStats();
    return str("wrong ", wrong, " slept ", stats.slept + stats.sleptForCoreMate, " for-mate ", stats.sleptForCoreMate,
               " ");
  }, spawnOptions);
  EXPECT_EQ(results.ranks.size(), 2u);
  for (int rank = 0; rank < static_cast<int>(results.ranks.size()); ++rank) {
    EXPECT_EQ(results[rank].signal, 0) << results[rank].describe();
    EXPECT_EQ(results[rank].value.rfind("wrong 0 ", 0), 0u) << results[rank].describe();
  }
  EXPECT_TRUE(results.planNotFired.empty()) << results.summary();
  return results;
}

// A peer stopped mid-exchange is waited for by sleeping, not by spinning for as long as it is
// away, and the exchange completes once it runs again.
TEST(Scheduling, APeerStoppedMidExchangeIsWaitedForAsleepAndCatchesUp) {
  const auto results = exchangeWithAStop([](int) { return -1; });
  if (results.ranks.size() != 2) return;
  // Rank 0 waited 300 ms for the stopped rank 1: asleep, not spinning.
  EXPECT_EQ(results[0].value.find(" slept 0 "), std::string::npos) << results[0].value;
}

// A core mate that does not get the core back while this rank yields it (stopped here; in a
// job, a busy process took the core on the yields) is waited for asleep after 2 ms of
// yielding: yielding on would keep a core busy for nothing, or hand it to the busy process
// slice after slice.
TEST(Scheduling, ACoreMateThatDoesNotRunOnTheYieldsIsWaitedForAsleep) {
  const auto results = exchangeWithAStop([](int) { return 0; });
  if (results.ranks.size() != 2) return;
  EXPECT_EQ(results[0].value.find(" for-mate 0 "), std::string::npos) << results[0].value;
}

// ---- core placement ----------------------------------------------------------------------

cpu_set_t cores(std::initializer_list<int> list) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : list) CPU_SET(c, &set);
  return set;
}

TEST(CorePlacement, AStackedRankGoesOnlyToAnIdleCoreNoRankHolds) {
  using shm::chooseIdleCore;
  using shm::kIdleUnknown;
  const std::vector<uint8_t> idle = {0, 100, 95, 100};
  // On core 0 with its core mate (runnable threads: this one and the mate).
  EXPECT_EQ(chooseIdleCore(cores({0, 1, 2, 3}), 0, {0}, 2, idle, 80), 1);
  // Core 1 holds another rank of the group: the next idlest free core.
  EXPECT_EQ(chooseIdleCore(cores({0, 1, 2, 3}), 0, {0, 1}, 2, idle, 80), 3);
  // Outside the affinity mask: never.
  EXPECT_EQ(chooseIdleCore(cores({0, 2}), 0, {0}, 2, idle, 80), 2);
  // As many threads run elsewhere as there are other cores: none is idle now.
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0}, 3, {0, 100}, 80), -1);
  // Busy in the last interval (a busy process holds it): stay.
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0}, 2, {0, 40}, 80), -1);
  // Nothing known yet about idle shares: the runnable count decides.
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0}, 2, {kIdleUnknown, kIdleUnknown}, 80), 1);
  // A known idle core before an unknown one.
  EXPECT_EQ(chooseIdleCore(cores({0, 1, 2}), 0, {0}, 2, {0, kIdleUnknown, 90}, 80), 2);
  // procs_running unreadable: stay.
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0}, -1, {0, 100}, 80), -1);
}

TEST(CorePlacement, WhereSwitchesAreExpensiveAStackedRankTakesACoreABusyProcessHolds) {
  using shm::chooseIdleCore;
  // On core 0 with its core mate; a busy process holds core 1 (runnable: this thread, the mate
  // and the busy one).
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0}, 3, {0, 0}, 80), -1) << "switches cheap: stay stacked";
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0}, 3, {0, 0}, 80, /*acceptBusyCore=*/true), 1);
  // Short-lived threads waiting for core 1 too (the group's own helpers): still up to four.
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0}, 5, {0, 0}, 80, true), 1);
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0}, 6, {0, 0}, 80, true), -1) << "a fifth of a core is too little";
  // An idle core still comes first, and cores of the group or outside the mask never do.
  EXPECT_EQ(chooseIdleCore(cores({0, 1, 2}), 0, {0}, 3, {0, 0, 100}, 80, true), 2);
  EXPECT_EQ(chooseIdleCore(cores({0, 1, 2}), 0, {0, 2}, 3, {0, 0, 100}, 80, true), 1);
  EXPECT_EQ(chooseIdleCore(cores({0, 2}), 0, {0, 2}, 3, {0, 0, 0}, 80, true), -1);
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0}, -1, {0, 0}, 80, true), -1) << "procs_running unreadable: stay";
}

// procs_running also counts threads that have just gone to sleep; where stacking is expensive a
// refusal is checked against the threads listed in state R.
TEST(CorePlacement, AStepAsideProcsRunningRefusesIsCheckedAgainstTheListedThreadsWhereStackingIsExpensive) {
  int listings = 0;
  const auto count = [](int n) { return [n] { return n; }; };
  const auto listedAs = [&](int n) {
    return [&listings, n] {
      ++listings;
      return n;
    };
  };
  // On core 0 with its mate, a busy process on core 1; procs_running reads 6, the tasks say 3.
  EXPECT_EQ(shm::chooseStepAsideCore(cores({0, 1}), 0, {0}, {0, 0}, 80, true, count(6), listedAs(3)), 1);
  EXPECT_EQ(listings, 1);
  // The listing agrees (a truly crowded core 1), or cannot be read: stay.
  EXPECT_EQ(shm::chooseStepAsideCore(cores({0, 1}), 0, {0}, {0, 0}, 80, true, count(6), listedAs(6)), -1);
  EXPECT_EQ(shm::chooseStepAsideCore(cores({0, 1}), 0, {0}, {0, 0}, 80, true, count(6), listedAs(-1)), -1);
  // procs_running allows it: no listing.
  listings = 0;
  EXPECT_EQ(shm::chooseStepAsideCore(cores({0, 1}), 0, {0}, {0, 0}, 80, true, count(3), listedAs(3)), 1);
  EXPECT_EQ(listings, 0);
  // Switches cheap: stacking costs little, a busy core is refused anyway, and no listing is made.
  EXPECT_EQ(shm::chooseStepAsideCore(cores({0, 1}), 0, {0}, {0, 0}, 80, false, count(6), listedAs(3)), -1);
  EXPECT_EQ(listings, 0);
}

TEST(CorePlacement, WithMoreRanksThanCoresARankLeavesACrowdedCoreForTheLeastCrowdedOne) {
  using shm::chooseIdleCore;
  using shm::kIdleUnknown;
  const std::vector<uint8_t> unknown = {kIdleUnknown, kIdleUnknown, kIdleUnknown};
  // World 4 on cores 0 and 1: this rank and two more on core 0, one on core 1 (runnable: the four
  // ranks). Core 1 holds a rank, so the idle search has nothing; 1 is two fewer than 3.
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0, 0, 1}, 4, unknown, 80), 1);
  // 2 and 2: moving would only swap the crowd.
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0, 1, 1}, 4, unknown, 80), -1);
  // 2 and 1 (world 3): the same.
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0, 1}, 3, unknown, 80), -1);
  // The least crowded of several, within the mask.
  EXPECT_EQ(chooseIdleCore(cores({0, 1, 2}), 0, {0, 0, 0, 1, 1, 2}, 7, unknown, 80), 2);
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0, 0, 0, 1, 1, 2}, 7, unknown, 80), 1) << "core 2 is outside the mask";
  // A core no rank holds is the idle search's, with its checks: a busy process there (runnable:
  // the pair and it) keeps a pair where it is, however the other cores are shared.
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0}, 3, {0, 0}, 80), -1);
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0, 0, 0}, 5, {0, 0}, 80), -1);
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0, 0, 1}, -1, unknown, 80), -1) << "procs_running unreadable: stay";
}

TEST(CorePlacement, OfAStackedPairTheHigherRankMovesOrTheLowerWhileItsMateSleeps) {
  using shm::mayStepAside;
  EXPECT_TRUE(mayStepAside(/*rank=*/1, /*mate=*/0, /*mateAsleep=*/false));
  EXPECT_FALSE(mayStepAside(0, 1, false)) << "both moving would swap cores";
  EXPECT_TRUE(mayStepAside(0, 1, true)) << "a sleeping mate is not moving";
  EXPECT_TRUE(mayStepAside(3, 1, true));
}

TEST(CorePlacement, SwitchesAreExpensiveOnlyWhenTheFastestOfSeveralIsSlow) {
  using Cost = shm::SwitchCost;
  Cost cost;
  EXPECT_FALSE(cost.expensive()) << "nothing measured";
  for (int i = 0; i < Cost::kSamples - 1; ++i) cost.record(5us);
  EXPECT_FALSE(cost.expensive()) << "too few switches to tell";
  cost.record(4800ns);
  EXPECT_TRUE(cost.expensive()) << "four switches of 4.8-5 us (a paravirtualized guest)";
  cost.record(Cost::kExpensive);
  EXPECT_FALSE(cost.expensive()) << "one as fast as the bound: the others waited for something else";
  cost.reset();
  for (int i = 0; i < Cost::kSamples; ++i) cost.record(i == 2 ? 1us : 20us);
  EXPECT_FALSE(cost.expensive()) << "a 1 us switch among slow ones";
  cost.reset();
  EXPECT_FALSE(cost.expensive()) << "reset forgets the run";
  for (int i = 0; i < Cost::kSamples; ++i) cost.record(3us);
  EXPECT_TRUE(cost.expensive());
}

TEST(CorePlacement, TheBusyShareOfACoreTheGroupLeftIsNotHeldAgainstIt) {
  using shm::chooseIdleCore;
  using shm::forgetSharesOfGroupCores;
  using shm::kIdleUnknown;
  // Ranks 0 and 1 spun on cores 0 and 1; then the kernel put rank 1 on core 0. The interval's
  // sample shows core 1 busy with rank 1's own spinning.
  std::vector<uint8_t> idle = {0, 5, 100, 30};
  const std::vector<uint8_t> sampled = idle;
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0}, 2, idle, 80), -1) << "the sample as it was refuses core 1";
  forgetSharesOfGroupCores(idle, /*groupCoresAtStart=*/{0, 1}, /*groupCoresAtEnd=*/{0, 0});
  EXPECT_EQ(idle, (std::vector<uint8_t>{kIdleUnknown, kIdleUnknown, 100, 30}));
  EXPECT_EQ(chooseIdleCore(cores({0, 1}), 0, {0}, 2, idle, 80), 1) << "procs_running decides";
  // A core the group never ran on keeps its share: a busy process there still keeps ranks away.
  EXPECT_EQ(chooseIdleCore(cores({0, 3}), 0, {0}, 2, idle, 80), -1);
  // Cores not known yet (-1) and cores beyond the sample change nothing.
  idle = sampled;
  forgetSharesOfGroupCores(idle, {-1, -1}, {7, 2});
  EXPECT_EQ(idle, (std::vector<uint8_t>{0, 5, kIdleUnknown, 30}));
  std::vector<uint8_t> none;
  forgetSharesOfGroupCores(none, {0}, {1});
  EXPECT_TRUE(none.empty()) << "the first sample (nothing to compare with) stays empty";
}

TEST(CorePlacement, ARefusedStepAsideIsTriedAgainSoonThenLessAndLessOften) {
  using Backoff = shm::StepAsideBackoff;
  Backoff backoff;
  const auto t0 = Backoff::Clock::now();
  EXPECT_TRUE(backoff.due(t0)) << "the first attempt waits for nothing";
  // Refused (no idle core at that instant, e.g. set-up threads running): 100 us, 200 us, ...
  backoff.refused(t0);
  EXPECT_FALSE(backoff.due(t0 + 99us));
  EXPECT_TRUE(backoff.due(t0 + 100us));
  const auto t1 = t0 + 100us;
  backoff.refused(t1);
  EXPECT_FALSE(backoff.due(t1 + 199us));
  EXPECT_TRUE(backoff.due(t1 + 200us));
  // ... up to 128 ms while a busy process holds the other core.
  auto t = t1 + 200us;
  for (int i = 0; i < 20; ++i) {
    backoff.refused(t);
    t += Backoff::kLongestPause;
  }
  backoff.refused(t);
  EXPECT_FALSE(backoff.due(t + Backoff::kLongestPause - 1us));
  EXPECT_TRUE(backoff.due(t + Backoff::kLongestPause));
  // A move starts over: the kernel may stack the pair again at once.
  t += Backoff::kLongestPause;
  backoff.moved(t);
  EXPECT_FALSE(backoff.due(t + 99us));
  EXPECT_TRUE(backoff.due(t + 100us));
  backoff.refused(t + 100us);
  EXPECT_TRUE(backoff.due(t + 200us)) << "after a move, the first refusal pauses 100 us again";
}

TEST(CorePlacement, OneLongYieldIsSleptOnOnceTwoWithin100MsMakeTheRankSleepFor100Ms) {
  using Slices = shm::ForeignSlices;
  Slices slices;
  const auto t0 = Slices::Clock::now();
  EXPECT_FALSE(slices.sleepInstead(t0)) << "nothing seen yet: yield";
  // A mate working through a large op kept the core 1.5 ms: only that wait sleeps (the caller's part).
  slices.longYield(t0);
  EXPECT_FALSE(slices.sleepInstead(t0 + 1ms));
  // Another one 150 ms later: still only that wait.
  const auto t1 = t0 + 150ms;
  slices.longYield(t1);
  EXPECT_FALSE(slices.sleepInstead(t1 + 1ms));
  // A busy process takes the core again 5 ms later: sleep instead of yielding for 100 ms.
  const auto t2 = t1 + 5ms;
  slices.longYield(t2);
  EXPECT_TRUE(slices.sleepInstead(t2));
  EXPECT_TRUE(slices.sleepInstead(t2 + Slices::kMemory - 1us));
  EXPECT_FALSE(slices.sleepInstead(t2 + Slices::kMemory));
}

TEST(CorePlacement, MovingAThreadLeavesItsAffinityMaskAsItWas) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "needs two cores, this machine has one";
  std::thread([] {
    cpu_set_t before;
    ASSERT_EQ(::sched_getaffinity(0, sizeof before, &before), 0);
    int target = -1;
    for (int c = 0; c < CPU_SETSIZE && target < 0; ++c) {
      if (CPU_ISSET(c, &before) && c != ::sched_getcpu()) target = c;
    }
    if (target < 0) GTEST_SKIP() << "this thread may run on one core only";
    ASSERT_TRUE(shm::moveCallingThreadTo(target));
    EXPECT_EQ(::sched_getcpu(), target);
    cpu_set_t after;
    ASSERT_EQ(::sched_getaffinity(0, sizeof after, &after), 0);
    EXPECT_TRUE(CPU_EQUAL(&before, &after));
    // A core outside the mask is refused and changes nothing.
    EXPECT_FALSE(shm::moveCallingThreadTo(CPU_SETSIZE + 1));
  }).join();
}

TEST(CorePlacement, IdleSharesComeFromProcStat) {
  shm::CoreIdleSampler sampler;
  EXPECT_TRUE(sampler.sample().empty()) << "nothing to compare with yet";
  std::this_thread::sleep_for(50ms);
  const auto idle = sampler.sample();
  ASSERT_GE(idle.size(), std::min<size_t>(1, std::thread::hardware_concurrency()));
  for (uint8_t share : idle) EXPECT_LE(share, 100);
  EXPECT_GE(shm::runnableThreads(), 1) << "this thread is running";
}

// The listed count reads each task's state, so a task that sleeps is left out even where the
// scheduler still holds it on a run queue (procs_running counts it then).
TEST(CorePlacement, ListedRunnableThreadsAreTheTasksInStateR) {
  testing::TempDir proc;
  const auto task = [&](const std::string& pid, const std::string& tid, const std::string& stat) {
    const auto dir = proc.path() / pid / "task" / tid;
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "stat") << stat;
  };
  task("100", "100", "100 (trainer) R 1 100 100 0 -1 4194304");
  task("100", "101", "101 (dt-pg-worker) S 1 100 100 0 -1 4194368");
  task("200", "200", "200 (odd) name) R 1 200 200 0 -1 4194304");  // a name may hold ") "
  task("300", "300", "300 (writer) D 1 300 300 0 -1 4194304");
  std::filesystem::create_directories(proc.path() / "self" / "task" / "1");  // not a pid: skipped
  std::filesystem::create_directories(proc.path() / "400");                  // exited: no task folder
  EXPECT_EQ(shm::runnableThreadsListed(proc.path().c_str()), 2);
  EXPECT_EQ(shm::runnableThreadsListed((proc.path() / "missing").c_str()), -1);

  std::atomic<bool> stop{false};
  std::thread spinner([&] {
    while (!stop.load(std::memory_order_relaxed)) {
    }
  });
  EXPECT_GE(shm::runnableThreadsListed(), 2) << "this thread and the spinning one";
  stop = true;
  spinner.join();
}

}  // namespace
}  // namespace dt
