#include "process_group/process_group.h"

#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <thread>

#include "common/config.h"
#include "common/errors.h"
#include "common/hostlist.h"
#include "common/strings.h"
#include "process_group/init.h"
#include "store/hash_store.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using testing::expectThrowsWith;
using testing::runRanks;
using testing::ScopedEnv;

#if DT_HAVE_GLOO

ProcessGroupOptions fastOptions() {
  ProcessGroupOptions o;
  o.timeout = 30s;
  o.progressInterval = 100ms;
  return o;
}

TEST(ProcessGroup, NumbersCollectivesAndRoutesByDevice) {
  auto store = std::make_shared<HashStore>();
  runRanks(2, [&](int rank) {
    auto pg = ProcessGroup::create(store, rank, 2, fastOptions());
    EXPECT_EQ(pg->rank(), rank);
    EXPECT_EQ(pg->size(), 2);
    EXPECT_EQ(pg->name(), "default");
    Tensor t = full({8}, rank + 1);
    pg->allreduce(t)->wait();
    pg->barrier()->wait();
    EXPECT_EQ(pg->lastSeq(), 2u);
    EXPECT_EQ(t.toVector<float>(), std::vector<float>(8, 3));
    // Bad input consumes no number and says which number it would have had.
    expectThrowsWith<InvalidArgument>([&] { pg->allgather({t}, t); }, {"allgather #3 (not issued)"});
    EXPECT_EQ(pg->lastSeq(), 2u);
    // CUDA tensors go to the nccl backend; without NCCL or a GPU the router
    // says why. (With both, two threads cannot share one GPU in NCCL 2.28:
    // nccl_backend_test covers that routing.)
    if (!DT_HAVE_NCCL || !deviceAvailable(Device::cuda(0))) {
      expectThrowsWith<NotSupportedError>([&] { pg->backendFor(Device::cuda(0)); }, {"cuda:0", "nccl"});
    }
    // Threads of one process share a host: shared memory.
    EXPECT_EQ(pg->backendFor(Device::cpu()).name(), "shm");
    // Point to point is not numbered.
    if (rank == 0) pg->send({t}, 1)->wait();
    else pg->recv({t}, 0)->wait();
    EXPECT_EQ(pg->lastSeq(), 2u);
    pg->destroy();
    expectThrowsWith<InvalidArgument>([&] { pg->barrier(); }, {"destroyed"});
  });
}

TEST(ProcessGroup, HostsDecideTheCpuBackendAndOptionsForceOne) {
  auto store = std::make_shared<HashStore>();
  runRanks(4, [&](int rank) {
    {
      auto pg = ProcessGroup::create(store, rank, 4, fastOptions());
      EXPECT_EQ(pg->backendFor(Device::cpu()).name(), "shm");
    }
    ProcessGroupOptions gloo = fastOptions();
    gloo.name = "forced-gloo";
    gloo.backend = "gloo";
    auto forced = ProcessGroup::create(store, rank, 4, gloo);
    EXPECT_EQ(forced->backendFor(Device::cpu()).name(), "gloo");
    // Subgroups inherit the parent's choice.
    auto sub = forced->newGroup({0, 1});
    if (sub->isMember()) {
      EXPECT_EQ(sub->backendFor(Device::cpu()).name(), "gloo");
    }
  });
  // Ranks that announce different hosts: two ranks on each of two hosts
  // get shm within a host and gloo across; one rank per host gets gloo.
  for (const auto& testCase : {std::pair<std::vector<std::string>, std::string>{{"a", "a", "b", "b"}, "shm+gloo"},
                               {{"a", "b", "c", "d"}, "gloo"}}) {
    const std::vector<std::string>& hosts = testCase.first;  // not a structured binding: clang < 16
    const std::string& expected = testCase.second;           // cannot capture those in a lambda
    auto hostStore = std::make_shared<HashStore>();
    runRanks(4, [&](int rank) {
      ProcessGroupOptions o = fastOptions();
      o.hostId = hosts[rank];  // threads of one process pretend to be on other hosts
      auto pg = ProcessGroup::create(hostStore, rank, 4, o);
      EXPECT_EQ(pg->backendFor(Device::cpu()).name(), expected) << "rank " << rank;
      Tensor t = full({1000}, rank + 1);
      pg->allreduce(t, {.reduceOp = ReduceOp::Avg})->wait();
      EXPECT_EQ(t.toVector<float>(), std::vector<float>(1000, 2.5f));
      Tensor b = full({3}, rank);
      pg->broadcast(b, {.root = 2})->wait();
      EXPECT_EQ(b.toVector<float>(), std::vector<float>(3, 2.0f));
    });
  }
  // shm across hosts is refused, naming them.
  auto refuseStore = std::make_shared<HashStore>();
  runRanks(2, [&](int rank) {
    ProcessGroupOptions o = fastOptions();
    o.hostId = rank == 0 ? "alpha" : "beta";
    o.backend = "shm";
    expectThrowsWith<InvalidArgument>([&] { ProcessGroup::create(refuseStore, rank, 2, o); },
                                      {"backend shm needs every rank on one host", "ranks 1", "\"alpha\"", "\"beta\""});
  });
}

