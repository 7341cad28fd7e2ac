// The elastic watcher beats while the training thread's op is blocked inside
// its backend (as NCCL's first op is while it makes a communicator) and while
// the abort for a dead member takes its time: a beat that waited for either
// would get this live member posted dead by the launcher, and the next epoch
// would lose it too. One member in this process, over a HashStore; the other
// member of epoch 0 never runs (the BlockingBackend needs no peer), and the
// test posts its death as the launcher would.
//
// The group timeout is 10 minutes and every wait has a deadline of 30 s.
#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "common/errors.h"
#include "elastic/elastic_group.h"
#include "store/hash_store.h"
#include "store/membership.h"
#include "tests/process_group/blocking_backend.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using testing::BlockingBackend;
using testing::BlockingGate;
using testing::expectThrowsWith;

constexpr std::chrono::milliseconds kGenerous = 30s;

// Polls (the watcher's beats are store writes; nothing to wait on) until `done` or kGenerous.
bool eventually(const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + kGenerous;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

uint64_t beats(Store& store, int member) { return membership::heartbeatOf(store, member).value_or(0); }

TEST(ElasticWatcher, BeatsGoOnWhileAnOpIsBlockedAndTheAbortTakesItsTimeAndTheOpFailsWithTheLoss) {
  auto gate = std::make_shared<BlockingGate>();
  auto store = std::make_shared<HashStore>();
  elastic::ElasticOptions options;
  options.minSize = 1;
  options.heartbeatInterval = 10ms;
  options.group.timeout = 10min;
  options.group.cpuBackendFactory = BlockingBackend::factory(gate);
  auto elastic = std::make_unique<elastic::ElasticGroup>(store, 0, 2, options);

  Tensor t = ones({4});
  auto op = std::async(std::launch::async, [&] { return elastic->group()->allreduce(t); });
  ASSERT_TRUE(gate->waitFor(kGenerous, [](const BlockingGate& g) { return g.inside == 1; }));
  uint64_t before = beats(*store, 0);
  EXPECT_TRUE(eventually([&] { return beats(*store, 0) >= before + 3; })) << "no beats while an op is blocked";

  gate->setHoldAborts(true);  // the group's abort blocks inside the backend until set back
  membership::postDeath(*store, 1, "exited: signal SIGKILL");
  ASSERT_TRUE(gate->waitFor(kGenerous, [](const BlockingGate& g) { return g.abortsEntered == 1; }));
  // The abort released the op before it blocked: the op fails with the loss.
  ASSERT_EQ(op.wait_for(kGenerous), std::future_status::ready);
  const WorkPtr work = op.get();
  expectThrowsWith<MemberLostError>([&] { work->wait(); }, {"rank 1 exited: signal SIGKILL"});
  // And the beats go on while the abort is still in progress.
  before = beats(*store, 0);
  EXPECT_TRUE(eventually([&] { return beats(*store, 0) >= before + 3; })) << "no beats while an abort is in progress";

  gate->setHoldAborts(false);
  elastic.reset();  // stops the watcher's threads and destroys the group
  EXPECT_TRUE(gate->waitFor(kGenerous, [](const BlockingGate& g) { return g.alive == 0; }));
}

}  // namespace
}  // namespace dt
