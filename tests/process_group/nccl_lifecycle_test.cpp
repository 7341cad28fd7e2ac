// The NCCL backend's rules without NCCL (process_group/nccl/comm_lifecycle.h), over fakes of
// the event, abort and NCCL state they read: which op counts as done, how a nonblocking call is
// waited for (and that a launch waiting for NCCL's enqueue leaves the handle's lock to an abort),
// which GPU a barrier takes when no op told the backend its device, how communicators are
// created while an abort gets through, and when shutdown finalizes and when it aborts. Runs in every build;
// nccl_backend_test.cpp runs the same paths on GPUs.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <future>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "process_group/nccl/comm_lifecycle.h"

namespace dt::nccl {
namespace {

// ---- pollOp --------------------------------------------------------------------------------------

struct FakeOp final : OpProbe {
  bool event = false;
  bool abortFlag = false;
  bool asyncError = false;
  // ncclCommAbort ends the op's kernels, so its event fires: the abort starts
  // on another thread while the watcher looks at the event.
  bool abortFiresTheEvent = false;
  std::vector<std::string> calls;

  bool eventCompleted() override {
    calls.push_back("event");
    if (abortFiresTheEvent) {
      abortFlag = true;
      event = true;
    }
    return event;
  }
  bool aborted() override {
    calls.push_back("aborted");
    return abortFlag;
  }
  void throwIfAsyncError() override {
    calls.push_back("asyncError");
    if (asyncError) throw std::runtime_error("ncclRemoteError");
  }
};

TEST(NcclPollOp, ACompletedEventWithoutAnAbortIsASuccess) {
  FakeOp op;
  EXPECT_EQ(pollOp(op), OpState::Running);
  op.event = true;
  EXPECT_EQ(pollOp(op), OpState::Completed);
}

TEST(NcclPollOp, AnEventThatCompletedBecauseOfAnAbortFailsTheOp) {
  // The abort begins after the watcher last saw the flag clear: the event then
  // completes because the kernels were told to quit. Read before the event,
  // the flag would still be clear and the half-reduced buffer would pass.
  FakeOp op;
  op.abortFiresTheEvent = true;
  EXPECT_EQ(pollOp(op), OpState::Aborted);
  EXPECT_EQ(op.calls, (std::vector<std::string>{"event", "aborted"}));
}

TEST(NcclPollOp, AnAbortFailsTheOpWhetherOrNotItsEventCompleted) {
  FakeOp running;
  running.abortFlag = true;
  EXPECT_EQ(pollOp(running), OpState::Aborted);
  FakeOp fired;
  fired.abortFlag = true;
  fired.event = true;
  EXPECT_EQ(pollOp(fired), OpState::Aborted);
}

TEST(NcclPollOp, AnAsynchronousErrorWinsOverACompletedEvent) {
  FakeOp op;
  op.event = true;
  op.asyncError = true;
  EXPECT_THROW(pollOp(op), std::runtime_error);
  EXPECT_EQ(op.calls, (std::vector<std::string>{"event", "aborted", "asyncError"}));
}

// ---- Backoff and awaitCall -----------------------------------------------------------------------

using std::chrono::microseconds;

TEST(NcclBackoff, YieldsWhileSpinningThenSleepsDoublingUpToTheCap) {
  const BackoffPolicy policy{microseconds(200), microseconds(50), microseconds(1000)};
  EXPECT_EQ(Backoff::next(policy, microseconds(0), microseconds(0)), microseconds(0));
  EXPECT_EQ(Backoff::next(policy, microseconds(199), microseconds(0)), microseconds(0));
  EXPECT_EQ(Backoff::next(policy, microseconds(200), microseconds(0)), microseconds(50));
  EXPECT_EQ(Backoff::next(policy, microseconds(300), microseconds(50)), microseconds(100));
  EXPECT_EQ(Backoff::next(policy, microseconds(5000), microseconds(800)), microseconds(1000));
  EXPECT_EQ(Backoff::next(policy, microseconds(9000), microseconds(1000)), microseconds(1000));
  // Without a spin phase the first wait is already a sleep.
  EXPECT_EQ(Backoff::next(BackoffPolicy{microseconds(0), microseconds(50), microseconds(10000)}, microseconds(0),
                          microseconds(0)),
            microseconds(50));
}

TEST(NcclBackoff, EnqueueingSpinsBeforeItsFirstSleepAndNeverSleepsLong) {
  // An op's enqueue waits for NCCL's helper thread: the first 200 us only yield, so a helper
  // that ends in tens of microseconds is seen at once instead of after a ~50 us+ sleep.
  for (int us = 0; us < 200; us += 10) {
    EXPECT_EQ(Backoff::next(kEnqueuePolling, microseconds(us), microseconds(0)), microseconds(0)) << us;
  }
  microseconds slept{0}, longest{0};
  for (int i = 0; i < 20; ++i) {
    slept = Backoff::next(kEnqueuePolling, microseconds(1000 + i), slept);
    longest = std::max(longest, slept);
  }
  EXPECT_EQ(longest, microseconds(1000));
  // Initialisation and shutdown sleep from the start (nothing there is on a hot path).
  EXPECT_GT(Backoff::next(kInitPolling, microseconds(0), microseconds(0)).count(), 0);
  EXPECT_GT(Backoff::next(kShutdownPolling, microseconds(0), microseconds(0)).count(), 0);
}

constexpr BackoffPolicy kFast{microseconds(0), microseconds(1), microseconds(1)};
auto never = [] { return false; };
auto always = [] { return true; };

TEST(NcclAwaitCall, ReturnsWhenTheCallLeavesInProgress) {
  int polls = 0;
  auto state = [&] { return ++polls < 3 ? CallState::InProgress : CallState::Done; };
  EXPECT_EQ(awaitCall(state, [] { return false; }, Clock::now() + std::chrono::hours(1), kFast), CallOutcome::Done);
  EXPECT_EQ(polls, 3);
  EXPECT_EQ(awaitCall([] { return CallState::Failed; }, [] { return false; }, Clock::now() + std::chrono::hours(1),
                      kFast),
            CallOutcome::Failed);
}

TEST(NcclAwaitCall, AnAbortEndsTheWaitAtOnceInsteadOfAtTheDeadline) {
  // The call stays in progress (a peer never arrives); another thread aborts after a few polls.
  int polls = 0;
  bool aborting = false;
  auto state = [&] {
    if (++polls == 5) aborting = true;
    return CallState::InProgress;
  };
  EXPECT_EQ(awaitCall(state, [&] { return aborting; }, Clock::now() + std::chrono::hours(1), kFast),
            CallOutcome::Aborted);
  EXPECT_EQ(polls, 5);
  // The abort is read first: a call that would be done does not pass once an abort began.
  polls = 0;
  EXPECT_EQ(awaitCall([&] { return ++polls, CallState::Done; }, [] { return true; },
                      Clock::now() + std::chrono::hours(1), kFast),
            CallOutcome::Aborted);
  EXPECT_EQ(polls, 0);
}

TEST(NcclAwaitCall, ACallStillInProgressAtTheDeadlineTimesOut) {
  EXPECT_EQ(awaitCall([] { return CallState::InProgress; }, [] { return false; }, Clock::now(), kFast),
            CallOutcome::TimedOut);
}

// ---- awaitEnqueue: which lock a launch holds while NCCL's helper enqueues ---------------------------

// The backend's launch waits for NCCL's helper thread with the communicator's launch order held
// but not its handle lock (issue 43, item 6: it used to sleep holding both). Here the helper
// stays in progress until an abort, which needs the handle lock (ncclCommAbort frees the
// communicator): the abort must get it while the launch waits, and the launch must not look at
// the handle again once it is gone.
TEST(NcclAwaitEnqueue, AnAbortTakesTheHandleLockWhileALaunchWaitsAndTheLaunchLooksNoMore) {
  std::mutex handle;
  std::atomic<bool> freed{false};
  std::atomic<int> looks{0}, looksAfterFree{0};
  std::promise<void> waiting;
  std::atomic<bool> signalled{false};
  auto state = [&] {
    // NCCL's helper still enqueueing; the 4th look tells the aborter that the launch waits.
    if (freed.load()) looksAfterFree.fetch_add(1);
    if (looks.fetch_add(1) == 3 && !signalled.exchange(true)) waiting.set_value();
    return CallState::InProgress;
  };
  CallOutcome outcome = CallOutcome::Done;
  // A long deadline and the backend's own policy: spins, then sleeps up to 1 ms.
  std::thread launcher([&] {
    outcome = awaitEnqueue(handle, [&] { return freed.load(); }, state, [] { return false; },
                           Clock::now() + std::chrono::seconds(30), kEnqueuePolling);
  });
  waiting.get_future().wait();
  const auto t0 = Clock::now();
  {
    std::lock_guard<std::mutex> lock(handle);  // abortOne: ncclCommAbort under the handle lock
    freed = true;
  }
  const auto gotLock = Clock::now() - t0;
  launcher.join();
  EXPECT_LT(gotLock, std::chrono::milliseconds(200)) << "the abort waited behind the launch's wait";
  EXPECT_EQ(outcome, CallOutcome::Aborted);
  EXPECT_EQ(looksAfterFree.load(), 0) << "the launch used the handle after the abort freed it";
}

TEST(NcclAwaitEnqueue, EveryLookRunsUnderTheHandleLockAndTheOutcomesAreAwaitCallsOwn) {
  std::mutex handle;
  int looks = 0;
  bool everUnlocked = false;
  auto state = [&] {
    // try_lock on a mutex this thread holds is undefined; another thread asks instead.
    std::atomic<bool> got{false};
    std::thread probe([&] {
      if (handle.try_lock()) {
        got = true;
        handle.unlock();
      }
    });
    probe.join();
    everUnlocked = everUnlocked || got.load();
    return ++looks < 3 ? CallState::InProgress : CallState::Done;
  };
  EXPECT_EQ(awaitEnqueue(handle, never, state, never, Clock::now() + std::chrono::hours(1), kFast), CallOutcome::Done);
  EXPECT_EQ(looks, 3);
  EXPECT_FALSE(everUnlocked) << "ncclCommGetAsyncError ran without the handle lock";
  EXPECT_EQ(awaitEnqueue(handle, never, [] { return CallState::Failed; }, never, Clock::now() + std::chrono::hours(1),
                         kFast),
            CallOutcome::Failed);
  EXPECT_EQ(awaitEnqueue(handle, never, [] { return CallState::InProgress; }, never, Clock::now(), kFast),
            CallOutcome::TimedOut);
  EXPECT_EQ(awaitEnqueue(handle, never, [] { return CallState::Done; }, always, Clock::now() + std::chrono::hours(1),
                         kFast),
            CallOutcome::Aborted);
  // A communicator already gone is never looked at.
  int looked = 0;
  EXPECT_EQ(awaitEnqueue(handle, always, [&] { return ++looked, CallState::Done; }, never,
                         Clock::now() + std::chrono::hours(1), kFast),
            CallOutcome::Aborted);
  EXPECT_EQ(looked, 0);
}

// ---- chooseDevice: the GPU of a barrier that is a group's first op ---------------------------------

TEST(NcclChooseDevice, ABoundDeviceThenTheLastOpsDeviceWin) {
  DeviceHints h;
  h.deviceCount = 4;
  h.groupSize = 4;
  h.current = 3;
  h.localRank = 2;
  h.lastUsed = 1;
  EXPECT_EQ(chooseDevice(h).device, 1);
  h.bound = 2;
  const DeviceChoice bound = chooseDevice(h);
  EXPECT_EQ(bound.device, 2);
  EXPECT_NE(bound.why.find("bound"), std::string::npos) << bound.why;
  h.bound = 4;  // not visible here
  const DeviceChoice invisible = chooseDevice(h);
  EXPECT_FALSE(invisible.device);
  EXPECT_NE(invisible.why.find("cuda:4"), std::string::npos) << invisible.why;
  EXPECT_NE(invisible.why.find("CUDA_VISIBLE_DEVICES"), std::string::npos) << invisible.why;
}

TEST(NcclChooseDevice, AFirstOpBarrierOnAThreadThatChoseNoDeviceTakesLocalRanksGpuNotCuda0) {
  // The bug: every rank of a PyTorch-style program (init, then barrier) took cudaGetDevice()'s
  // default, cuda:0, and NCCL refused the duplicate GPU at world >= 2.
  for (int rank = 0; rank < 4; ++rank) {
    DeviceHints h;
    h.groupSize = 8;
    h.deviceCount = 4;  // two hosts of four GPUs
    h.localRank = rank;
    EXPECT_EQ(chooseDevice(h).device, rank) << rank;
    h.localRank = rank + 4;  // LOCAL_RANK beyond the device count wraps, as the trainer does
    EXPECT_EQ(chooseDevice(h).device, rank) << rank;
  }
  // A device the thread chose wins over LOCAL_RANK (cuda:0 is only a default).
  DeviceHints chosen;
  chosen.groupSize = 2;
  chosen.deviceCount = 2;
  chosen.localRank = 0;
  chosen.current = 1;
  EXPECT_EQ(chooseDevice(chosen).device, 1);
  // cuda:0 current with its context held but LOCAL_RANK saying 1: the launcher's contract wins.
  chosen.current = 0;
  chosen.currentHasContext = true;
  chosen.localRank = 1;
  EXPECT_EQ(chooseDevice(chosen).device, 1);
}

TEST(NcclChooseDevice, Cuda0IsTakenOnlyWhereItIsKnownToBeThisRanksOrNoOtherRankCanClaimIt) {
  DeviceHints h;
  h.groupSize = 2;
  h.deviceCount = 2;
  h.currentHasContext = true;  // no launcher, but this process works on cuda:0
  EXPECT_EQ(chooseDevice(h).device, 0);
  DeviceHints single;
  single.deviceCount = 1;
  EXPECT_EQ(chooseDevice(single).device, 0);  // a group of one: no duplicate possible
}

TEST(NcclChooseDevice, NoDeviceKnownAtWorldTwoIsRefusedWithAHint) {
  DeviceHints h;
  h.groupSize = 2;
  h.deviceCount = 2;
  const DeviceChoice none = chooseDevice(h);
  EXPECT_FALSE(none.device);
  for (const char* part : {"no CUDA device is known", "LOCAL_RANK is unset", "setCurrentDevice", "NcclBackendOptions::device"}) {
    EXPECT_NE(none.why.find(part), std::string::npos) << part << " in: " << none.why;
  }
  EXPECT_EQ(none.why.find('\n'), std::string::npos) << "one line";
  h.deviceCount = 0;  // LOCAL_RANK set, but nothing visible to map it onto
  h.localRank = 1;
  const DeviceChoice invisible = chooseDevice(h);
  EXPECT_FALSE(invisible.device);
  EXPECT_NE(invisible.why.find("LOCAL_RANK 1"), std::string::npos) << invisible.why;
}

// ---- closeCommunicators ----------------------------------------------------------------------------

// A communicator as shutdown sees it; every call lands in one shared log ("0:finalize").
struct FakeCloser final : CommCloser {
  FakeCloser(int id, std::vector<std::string>& log) : id(id), log(log) {}
  int busyPolls = 0;        // idle() is false this many times
  int finalizePolls = 1;    // state() is InProgress this many times after finalize()
  bool finalizeFails = false;
  bool asyncError = false;
  std::function<void()> onStatePoll;