// Ops are asynchronous even when small: an op nobody waits for starts on its
// own, and ranks may wait in different orders on different groups.
TEST(ProcessGroup, OpsRunWithoutAWaiterAndGroupsDoNotBlockEachOther) {
  for (const std::string backend : {"shm", "gloo"}) {
    auto store = std::make_shared<HashStore>();
    runRanks(2, [&](int rank) {
      ProcessGroupOptions a = fastOptions(), b = fastOptions();
      a.name = "a";
      b.name = "b";
      a.backend = b.backend = backend;
      auto groupA = ProcessGroup::create(store, rank, 2, a);
      auto groupB = ProcessGroup::create(store, rank, 2, b);
      Tensor x = full({16}, rank + 1), y = full({16}, 10 * (rank + 1));
      WorkPtr wa = groupA->allreduce(x);
      WorkPtr wb = groupB->allreduce(y);
      // Rank 0 waits for B first, rank 1 for A: neither may block the other.
      if (rank == 0) {
        wb->wait();
        wa->wait();
      } else {
        wa->wait();
        wb->wait();
      }
      EXPECT_EQ(x.toVector<float>(), std::vector<float>(16, 3.0f));
      EXPECT_EQ(y.toVector<float>(), std::vector<float>(16, 30.0f));
      // Nobody waits for this one: it completes anyway.
      Tensor z = full({4}, 1);
      WorkPtr wz = groupA->allreduce(z);
      const auto until = std::chrono::steady_clock::now() + 10s;
      while (!wz->isCompleted() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
      EXPECT_TRUE(wz->isCompleted()) << backend;
      EXPECT_EQ(z.toVector<float>(), std::vector<float>(4, 2.0f));
    });
  }
}

bool eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 3000 && !done(); ++i) std::this_thread::sleep_for(10ms);
  return done();
}

// A callback registered with then() may take its time: the group's next
// collective does not wait for it (it would never complete if the callback
// ran on the worker, since the callback waits for it).
TEST(ProcessGroup, SlowCallbacksDoNotHoldBackLaterCollectives) {
  for (const std::string backend : {"shm", "gloo"}) {
    auto store = std::make_shared<HashStore>();
    runRanks(2, [&](int rank) {
      ProcessGroupOptions o = fastOptions();
      o.backend = backend;
      auto pg = ProcessGroup::create(store, rank, 2, o);
      Tensor x = full({16}, 1), y = full({16}, 2);
      WorkPtr second;
      std::atomic<bool> sawSecondComplete{false}, callbackDone{false};
      std::mutex secondMutex;
      if (rank == 1) store->wait({"callback registered"});
      WorkPtr first = pg->allreduce(x);
      if (rank == 0) {
        // Registered before rank 1 joins the op, so the callback cannot run
        // here on the caller's thread (that would hold back the second op).
        first->then([&](Work&) {
          sawSecondComplete = eventually([&] {
            std::lock_guard<std::mutex> lock(secondMutex);
            return second && second->isCompleted();
          });
          callbackDone = true;
        });
        store->set("callback registered", "1");
      }
      {
        std::lock_guard<std::mutex> lock(secondMutex);
        second = pg->allreduce(y);
      }
      second->wait();
      EXPECT_EQ(y.toVector<float>(), std::vector<float>(16, 4.0f)) << backend;
      if (rank == 0) {
        EXPECT_TRUE(eventually([&] { return callbackDone.load(); })) << backend;
        EXPECT_TRUE(sawSecondComplete.load()) << backend;
      }
    });
  }
}

