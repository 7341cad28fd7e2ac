// The multi-node coordinator over an in-process HashStore (nodes as objects,
// no processes): failure records, lost nodes, the hang watchdog, the end-of-job
// handshake. Fast, and clean under ThreadSanitizer (label tsan).
#include <chrono>
#include <sys/eventfd.h>
#include <thread>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "launcher/coordinator.h"
#include "launcher/machine.h"
#include "store/hash_store.h"

namespace dt::launcher {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using Kind = CoordinatorEvent::Kind;

struct Node {
  int wakeFd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  std::unique_ptr<Coordinator> coord;
  std::vector<CoordinatorEvent> seen;
  ~Node() {
    coord.reset();
    ::close(wakeFd);
  }
  // Waits for an event of `kind` (collecting everything seen).
  std::optional<CoordinatorEvent> waitFor(Kind kind, std::chrono::milliseconds timeout = 10s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      for (auto& event : coord->takeEvents()) seen.push_back(event);
      for (const auto& event : seen) {
        if (event.kind == kind) return event;
      }
      std::this_thread::sleep_for(10ms);
    }
    return std::nullopt;
  }
};

Coordinator::Config config(int node, int nnodes, Millis hang = Millis(0)) {
  Coordinator::Config c;
  c.nodeRank = node;
  c.nnodes = nnodes;
  c.interval = 20ms;
  c.nodeTimeout = 1s;
  c.hangTimeout = hang;
  return c;
}

TEST(LauncherCoordinator, FirstFailureWinsAndReachesEveryNode) {
  auto store = std::make_shared<HashStore>();
  Node n0, n1, n2;
  n0.coord = std::make_unique<Coordinator>(store->clone(), config(0, 3), n0.wakeFd);
  n1.coord = std::make_unique<Coordinator>(store->clone(), config(1, 3), n1.wakeFd);
  n2.coord = std::make_unique<Coordinator>(store->clone(), config(2, 3), n2.wakeFd);
  for (Node* n : {&n0, &n1, &n2}) n->coord->beginAttempt(0, 6, wallMs());
  const std::string first = encodeFailure(3, 1000, 1, "rank 2 (host b, pid 7) ended with exit code 3");
  n1.coord->publishFailure(first);
  ASSERT_TRUE(n1.waitFor(Kind::FailurePublished));
  // A later report loses: its node learns the recorded one.
  n2.coord->publishFailure(encodeFailure(9, 2000, 2, "rank 4 ended with exit code 9"));
  const auto lost = n2.waitFor(Kind::RemoteFailure);
  ASSERT_TRUE(lost);
  EXPECT_EQ(lost->text, first);
  EXPECT_EQ(lost->attempt, 0);
  const auto remote = n0.waitFor(Kind::RemoteFailure);
  ASSERT_TRUE(remote);
  EXPECT_EQ(decodeFailure(remote->text).node, 1);
  EXPECT_EQ(remote->code, 3);
}

TEST(LauncherCoordinator, SilentNodeIsLostButAnExitedOneIsNot) {
  auto store = std::make_shared<HashStore>();
  Node n0, n1, n2;
  n0.coord = std::make_unique<Coordinator>(store->clone(), config(0, 3), n0.wakeFd);
  n1.coord = std::make_unique<Coordinator>(store->clone(), config(1, 3), n1.wakeFd);
  n2.coord = std::make_unique<Coordinator>(store->clone(), config(2, 3), n2.wakeFd);
  for (Node* n : {&n0, &n1, &n2}) n->coord->beginAttempt(0, 3, wallMs());
  std::this_thread::sleep_for(100ms);
  n2.coord->publishExit();
  ASSERT_TRUE(n2.waitFor(Kind::ExitPublished));
  n2.coord.reset();  // finished properly
  n1.coord.reset();  // dies: its heartbeat stops
  const auto event = n0.waitFor(Kind::NodeLost);
  ASSERT_TRUE(event);
  EXPECT_THAT(event->text, HasSubstr("node 1 stopped sending heartbeats"));
  std::this_thread::sleep_for(1500ms);
  for (auto& e : n0.coord->takeEvents()) n0.seen.push_back(e);
  int lostCount = 0;
  for (const auto& e : n0.seen) lostCount += e.kind == Kind::NodeLost;
  EXPECT_EQ(lostCount, 1) << "node 2 published its exit and must not be reported";
}

TEST(LauncherCoordinator, AllDoneThenExitsSeen) {
  auto store = std::make_shared<HashStore>();
  Node n0, n1;
  n0.coord = std::make_unique<Coordinator>(store->clone(), config(0, 2), n0.wakeFd);
  n1.coord = std::make_unique<Coordinator>(store->clone(), config(1, 2), n1.wakeFd);
  n0.coord->beginAttempt(0, 2, wallMs());
  n1.coord->beginAttempt(0, 2, wallMs());
  n0.coord->publishDone();
  std::this_thread::sleep_for(100ms);
  for (auto& e : n0.coord->takeEvents()) EXPECT_NE(e.kind, Kind::AllDone) << "node 1 is not done yet";
  n1.coord->publishDone();
  EXPECT_TRUE(n0.waitFor(Kind::AllDone));
  EXPECT_TRUE(n1.waitFor(Kind::AllDone));
  n0.coord->awaitExits();
  n1.coord->publishExit();
  EXPECT_TRUE(n0.waitFor(Kind::ExitsSeen));
}

TEST(LauncherCoordinator, HangWatchdogFiresOnceWithTheReport) {
  auto store = std::make_shared<HashStore>();
  Node n0;
  n0.coord = std::make_unique<Coordinator>(store->clone(), config(0, 1, 1s), n0.wakeFd);
  n0.coord->beginAttempt(0, 2, wallMs());
  for (int seq = 1; seq <= 4; ++seq) {
    store->set("dt/progress/0", str(seq, " allreduce"));
    if (seq <= 2) store->set("dt/progress/1", str(seq, " allreduce"));
    std::this_thread::sleep_for(100ms);  // progress: no hang yet
    for (auto& e : n0.coord->takeEvents()) EXPECT_NE(e.kind, Kind::Hang);
  }
  const auto hang = n0.waitFor(Kind::Hang, 5s);
  ASSERT_TRUE(hang);
  EXPECT_EQ(hang->code, 124);
  EXPECT_THAT(hang->text, HasSubstr("rank 0: #4 allreduce; rank 1: #2 allreduce"));
  EXPECT_THAT(hang->text, HasSubstr("Behind: rank(s) 1"));
  // A new attempt starts a new watch.
  n0.seen.clear();
  n0.coord->beginAttempt(1, 2, wallMs());
  EXPECT_TRUE(n0.waitFor(Kind::Hang, 5s));
}

TEST(LauncherCoordinator, WakeDescriptorIsSignalled) {
  auto store = std::make_shared<HashStore>();
  Node n0;
  n0.coord = std::make_unique<Coordinator>(store->clone(), config(0, 2), n0.wakeFd);
  n0.coord->beginAttempt(0, 2, wallMs());
  n0.coord->publishFailure(encodeFailure(1, 1, 0, "x"));
  uint64_t counter = 0;
  for (int i = 0; i < 500 && ::read(n0.wakeFd, &counter, sizeof(counter)) != sizeof(counter); ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_GT(counter, 0u);
}

}  // namespace
}  // namespace dt::launcher
