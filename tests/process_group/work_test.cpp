#include "process_group/work.h"

#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "process_group/backend.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;

// Polls `done` (set by a callback on another thread) for up to 30 s.
bool eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 3000 && !done(); ++i) std::this_thread::sleep_for(10ms);
  return done();
}

TEST(Work, CompletesOnceAndRunsCallbacksOnce) {
  auto work = std::make_shared<Work>("allreduce #1 (test)");
  EXPECT_FALSE(work->isCompleted());
  EXPECT_FALSE(work->isSuccess());
  std::atomic<int> before{0}, after{0};
  work->then([&](Work& w) {
    EXPECT_TRUE(w.isCompleted());
    before++;
  });
  std::thread completer([&] {
    std::this_thread::sleep_for(50ms);
    Work::markCompleted(work);
  });
  work->wait();
  completer.join();
  EXPECT_TRUE(work->isSuccess());
  EXPECT_EQ(work->exception(), nullptr);
  EXPECT_TRUE(eventually([&] { return before.load() == 1; }));
  work->then([&](Work&) { after++; });  // already complete: runs at once
  EXPECT_EQ(after.load(), 1);
  testing::expectThrowsWith<Error>([&] { Work::markCompleted(work); }, {"completed twice", "allreduce #1"});
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(before.load(), 1);
}

TEST(Work, WaitRethrowsTheBackendErrorEveryTime) {
  auto work = Work::failed("broadcast #7", std::make_exception_ptr(BackendError("peer 3 went away")));
  EXPECT_TRUE(work->isCompleted());
  EXPECT_FALSE(work->isSuccess());
  EXPECT_NE(work->exception(), nullptr);
  testing::expectThrowsWith<BackendError>([&] { work->wait(); }, {"peer 3 went away"});
  testing::expectThrowsWith<BackendError>([&] { work->wait(1s); }, {"peer 3 went away"});
  int calls = 0;
  work->then([&](Work& w) {
    calls++;
    EXPECT_NE(w.exception(), nullptr);
  });
  EXPECT_EQ(calls, 1);
}

TEST(Work, WaitWithTimeoutThrowsTimeoutButTheWorkContinues) {
  auto work = std::make_shared<Work>("barrier #2 (test)");
  testing::expectThrowsWith<TimeoutError>([&] { work->wait(50ms); },
                                          {"barrier #2", "still running", "50 ms", "only this wait timed out",
                                           "not broken"});
  Work::markCompleted(work);
  work->wait(50ms);
}

TEST(Work, CallbackExceptionsDoNotEscape) {
  auto work = std::make_shared<Work>("x");
  std::atomic<int> second{0};
  work->then([](Work&) { throw std::runtime_error("boom"); });
  work->then([&](Work&) { second++; });
  work->thenInline([](Work&) { throw std::runtime_error("inline boom"); });
  Work::markCompleted(work);
  EXPECT_TRUE(eventually([&] { return second.load() == 1; }));
}

TEST(Work, ThenRunsOffTheCompletingThreadInOrderAndThenInlineOnIt) {
  auto work = std::make_shared<Work>("allreduce #4 (test)");
  std::thread::id completing, inlineRan, firstRan, secondRan;
  std::atomic<int> order{0};
  std::atomic<int> firstAt{-1}, secondAt{-1};
  std::atomic<bool> slowReleased{false}, completerReturned{false};
  work->then([&](Work&) {
    firstRan = std::this_thread::get_id();
    firstAt = order++;
    // A slow callback: the completing thread must not wait for it.
    EXPECT_TRUE(eventually([&] { return completerReturned.load(); }));
    slowReleased = true;
  });
  work->then([&](Work&) {
    secondRan = std::this_thread::get_id();
    secondAt = order++;
  });
  work->thenInline([&](Work&) { inlineRan = std::this_thread::get_id(); });
  std::thread completer([&] {
    completing = std::this_thread::get_id();
    Work::markCompleted(work);
    completerReturned = true;
  });
  completer.join();
  EXPECT_TRUE(eventually([&] { return secondAt.load() >= 0; }));
  EXPECT_TRUE(slowReleased.load());
  EXPECT_EQ(inlineRan, completing);
  EXPECT_NE(firstRan, completing);
  EXPECT_EQ(firstRan, secondRan);
  EXPECT_EQ(firstAt.load(), 0);
  EXPECT_EQ(secondAt.load(), 1);
}

TEST(Work, ALateCallbackWaitsForTheEarlierOnesStillRunning) {
  auto work = std::make_shared<Work>("allreduce #6 (test)");
  std::atomic<int> order{0};
  std::atomic<int> slowAt{-1}, lateAt{-1};
  std::atomic<bool> lateRegistered{false};
  work->then([&](Work&) {
    EXPECT_TRUE(eventually([&] { return lateRegistered.load(); }));
    slowAt = order++;
  });
  Work::markCompleted(work);
  // The Work is complete but its first callback still runs on the pool: the
  // late one queues behind it instead of running now on this thread.
  work->then([&](Work&) { lateAt = order++; });
  lateRegistered = true;
  EXPECT_TRUE(eventually([&] { return lateAt.load() >= 0; }));
  EXPECT_EQ(slowAt.load(), 0);
  EXPECT_EQ(lateAt.load(), 1);
}