TEST(ProcessGroup, WorksCarryResultsAndFutures) {
  auto store = std::make_shared<HashStore>();
  runRanks(2, [&](int rank) {
    auto pg = ProcessGroup::create(store, rank, 2, fastOptions());
    Tensor x = full({4}, rank + 1);
    auto reduced = pg->allreduce(x)->future().get();
    ASSERT_EQ(reduced.size(), 1u);
    EXPECT_TRUE(reduced[0].isSameAs(x));
    EXPECT_EQ(reduced[0].toVector<float>(), std::vector<float>(4, 3.0f));
    std::vector<Tensor> outs = {zeros({4}), zeros({4})};
    WorkPtr gathered = pg->allgather(outs, x);
    gathered->wait();
    ASSERT_EQ(gathered->result().size(), 2u);
    EXPECT_TRUE(gathered->result()[1].isSameAs(outs[1]));
    EXPECT_TRUE(pg->barrier()->result().empty());
    Tensor received = zeros({2});
    WorkPtr batch = pg->batchIsendIrecv({P2POp::send({full({2}, 10 + rank)}, 1 - rank), P2POp::recv({received}, 1 - rank)});
    auto got = batch->future().get();
    ASSERT_EQ(got.size(), 1u);
    EXPECT_TRUE(got[0].isSameAs(received));
    EXPECT_EQ(received.toVector<float>(), std::vector<float>(2, 11.0f - rank));
  });
}

TEST(ProcessGroup, AnExpiredWaitLeavesTheGroupHealthyATimedOutOpBreaksIt) {
  auto store = std::make_shared<HashStore>();
  runRanks(2, [&](int rank) {
    auto pg = ProcessGroup::create(store, rank, 2, fastOptions());
    Tensor t = full({8}, 1);
    if (rank == 1) std::this_thread::sleep_for(500ms);
    WorkPtr late = pg->allreduce(t);  // #1: rank 0 waits for rank 1
    if (rank == 0) {
      expectThrowsWith<TimeoutError>([&] { late->wait(50ms); }, {"allreduce #1", "only this wait timed out", "not broken"});
      EXPECT_FALSE(pg->isBroken());
      EXPECT_EQ(pg->brokenCause(), nullptr);
    }
    late->wait();
    EXPECT_FALSE(pg->isBroken());
    if (rank == 1) {
      std::this_thread::sleep_for(3s);  // never issues #2
      return;
    }
    WorkPtr stuck = pg->allreduce(t, {.timeout = 1s});
    expectThrowsWith<TimeoutError>([&] { stuck->wait(); }, {"allreduce #2", "timed out", "the group is broken now"});
    EXPECT_TRUE(pg->isBroken());
    expectThrowsWith<TimeoutError>([&] { pg->barrier()->wait(); }, {"#3", "broken"});
  });
}

TEST(ProcessGroup, BadInputReadsAsTheCallersProblem) {
  auto store = std::make_shared<HashStore>();
  runRanks(2, [&](int rank) {
    auto pg = ProcessGroup::create(store, rank, 2, fastOptions());
    Tensor t = zeros({3});
    const std::string message = expectThrowsWith<InvalidArgument>(
        [&] { pg->reduce(t, {.root = 2}); },
        {str("[rank ", rank, "/2 pg=default shm] reduce #1 (not issued): root 2 is not a rank of the group (size 2)")});
    EXPECT_EQ(message.find("check failed"), std::string::npos) << message;
    EXPECT_EQ(message.find(".cpp:"), std::string::npos) << message;
    expectThrowsWith<InvalidArgument>([&] { pg->newGroup({0, 5}); }, {"newGroup: ranks 0, 5 must lie in [0, 2)"});
    EXPECT_EQ(pg->lastSeq(), 0u);
  });
}

