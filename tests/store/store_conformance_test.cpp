// The Store contract (store/store.h), written once and run against every
// implementation, with threads as ranks. Each implementation provides a
// StoreHarness: a fresh store, plus extra clients onto the same data (what a
// second rank would hold).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "common/config.h"
#include "common/errors.h"
#include "common/strings.h"
#include "store/file_store.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"
#include "tests/testing/testing.h"
#if DT_HAVE_ETCD
#include "store/etcd_store.h"
#include "tests/store/etcd_test_support.h"
#endif

namespace dt {
namespace {

using namespace std::chrono_literals;
using dt::testing::expectThrowsWith;
using dt::testing::runRanks;

struct StoreHarness {
  virtual ~StoreHarness() = default;
  virtual StorePtr main() = 0;
  // Another client onto the same data (another rank's handle).
  virtual StorePtr newClient() = 0;
  // A substring of describe() that timeouts must mention.
  virtual std::string where() = 0;
};

struct HashHarness : StoreHarness {
  StorePtr store = std::make_shared<HashStore>();
  StorePtr main() override { return store; }
  StorePtr newClient() override { return store->clone(); }
  std::string where() override { return "in-process"; }
};

struct PrefixHarness : StoreHarness {
  StorePtr base = std::make_shared<HashStore>();
  StorePtr store = std::make_shared<PrefixStore>("job7", base);
  StorePtr main() override { return store; }
  StorePtr newClient() override { return std::make_shared<PrefixStore>("job7", base->clone()); }
  std::string where() override { return "in-process"; }  // the wrapped store reports
};

struct FileHarness : StoreHarness {
  dt::testing::TempDir dir;
  std::string path = (dir.path() / "store").string();
  StorePtr store = std::make_shared<FileStore>(path);
  StorePtr main() override { return store; }
  StorePtr newClient() override { return std::make_shared<FileStore>(path); }
  std::string where() override { return path; }
};


struct TcpHarness : StoreHarness {
  std::shared_ptr<TcpStore> server;
  TcpHarness() {
    TcpStoreOptions options;
    options.isServer = true;
    options.waitForWorkers = false;
    options.token = "conformance-token";
    server = std::make_shared<TcpStore>("127.0.0.1", 0, options);
  }
  StorePtr main() override { return server; }
  StorePtr newClient() override {
    TcpStoreOptions options;
    options.token = "conformance-token";
    return std::make_shared<TcpStore>("127.0.0.1", server->port(), options);
  }
  std::string where() override { return "127.0.0.1:"; }
};

// A primary that replicates every write to a hot standby before it answers
// (tcp_store_server.h): the contract holds while replies wait for the standby.
struct ReplicatedTcpHarness : StoreHarness {
  std::shared_ptr<TcpStoreServer> standby;
  std::shared_ptr<TcpStore> server;
  std::string standbyAddress;
  ReplicatedTcpHarness() {
    TcpStoreServerOptions so;
    so.token = "conformance-token";
    so.standby = true;
    standby = TcpStoreServer::start(so);
    TcpStoreOptions options;
    options.isServer = true;
    options.waitForWorkers = false;
    options.token = "conformance-token";
    server = std::make_shared<TcpStore>("127.0.0.1", 0, options);
    standbyAddress = server->attachStandby(standby->port());
    server->setStandby(standbyAddress);
  }
  StorePtr main() override { return server; }
  StorePtr newClient() override {
    TcpStoreOptions options;
    options.token = "conformance-token";
    options.standby = standbyAddress;
    return std::make_shared<TcpStore>("127.0.0.1", server->port(), options);
  }
  std::string where() override { return "127.0.0.1:"; }
};

// The standby after its primary is gone: it promoted itself and serves the
// whole contract; clients are given both addresses and find it.
struct FailedOverTcpHarness : StoreHarness {
  std::shared_ptr<TcpStoreServer> standby;
  uint16_t primaryPort = 0;
  std::string standbyAddress;
  StorePtr store;
  FailedOverTcpHarness() {
    TcpStoreServerOptions so;
    so.token = "conformance-token";
    so.standby = true;
    standby = TcpStoreServer::start(so);
    so.standby = false;
    auto primary = TcpStoreServer::start(so);
    primaryPort = primary->port();
    {
      TcpStoreOptions options;
      options.token = "conformance-token";
      TcpStore attacher("127.0.0.1", primaryPort, options);
      standbyAddress = attacher.attachStandby(standby->port());
      attacher.set("written/before/the/fail-over", "kept");
    }
    primary.reset();  // closes the replication connection: the standby promotes itself
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (standby->role() != "primary" && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    if (standby->role() != "primary") throw std::runtime_error("the standby did not promote itself within 30 s");
    store = newClient();
    if (store->get("written/before/the/fail-over") != "kept") throw std::runtime_error("the standby lost a write");
    store->deleteKey("written/before/the/fail-over");
  }
  StorePtr main() override { return store; }
  StorePtr newClient() override {
    TcpStoreOptions options;
    options.token = "conformance-token";
    options.standby = standbyAddress;
    return std::make_shared<TcpStore>("127.0.0.1", primaryPort, options);
  }
  std::string where() override { return "127.0.0.1:"; }
};

#if DT_HAVE_ETCD
// One real etcd member per test process (started at the first EtcdStore
// test); each test gets a fresh key prefix on it.
struct EtcdHarness : StoreHarness {
  static dt::testing::EtcdCluster& cluster() {
    static dt::testing::EtcdCluster member;
    return member;
  }
  EtcdStoreOptions options;
  StorePtr store;
  EtcdHarness() {
    static int counter = 0;
    options = cluster().storeOptions(str("/conformance/", getpid(), "/", counter++));
    store = std::make_shared<EtcdStore>(options);
  }
  StorePtr main() override { return store; }
  StorePtr newClient() override { return std::make_shared<EtcdStore>(options); }
  std::string where() override { return "etcd http://127.0.0.1:"; }
};
#endif

struct Impl {
  std::string name;
  std::function<std::unique_ptr<StoreHarness>()> make;
};

void PrintTo(const Impl& impl, std::ostream* out) { *out << impl.name; }

class StoreConformance : public ::testing::TestWithParam<Impl> {
 protected:
  void SetUp() override { harness_ = GetParam().make(); }
  StorePtr store() { return harness_->main(); }
  std::unique_ptr<StoreHarness> harness_;
};

TEST_P(StoreConformance, SetThenGet) {
  store()->set("a", "hello");
  EXPECT_EQ(store()->get("a"), "hello");
  store()->set("a", "again");
  EXPECT_EQ(store()->get("a"), "again");
  auto other = harness_->newClient();
  EXPECT_EQ(other->get("a"), "again");
}

TEST_P(StoreConformance, BinaryAndEmptyValues) {
  const Bytes binary("\0\x01\xff\n\0end", 8);
  store()->set("bin", binary);
  store()->set("empty", "");
  EXPECT_EQ(store()->get("bin"), binary);
  EXPECT_EQ(store()->get("empty"), "");
  EXPECT_TRUE(store()->check({"empty"}));
  const Bytes big(1 << 20, 'x');
  store()->set("big", big);
  EXPECT_EQ(harness_->newClient()->get("big"), big);
}

TEST_P(StoreConformance, GetWaitsForALaterSet) {
  auto writer = harness_->newClient();
  std::thread t([&] {
    std::this_thread::sleep_for(100ms);
    writer->set("late", "here");
  });
  EXPECT_EQ(store()->get("late", 20s), "here");
  t.join();
}

TEST_P(StoreConformance, GetTimesOutNamingKeyAndStore) {
  store()->setTimeout(150ms);
  const auto start = std::chrono::steady_clock::now();
  expectThrowsWith<TimeoutError>([&] { store()->get("never"); },
                                 {"get", "never\"]", "timed out after 150 ms", harness_->where(),
                                  "Keys still missing: ", "never."});
  EXPECT_GE(std::chrono::steady_clock::now() - start, 140ms);
  // The per-call timeout overrides the store's.
  store()->setTimeout(30s);
  expectThrowsWith<TimeoutError>([&] { store()->get("never", 50ms); }, {"timed out after 50 ms"});
}

TEST_P(StoreConformance, ZeroAndHugeTimeoutsAreSafe) {
  expectThrowsWith<TimeoutError>([&] { store()->get("absent", Store::Duration(0)); }, {"absent"});
  expectThrowsWith<TimeoutError>([&] { store()->wait({"absent"}, Store::Duration(-5)); }, {"absent"});
  store()->set("present", "1");
  EXPECT_EQ(store()->get("present", Store::Duration::max()), "1");
  store()->wait({"present"}, Store::Duration::max());
  store()->setTimeout(Store::Duration::max());
  EXPECT_EQ(store()->get("present"), "1");
  EXPECT_EQ(store()->multiGet({"present"}), std::vector<Bytes>{"1"});
  store()->queuePush("q", "item");
  EXPECT_EQ(store()->queuePop("q", true), "item");
  // A huge timeout still wakes up when the key arrives.
  auto writer = harness_->newClient();
  std::thread t([&] {
    std::this_thread::sleep_for(50ms);
    writer->set("later", "2");
  });
  EXPECT_EQ(store()->get("later", std::chrono::hours(24 * 365 * 1000)), "2");
  t.join();
}

TEST_P(StoreConformance, TimedOutCallLeavesStoreUsable) {
  expectThrowsWith<TimeoutError>([&] { store()->get("x", 50ms); }, {"x"});
  expectThrowsWith<TimeoutError>([&] { store()->wait({"y"}, 50ms); }, {"y"});
  store()->set("x", "1");
  EXPECT_EQ(store()->get("x"), "1");
  // A key set after the timed-out wait does not produce a stale reply.
  store()->set("y", "2");
  EXPECT_EQ(store()->add("counter", 5), 5);
  EXPECT_EQ(store()->get("y"), "2");
}

TEST_P(StoreConformance, AddStartsFromZeroAndStoresDecimal) {
  EXPECT_EQ(store()->add("c", 3), 3);
  EXPECT_EQ(store()->add("c", -5), -2);
  EXPECT_EQ(store()->get("c"), "-2");
  EXPECT_EQ(harness_->newClient()->add("c", 0), -2);
  store()->set("n", "40");
  EXPECT_EQ(store()->add("n", 2), 42);
}

TEST_P(StoreConformance, AddOnNonCounterIsInvalidArgument) {
  store()->set("text", "abc");
  expectThrowsWith<InvalidArgument>([&] { store()->add("text", 1); }, {"text", "not a decimal integer"});
  EXPECT_EQ(store()->get("text"), "abc");
}

TEST_P(StoreConformance, CompareSetFollowsC10d) {
  // Missing key, empty expected: created.
  EXPECT_EQ(store()->compareSet("k", "", "first"), "first");
  EXPECT_EQ(store()->get("k"), "first");
  // Missing key, non-empty expected: nothing written, expected returned.
  EXPECT_EQ(store()->compareSet("absent", "old", "new"), "old");
  EXPECT_FALSE(store()->check({"absent"}));
  // Match: written.
  EXPECT_EQ(store()->compareSet("k", "first", "second"), "second");
  // Mismatch: current value returned, nothing written.
  EXPECT_EQ(store()->compareSet("k", "first", "third"), "second");
  EXPECT_EQ(store()->get("k"), "second");
}

TEST_P(StoreConformance, WaitReturnsWhenAllKeysExist) {
  auto writer = harness_->newClient();
  std::thread t([&] {
    writer->set("w1", "1");
    std::this_thread::sleep_for(50ms);
    writer->set("w2", "2");
  });
  store()->wait({"w1", "w2"}, 20s);
  EXPECT_TRUE(store()->check({"w1", "w2"}));
  t.join();
}

TEST_P(StoreConformance, WaitTimeoutNamesOnlyMissingKeys) {
  store()->set("present", "1");
  const std::string message = expectThrowsWith<TimeoutError>(
      [&] { store()->wait({"present", "absent1", "absent2"}, 100ms); },
      {"wait", "timed out after 100 ms", "Keys still missing: ", "absent1", "absent2"});
  const auto tail = message.substr(message.find("Keys still missing"));
  EXPECT_EQ(tail.find("present"), std::string::npos) << message;
}

TEST_P(StoreConformance, CheckNeverBlocks) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(store()->check({"nothing"}));
  store()->set("one", "1");
  EXPECT_TRUE(store()->check({"one"}));
  EXPECT_FALSE(store()->check({"one", "nothing"}));
  EXPECT_TRUE(store()->check({}));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST_P(StoreConformance, DeleteKeyAndNumKeys) {
  const int64_t before = store()->numKeys();
  store()->set("d1", "1");
  store()->set("d2", "2");
  EXPECT_EQ(store()->numKeys(), before + 2);
  EXPECT_TRUE(store()->deleteKey("d1"));
  EXPECT_FALSE(store()->deleteKey("d1"));
  EXPECT_FALSE(store()->check({"d1"}));
  EXPECT_EQ(store()->numKeys(), before + 1);
  EXPECT_EQ(store()->get("d2"), "2");
}

TEST_P(StoreConformance, AppendCreatesAndExtends) {
  store()->append("log", "a");
  store()->append("log", "bc");
  harness_->newClient()->append("log", "d");
  EXPECT_EQ(store()->get("log"), "abcd");
}

TEST_P(StoreConformance, MultiSetAndMultiGetKeepOrder) {
  store()->multiSet({"m3", "m1", "m2"}, {"three", "one", "two"});
  EXPECT_EQ(store()->multiGet({"m1", "m2", "m3", "m1"}), (std::vector<Bytes>{"one", "two", "three", "one"}));
  EXPECT_TRUE(store()->multiGet({}).empty());
  expectThrowsWith<InvalidArgument>([&] { store()->multiSet({"a", "b"}, {"1"}); }, {"multiSet"});
}

TEST_P(StoreConformance, MultiGetWaitsAndTimesOut) {
  auto writer = harness_->newClient();
  std::thread t([&] {
    std::this_thread::sleep_for(50ms);
    writer->set("mg2", "2");
  });
  store()->set("mg1", "1");
  EXPECT_EQ(store()->multiGet({"mg1", "mg2"}), (std::vector<Bytes>{"1", "2"}));
  t.join();
  store()->setTimeout(100ms);
  expectThrowsWith<TimeoutError>([&] { store()->multiGet({"mg1", "mg-never"}); }, {"mg-never", "100 ms"});
}

TEST_P(StoreConformance, MultiGetTakesAPerCallTimeout) {
  store()->set("pc1", "1");
  // The per-call timeout wins over the store's, and the store's is untouched.
  store()->setTimeout(30s);
  const std::string message = expectThrowsWith<TimeoutError>(
      [&] { store()->multiGet({"pc1", "pc-missing", "pc-absent"}, 80ms); },
      {"multiGet", "timed out after 80 ms", harness_->where(), "Keys still missing: ", "pc-missing", "pc-absent"});
  const auto tail = message.substr(message.find("Keys still missing"));
  EXPECT_EQ(tail.find("pc1"), std::string::npos) << message;
  EXPECT_EQ(store()->timeout(), 30s);
  // One deadline for all keys: each arriving in time is enough.
  auto writer = harness_->newClient();
  std::thread t([&] {
    std::this_thread::sleep_for(50ms);
    writer->set("pc-missing", "2");
    writer->set("pc-absent", "3");
  });
  EXPECT_EQ(store()->multiGet({"pc1", "pc-missing", "pc-absent"}, 20s), (std::vector<Bytes>{"1", "2", "3"}));
  t.join();
  EXPECT_EQ(store()->multiGet({"pc1"}, Store::Duration(0)), std::vector<Bytes>{"1"});
}

TEST_P(StoreConformance, QueuesAreFifo) {
  EXPECT_EQ(store()->queueLen("q"), 0);
  store()->queuePush("q", "1");
  store()->queuePush("q", "2");
  harness_->newClient()->queuePush("q", "3");
  EXPECT_EQ(store()->queueLen("q"), 3);
  EXPECT_EQ(store()->queuePop("q", false), "1");
  EXPECT_EQ(store()->queuePop("q", true), "2");
  EXPECT_EQ(store()->queuePop("q", false), "3");
  EXPECT_EQ(store()->queuePop("q", false), std::nullopt);
  EXPECT_EQ(store()->queueLen("q"), 0);
}

TEST_P(StoreConformance, BlockingQueuePopWaitsForPush) {
  auto producer = harness_->newClient();
  std::thread t([&] {
    std::this_thread::sleep_for(80ms);
    producer->queuePush("jobs", "job-1");
  });
  EXPECT_EQ(store()->queuePop("jobs", true, 20s), "job-1");
  t.join();
  expectThrowsWith<TimeoutError>([&] { store()->queuePop("jobs", true, 60ms); },
                                 {"queuePop", "jobs", "60 ms"});
  store()->queuePush("jobs", "job-2");
  EXPECT_EQ(store()->queuePop("jobs", true), "job-2");
}

TEST_P(StoreConformance, EveryQueueItemReachesExactlyOneConsumer) {
  constexpr int kConsumers = 4, kItems = 40;
  std::atomic<int> received{0};
  std::vector<std::vector<int>> got(kConsumers);
  runRanks(kConsumers + 1, [&](int rank) {
    auto client = harness_->newClient();
    if (rank == kConsumers) {
      for (int i = 0; i < kItems; ++i) client->queuePush("work", std::to_string(i));
      for (int i = 0; i < kConsumers; ++i) client->queuePush("work", "stop");
      return;
    }
    while (true) {
      auto item = client->queuePop("work", true, 30s);
      ASSERT_TRUE(item.has_value());
      if (*item == "stop") break;
      got[rank].push_back(std::stoi(*item));
      ++received;
    }
  }, 60s);
  EXPECT_EQ(received.load(), kItems);
  std::vector<int> all;
  for (auto& v : got) {
    EXPECT_TRUE(std::is_sorted(v.begin(), v.end()));  // FIFO per consumer
    all.insert(all.end(), v.begin(), v.end());
  }
  std::sort(all.begin(), all.end());
  for (int i = 0; i < kItems; ++i) EXPECT_EQ(all[i], i);
}

TEST_P(StoreConformance, ConcurrentAddsGiveExactCount) {
  constexpr int kRanks = 6, kAdds = 100;
  runRanks(kRanks, [&](int) {
    auto client = harness_->newClient();
    for (int i = 0; i < kAdds; ++i) client->add("hits", 1);
  }, 60s);
  EXPECT_EQ(store()->get("hits"), std::to_string(kRanks * kAdds));
}

TEST_P(StoreConformance, CloneIsIndependent) {
  auto a = store()->clone();
  auto b = store()->clone();
  // a blocks in get while b keeps working and then releases it.
  std::thread t([&] { EXPECT_EQ(a->get("release", 20s), "go"); });
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(b->add("side", 1), 1);
  b->set("release", "go");
  t.join();
  a->setTimeout(10ms);
  EXPECT_NE(b->timeout(), 10ms);
}

TEST_P(StoreConformance, ValuesSurviveClientsGoingAway) {
  {
    auto client = harness_->newClient();
    client->set("kept", "v");
    client->add("count", 7);
  }
  auto later = harness_->newClient();
  EXPECT_EQ(later->get("kept"), "v");
  EXPECT_EQ(later->add("count", 1), 8);
}

TEST_P(StoreConformance, BarrierReleasesAllRanksRepeatedly) {
  constexpr int kRanks = 4;
  std::atomic<int> passed{0};
  runRanks(kRanks, [&](int rank) {
    auto client = harness_->newClient();
    for (int round = 0; round < 3; ++round) {
      storeBarrier(*client, "bar", rank, kRanks, 30s);
      ++passed;
    }
  }, 60s);
  EXPECT_EQ(passed.load(), 3 * kRanks);
}

TEST_P(StoreConformance, BarrierTimeoutNamesMissingRanks) {
  constexpr int kRanks = 4;
  std::atomic<int> timeouts{0};
  runRanks(kRanks - 1, [&](int index) {
    const int rank = index < 2 ? index : 3;  // rank 2 never arrives
    auto client = harness_->newClient();
    expectThrowsWith<TimeoutError>([&] { storeBarrier(*client, "lonely", rank, kRanks, 300ms); },
                                   {"barrier", "lonely", "3/4 joined; missing: rank 2", "300 ms"});
    ++timeouts;
  }, 60s);
  EXPECT_EQ(timeouts.load(), kRanks - 1);
}

TEST_P(StoreConformance, PrefixesIsolateKeys) {
  PrefixStore a("a", store());
  PrefixStore b("b", harness_->newClient());
  a.set("k", "in a");
  b.set("k", "in b");
  EXPECT_EQ(a.get("k"), "in a");
  EXPECT_EQ(b.get("k"), "in b");
  EXPECT_EQ(store()->get("a/k"), "in a");
  EXPECT_EQ(a.add("n", 2), 2);
  EXPECT_FALSE(b.check({"n"}));
  PrefixStore nested("inner", std::make_shared<PrefixStore>("outer", store()));
  nested.set("x", "1");
  EXPECT_EQ(store()->get("outer/inner/x"), "1");
  expectThrowsWith<TimeoutError>([&] { a.wait({"nope"}, 50ms); }, {"a/nope"});
}

std::string implName(const ::testing::TestParamInfo<Impl>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(Stores, StoreConformance,
                         ::testing::Values(Impl{"HashStore", [] { return std::make_unique<HashHarness>(); }},
                                           Impl{"PrefixStore", [] { return std::make_unique<PrefixHarness>(); }},
                                           Impl{"FileStore", [] { return std::make_unique<FileHarness>(); }},
                                           Impl{"TcpStore", [] { return std::make_unique<TcpHarness>(); }},
                                           Impl{"ReplicatedTcpStore", [] { return std::make_unique<ReplicatedTcpHarness>(); }},
                                           Impl{"FailedOverTcpStore", [] { return std::make_unique<FailedOverTcpHarness>(); }}),
                         implName);
#if DT_HAVE_ETCD
INSTANTIATE_TEST_SUITE_P(Etcd, StoreConformance,
                         ::testing::Values(Impl{"EtcdStore", [] { return std::make_unique<EtcdHarness>(); }}), implName);
#endif

}  // namespace
}  // namespace dt