// A Work nobody listens to completes without its lock (finish()); registrations that race
// with that completion must neither be lost nor run out of order. Many rounds of: a thread
// completes the Work while another registers callbacks, an inline callback, a future and a
// wait, in that order.
TEST(Work, RegistrationsRacingTheCompletionRunOnceAndInOrder) {
  for (int round = 0; round < 500; ++round) {
    auto work = std::make_shared<Work>("allreduce #9 (test)");
    std::mutex mu;
    std::vector<int> ran;
    std::atomic<int> inlineRan{0};
    std::atomic<bool> go{false};
    std::thread completer([&] {
      while (!go.load()) {
      }
      Work::markCompleted(work);
    });
    go = true;
    for (int i = 0; i < 3; ++i) {
      work->then([&, i](Work& w) {
        EXPECT_TRUE(w.isSuccess());
        std::lock_guard lock(mu);
        ran.push_back(i);
      });
    }
    work->thenInline([&](Work&) { inlineRan++; });
    std::shared_future<std::vector<Tensor>> future = work->future();
    work->wait();
    completer.join();
    EXPECT_NO_THROW(future.get()) << "round " << round;
    ASSERT_TRUE(eventually([&] {
      std::lock_guard lock(mu);
      return ran.size() == 3;
    })) << "round " << round;
    std::lock_guard lock(mu);
    ASSERT_EQ(ran, (std::vector<int>{0, 1, 2})) << "round " << round;
    ASSERT_EQ(inlineRan.load(), 1) << "round " << round;
  }
}

TEST(Work, CallbacksThatWaitForEachOtherDoNotDeadlock) {
  // b's callback waits for a's callback, registered later on another Work:
  // one callback thread would deadlock, the pool grows instead.
  auto a = std::make_shared<Work>("a"), b = std::make_shared<Work>("b");
  std::atomic<bool> aRan{false}, bSawA{false};
  b->then([&](Work&) { bSawA = eventually([&] { return aRan.load(); }); });
  Work::markCompleted(b);
  a->then([&](Work&) { aRan = true; });
  Work::markCompleted(a);
  EXPECT_TRUE(eventually([&] { return bSawA.load(); }));
}

TEST(Work, FutureCarriesTheResultTensorsOrTheError) {
  auto work = std::make_shared<Work>("allreduce #5 (test)");
  Tensor t = full({3}, 7);
  work->setResult({t});
  auto early = work->future();
  EXPECT_EQ(early.wait_for(0s), std::future_status::timeout);
  Work::markCompleted(work);
  ASSERT_EQ(early.get().size(), 1u);
  EXPECT_TRUE(early.get()[0].isSameAs(t));
  EXPECT_TRUE(work->future().get()[0].isSameAs(t));  // made after completion
  EXPECT_TRUE(work->result()[0].isSameAs(t));
  auto failed = Work::failed("broadcast #6", std::make_exception_ptr(BackendError("peer 2 went away")));
  testing::expectThrowsWith<BackendError>([&] { failed->future().get(); }, {"peer 2 went away"});
}

TEST(Work, AllOfCompletesWithTheLastAndReportsTheFirstFailure) {
  auto a = std::make_shared<Work>("a"), b = std::make_shared<Work>("b");
  auto all = allOf("batch", {a, b});
  Work::markCompleted(b);
  EXPECT_FALSE(all->isCompleted());
  Work::markFailed(a, std::make_exception_ptr(BackendError("a broke")));
  EXPECT_TRUE(all->isCompleted());
  testing::expectThrowsWith<BackendError>([&] { all->wait(); }, {"a broke"});
  EXPECT_TRUE(allOf("none", {})->isSuccess());
}

