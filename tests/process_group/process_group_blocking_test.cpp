// An op blocked inside its backend's call (NCCL's first op makes a
// communicator there, for up to the group timeout) must not hold up abort(),
// brokenCause(), lastSeq() or destroy() from another thread: an elastic job's
// watcher aborts the group exactly then. The backend is a BlockingBackend
// (tests/process_group/blocking_backend.h), plugged in through
// ProcessGroupOptions::cpuBackendFactory.
//
// The group timeout is 10 minutes and every wait here has a deadline of 30 s:
// a pass shows that nothing waited for the timeout. No test asserts on time
// beyond that.
#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "common/errors.h"
#include "process_group/process_group.h"
#include "store/hash_store.h"
#include "tests/process_group/blocking_backend.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using testing::BlockingBackend;
using testing::BlockingGate;
using testing::expectThrowsWith;

constexpr std::chrono::milliseconds kGenerous = 30s;

ProcessGroupOptions blockingOptions(const std::shared_ptr<BlockingGate>& gate) {
  ProcessGroupOptions o;
  o.timeout = 10min;
  o.cpuBackendFactory = BlockingBackend::factory(gate);
  return o;
}

// Runs `fn` on a thread of its own; true if it returned within kGenerous.
// If not, it waits for the blocked op: the op is released so that the test
// ends with a failure instead of a hang.
bool returnsPromptly(const std::function<void()>& fn, BlockingGate& gate) {
  auto done = std::async(std::launch::async, fn);
  if (done.wait_for(kGenerous) == std::future_status::ready) {
    done.get();
    return true;
  }
  gate.release();
  done.get();
  return false;
}

// An op issued on a thread of its own; its Work (or its exception) arrives in `work`.
struct Issued {
  std::promise<WorkPtr> promise;
  std::future<WorkPtr> work = promise.get_future();
  std::thread thread;

  explicit Issued(std::function<WorkPtr()> issue) {
    thread = std::thread([this, issue = std::move(issue)] {
      try {
        promise.set_value(issue());
      } catch (...) {
        promise.set_exception(std::current_exception());
      }
    });
  }
  ~Issued() {
    if (thread.joinable()) thread.join();
  }
  // The Work, once the call returned (within kGenerous).
  WorkPtr get() {
    EXPECT_EQ(work.wait_for(kGenerous), std::future_status::ready) << "the call did not return";
    return work.get();
  }
};

bool blockedInside(BlockingGate& gate, int n) {
  return gate.waitFor(kGenerous, [n](const BlockingGate& g) { return g.inside == n; });
}

TEST(ProcessGroupBlocking, AbortReachesAnOpBlockedInItsBackendAndTheOpFailsWithItsCause) {
  auto gate = std::make_shared<BlockingGate>();
  auto pg = ProcessGroup::create(std::make_shared<HashStore>(), 0, 2, blockingOptions(gate));
  EXPECT_EQ(pg->backendFor(Device::cpu()).name(), "blocking");
  Tensor t = ones({4});
  Issued first([&] { return pg->allreduce(t); });
  ASSERT_TRUE(blockedInside(*gate, 1));
  // A second thread issuing on the group waits behind the first (sequence order is issue order).
  Issued second([&] { return pg->barrier(); });

  // None of these waits for the op inside the backend.
  EXPECT_TRUE(returnsPromptly(
      [&] {
        EXPECT_EQ(pg->brokenCause(), nullptr);
        EXPECT_FALSE(pg->isBroken());
        EXPECT_EQ(pg->lastSeq(), 0u);  // numbered once its call returns
      },
      *gate));
  const auto cause = std::make_exception_ptr(MemberLostError("rank 1 exited: signal SIGKILL"));
  EXPECT_TRUE(returnsPromptly([&] { pg->abort(cause); }, *gate));

  // The blocked op fails with the abort's cause, and so does the one queued behind it.
  const WorkPtr a = first.get();
  expectThrowsWith<MemberLostError>([&] { a->wait(); }, {"rank 1 exited: signal SIGKILL"});
  const WorkPtr b = second.get();
  expectThrowsWith<MemberLostError>([&] { b->wait(); }, {"rank 1 exited: signal SIGKILL"});
  EXPECT_EQ(pg->lastSeq(), 2u);
  EXPECT_EQ(pg->brokenCause(), cause);
  // A later op fails at once with it.
  expectThrowsWith<MemberLostError>([&] { pg->allreduce(t)->wait(); }, {"rank 1 exited"});
  EXPECT_TRUE(gate->waitFor(0ms, [](const BlockingGate& g) { return g.inside == 0 && g.calls == 3; }));
}

