// ProcessGroupDtrain and DtrainStore from LibTorch C++, with forked ranks (dt::testing::spawn):
// the c10d calls torch makes, their Work and Future, the store wrapper, torch's "not supported"
// errors, and what a survivor's pending wait() says when a rank is killed.
#include <gtest/gtest.h>

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/torch.h>

#include <chrono>
#include <string>

#include "common/errors.h"
#include "common/strings.h"
#include "process_group/init.h"
#include "testing/point.h"
#include "testing/spawn.h"
#include "testing/spawn_gtest.h"
#include "torch_shim/process_group_dtrain.h"

using namespace std::chrono_literals;
using dt::testing::RankContext;
using dt::torch_shim::DtrainStore;
using dt::torch_shim::ProcessGroupDtrain;

namespace {

// What a rank checks itself, as one line that names the value (the parent asserts on it).
void require(bool ok, const std::string& what) {
  if (!ok) throw dt::InvalidArgument(what);
}

std::string errorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

c10::intrusive_ptr<ProcessGroupDtrain> makeGroup(RankContext& ctx) {
  // torch's own layout: the group's store is a PrefixStore over the job's store.
  auto job = c10::make_intrusive<DtrainStore>(ctx.store());
  auto store = c10::make_intrusive<c10d::PrefixStore>("default_pg", job);
  return ProcessGroupDtrain::create(store, ctx.rank, ctx.worldSize, {.groupId = "0", .globalRanks = {}, .timeout = 60s});
}

TEST(ProcessGroupDtrain, CollectivesWorkFutureAndErrorsAsTorchCallsThem) {
  auto result = dt::testing::spawn(3, [](RankContext& ctx) {
    auto pg = makeGroup(ctx);
    const int world = ctx.worldSize;
    require(pg->getRank() == ctx.rank && pg->getSize() == world && pg->getBackendName() == "dtrain",
            dt::str("rank/size/name ", pg->getRank(), "/", pg->getSize(), " ", pg->getBackendName()));

    // allreduce in place, waited for; then one through its future, as DDP's hooks do.
    std::vector<at::Tensor> t{torch::full({4, 5}, ctx.rank + 1.0)};
    pg->allreduce(t)->wait();
    require(torch::equal(t[0], torch::full({4, 5}, world * (world + 1) / 2.0)),
            dt::str("allreduce sum: ", t[0][0][0].item<float>()));
    std::vector<at::Tensor> u{torch::ones({8}, torch::kFloat64)};
    c10d::AllreduceOptions maxOpts;
    maxOpts.reduceOp = c10d::ReduceOp::MAX;
    auto future = pg->allreduce(u, maxOpts)->getFuture();
    auto doubled = future->then([](c10::ivalue::Future& f) { return c10::IValue(f.value().toTensorVector()[0] * 2); },
                                c10::TensorType::get());
    doubled->wait();
    require(future->value().toTensorVector()[0].data_ptr() == u[0].data_ptr(), "the future's value is the tensor itself");
    require(torch::equal(doubled->value().toTensor(), torch::full({8}, 2.0, torch::kFloat64)), "future.then value");

    // out of place: allgather into one tensor, a broadcast, a barrier with a timed wait.
    at::Tensor mine = torch::full({2}, ctx.rank, torch::kInt64);
    at::Tensor all = torch::zeros({2 * world}, torch::kInt64);
    pg->_allgather_base(all, mine)->wait();
    require(torch::equal(all, torch::arange(world, torch::kInt64).repeat_interleave(2)), "_allgather_base");
    std::vector<at::Tensor> b{ctx.rank == 1 ? torch::arange(6, torch::kUInt8) : torch::zeros({6}, torch::kUInt8)};
    c10d::BroadcastOptions fromOne;
    fromOne.rootRank = 1;
    pg->broadcast(b, fromOne)->wait();
    require(torch::equal(b[0], torch::arange(6, torch::kUInt8)), "broadcast of uint8 bytes from rank 1");
    auto barrier = pg->barrier();
    require(barrier->wait(60s), "barrier wait(timeout)");
    require(barrier->isCompleted() && barrier->isSuccess() && !barrier->exception(), "barrier completed");

    // torch's "not supported" wording for what dtrain lacks; dtrain's own check of bad input.
    std::vector<at::Tensor> ints{torch::ones({2}, torch::kInt64)};
    c10d::AllreduceOptions band;
    band.reduceOp = c10d::ReduceOp::BAND;
    const std::string bandError = errorOf([&] { pg->allreduce(ints, band); });
    require(bandError.find("ProcessGroup dtrain does not support allreduce with reduce op BAND") != std::string::npos,
            "BAND: " + bandError);
    std::vector<at::Tensor> any{torch::zeros({1})};
    const std::string anyError = errorOf([&] { pg->recvAnysource(any, 0); });
    require(anyError.find("does not support recvAnysource") != std::string::npos, "recvAnysource: " + anyError);
    std::vector<at::Tensor> two{torch::ones({1}), torch::ones({1})};
    const std::string twoError = errorOf([&] { pg->allreduce(two); });
    require(twoError.find("allreduce takes one tensor per rank, got 2") != std::string::npos, "two tensors: " + twoError);
    at::Tensor small = torch::zeros({3});
    const std::string shapeError = errorOf([&] { pg->_allgather_base(small, mine); });
    require(shapeError.find("allgather") != std::string::npos, "dtrain's shape check: " + shapeError);
    return std::string("ok");
  });
  ASSERT_TRUE(dt::testing::everyRankReturned(result));
  for (const auto& rank : result.ranks) EXPECT_EQ(rank.value, "ok");
}

TEST(ProcessGroupDtrain, DtrainStoreIsATorchStoreOverDtrainsStore) {
  auto result = dt::testing::spawn(2, [](RankContext& ctx) {
    auto store = c10::make_intrusive<DtrainStore>(ctx.store());
    const std::string me = std::to_string(ctx.rank);
    store->set("k/" + me, std::vector<uint8_t>{'v', static_cast<uint8_t>('0' + ctx.rank)});
    store->add("count", 5);
    store->wait({"k/0", "k/1"});
    const auto other = store->get(ctx.rank == 0 ? "k/1" : "k/0");
    require(other == std::vector<uint8_t>{'v', static_cast<uint8_t>(ctx.rank == 0 ? '1' : '0')}, "get the other's key");
    require(store->check({"k/0", "k/1"}) && !store->check({"k/none"}), "check");
    // add() counters are decimal ASCII on both sides: dtrain's store reads what torch's add wrote.
    store->wait({"count"});
    const auto swapped = store->compareSet("cas", {}, {'x'});
    require(swapped == std::vector<uint8_t>{'x'}, "compareSet creates a missing key");
    const std::string timeoutError = errorOf([&] { store->wait({"never"}, 200ms); });
    require(timeoutError.find("never") != std::string::npos, "a timed-out wait names the key: " + timeoutError);
    dt::storeBarrier(*ctx.store(), "done", ctx.rank, ctx.worldSize, 60s);
    require(ctx.store()->get("count") == "10", "count " + ctx.store()->get("count"));
    return std::string("ok");
  });
  ASSERT_TRUE(dt::testing::everyRankReturned(result));
}

TEST(ProcessGroupDtrain, WrapsAGroupTheCallerMade) {
  auto result = dt::testing::spawn(2, [](RankContext& ctx) {
    ProcessGroupDtrain pg(dt::initProcessGroup());
    std::vector<at::Tensor> t{torch::full({3}, 7, torch::kInt32)};
    c10d::AllreduceOptions min;
    min.reduceOp = c10d::ReduceOp::MIN;
    pg.allreduce(t, min)->wait();
    require(torch::equal(t[0], torch::full({3}, 7, torch::kInt32)), "allreduce min");
    require(pg.getSequenceNumberForGroup() == 1, dt::str("sequence ", pg.getSequenceNumberForGroup()));
    return std::string("ok");
  });
  ASSERT_TRUE(dt::testing::everyRankReturned(result));
}

TEST(ProcessGroupDtrain, AKilledRankFailsTheSurvivorsPendingWaitWithDtrainsMessage) {
  dt::testing::SpawnOptions options;
  options.plan = {dt::testing::killAt(2, "before-allreduce")};
  options.killAllOnFailure = false;  // the survivors' errors are the point
  options.deadline = 90s;
  auto result = dt::testing::spawn(3, [](RankContext& ctx) {
    auto pg = makeGroup(ctx);
    std::vector<at::Tensor> t{torch::ones({1 << 16})};
    pg->allreduce(t)->wait();  // everyone is in the group before rank 2 goes
    dt::testing::point("before-allreduce");
    auto work = pg->allreduce(t);
    const auto start = std::chrono::steady_clock::now();
    try {
      work->wait();
    } catch (const dt::Error& e) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
      std::printf("rank %d: wait() raised after %lld ms: %s\n", ctx.rank, static_cast<long long>(ms.count()), e.what());
      return std::string(e.kind()) + ": " + e.what();
    }
    return std::string("no error");
  }, options);
  EXPECT_EQ(result[2].ending, dt::testing::Ending::Killed) << result.summary();
  for (int rank : {0, 1}) {
    ASSERT_EQ(result[rank].ending, dt::testing::Ending::Returned) << result.summary();
    EXPECT_NE(result[rank].value.find("rank 2"), std::string::npos) << result[rank].value;
    EXPECT_NE(result[rank].value.find("allreduce #2"), std::string::npos) << result[rank].value;
  }
}

}  // namespace