  bool idle() override {
    if (asyncError) throw std::runtime_error("ncclRemoteError");
    return busyPolls-- <= 0;
  }
  CallState finalize() override {
    note("finalize");
    return finalizeFails ? CallState::Failed : CallState::InProgress;
  }
  CallState state() override {
    if (onStatePoll) onStatePoll();
    return finalizePolls-- > 0 ? CallState::InProgress : CallState::Done;
  }
  void destroy() override { note("destroy"); }
  void abort() override { note("abort"); }
  void note(const std::string& what) { log.push_back(std::to_string(id) + ":" + what); }

  int id;
  std::vector<std::string>& log;
};

const auto kLater = [] { return Clock::now() + std::chrono::hours(1); };

TEST(NcclCloseCommunicators, AHealthyGroupWaitsForItsOpsThenFinalizesEveryOneBeforeDestroying) {
  std::vector<std::string> log;
  FakeCloser a(0, log), b(1, log);
  a.busyPolls = 3;  // allreduce(t)->wait() only ordered the caller's stream: the op still runs
  int drainedPolls = 0;
  const CloseResult result = closeCommunicators(
      {&a, &b}, true, [&] { return ++drainedPolls > 5; }, never, kLater(), kFast);
  EXPECT_TRUE(result.graceful) << result.reason;
  EXPECT_GT(drainedPolls, 5) << "the Works are waited for as well as the GPU";
  EXPECT_EQ(log, (std::vector<std::string>{"0:finalize", "1:finalize", "0:destroy", "1:destroy"}));
}

TEST(NcclCloseCommunicators, ABrokenGroupAbortsAtOnce) {
  std::vector<std::string> log;
  FakeCloser a(0, log), b(1, log);
  a.busyPolls = 1000000;  // an op a dead peer never completes: not waited for
  const CloseResult result = closeCommunicators({&a, &b}, false, always, never, kLater(), kFast);
  EXPECT_FALSE(result.graceful);
  EXPECT_EQ(result.reason, "the group is broken");
  EXPECT_EQ(log, (std::vector<std::string>{"0:abort", "1:abort"}));
}

TEST(NcclCloseCommunicators, OpsThatDoNotCompleteBeforeTheDeadlineAreAborted) {
  std::vector<std::string> log;
  FakeCloser a(0, log);
  a.busyPolls = 1000000;
  const CloseResult result = closeCommunicators({&a}, true, always, never, Clock::now(), kFast);
  EXPECT_FALSE(result.graceful);
  EXPECT_NE(result.reason.find("did not complete"), std::string::npos) << result.reason;
  EXPECT_EQ(log, (std::vector<std::string>{"0:abort"}));
}

TEST(NcclCloseCommunicators, AFailedFinalizeOrAnAsyncErrorAbortsWhatIsLeft) {
  std::vector<std::string> log;
  FakeCloser a(0, log), b(1, log);
  b.finalizeFails = true;
  EXPECT_FALSE(closeCommunicators({&a, &b}, true, always, never, kLater(), kFast).graceful);
  EXPECT_EQ(log, (std::vector<std::string>{"0:finalize", "1:finalize", "0:abort", "1:abort"}));

  log.clear();
  FakeCloser c(2, log);
  c.asyncError = true;
  const CloseResult result = closeCommunicators({&c}, true, always, never, kLater(), kFast);
  EXPECT_NE(result.reason.find("ncclRemoteError"), std::string::npos) << result.reason;
  EXPECT_EQ(log, (std::vector<std::string>{"2:abort"}));
}

TEST(NcclCloseCommunicators, AnAbortThatBeginsWhileFinalizingEndsItWithAnAbort) {
  std::vector<std::string> log;
  FakeCloser a(0, log);
  a.finalizePolls = 1000000;
  bool aborting = false;
  a.onStatePoll = [&] { aborting = true; };  // the watchdog fails an op meanwhile
  const CloseResult result =
      closeCommunicators({&a}, true, always, [&] { return aborting; }, kLater(), kFast);
  EXPECT_FALSE(result.graceful);
  EXPECT_EQ(log, (std::vector<std::string>{"0:finalize", "0:abort"}));
}

// ---- CommRegistry ---------------------------------------------------------------------------------

struct FakeComm {
  int index = -1;
  bool abandoned = false;
};
using Registry = CommRegistry<FakeComm>;

TEST(NcclCommRegistry, AnAbortGetsThroughWhileACommunicatorIsBeingCreated) {
  Registry registry;
  std::promise<void> started;
  std::shared_ptr<FakeComm> made;
  std::atomic<bool> creatorThrew{false};
  std::thread creator([&] {
    try {
      registry.getOrCreate(
          0,
          [&](int index) {
            started.set_value();
            // NCCL's initialisation in progress: it ends once the creator sees the abort (the
            // backend aborts its half-made communicator then; this one finishes late instead).
            while (!registry.aborting()) std::this_thread::yield();
            made = std::make_shared<FakeComm>();
            made->index = index;
            return made;
          },
          [](FakeComm& c) { c.abandoned = true; });
    } catch (const BackendError&) {
      creatorThrew = true;
    }
  });
  started.get_future().wait();
  // Before the fix this needed the lock the creator held through NCCL's whole initialisation.
  const auto toAbort = registry.beginAbort();
  EXPECT_TRUE(toAbort.empty()) << "a communicator still being made is its creator's to end";
  creator.join();
  EXPECT_TRUE(creatorThrew.load());
  ASSERT_NE(made, nullptr);
  EXPECT_TRUE(made->abandoned) << "a communicator finished after the abort began must be ended, not kept";
  EXPECT_TRUE(registry.made().empty());
  EXPECT_THROW(registry.getOrCreate(
                   1, [](int) -> std::shared_ptr<FakeComm> { throw std::logic_error("must not be called"); },
                   [](FakeComm&) {}),
               BackendError);
}

TEST(NcclCommRegistry, EachKeyIsCreatedOnceAndIndicesFollowCreationOrder) {
  Registry registry;
  std::atomic<int> creations{0};
  auto create = [&](int index) {
    ++creations;
    auto c = std::make_shared<FakeComm>();
    c->index = index;
    return c;
  };
  auto noAbandon = [](FakeComm&) { FAIL() << "nothing aborted"; };
  auto three = registry.getOrCreate(3, create, noAbandon);
  auto one = registry.getOrCreate(1, create, noAbandon);
  EXPECT_EQ(three->index, 0);
  EXPECT_EQ(one->index, 1);
  EXPECT_EQ(registry.getOrCreate(3, create, noAbandon), three);
  EXPECT_EQ(creations.load(), 2);
  const auto made = registry.made();
  ASSERT_EQ(made.size(), 2u);
  EXPECT_EQ(made[0], three);
  EXPECT_EQ(made[1], one);
  EXPECT_EQ(registry.beginAbort().size(), 2u);
  EXPECT_EQ(registry.beginAbort().size(), 2u);  // idempotent
}

TEST(NcclCommRegistry, ASecondCallerWaitsForTheFirstAndSharesItsResultOrError) {
  Registry registry;
  std::promise<void> started, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> creations{0};
  auto slow = [&](int index) {
    ++creations;
    started.set_value();
    released.wait();
    auto c = std::make_shared<FakeComm>();
    c->index = index;
    return c;
  };
  std::shared_ptr<FakeComm> first, second;
  std::thread a([&] { first = registry.getOrCreate(0, slow, [](FakeComm&) {}); });
  started.get_future().wait();
  std::thread b([&] { second = registry.getOrCreate(0, slow, [](FakeComm&) {}); });
  release.set_value();
  a.join();
  b.join();
  EXPECT_EQ(first, second);
  EXPECT_EQ(creations.load(), 1);

  // A creation that fails: the waiter gets the same error.
  Registry failing;
  std::promise<void> failStarted, failRelease;
  std::shared_future<void> failReleased = failRelease.get_future().share();
  auto broken = [&](int) -> std::shared_ptr<FakeComm> {
    failStarted.set_value();
    failReleased.wait();
    throw TimeoutError("creating NCCL communicator #0 timed out: rank 1 never started to join");
  };
  std::string firstError, secondError;
  std::thread c([&] {
    try {
      failing.getOrCreate(0, broken, [](FakeComm&) {});
    } catch (const TimeoutError& e) {
      firstError = e.what();
    }
  });
  failStarted.get_future().wait();
  std::thread d([&] {
    try {
      failing.getOrCreate(0, broken, [](FakeComm&) {});
    } catch (const TimeoutError& e) {
      secondError = e.what();
    }
  });
  failRelease.set_value();
  c.join();
  d.join();
  EXPECT_NE(firstError.find("rank 1 never started to join"), std::string::npos) << firstError;
  EXPECT_EQ(secondError, firstError);
}

}  // namespace
}  // namespace dt::nccl