// A backend that implements nothing: every op must say which backend lacks which op.
class EmptyBackend final : public Backend {
 public:
  std::string name() const override { return "empty"; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void abort(std::exception_ptr) override {}  // no transfers to end
};

// A backend's start helper hears how the caller uses a Work it has not started:
// wait() asks to run it on the waiting thread; any other use (then,
// thenInline, isCompleted, exception, future, a wait with a timeout) asks
// for it to start soon elsewhere, once.
TEST(Work, TheStartHelperHearsWaitsAndEveryOtherUseOnce) {
  using Start = Work::Start;
  struct Heard {
    std::mutex mutex;
    std::vector<Start> calls;
  };
  auto make = [](Heard& heard) {
    auto work = std::make_shared<Work>("allreduce", 7, Work::internName("rank 0/2 pg=default test"));
    work->setStartHelper([&heard](Start how) {
      std::lock_guard<std::mutex> lock(heard.mutex);
      heard.calls.push_back(how);
      return false;
    });
    return work;
  };
  {
    Heard heard;
    auto work = make(heard);
    std::thread completer([&] {
      while (true) {
        std::lock_guard<std::mutex> lock(heard.mutex);
        if (!heard.calls.empty()) break;
      }
      Work::markCompleted(work);
    });
    work->wait();
    completer.join();
    EXPECT_EQ(heard.calls, std::vector<Start>{Start::OnThisThread});
    EXPECT_EQ(work->description(), "allreduce #7 (rank 0/2 pg=default test)");  // made when asked
  }
  const std::vector<std::function<void(Work&)>> uses = {
      [](Work& w) { w.then([](Work&) {}); },      [](Work& w) { w.thenInline([](Work&) {}); },
      [](Work& w) { (void)w.isCompleted(); },     [](Work& w) { (void)w.exception(); },
      [](Work& w) { (void)w.future(); },          [](Work& w) { EXPECT_THROW(w.wait(1ms), TimeoutError); }};
  for (size_t use = 0; use < uses.size(); ++use) {
    Heard heard;
    auto work = make(heard);
    uses[use](*work);
    uses[use](*work);  // a second use says nothing new
    EXPECT_EQ(heard.calls, std::vector<Start>{Start::Soon}) << "use " << use;
    Work::markCompleted(work);
    (void)work->isCompleted();  // completed: nothing to start
    EXPECT_EQ(heard.calls.size(), 1u) << "use " << use;
  }
}

// Blocked waits sleep on the completion word; a completion that nobody registered a callback
// or a future for takes the lock-free path and must still wake every one of them, whether it
// lands before, while or after they go to sleep.
TEST(Work, BlockedWaitsWakeOnACompletionNobodyElseListensTo) {
  for (int round = 0; round < 200; ++round) {
    const bool fails = round % 2 == 1;
    auto work = std::make_shared<Work>("allreduce", static_cast<uint64_t>(round + 1),
                                       Work::internName("rank 0/2 pg=default test"));
    std::atomic<int> woken{0};
    std::vector<std::thread> waiters;
    for (int w = 0; w < 3; ++w) {
      waiters.emplace_back([&, w] {
        try {
          if (w == 2) {
            work->wait(30s);  // with a deadline: a timed futex wait
          } else {
            work->wait();
          }
          EXPECT_FALSE(fails) << "round " << round;
        } catch (const BackendError& e) {
          EXPECT_TRUE(fails) << "round " << round << ": " << e.what();
        }
        ++woken;
      });
    }
    if (round % 4 < 2) std::this_thread::sleep_for(std::chrono::microseconds(200));  // most are asleep by now
    if (fails) {
      Work::markFailed(work, std::make_exception_ptr(BackendError("peer 1 went away")));
    } else {
      Work::markCompleted(work);
    }
    for (auto& t : waiters) t.join();
    EXPECT_EQ(woken.load(), 3) << "round " << round;
  }
}

TEST(Work, InternedNamesAreOnePerTextAndOutliveTheirCaller) {
  const std::string* first = nullptr;
  {
    std::string name = "rank 1/4 pg=interned shm";
    first = Work::internName(name);
    name = "changed";
    EXPECT_EQ(Work::internName("rank 1/4 pg=interned shm"), first);
  }
  EXPECT_EQ(*first, "rank 1/4 pg=interned shm");
  EXPECT_NE(Work::internName("rank 2/4 pg=interned shm"), first);
  auto work = std::make_shared<Work>("broadcast", 3, first);
  EXPECT_EQ(work->description(), "broadcast #3 (rank 1/4 pg=interned shm)");
}

TEST(Backend, MissingOpsThrowNotSupportedNamingBackendAndOp) {
  EmptyBackend b;
  Tensor t = zeros({1});
  testing::expectThrowsWith<NotSupportedError>([&] { b.allreduce({t}); }, {"empty", "allreduce"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.broadcast({t}); }, {"empty", "broadcast"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.allgather({t}, t); }, {"empty", "allgather"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.reduceScatter(t, {t}); }, {"empty", "reduceScatter"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.reduce({t}); }, {"empty", "reduce"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.barrier(); }, {"empty", "barrier"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.send({t}, 0); }, {"empty", "send"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.recv({t}, 0); }, {"empty", "recv"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.allToAll({t}, {t}); }, {"empty", "allToAll"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.gather({t}, t); }, {"empty", "gather"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.scatter(t, {t}); }, {"empty", "scatter"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.allgatherIntoTensor(t, t); }, {"empty", "allgatherIntoTensor"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.reduceScatterTensor(t, t); }, {"empty", "reduceScatterTensor"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.allToAllSingle(t, t, {}, {}); }, {"empty", "allToAllSingle"});
  testing::expectThrowsWith<NotSupportedError>([&] { b.monitoredBarrier(); }, {"empty", "monitoredBarrier"});
}

}  // namespace
}  // namespace dt
