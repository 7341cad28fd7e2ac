// A TcpStore primary with a hot standby (tcp_store_server.h), its processes
// really killed: SIGKILL of the primary in the middle of adds, queue traffic
// and blocked gets from several clients loses no acknowledged write, applies
// none twice and lets the blocked calls complete on the standby; a standby
// that dies leaves the primary alone; one that only stops answering (SIGSTOP:
// suspicion, not proof) is retired and never serves, even once the primary
// is gone too.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <thread>

#include "common/errors.h"
#include "common/strings.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"
#include "tests/store/tcp_test_support.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using store_testing::Child;
using store_testing::kToken;
using store_testing::ServerProcess;
using dt::testing::eventually;
// How long to wait for an event on a machine that may be busy.
constexpr auto kPatience = 60s;

std::shared_ptr<TcpStore> clientOf(uint16_t port, const std::string& standby = "", Store::Duration connect = 20s) {
  TcpStoreOptions options;
  options.token = kToken;
  options.standby = standby;
  options.connectTimeout = connect;
  return std::make_shared<TcpStore>("127.0.0.1", port, options);
}

TcpStoreServerOptions serverOptions(bool standby) {
  TcpStoreServerOptions options;
  options.token = kToken;
  options.standby = standby;
  return options;
}

// A standby server in a child process (forked before the test starts threads).
struct StandbyProcess {
  std::unique_ptr<Child> child;
  uint16_t port = 0;
  StandbyProcess() {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
    child = std::make_unique<Child>([&] {
      ::close(fds[0]);
      auto server = TcpStoreServer::start(serverOptions(true));
      const uint16_t bound = server->port();
      [[maybe_unused]] const ssize_t ignored = ::write(fds[1], &bound, sizeof(bound));
      while (true) ::pause();
    });
    ::close(fds[1]);
    if (::read(fds[0], &port, sizeof(port)) != sizeof(port)) throw std::runtime_error("standby child died");
    ::close(fds[0]);
  }
};

// A client that may only dial the standby: refused (NotPrimary) while it does not serve.
void expectStandbyRefuses(uint16_t standbyPort, const std::string& why) {
  dt::testing::expectThrowsWith<TimeoutError>([&] { clientOf(standbyPort, "", 300ms); },
                                              {"could not connect", why});
}

TEST(TcpStoreFailover, KillingThePrimaryLosesNoAcknowledgedWriteAndDoublesNone) {
  ServerProcess primary;  // forked first: the test's threads come after
  auto standby = TcpStoreServer::start(serverOptions(true));
  const std::string standbyAddress = clientOf(primary.port())->attachStandby(standby->port());
  EXPECT_EQ(standbyAddress, str("127.0.0.1:", standby->port()));
  expectStandbyRefuses(standby->port(), "a standby that serves only once its primary is gone");

  constexpr int kAdders = 4, kPushers = 2, kPoppers = 2, kWaiters = 3;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> acks{0};
  std::atomic<int> waitersCalling{0};
  std::mutex mutex;
  std::vector<int64_t> addResults;
  std::multiset<std::string> pushed, popped;
  std::vector<std::string> waited;
  std::vector<std::string> errors;
  auto guard = [&](auto&& body) {
    return [&, body] {
      try {
        body();
      } catch (const std::exception& e) {
        std::lock_guard lock(mutex);
        errors.push_back(e.what());
      }
    };
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kWaiters; ++t) {
    threads.emplace_back(guard([&] {
      auto store = clientOf(primary.port(), standbyAddress);
      ++waitersCalling;
      const std::string value = store->get("after-the-kill", 120s);
      std::lock_guard lock(mutex);
      waited.push_back(value);
    }));
  }
  for (int t = 0; t < kAdders; ++t) {
    threads.emplace_back(guard([&] {
      auto store = clientOf(primary.port(), standbyAddress);
      std::vector<int64_t> mine;
      while (!stop) {
        mine.push_back(store->add("counter", 1));
        ++acks;
      }
      std::lock_guard lock(mutex);
      addResults.insert(addResults.end(), mine.begin(), mine.end());
    }));
  }
  for (int t = 0; t < kPushers; ++t) {
    threads.emplace_back(guard([&, t] {
      auto store = clientOf(primary.port(), standbyAddress);
      std::vector<std::string> mine;
      for (int n = 0; !stop; ++n) {
        const std::string item = str("pusher", t, "-", n);
        store->queuePush("jobs", item);
        mine.push_back(item);
      }
      std::lock_guard lock(mutex);
      pushed.insert(mine.begin(), mine.end());
    }));
  }
  for (int t = 0; t < kPoppers; ++t) {
    threads.emplace_back(guard([&] {
      auto store = clientOf(primary.port(), standbyAddress);
      std::vector<std::string> mine;
      while (!stop) {
        try {
          if (auto item = store->queuePop("jobs", true, 200ms)) mine.push_back(*item);
        } catch (const TimeoutError&) {
          // the queue was empty for a while: ask again
        }
      }
      std::lock_guard lock(mutex);
      popped.insert(mine.begin(), mine.end());
    }));
  }

  ASSERT_TRUE(eventually([&] { return waitersCalling == kWaiters && acks >= 300; }, kPatience)) << acks;
  const int64_t before = acks;
  ASSERT_TRUE(eventually([&] { return acks >= before + 100; }, kPatience));  // the waiters' gets have reached the primary
  const auto killedAt = Clock::now();
  const int64_t acksAtKill = acks;
  primary.child().kill();  // SIGKILL
  ASSERT_TRUE(eventually([&] { return acks > acksAtKill + 10; }, kPatience)) << "no write acknowledged after the kill";
  const auto resumedAfter = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - killedAt);
  ASSERT_TRUE(eventually([&] { return acks >= acksAtKill + 300; }, kPatience));
  EXPECT_EQ(standby->role(), "primary");

  auto late = clientOf(primary.port(), standbyAddress);  // the primary's port refuses: it finds the standby
  late->set("after-the-kill", "went on");
  stop = true;
  for (auto& thread : threads) thread.join();
  ASSERT_TRUE(errors.empty()) << errors.front();

  // Every add acknowledged exactly once: the results are 1..N, each once, and N is stored.
  std::sort(addResults.begin(), addResults.end());
  ASSERT_FALSE(addResults.empty());
  for (size_t i = 0; i < addResults.size(); ++i) ASSERT_EQ(addResults[i], static_cast<int64_t>(i + 1)) << "at " << i;
  EXPECT_EQ(std::stoll(late->get("counter")), static_cast<int64_t>(addResults.size()));
  // Every acknowledged push popped once, none twice, none invented.
  while (auto item = late->queuePop("jobs", false)) popped.insert(*item);
  EXPECT_EQ(popped, pushed);
  EXPECT_EQ(waited, std::vector<std::string>(kWaiters, "went on"));
  std::printf("failover: %zu adds (%lld before the kill), %zu queue items; from the SIGKILL to the next "
              "acknowledged write: %lld ms\n",
              addResults.size(), static_cast<long long>(acksAtKill), pushed.size(),
              static_cast<long long>(resumedAfter.count()));
}

