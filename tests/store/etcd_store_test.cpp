// EtcdStore against real etcd members (etcd_test_support.h): what the
// conformance suite does not cover. A three-member cluster that loses a
// member (SIGKILL) in the middle of a workload, with no error visible to the
// clients and every counter exact; leases that vanish when their holder is
// SIGKILLed and not while it lives; membership listing and watching; TLS with
// certificates made by openssl and user/password authentication, where every
// wrong certificate or credential is one clear error naming the endpoint,
// never a hang; and bad endpoints.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>

#include "common/errors.h"
#include "common/strings.h"
#include "store/etcd_store.h"
#include "store/internal/etcd_client.h"
#include "store/tcp_store.h"
#include "tests/store/etcd_test_support.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using dt::testing::EtcdCluster;
using dt::testing::expectThrowsWith;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// ---- fail-over ----------------------------------------------------------------------

// Four clients run adds, sets/gets, compare-and-sets and queue pushes/pops;
// one member is SIGKILLed once the work is under way. Nothing may throw and
// every result must be exact (no add applied twice, no queue item lost or
// popped twice) while a waiter blocked before the kill is released after it.
void workloadSurvivesKilling(bool killLeader) {
  EtcdCluster cluster({.members = 3});
  const auto options = cluster.storeOptions("/failover");
  const int victim = killLeader ? cluster.leader() : 0;  // clients start at member 0
  ASSERT_GE(victim, 0) << "no leader";
  constexpr int kClients = 4, kRounds = 90;
  std::atomic<int> progress{0};
  std::mutex errorsMutex;
  std::vector<std::string> errors;
  std::vector<std::vector<std::string>> popped(kClients);
  auto waiterStore = std::make_shared<EtcdStore>(options);
  std::string released;
  std::thread waiter([&] {
    try {
      released = waiterStore->get("released", 60s);
    } catch (const std::exception& e) {
      std::lock_guard lock(errorsMutex);
      errors.push_back(str("waiter: ", e.what()));
    }
  });
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      try {
        EtcdStore store(options);
        for (int i = 0; i < kRounds; ++i) {
          store.add("count", 1);
          store.set(str("key/", c, "/", i), str(i));
          if (store.get(str("key/", c, "/", i)) != str(i)) throw Error("read back a different value");
          store.compareSet(str("cas/", c), i == 0 ? "" : str(i - 1), str(i));
          store.queuePush("work", str(c, ":", i));
          if (auto item = store.queuePop("work", true, 30s)) popped[static_cast<size_t>(c)].push_back(*item);
          ++progress;
        }
      } catch (const std::exception& e) {
        std::lock_guard lock(errorsMutex);
        errors.push_back(str("client ", c, ": ", e.what()));
      }
    });
  }
  const auto start = Clock::now();
  while (progress < kClients * kRounds / 3 && secondsSince(start) < 60) std::this_thread::sleep_for(5ms);
  cluster.kill(victim);
  const int before = progress.load();
  const auto killedAt = Clock::now();
  for (auto& t : clients) t.join();
  std::printf("workload: %.2f s before the kill (member %d, %d of %d rounds done), %.2f s after\n",
              std::chrono::duration<double>(killedAt - start).count(), victim, before, kClients * kRounds,
              secondsSince(killedAt));
  EtcdStore survivor(options);
  survivor.set("released", "after the kill");
  waiter.join();
  EXPECT_TRUE(errors.empty()) << join(errors, "\n");
  EXPECT_LT(before, kClients * kRounds) << "the kill came after the work was done";
  EXPECT_EQ(survivor.get("count"), str(kClients * kRounds));
  for (int c = 0; c < kClients; ++c) EXPECT_EQ(survivor.get(str("cas/", c)), str(kRounds - 1));
  std::multiset<std::string> all;
  for (const auto& items : popped) all.insert(items.begin(), items.end());
  EXPECT_EQ(all.size(), static_cast<size_t>(kClients * kRounds));
  EXPECT_EQ(std::set<std::string>(all.begin(), all.end()).size(), all.size()) << "an item was popped twice";
  EXPECT_EQ(survivor.queueLen("work"), 0);
  EXPECT_EQ(released, "after the kill");
}

TEST(EtcdStoreFailover, KillingTheMemberInUseIsInvisible) { workloadSurvivesKilling(false); }
TEST(EtcdStoreFailover, KillingTheLeaderIsInvisible) { workloadSurvivesKilling(true); }