TEST(ProcessGroup, NewGroupMembersAndNonMembers) {
  auto store = std::make_shared<HashStore>();
  runRanks(4, [&](int rank) {
    auto world = ProcessGroup::create(store, rank, 4, fastOptions());
    auto odd = world->newGroup({3, 1});
    auto even = world->newGroup({0, 2});
    const bool isOdd = rank % 2 == 1;
    EXPECT_EQ(odd->isMember(), isOdd);
    EXPECT_EQ(even->isMember(), !isOdd);
    auto& mine = isOdd ? odd : even;
    auto& other = isOdd ? even : odd;
    EXPECT_EQ(mine->rank(), rank / 2);
    EXPECT_EQ(mine->size(), 2);
    // Both subgroups and the world group run at the same time.
    Tensor s = full({5}, rank);
    auto w1 = mine->allreduce(s);
    Tensor w = full({5}, 1);
    auto w2 = world->allreduce(w);
    w1->wait();
    w2->wait();
    EXPECT_EQ(s.toVector<float>(), std::vector<float>(5, isOdd ? 4 : 2));
    EXPECT_EQ(w.toVector<float>(), std::vector<float>(5, 4));
    expectThrowsWith<InvalidArgument>([&] { other->allreduce(s); }, {"not a member", other->name()});
    // Keys of a subgroup live under its own scope.
    EXPECT_TRUE(store->check({"pg/default/0/sub1/gloo/0"}) || store->check({"pg/default/0/sub1/dt_progress/0"}));
    world->barrier()->wait();
  });
}

TEST(ProcessGroup, DestroyAndRecreateInTheSameProcess) {
  auto store = std::make_shared<HashStore>();
  runRanks(3, [&](int rank) {
    for (int round = 0; round < 3; ++round) {
      auto pg = ProcessGroup::create(store, rank, 3, fastOptions());
      Tensor t = full({4}, round);
      pg->allreduce(t)->wait();
      EXPECT_EQ(t.toVector<float>(), std::vector<float>(4, 3.0f * round));
      EXPECT_EQ(pg->lastSeq(), 1u);  // numbering restarts with the group
      pg->destroy();
    }
  });
}

TEST(ProcessGroup, WatchdogKeyFollowsTheLastCompletedCollective) {
  auto store = std::make_shared<HashStore>();
  auto launcherStore = std::make_shared<HashStore>();
  runRanks(2, [&](int rank) {
    auto o = fastOptions();
    o.watchdogStore = launcherStore;
    o.watchdogKey = "dt/progress/" + std::to_string(rank);
    auto pg = ProcessGroup::create(store, rank, 2, o);
    Tensor t = ones({3});
    for (int i = 0; i < 5; ++i) pg->allreduce(t)->wait();
    pg->barrier()->wait();
    // Throttled to one write per interval (100 ms here), but the latest
    // value always arrives.
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    std::string value;
    while (std::chrono::steady_clock::now() < deadline) {
      if (launcherStore->check({o.watchdogKey})) value = launcherStore->get(o.watchdogKey);
      if (value == "6 barrier") break;
      std::this_thread::sleep_for(20ms);
    }
    EXPECT_EQ(value, "6 barrier");
    pg->destroy();
  });
}

#endif  // DT_HAVE_GLOO

TEST(InitProcessGroup, ReadsTorchrunStyleEnvironment) {
  ScopedEnv r("RANK", "2"), w("WORLD_SIZE", "4"), a("MASTER_ADDR", "10.0.0.5"), p("MASTER_PORT", "29511");
  ScopedEnv s("DT_STORE_ADDR", "");
  const auto init = resolveInit({});
  EXPECT_EQ(init.rank, 2);
  EXPECT_EQ(init.worldSize, 4);
  EXPECT_EQ(init.storeHost, "10.0.0.5");
  EXPECT_EQ(init.storePort, 29511);
  EXPECT_FALSE(init.hostStore);
  EXPECT_FALSE(init.launcherStore);
}

