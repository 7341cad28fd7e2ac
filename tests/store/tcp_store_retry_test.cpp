// Exactly-once mutating requests: a TcpStore client whose connection breaks
// between request and reply, or whose call times out, sends the request again
// and the server answers it from memory instead of applying it twice. The
// connections are cut by a proxy between client and server that understands
// just enough of the framing to cut at the right moment.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <thread>

#include "common/errors.h"
#include "common/strings.h"
#include "store/internal/protocol.h"
#include "store/tcp_store_server.h"
#include "tests/store/tcp_test_support.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using namespace store_testing;
using dt::testing::expectThrowsWith;
namespace proto = store_proto;

// Reads one whole frame (header included) with blocking reads; nullopt once
// the socket is closed or shut down.
std::optional<std::string> readWholeFrame(int fd) {
  auto readExactly = [fd](std::string& into, size_t n) {
    while (n > 0) {
      char buffer[65536];
      const ssize_t got = ::recv(fd, buffer, std::min(n, sizeof(buffer)), 0);
      if (got <= 0) return false;
      into.append(buffer, static_cast<size_t>(got));
      n -= static_cast<size_t>(got);
    }
    return true;
  };
  std::string frame;
  if (!readExactly(frame, proto::kHeaderBytes)) return std::nullopt;
  if (!readExactly(frame, proto::readLength(frame.data()))) return std::nullopt;
  return frame;
}

// Forwards whole frames between TcpStore clients and a server, and on
// request cuts a connection at one of three moments (handshakes always pass):
//  * cutBeforeReplies(n): the next n replies are dropped and both sides of
//    their connection closed: the request was applied, the client never
//    learns it.
//  * cutAfterRequests(n): the next n requests are forwarded, then the
//    client's side is closed while the server's stays open: the server still
//    works on (or waits in) a request whose client has gone.
//  * holdReplies(true): replies are held back, connections stay up, until
//    holdReplies(false): the client times out instead.
class CuttingProxy {
 public:
  explicit CuttingProxy(uint16_t upstream) : upstream_(upstream) {
    listener_ = loopbackListener(port_);
    if (listener_ < 0) throw std::runtime_error("proxy: no listening socket");
    acceptor_ = std::thread([this] { acceptLoop(); });
  }

  ~CuttingProxy() {
    stopping_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    acceptor_.join();
    {
      std::lock_guard lock(mutex_);
      for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    }
    for (auto& pump : pumps_) pump.join();
    for (int fd : fds_) ::close(fd);
    ::close(listener_);
  }

  uint16_t port() const { return port_; }
  void cutBeforeReplies(int n) { replyCuts_ = n; }
  void cutAfterRequests(int n) { requestCuts_ = n; }
  void holdReplies(bool hold) { holding_ = hold; }
  int cuts() const { return cuts_; }

 private:
  void acceptLoop() {
    while (!stopping_) {
      const int client = ::accept(listener_, nullptr, nullptr);
      if (client < 0) return;
      const int server = rawConnect(upstream_);
      if (server < 0) {  // the server is gone: so is this connection
        ::close(client);
        continue;
      }
      std::lock_guard lock(mutex_);
      fds_.push_back(client);
      fds_.push_back(server);
      pumps_.emplace_back([this, client, server] { forwardRequests(client, server); });
      pumps_.emplace_back([this, client, server] { forwardReplies(server, client); });
    }
  }

  static bool takeOne(std::atomic<int>& budget) {
    int left = budget.load();
    while (left > 0 && !budget.compare_exchange_weak(left, left - 1)) {
    }
    return left > 0;
  }

  void forwardRequests(int client, int server) {
    for (bool handshake = true;; handshake = false) {
      auto frame = readWholeFrame(client);
      if (!frame) break;
      rawSend(server, *frame);
      if (!handshake && takeOne(requestCuts_)) {
        ++cuts_;
        ::shutdown(client, SHUT_RDWR);  // the server's side stays open
        return;
      }
    }
    // The client went away: so does its connection to the server.
    ::shutdown(server, SHUT_RDWR);
  }

  void forwardReplies(int server, int client) {
    for (bool handshake = true;; handshake = false) {
      auto frame = readWholeFrame(server);
      if (!frame) break;
      while (!handshake && holding_ && !stopping_) std::this_thread::sleep_for(1ms);
      if (!handshake && takeOne(replyCuts_)) {
        ++cuts_;
        ::shutdown(client, SHUT_RDWR);
        ::shutdown(server, SHUT_RDWR);
        return;
      }
      rawSend(client, *frame);
    }
    ::shutdown(client, SHUT_RDWR);
  }