TEST(EtcdStoreFailover, ADeadEndpointInTheListIsPassedOver) {
  EtcdCluster cluster;
  auto options = cluster.storeOptions("/dead-first");
  TcpStoreOptions nothing;  // a port with nothing behind it: the store's, then closed
  nothing.isServer = true;
  nothing.waitForWorkers = false;
  uint16_t deadPort = 0;
  {
    TcpStore probe("127.0.0.1", 0, nothing);
    deadPort = probe.port();
  }
  options.endpoints = str("127.0.0.1:", deadPort, ",", options.endpoints);
  EtcdStore store(options);
  store.set("k", "v");
  EXPECT_EQ(store.clone()->get("k"), "v");
}

// ---- leases -------------------------------------------------------------------------

TEST(EtcdStoreLease, TheKeysOfASigkilledHolderVanish) {
  EtcdCluster cluster;
  const auto options = cluster.storeOptions("/lease");
  EtcdStore store(options);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    try {
      auto mine = std::make_shared<EtcdStore>(options);
      auto lease = mine->grantLease(1s);
      mine->setWithLease("members/child", str(getpid()), *lease);
      mine->set("child-ready", "1");
      while (true) std::this_thread::sleep_for(1s);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
      _exit(1);
    }
  }
  store.get("child-ready", 30s);
  // Alive for several TTLs: the keep-alives work.
  std::this_thread::sleep_for(2500ms);
  auto listing = store.list("members/");
  ASSERT_EQ(listing.entries.size(), 1u);
  EXPECT_EQ(listing.entries[0].key, "members/child");
  EXPECT_NE(listing.entries[0].lease, 0);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  const auto killed = Clock::now();
  std::vector<EtcdStore::Change> changes;
  while (changes.empty() && secondsSince(killed) < 30) changes = store.watchPrefix("members/", listing.revision, 30s);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_TRUE(changes[0].deleted);
  EXPECT_EQ(changes[0].key, "members/child");
  EXPECT_FALSE(store.check({"members/child"}));
  EXPECT_LT(secondsSince(killed), 10) << "the lease (TTL 1 s) outlived its holder";
}

TEST(EtcdStoreLease, CreateWithLeaseClaimsOnceAndRevokeDeletesAtOnce) {
  EtcdCluster cluster;
  auto store = std::make_shared<EtcdStore>(cluster.storeOptions("/claims"));
  auto other = std::make_shared<EtcdStore>(cluster.storeOptions("/claims"));
  auto lease = store->grantLease(5s);
  EXPECT_TRUE(lease->alive());
  EXPECT_GE(lease->ttl(), 5s);
  EXPECT_EQ(store->createWithLease("slot/0", "mine", *lease), std::nullopt);
  auto theirs = other->grantLease(5s);
  EXPECT_EQ(other->createWithLease("slot/0", "theirs", *theirs), std::optional<Bytes>("mine"));
  EXPECT_EQ(other->createWithLease("slot/1", "theirs", *theirs), std::nullopt);
  EXPECT_EQ(other->get("slot/0"), "mine");
  lease->revoke();
  EXPECT_FALSE(lease->alive());
  EXPECT_EQ(lease->lostReason(), "revoked");
  EXPECT_FALSE(other->check({"slot/0"}));  // at once, not after the TTL
  theirs.reset();                          // releasing revokes too
  EXPECT_FALSE(store->check({"slot/1"}));
  expectThrowsWith<NetworkError>([&] { store->setWithLease("late", "x", *lease); }, {"lease", "expired"});
}

TEST(EtcdStoreMembership, ListAndWatchPrefixSeePutsAndDeletes) {
  EtcdCluster cluster;
  auto store = std::make_shared<EtcdStore>(cluster.storeOptions("/members"));
  store->set("m/a", "1");
  store->set("m/b", "2");
  store->set("other", "x");
  auto listing = store->list("m/");
  ASSERT_EQ(listing.entries.size(), 2u);
  EXPECT_EQ(listing.entries[0].key, "m/a");
  EXPECT_EQ(listing.entries[1].value, "2");
  EXPECT_TRUE(store->watchPrefix("m/", listing.revision, 100ms).empty());
  auto writer = store->clone();
  std::thread t([&] {
    std::this_thread::sleep_for(50ms);
    writer->deleteKey("m/a");
  });
  const auto changes = store->watchPrefix("m/", listing.revision, 20s);
  t.join();
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_TRUE(changes[0].deleted);
  EXPECT_EQ(changes[0].key, "m/a");
  EXPECT_GT(changes[0].revision, listing.revision);
  // Prefixes are separate stores.
  auto round = store->withPrefix("/members/r1");
  round->set("m/a", "in r1");
  EXPECT_EQ(store->list("m/").entries.size(), 1u);
  EXPECT_EQ(round->get("m/a"), "in r1");
}