TEST(InitProcessGroup, LauncherStoreMakesEveryRankAClient) {
  ScopedEnv r("RANK", "0"), w("WORLD_SIZE", "2"), a("MASTER_ADDR", "127.0.0.1"), p("MASTER_PORT", "29511");
  ScopedEnv s("DT_STORE_ADDR", "node7:40001"), t("DT_STORE_TOKEN", "secret");
  const auto init = resolveInit({});
  EXPECT_TRUE(init.launcherStore);
  EXPECT_FALSE(init.hostStore);
  EXPECT_EQ(init.storeHost, "node7");
  EXPECT_EQ(init.storePort, 40001);
  EXPECT_EQ(init.token, "secret");
  ScopedEnv bad("DT_STORE_ADDR", "node7");
  expectThrowsWith<InvalidArgument>([] { resolveInit({}); }, {"DT_STORE_ADDR", "host:port"});
}

TEST(InitProcessGroup, SlurmWithoutLauncher) {
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("MASTER_ADDR");
  ::unsetenv("MASTER_PORT");
  ScopedEnv s("DT_STORE_ADDR", "");
  ScopedEnv a("SLURM_PROCID", "5"), b("SLURM_NTASKS", "8"), c("SLURM_LOCALID", "1"),
      d("SLURM_JOB_NODELIST", "gpu-a[07-09,12],gpu-b3"), e("SLURM_JOB_ID", "123456");
  const auto init = resolveInit({});
  EXPECT_EQ(init.source, "slurm");
  EXPECT_EQ(init.rank, 5);
  EXPECT_EQ(init.worldSize, 8);
  EXPECT_EQ(init.localRank, 1);
  EXPECT_EQ(init.storeHost, "gpu-a07");
  EXPECT_EQ(init.storePort, slurmDerivedPort("123456"));
  EXPECT_EQ(init.storePort, 23456);
  EXPECT_FALSE(init.hostStore);
  {
    ScopedEnv r0("SLURM_PROCID", "0");
    EXPECT_TRUE(resolveInit({}).hostStore);
  }
  ::unsetenv("SLURM_JOB_ID");
  expectThrowsWith<InvalidArgument>([] { resolveInit({}); }, {"SLURM_JOB_ID", "MASTER_PORT"});
}

TEST(InitProcessGroup, MissingVariablesAreNamedWithWhatSetsThem) {
  ::unsetenv("RANK");
  ::unsetenv("SLURM_PROCID");
  ScopedEnv s("DT_STORE_ADDR", "");
  expectThrowsWith<InvalidArgument>([] { resolveInit({}); }, {"RANK is not set", "dtrun", "torchrun"});
  ScopedEnv r("RANK", "1");
  ::unsetenv("WORLD_SIZE");
  expectThrowsWith<InvalidArgument>([] { resolveInit({}); }, {"WORLD_SIZE is not set"});
  ScopedEnv w("WORLD_SIZE", "2");
  ::unsetenv("MASTER_ADDR");
  expectThrowsWith<InvalidArgument>([] { resolveInit({}); }, {"MASTER_ADDR is not set"});
  ScopedEnv a("MASTER_ADDR", "localhost");
  ::unsetenv("MASTER_PORT");
  expectThrowsWith<InvalidArgument>([] { resolveInit({}); }, {"MASTER_PORT is not set"});
  ScopedEnv p("MASTER_PORT", "99999");
  expectThrowsWith<InvalidArgument>([] { resolveInit({}); }, {"MASTER_PORT", "99999"});
  ScopedEnv rr("RANK", "2");
  ScopedEnv p2("MASTER_PORT", "1234");
  expectThrowsWith<InvalidArgument>([] { resolveInit({}); }, {"rank 2", "outside"});
}

}  // namespace
}  // namespace dt
