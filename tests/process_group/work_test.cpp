#include "process_group/work.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "common/errors.h"
#include "process_group/backend.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;

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
    work->markCompleted();
  });
  work->wait();
  completer.join();
  EXPECT_TRUE(work->isSuccess());
  EXPECT_EQ(work->exception(), nullptr);
  EXPECT_EQ(before.load(), 1);
  work->then([&](Work&) { after++; });  // already complete: runs at once
  EXPECT_EQ(after.load(), 1);
  testing::expectThrowsWith<Error>([&] { work->markCompleted(); }, {"completed twice", "allreduce #1"});
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
  testing::expectThrowsWith<TimeoutError>([&] { work->wait(50ms); }, {"barrier #2", "still running", "50 ms"});
  work->markCompleted();
  work->wait(50ms);
}

TEST(Work, CallbackExceptionsDoNotEscape) {
  auto work = std::make_shared<Work>("x");
  int second = 0;
  work->then([](Work&) { throw std::runtime_error("boom"); });
  work->then([&](Work&) { second++; });
  work->markCompleted();
  EXPECT_EQ(second, 1);
}

// A backend that implements nothing: every op must say which backend lacks which op.
class EmptyBackend final : public Backend {
 public:
  std::string name() const override { return "empty"; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
};

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
}

}  // namespace
}  // namespace dt
