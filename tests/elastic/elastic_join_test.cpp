// ElasticGroup growing back, with forked ranks: ranks 0 and 1 start the job
// (members 0 and 1 of epoch 0), rank 2 plays a replacement that dtrun started
// later (member id 2 from membership::newMemberId, registered as a joiner).
// The members see it waiting (joinersWaiting()), agree on it in a step's
// commit vote, admit it at that step boundary (admit()), and send it their
// state; it then trains with them from that step. The state after all steps
// is known exactly, so a lost, repeated or half-applied step shows, and so
// does a joiner that started from the wrong state.
//
// The step is elastic_group_test's: each rank sums its share of the step's
// 12 examples (positions r, r+W, ...: the same examples at any world size),
// the "gradient" allreduce adds the shares, the commit allreduce ends the
// step and carries the joiners-waiting vote.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "common/errors.h"
#include "common/strings.h"
#include "elastic/elastic_group.h"
#include "store/membership.h"
#include "tensor/tensor.h"
#include "testing/point.h"
#include "testing/spawn.h"
#include "tests/elastic/supervise.h"
#include "tests/elastic/toy_step.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using testing::RankContext;

constexpr int kInitialWorld = 2;
constexpr int64_t kSteps = 100;

elastic::ElasticOptions optionsForTest() {
  elastic::ElasticOptions options;
  options.group.timeout = 60s;
  options.heartbeatInterval = 50ms;
  options.joinTimeout = 60s;
  return options;
}

// After a new epoch: rank 0 (an old member) sends {state, steps applied} to the joiners.
void transfer(elastic::ElasticGroup& elastic, double& state, int64_t& applied) {
  if (elastic.membership().joined.empty()) return;
  testing::point("before-transfer");
  Tensor t = fromVector<double>({state, static_cast<double>(applied)});
  elastic.group()->broadcast(t, {.root = 0})->wait();
  if (!elastic.joinedNow()) return;
  state = t.data<double>()[0];
  applied = static_cast<int64_t>(t.data<double>()[1]);
}

// The training loop of a member or an admitted joiner; returns
// "state=<x> epoch=<e> size=<n> joined=<step or -1>". `stepPause` slows the steps so that
// the joiner arrives mid-run.
std::string trainLoop(elastic::ElasticGroup& elastic, double state, int64_t applied, int64_t joinedAt,
                      std::chrono::milliseconds stepPause) {
  Tensor grad = zeros({1}, DType::Float64);
  while (applied < kSteps) {
    const auto& m = elastic.membership();
    try {
      std::this_thread::sleep_for(stepPause);
      grad.data<double>()[0] = testing::toyShare(applied, m.rank, m.size());
      elastic.group()->allreduce(grad)->wait();
      Tensor commit = fromVector<double>({1.0, elastic.joinersWaiting() ? 1.0 : 0.0});
      elastic.group()->allreduce(commit)->wait();
      state += grad.data<double>()[0];
      ++applied;
      if (commit.data<double>()[1] > 0 && applied < kSteps) {
        elastic.admit(applied);
        transfer(elastic, state, applied);
      }
    } catch (const Error&) {
      const auto& next = elastic.recover(std::current_exception(), applied);
      if (next.resumeStep > applied) {
        state += grad.data<double>()[0];
        ++applied;
      }
      transfer(elastic, state, applied);  // a transfer that failed is made again
    }
  }
  const auto& m = elastic.membership();
  return str("state=", state, " epoch=", m.epoch, " size=", m.size(), " joined=", joinedAt);
}

// Rank 2 joins `joinDelay` after the start; the members finish by marking the job finished,
// as dtrun does when a worker exits 0.
std::string rankBody(RankContext& ctx, std::chrono::milliseconds joinDelay, std::chrono::milliseconds stepPause) {
  auto store = ctx.store();
  if (ctx.rank < kInitialWorld) {
    elastic::ElasticGroup elastic(store, ctx.rank, kInitialWorld, optionsForTest());
    std::string result = trainLoop(elastic, 0, 0, -1, stepPause);
    membership::markFinished(*store);
    return result;
  }
  std::this_thread::sleep_for(joinDelay);
  const int member = membership::newMemberId(*store, kInitialWorld);
  try {
    auto elastic = elastic::ElasticGroup::join(store, member, optionsForTest());
    if (!elastic->joinedNow()) return "admitted without the joined mark";
    double state = -1;
    int64_t applied = -1;
    transfer(*elastic, state, applied);
    return trainLoop(*elastic, state, applied, applied, stepPause);
  } catch (const JobFinishedError& e) {
    return str("finished: ", e.what());
  }
}

testing::SpawnResult runJob(std::chrono::milliseconds joinDelay, std::chrono::milliseconds stepPause,
                            std::vector<testing::PlanStep> plan = {}) {
  testing::SpawnOptions options;
  options.plan = std::move(plan);
  options.killAllOnFailure = false;
  options.deadline = 90s;
  testing::SpawnedRanks ranks(
      kInitialWorld + 1, [=](RankContext& ctx) { return rankBody(ctx, joinDelay, stepPause); }, options);
  testing::superviseUntilDone(ranks);
  return ranks.wait();
}