TEST(ProcessGroupBlocking, DestroyDoesNotWaitForAnOpBlockedInItsBackendWhichKeepsItAlive) {
  auto gate = std::make_shared<BlockingGate>();
  auto pg = ProcessGroup::create(std::make_shared<HashStore>(), 0, 2, blockingOptions(gate));
  gate->opsOutlastShutdown = true;  // the op stays in the backend after destroy()
  Tensor t = ones({4});
  Issued op([&] { return pg->allreduce(t); });
  ASSERT_TRUE(blockedInside(*gate, 1));

  EXPECT_TRUE(returnsPromptly([&] { pg->destroy(); }, *gate));
  EXPECT_TRUE(gate->waitFor(kGenerous, [](const BlockingGate& g) { return g.shutDown; }));
  // The group let its backend go; the call still inside keeps it alive.
  EXPECT_TRUE(gate->waitFor(0ms, [](const BlockingGate& g) { return g.alive == 1 && g.inside == 1; }));
  EXPECT_TRUE(returnsPromptly([&] { EXPECT_EQ(pg->brokenCause(), nullptr); }, *gate));

  gate->release();
  const WorkPtr w = op.get();
  expectThrowsWith<BackendError>([&] { w->wait(); }, {"allreduce #1", "shut down"});
  // (A later op waits for the issue lock, held by the call in the backend until now.)
  expectThrowsWith<InvalidArgument>([&] { pg->allreduce(t); }, {"allreduce on process group default", "destroyed"});
  // The last reference went with the call.
  EXPECT_TRUE(gate->waitFor(kGenerous, [](const BlockingGate& g) { return g.alive == 0; }));
}

TEST(ProcessGroupBlocking, AbortOnTheParentReachesASubgroupOpBlockedInItsBackend) {
  auto gate = std::make_shared<BlockingGate>();
  auto pg = ProcessGroup::create(std::make_shared<HashStore>(), 0, 2, blockingOptions(gate));
  auto sub = pg->newGroup({0});  // made by the parent's factory too
  ASSERT_TRUE(sub->isMember());
  EXPECT_EQ(sub->backendFor(Device::cpu()).name(), "blocking");
  Tensor t = ones({4});
  Issued op([&] { return sub->allreduce(t); });
  ASSERT_TRUE(blockedInside(*gate, 1));

  const auto cause = std::make_exception_ptr(MemberLostError("rank 1 exited: exit code 1"));
  EXPECT_TRUE(returnsPromptly([&] { pg->abort(cause); }, *gate));
  const WorkPtr w = op.get();
  expectThrowsWith<MemberLostError>([&] { w->wait(); }, {"rank 1 exited: exit code 1"});
  EXPECT_TRUE(sub->isBroken());
}

TEST(ProcessGroupBlocking, AFactoryIsRefusedBesideAForcedBackendAndMustMatchTheGroup) {
  auto gate = std::make_shared<BlockingGate>();
  auto store = std::make_shared<HashStore>();
  ProcessGroupOptions forced = blockingOptions(gate);
  forced.backend = "gloo";
  expectThrowsWith<InvalidArgument>([&] { ProcessGroup::create(store, 0, 2, forced); },
                                    {"process group default", "backend gloo", "cpuBackendFactory", "set one of them"});
  ProcessGroupOptions wrong;
  wrong.cpuBackendFactory = [gate](const BackendContext& c) {
    return std::make_shared<BlockingBackend>(gate, c.rank, c.size + 1);
  };
  expectThrowsWith<InvalidArgument>([&] { ProcessGroup::create(store, 1, 2, wrong); },
                                    {"process group default [rank 1/2]", "rank 1/3", "the group's rank and size"});
}

}  // namespace
}  // namespace dt