  uint16_t upstream_;
  uint16_t port_ = 0;
  int listener_ = -1;
  std::atomic<bool> stopping_{false}, holding_{false};
  std::atomic<int> replyCuts_{0}, requestCuts_{0}, cuts_{0};
  std::mutex mutex_;
  std::vector<int> fds_;
  std::vector<std::thread> pumps_;
  std::thread acceptor_;
};

class TcpStoreRetry : public ::testing::Test {
 protected:
  void SetUp() override {
    TcpStoreServerOptions options;
    options.token = kToken;
    server_ = TcpStoreServer::start(options);
    proxy_ = std::make_unique<CuttingProxy>(server_->port());
    direct_ = client(server_->port());
    viaProxy_ = client(proxy_->port());
  }
  void TearDown() override {
    viaProxy_.reset();
    proxy_.reset();
  }

  std::shared_ptr<TcpStoreServer> server_;
  std::unique_ptr<CuttingProxy> proxy_;
  std::shared_ptr<TcpStore> direct_, viaProxy_;
};

TEST_F(TcpStoreRetry, AddWhoseReplyIsLostCountsOnce) {
  proxy_->cutBeforeReplies(1);
  EXPECT_EQ(viaProxy_->add("counter", 5), 5) << "the repeat must get the original answer";
  EXPECT_EQ(proxy_->cuts(), 1);
  EXPECT_EQ(direct_->get("counter"), "5") << "applied twice";
  // Cut again and again: every add still counts once.
  for (int i = 1; i <= 3; ++i) {
    proxy_->cutBeforeReplies(1);
    EXPECT_EQ(viaProxy_->add("counter", 1), 5 + i);
  }
  EXPECT_EQ(direct_->get("counter"), "8");
  EXPECT_EQ(proxy_->cuts(), 4);
}

TEST_F(TcpStoreRetry, EveryMutatingCallAppliesOnceAcrossACut) {
  auto cut = [&] { proxy_->cutBeforeReplies(1); };
  cut();
  EXPECT_EQ(viaProxy_->compareSet("cas", "", "first"), "first");
  EXPECT_EQ(direct_->get("cas"), "first");
  direct_->set("cas", "changed by someone else");
  cut();
  viaProxy_->set("kv", "mine");
  EXPECT_EQ(direct_->get("kv"), "mine");
  cut();
  viaProxy_->append("log", "a");
  EXPECT_EQ(direct_->get("log"), "a") << "appended twice";
  cut();
  viaProxy_->multiSet({"m1", "m2"}, {"1", "2"});
  EXPECT_EQ(direct_->multiGet({"m1", "m2"}), (std::vector<Bytes>{"1", "2"}));
  direct_->set("doomed", "x");
  cut();
  EXPECT_TRUE(viaProxy_->deleteKey("doomed")) << "the repeat must say the key was deleted";
  cut();
  viaProxy_->queuePush("q", "item");
  EXPECT_EQ(direct_->queueLen("q"), 1) << "pushed twice";
  direct_->queuePush("q", "second");
  cut();
  EXPECT_EQ(viaProxy_->queuePop("q", false), "item") << "the popped item must not be lost";
  EXPECT_EQ(direct_->queueLen("q"), 1);
  EXPECT_EQ(direct_->queuePop("q", false), "second");
  EXPECT_EQ(proxy_->cuts(), 7);
}

TEST_F(TcpStoreRetry, BlockingQueuePopAnsweredWhileCutGetsItsItem) {
  // The reply carrying the item is lost: the repeat returns that item.
  proxy_->cutBeforeReplies(1);
  std::optional<Bytes> got;
  std::thread consumer([&] { got = viaProxy_->queuePop("jobs", true, 30s); });
  std::this_thread::sleep_for(50ms);  // usually parked by now; either way it must work
  direct_->queuePush("jobs", "job-1");
  consumer.join();
  EXPECT_EQ(got, "job-1");
  EXPECT_EQ(direct_->queueLen("jobs"), 0);
  EXPECT_EQ(proxy_->cuts(), 1);
}

TEST_F(TcpStoreRetry, WaitingQueuePopMovesToTheNewConnection) {
  // The client's connection is cut while its queuePop waits on the server,
  // whose side of the old connection stays open: the repeat takes the waiting
  // request over, so the item goes to the new connection, not the dead one.
  proxy_->cutAfterRequests(1);
  std::optional<Bytes> got;
  std::thread consumer([&] { got = viaProxy_->queuePop("tasks", true, 30s); });
  while (proxy_->cuts() == 0) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(50ms);  // usually resent by now; either way it must work
  direct_->queuePush("tasks", "task-1");
  consumer.join();
  EXPECT_EQ(got, "task-1");
  EXPECT_EQ(direct_->queueLen("tasks"), 0);
}