// ---- TLS --------------------------------------------------------------------------------

TEST(EtcdStoreTls, TheRightCertificatesWork) {
  EtcdCluster cluster({.tls = true, .clientCertAuth = true});
  EtcdStore store(cluster.storeOptions("/tls"));
  EXPECT_THAT(store.describe(), HasSubstr("https://127.0.0.1:"));
  store.set("k", "over TLS");
  EXPECT_EQ(store.clone()->get("k"), "over TLS");
  auto lease = store.grantLease(2s);
  EXPECT_TRUE(lease->alive());
}

void expectOneClearTlsError(EtcdStoreOptions options, const std::vector<std::string>& needles) {
  options.connectTimeout = 20s;  // a refusal must not wait for it
  const auto start = Clock::now();
  const std::string message = expectThrowsWith<NetworkError>([&] { EtcdStore store(options); }, needles);
  std::printf("the error reads: %s\n", message.c_str());
  EXPECT_LT(secondsSince(start), 10) << "a TLS refusal took as long as a retry loop";
}

TEST(EtcdStoreTls, AServerCertificateFromAnotherCaIsOneClearError) {
  EtcdCluster cluster({.tls = true, .clientCertAuth = true});
  auto options = cluster.storeOptions("/tls");
  options.caFile = cluster.certificates().otherCa;
  expectOneClearTlsError(options, {"TLS handshake with https://127.0.0.1:", "CA file", cluster.certificates().otherCa});
}

TEST(EtcdStoreTls, AClientCertificateFromAnotherCaIsOneClearError) {
  EtcdCluster cluster({.tls = true, .clientCertAuth = true});
  auto options = cluster.storeOptions("/tls");
  options.certFile = cluster.certificates().otherClientCert;
  options.keyFile = cluster.certificates().otherClientKey;
  expectOneClearTlsError(options, {"https://127.0.0.1:", "client certificate"});
}

TEST(EtcdStoreTls, NoClientCertificateIsOneClearError) {
  EtcdCluster cluster({.tls = true, .clientCertAuth = true});
  auto options = cluster.storeOptions("/tls");
  options.certFile.clear();
  options.keyFile.clear();
  expectOneClearTlsError(options, {"https://127.0.0.1:", "client certificate"});
}

TEST(EtcdStoreTls, PlainHttpToATlsMemberIsOneClearError) {
  EtcdCluster cluster({.tls = true});
  auto options = cluster.storeOptions("/tls");
  options.caFile.clear();
  options.certFile.clear();
  options.keyFile.clear();
  std::string url = options.endpoints;
  options.endpoints = "http://" + url.substr(std::string("https://").size());
  expectOneClearTlsError(options, {"speaks HTTPS", "https://"});
}

// ---- authentication --------------------------------------------------------------------

TEST(EtcdStoreAuth, TheRightPasswordWorksAndIsSharedByClones) {
  EtcdCluster cluster({.auth = true});
  auto store = std::make_shared<EtcdStore>(cluster.storeOptions(str(EtcdCluster::kAuthPrefix, "/job")));
  store->set("k", "authenticated");
  EXPECT_EQ(store->add("n", 2), 2);
  auto clone = store->clone();
  EXPECT_EQ(clone->get("k"), "authenticated");
  EXPECT_EQ(clone->multiGet({"k", "n"}), (std::vector<Bytes>{"authenticated", "2"}));
  auto lease = store->grantLease(2s);
  EXPECT_EQ(store->createWithLease("member", "me", *lease), std::nullopt);
}

TEST(EtcdStoreAuth, AWrongPasswordIsOneClearError) {
  EtcdCluster cluster({.auth = true});
  auto options = cluster.storeOptions(str(EtcdCluster::kAuthPrefix, "/job"));
  options.password = "not-the-password";
  const auto start = Clock::now();
  expectThrowsWith<NetworkError>([&] { EtcdStore store(options); },
                                 {"http://127.0.0.1:", "authentication failed", "alice", "--rdzv-password"});
  EXPECT_LT(secondsSince(start), 10);
}

TEST(EtcdStoreAuth, NoCredentialsIsOneClearError) {
  EtcdCluster cluster({.auth = true});
  auto options = cluster.storeOptions(str(EtcdCluster::kAuthPrefix, "/job"));
  options.user.clear();
  options.password.clear();
  expectThrowsWith<NetworkError>([&] { EtcdStore store(options); },
                                 {"http://127.0.0.1:", "authentication enabled", "--rdzv-user"});
}