TEST(TcpStoreFailover, APrimaryWhoseStandbyDiesGoesOnAlone) {
  StandbyProcess standby;
  auto primary = TcpStoreServer::start(serverOptions(false));
  auto store = clientOf(primary->port());
  const std::string standbyAddress = store->attachStandby(standby.port);
  store->setStandby(standbyAddress);
  store->set("a", "1");
  standby.child->kill();
  // The writes in flight when the standby went are released, and later ones need nobody.
  EXPECT_EQ(store->add("n", 5), 5);
  store->set("b", "2");
  EXPECT_EQ(clientOf(primary->port(), standbyAddress)->get("a"), "1");
  EXPECT_EQ(primary->role(), "primary");
}

TEST(TcpStoreFailover, AStandbyThatOnlyStopsAnsweringIsRetiredAndNeverServes) {
  StandbyProcess standby;
  auto options = serverOptions(false);
  options.standbyTimeout = 300ms;
  auto primary = TcpStoreServer::start(options);
  auto store = clientOf(primary->port());
  const std::string standbyAddress = store->attachStandby(standby.port);
  store->set("before", "1");
  ASSERT_EQ(::kill(standby.child->pid(), SIGSTOP), 0);
  // Stopped for sure before the write: a stop still in flight could let it acknowledge.
  ASSERT_TRUE(eventually([&] { return dt::testing::processState(standby.child->pid()) == 'T'; }, kPatience));
  // Silence is suspicion: the primary waits standbyTimeout, retires the standby and goes on.
  store->set("while-it-is-stopped", "2");
  EXPECT_EQ(store->get("while-it-is-stopped"), "2");
  ASSERT_EQ(::kill(standby.child->pid(), SIGCONT), 0);
  // Once it runs again it reads the retirement, and losing the primary later does not promote it.
  ASSERT_TRUE(eventually([&] {
    try {
      clientOf(standby.port, "", 200ms);
      return false;
    } catch (const TimeoutError& e) {
      return std::string(e.what()).find("retired standby") != std::string::npos;
    }
  }, kPatience));
  store.reset();
  primary.reset();
  expectStandbyRefuses(standby.port, "retired standby");
}

TEST(TcpStoreFailover, OnlyOneStandbyAtATimeAndNotOnAStandby) {
  auto first = TcpStoreServer::start(serverOptions(true));
  auto second = TcpStoreServer::start(serverOptions(true));
  auto primary = TcpStoreServer::start(serverOptions(false));
  auto store = clientOf(primary->port());
  store->attachStandby(first->port());
  dt::testing::expectThrowsWith<Error>([&] { store->attachStandby(second->port()); },
                                       {"already replicates to the standby at 127.0.0.1:"});
  // A primary cannot follow another one, and a standby follows one primary once.
  auto other = TcpStoreServer::start(serverOptions(false));
  dt::testing::expectThrowsWith<Error>([&] { clientOf(other->port())->attachStandby(primary->port()); },
                                       {"refused the replication connection", "a primary, not a standby"});
  dt::testing::expectThrowsWith<Error>([&] { clientOf(other->port())->attachStandby(first->port()); },
                                       {"refused the replication connection", "already the standby"});
}

}  // namespace
}  // namespace dt