int64_t joinedStep(const std::string& value) {
  const auto at = value.find("joined=");
  return at == std::string::npos ? -2 : std::stoll(value.substr(at + 7));
}

TEST(ElasticJoin, AJoinerIsAdmittedAtAStepBoundaryAndTrainsFromThereWithTheSameExamples) {
  const auto result = runJob(300ms, 10ms);
  const std::string expected = str("state=", testing::toyState(kSteps), " epoch=1 size=3");
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(result[r].returned()) << result.summary();
    EXPECT_EQ(result[r].value.rfind(expected, 0), 0u) << "rank " << r << ": " << result[r].value;
  }
  const int64_t at = joinedStep(result[2].value);
  EXPECT_GT(at, 0) << result[2].value;
  EXPECT_LT(at, kSteps) << result[2].value;
}

TEST(ElasticJoin, JoinersOfAReplicaAreAdmittedTogetherInOneDecision) {
  // Replicas of two (tensor parallelism): a joiner alone is no replica; the members go on
  // without it (joinersWaiting() stays false) until a second one registers, and admit both in
  // one decision: every rank ends in epoch 1 (an admission of one alone would make two). The
  // second comes later, so the first usually waits; the check holds for any interleaving.
  testing::SpawnOptions options;
  options.killAllOnFailure = false;
  options.deadline = 90s;
  testing::SpawnedRanks ranks(4, [](RankContext& ctx) -> std::string {
    auto store = ctx.store();
    elastic::ElasticOptions o = optionsForTest();
    o.replicaSize = 2;
    if (ctx.rank < kInitialWorld) {
      elastic::ElasticGroup elastic(store, ctx.rank, kInitialWorld, o);
      std::string result = trainLoop(elastic, 0, 0, -1, 30ms);
      membership::markFinished(*store);
      return result;
    }
    std::this_thread::sleep_for(ctx.rank == 2 ? 100ms : 700ms);
    const int member = membership::newMemberId(*store, kInitialWorld);
    auto elastic = elastic::ElasticGroup::join(store, member, o);
    double state = -1;
    int64_t applied = -1;
    transfer(*elastic, state, applied);
    return trainLoop(*elastic, state, applied, applied, 30ms);
  }, options);
  testing::superviseUntilDone(ranks);
  const auto result = ranks.wait();
  const std::string expected = str("state=", testing::toyState(kSteps), " epoch=1 size=4");
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(result[r].returned()) << result.summary();
    EXPECT_EQ(result[r].value.rfind(expected, 0), 0u) << "rank " << r << ": " << result[r].value;
  }
  EXPECT_GT(joinedStep(result[2].value), 0) << result[2].value;
  EXPECT_EQ(joinedStep(result[2].value), joinedStep(result[3].value)) << result[2].value << " / " << result[3].value;
}

TEST(ElasticJoin, AJoinerThatDiesBeforeItsAdmissionIsNotAdmitted) {
  // It registers and dies; the members still decide on it and go on at two: in one epoch
  // when its death was posted before the decision, in two when the decision admitted it and
  // making the group then found it dead.
  const auto result = runJob(200ms, 10ms, {testing::killAt(2, "elastic-joiner-registered")});
  EXPECT_FALSE(result[2].returned()) << result[2].describe();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(result[r].returned()) << result.summary();
    const std::string& v = result[r].value;
    EXPECT_TRUE(v.rfind(str("state=", testing::toyState(kSteps), " epoch=1 size=2"), 0) == 0 ||
                v.rfind(str("state=", testing::toyState(kSteps), " epoch=2 size=2"), 0) == 0) << v;
  }
}

TEST(ElasticJoin, AJoinerThatDiesDuringTheStateTransferIsDroppedAndTheMembersLoseNothing) {
  // Killed the first time it reaches the transfer (after its admission): the members'
  // collectives fail or the next step's do; they recover without it, their state intact.
  const auto result = runJob(200ms, 10ms, {testing::killAt(2, "before-transfer")});
  EXPECT_FALSE(result[2].returned()) << result[2].describe();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(result[r].returned()) << result.summary();
    EXPECT_EQ(result[r].value.rfind(str("state=", testing::toyState(kSteps), " epoch=2 size=2"), 0), 0u) << result[r].value;
  }
}

TEST(ElasticJoin, AJoinerArrivingAfterTheEndGivesUpWithJobFinished) {
  // The members are done (and marked it) long before the joiner registers.
  const auto result = runJob(1500ms, 0ms);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(result[r].returned()) << result.summary();
    EXPECT_EQ(result[r].value.rfind(str("state=", testing::toyState(kSteps), " epoch=0 size=2"), 0), 0u) << result[r].value;
  }
  ASSERT_TRUE(result[2].returned()) << result.summary();
  EXPECT_NE(result[2].value.find("finished: "), std::string::npos) << result[2].value;
  EXPECT_NE(result[2].value.find("the job finished before this process was admitted"), std::string::npos) << result[2].value;
}

}  // namespace
}  // namespace dt