TEST(EtcdStoreAuth, APrefixWithoutPermissionIsOneClearError) {
  EtcdCluster cluster({.auth = true});
  auto options = cluster.storeOptions("/somebody-elses");
  expectThrowsWith<NetworkError>([&] { EtcdStore store(options); },
                                 {"permission denied", "alice", "grant-permission"});
}

TEST(EtcdStoreAuth, TlsAndAuthTogether) {
  EtcdCluster cluster({.tls = true, .clientCertAuth = true, .auth = true});
  EtcdStore store(cluster.storeOptions(str(EtcdCluster::kAuthPrefix, "/both")));
  store.queuePush("q", "item");
  EXPECT_EQ(store.queuePop("q", false), "item");
}

// ---- bad endpoints ---------------------------------------------------------------------

TEST(EtcdStoreEndpoints, AnUnreachableEndpointFailsWithinTheConnectTimeout) {
  TcpStoreOptions nothing;
  nothing.isServer = true;
  nothing.waitForWorkers = false;
  uint16_t deadPort = 0;
  {
    TcpStore probe("127.0.0.1", 0, nothing);
    deadPort = probe.port();
  }
  EtcdStoreOptions options;
  options.endpoints = str("127.0.0.1:", deadPort);
  options.connectTimeout = 1500ms;
  const auto start = Clock::now();
  expectThrowsWith<TimeoutError>([&] { EtcdStore store(options); },
                                 {str("http://127.0.0.1:", deadPort), "no etcd member answered", "Is etcd running",
                                  "DT_STORE_CONNECT_TIMEOUT"});
  EXPECT_LT(secondsSince(start), 10);
}

// A member that takes requests and never answers (as a follower whose leader
// just died holds them) gets its share of a short deadline, not all of it: a
// lease keep-alive, whose deadline is the rest of the lease's TTL, must reach
// a member that answers. The silent member is first in line.
TEST(EtcdStoreEndpoints, AMemberThatHoldsRequestsDoesNotUseUpAShortDeadline) {
  EtcdCluster cluster;
  // Listening without accepting: the kernel completes each connection and the request goes
  // unanswered.
  const int silent = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(silent, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(silent, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(silent, 16), 0);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::getsockname(silent, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string silentEndpoint = str("127.0.0.1:", ntohs(addr.sin_port));

  detail::EtcdConfig config;
  config.urls = detail::parseEtcdEndpoints(str(silentEndpoint, ",", cluster.endpoint(0)), false, "endpoints");
  detail::EtcdClient client(std::make_shared<detail::EtcdSession>(config));
  const detail::Json put = {{"key", detail::base64Encode("held")}, {"value", detail::base64Encode("answered")}};
  // 1.3 s: what a keep-alive of a 2 s lease has. Before the shares, the silent member held the
  // whole of it.
  EXPECT_NO_THROW(client.call("/v3/kv/put", put, detail::EtcdClock::now() + 1300ms, "put(\"held\")"));
  EXPECT_EQ(client.currentEndpoint(), cluster.endpoint(0));
  ::close(silent);
}

TEST(EtcdStoreEndpoints, SomethingThatIsNotEtcdIsOneClearError) {
  // A TcpStore speaks its own protocol: it drops the HTTP request.
  TcpStoreOptions server;
  server.isServer = true;
  server.waitForWorkers = false;
  TcpStore tcp("127.0.0.1", 0, server);
  EtcdStoreOptions options;
  options.endpoints = str("127.0.0.1:", tcp.port());
  options.connectTimeout = 1500ms;
  expectThrowsWith<TimeoutError>([&] { EtcdStore store(options); }, {str("127.0.0.1:", tcp.port()), "no etcd member answered"});
}

TEST(EtcdStoreEndpoints, AnEtcdPeerPortIsRefusedWithAHint) {
  EtcdCluster cluster;
  // The peer URL (raft's HTTP) answers 404 to the v3 gateway's paths.
  auto options = cluster.storeOptions("/peer");
  options.endpoints = str("127.0.0.1:", cluster.peerPort(0));
  expectThrowsWith<NetworkError>([&] { EtcdStore store(options); }, {"not an etcd v3 gateway", "2380"});
}

TEST(EtcdStoreEndpoints, BadSyntaxIsInvalidArgument) {
  EtcdStoreOptions options;
  options.endpoints = "127.0.0.1:notaport";
  expectThrowsWith<InvalidArgument>([&] { EtcdStore store(options); }, {"notaport", "host:port"});
  options.endpoints = " , ";
  expectThrowsWith<InvalidArgument>([&] { EtcdStore store(options); }, {"empty"});
}

}  // namespace
}  // namespace dt