TEST_F(TcpStoreRetry, CutBeforeTheServerAnswersStillAppliesOnce) {
  proxy_->cutAfterRequests(1);
  EXPECT_EQ(viaProxy_->add("n", 3), 3);
  EXPECT_EQ(direct_->get("n"), "3");
  proxy_->cutAfterRequests(1);
  EXPECT_EQ(viaProxy_->get("n", 10s), "3") << "reads are sent again too";
}

TEST_F(TcpStoreRetry, RepeatingATimedOutCallAppliesItOnce) {
  proxy_->holdReplies(true);
  viaProxy_->setTimeout(300ms);
  expectThrowsWith<TimeoutError>([&] { viaProxy_->add("t", 1); },
                                 {"add", "no reply", "Repeating the same call is safe"});
  proxy_->holdReplies(false);
  EXPECT_EQ(direct_->get("t"), "1") << "the server applied the timed-out add";
  viaProxy_->setTimeout(30s);
  EXPECT_EQ(viaProxy_->add("t", 1), 1) << "the repeat is answered, not applied";
  EXPECT_EQ(viaProxy_->add("t", 1), 2) << "the next call is a new one";
  EXPECT_EQ(direct_->get("t"), "2");
}

TEST_F(TcpStoreRetry, ADifferentCallAfterATimeoutIsApplied) {
  proxy_->holdReplies(true);
  viaProxy_->setTimeout(300ms);
  expectThrowsWith<TimeoutError>([&] { viaProxy_->add("u", 1); }, {"add"});
  proxy_->holdReplies(false);
  EXPECT_EQ(direct_->get("u"), "1");
  viaProxy_->setTimeout(30s);
  EXPECT_EQ(viaProxy_->add("u", 2), 3);
  EXPECT_EQ(direct_->get("u"), "3");
}

TEST_F(TcpStoreRetry, ServerAnswersRepeatsFromMemoryAndRefusesStaleOnes) {
  // The wire rule itself, over raw connections.
  constexpr uint64_t kClient = 0x5eed;
  auto roundTrip = [](int fd, const std::string& frame) {
    rawSend(fd, frame);
    auto reply = rawReadFrame(fd);
    EXPECT_TRUE(reply.has_value());
    return reply.value_or(std::string(1, '\xff'));
  };
  auto counterIn = [](const std::string& reply) {
    proto::FrameReader r(reply);
    EXPECT_EQ(r.u8(), static_cast<uint8_t>(proto::Status::Ok));
    return r.i64();
  };
  const int first = rawConnect(server_->port());
  ASSERT_EQ(statusOf(roundTrip(first, helloFrame())), static_cast<uint8_t>(proto::Status::Ok));
  EXPECT_EQ(counterIn(roundTrip(first, addFrame("raw", 5, kClient, 1))), 5);
  EXPECT_EQ(counterIn(roundTrip(first, addFrame("raw", 5, kClient, 1))), 5);
  ::close(first);
  const int second = rawConnect(server_->port());
  ASSERT_EQ(statusOf(roundTrip(second, helloFrame())), static_cast<uint8_t>(proto::Status::Ok));
  EXPECT_EQ(counterIn(roundTrip(second, addFrame("raw", 5, kClient, 1))), 5) << "remembered across connections";
  EXPECT_EQ(counterIn(roundTrip(second, addFrame("raw", 5, kClient, 2))), 10);
  const std::string stale = roundTrip(second, addFrame("raw", 5, kClient, 1));
  EXPECT_EQ(statusOf(stale), static_cast<uint8_t>(proto::Status::Error));
  EXPECT_NE(stale.find("older than its latest request #2"), std::string::npos) << stale;
  // Client id 0 opts out: every request is applied.
  EXPECT_EQ(counterIn(roundTrip(second, addFrame("raw", 1, 0, 7))), 11);
  EXPECT_EQ(counterIn(roundTrip(second, addFrame("raw", 1, 0, 7))), 12);
  ::close(second);
  EXPECT_EQ(direct_->get("raw"), "12");
}

TEST_F(TcpStoreRetry, ServerGoneStillFailsTheCallWithTheReason) {
  proxy_->cutBeforeReplies(1);
  server_.reset();  // nothing to reconnect to
  expectThrowsWith<NetworkError>([&] { viaProxy_->add("x", 1); }, {"gone", str("127.0.0.1:", proxy_->port())});
  expectThrowsWith<NetworkError>([&] { viaProxy_->add("x", 1); }, {"lost earlier"});
}

}  // namespace
}  // namespace dt
