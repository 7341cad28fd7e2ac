// The sharded wrapper under the elastic mode, with forked ranks (testing/spawn.h): a rank
// SIGKILLed in the middle of a sharded step, and the job recovering without a restart. The
// lost rank's shards have no other copy, so the survivors agree on the next epoch
// (ElasticGroup::recover), rebind the wrapper to its group and reload the newest sharded
// checkpoint resharded for their number (docs/sharded.md, "Membership changes"). The test
// plays the launcher (tests/elastic/supervise.h), as dtrun --elastic does.
//
// Four ranks train the harness's GPT (AdamW, clipping, a schedule) fully sharded; after steps
// [0, 5) every rank writes its pieces of a checkpoint; in step 6's backward, with a
// reduce-scatter in flight, rank 3 is killed (at two places: kScenarios). The three left redo
// steps 5 and 6 from the checkpoint and train to step 9: their parameters must be bitwise
// those of a fresh world-3 job resumed from the same checkpoint (threads as ranks).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_dir.h"
#include "common/errors.h"
#include "common/strings.h"
#include "elastic/elastic_group.h"
#include "testing/point.h"
#include "testing/spawn.h"
#include "tests/elastic/supervise.h"
#include "tests/fsdp/harness.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;

constexpr int kWorld = 4;
constexpr int kLost = 3;           // the rank killed
constexpr int64_t kSaveAt = 5;     // the checkpoint holds steps [0, 5)
constexpr int64_t kKillStep = 6;   // rank 3 dies in this step's backward
constexpr int64_t kSteps = 9;      // the job trains steps [0, 9)
constexpr const char* kPoint = "sharded-backward";

// Where rank 3 dies, and how the wrapper prefetches.
struct Scenario {
  const char* name;
  bool lastBlock;  // the point in the last block's backward (the first in backward), else the first's
  int prefetch;
};

RunSpec shardedSpec(const Scenario& scenario) {
  RunSpec s;
  s.wrapper = Wrapper::Sharded;
  s.sharded.prefetch = scenario.prefetch;
  return s;
}

// The parameters' bytes in hex, one tensor after the other (float32, model order).
std::string hexOf(const std::vector<Tensor>& tensors) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (const Tensor& t : tensors) {
    const Tensor c = t.contiguous();
    const auto* bytes = static_cast<const unsigned char*>(c.dataPtr());
    for (size_t i = 0; i < c.nbytes(); ++i) {
      out += kDigits[bytes[i] >> 4];
      out += kDigits[bytes[i] & 0xfu];
    }
  }
  return out;
}

// hexOf's inverse, with the shapes and dtypes of `like` (empty if the sizes do not match).
std::vector<Tensor> fromHex(const std::string& hex, const std::vector<Tensor>& like) {
  std::vector<Tensor> out;
  size_t at = 0;
  for (const Tensor& l : like) {
    Tensor t = empty(l.sizes(), l.dtype());
    if (at + 2 * t.nbytes() > hex.size()) return {};
    auto* bytes = static_cast<unsigned char*>(t.dataPtr());
    for (size_t i = 0; i < t.nbytes(); ++i, at += 2) {
      bytes[i] = static_cast<unsigned char>(std::stoi(hex.substr(at, 2), nullptr, 16));
    }
    out.push_back(t);
  }
  return at == hex.size() ? out : std::vector<Tensor>{};
}

// One member's training loop: steps one at a time on the elastic group's current epoch; a
// failure is recovered from by the new epoch, a rebind and the newest checkpoint. Returns
// "params=<hex>\n" then what happened ("epoch=1 size=3 members=0,1,2 ...").
std::string trainElastic(RankContext& ctx, const CheckpointDir& checkpoints, const Scenario& scenario) {
  elastic::ElasticOptions options;
  options.minSize = kWorld - 1;
  options.group.timeout = 60s;
  auto elastic = elastic::ElasticGroup::fromEnvironment(options);
  auto job = std::make_unique<TrainingRank>(shardedSpec(scenario), elastic->group());
  // The kill point: when a block's first parameter has its gradient, in backward (the block
  // is gathered for its backward then, and the gradient has not reached its input).
  const auto blocks = job->model().h->namedChildren();
  Tensor watched = (scenario.lastBlock ? blocks.back() : blocks.front()).second->parameters().front();
  watched.registerPostAccumulateGradHook([](Tensor&) { point(kPoint); });

  int64_t step = 0;  // optimizer steps applied
  int64_t failedAt = -1, resumeStep = -1, loadedStep = -1;
  std::string caught;
  while (step < kSteps) {
    try {
      job->train(step, step + 1);
      ++step;
      if (step == kSaveAt) {
        TrainingState state = job->state();
        state.step = step;
        checkpoints.save(state, elastic->group().get());
      }
    } catch (const Error& e) {  // MemberLostError, or the transport's own word for the death
      failedAt = step;
      caught = e.what();
      const auto& next = elastic->recover(std::current_exception(), step);
      resumeStep = next.resumeStep;
      // The lost rank's shards exist nowhere else: every survivor goes back to the newest
      // checkpoint, cut for the new world size (redoing the steps since, whatever resumeStep).
      job->rebind(elastic->group());
      TrainingState state = job->state();
      checkpoints.load(*checkpoints.latestAgreed(*elastic->group()), state, elastic->group().get());
      step = loadedStep = state.step;
    }
  }
  const std::string params = hexOf(job->fullParameters());
  // No survivor ends (and is posted dead by the launcher) while another is still in that
  // last collective, which the death would abort.
  auto store = ctx.store();
  if (store->add("test/finished", 1) == elastic->membership().size()) store->set("test/all-finished", "1");
  store->wait({"test/all-finished"});

  const auto& m = elastic->membership();
  std::vector<std::string> members;
  for (int id : m.members) members.push_back(std::to_string(id));
  return str("params=", params, "\nepoch=", m.epoch, " size=", m.size(), " members=", join(members, ","),
             " rank=", m.rank, " failed-at=", failedAt, " resume=", resumeStep, " loaded=", loadedStep,
             " lost=", join(m.lost, ";"), "\ncaught: ", caught);
}

// Rank 0's full parameters after a fresh job at `world` loads the newest checkpoint and
// trains to `until` (threads as ranks).
std::vector<Tensor> resumedFresh(const Scenario& scenario, int world, const CheckpointDir& checkpoints, int64_t until) {
  std::vector<Tensor> out;
  withRanks(world, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    TrainingRank job(shardedSpec(scenario), group);
    TrainingState state = job.state();
    checkpoints.load(*checkpoints.latestAgreed(*group), state, group.get());
    job.train(state.step, until);
    auto params = job.fullParameters();
    if (rank == 0) out = std::move(params);
  });
  return out;
}

// Two places for the kill (both in step 6's backward):
//  * in the first block's backward, with the default prefetch: the last block's reduce-scatter
//    is launched, and the survivors find out where backward ends waiting for its
//    reduce-scatters (or in backward, in the last block's reduce-scatter, if the abort comes
//    first);
//  * in the last block's backward, without prefetch: the survivors launch that block's
//    reduce-scatter, which rank 3 never joins, and wait inside backward for the first block's
//    gather behind it, which fails there (the wrapper's end-of-backward never runs).
constexpr Scenario kScenarios[] = {
    {"killed in the first block's backward", false, 1},
    {"killed in the last block's backward, no prefetch", true, 0},
};

struct ElasticRun {
  std::unique_ptr<TempDir> dir = std::make_unique<TempDir>();
  CheckpointDir checkpoints{dir->path(), 10};
  SpawnResult result;
};

// The elastic job of one scenario, forked (before this process starts any thread).
ElasticRun runElastic(const Scenario& scenario) {
  ElasticRun run;
  SpawnOptions options;
  options.plan = {killAt(kLost, kPoint, static_cast<int>(kKillStep) + 1)};  // hit n: step n - 1's backward
  options.killAllOnFailure = false;  // every survivor's own outcome is what the test checks
  options.deadline = 90s;
  SpawnedRanks ranks(
      kWorld, [&run, &scenario](RankContext& ctx) { return trainElastic(ctx, run.checkpoints, scenario); }, options);
  superviseUntilDone(ranks);
  run.result = ranks.wait();
  return run;
}

void expectRecovered(const Scenario& scenario, const ElasticRun& run) {
  SCOPED_TRACE(scenario.name);
  const SpawnResult& result = run.result;
  EXPECT_TRUE(result.planNotFired.empty()) << join(result.planNotFired, "; ");
  EXPECT_EQ(result[kLost].ending, Ending::Killed) << result[kLost].describe();

  // The checkpoint the survivors went back to: written by four ranks after step 4.
  const auto newest = run.checkpoints.latest();
  ASSERT_TRUE(newest.has_value());
  EXPECT_EQ(newest->step, kSaveAt);
  EXPECT_EQ(run.checkpoints.readManifest(*newest).worldSize, kWorld);

  // The reference: a fresh world-3 job from that checkpoint (threads as ranks).
  const auto fresh = resumedFresh(scenario, kWorld - 1, run.checkpoints, kSteps);
  ASSERT_FALSE(fresh.empty());
  const std::string freshHex = hexOf(fresh);

  for (int r = 0; r < kWorld - 1; ++r) {
    SCOPED_TRACE(str("rank ", r));
    ASSERT_TRUE(result[r].returned()) << result.summary();
    const std::string& value = result[r].value;
    const size_t newline = value.find('\n');
    ASSERT_NE(newline, std::string::npos) << value;
    const std::string params = value.substr(0, newline).substr(std::strlen("params="));
    const std::string what = value.substr(newline + 1);
    std::printf("%s: rank %d: %s\n", scenario.name, r, what.c_str());
    EXPECT_EQ(what.rfind(str("epoch=1 size=3 members=0,1,2 rank=", r, " failed-at=", kKillStep, " resume=", kKillStep,
                             " loaded=", kSaveAt, " lost="),
                         0),
              0u)
        << what;
    // Member 3 (rank 3 of epoch 0), as the launcher posted it.
    EXPECT_NE(what.find("lost=rank 3 exited: signal SIGKILL\n"), std::string::npos) << what;
    if (params != freshHex) {
      const auto mine = fromHex(params, fresh);
      ADD_FAILURE() << "rank " << r << "'s parameters differ from the fresh world-3 job's: "
                    << (mine.empty() ? std::string("a different size")
                                     : str("largest relative difference ", relativeDifference(fresh, mine)));
    }
  }
}

// Both scenarios are forked first; the references (threads) come after.
TEST(ShardedElastic, ARankKilledInBackwardIsReplacedByTheNewestCheckpointReshardedForTheSurvivors) {
  std::vector<ElasticRun> runs;
  for (const Scenario& scenario : kScenarios) runs.push_back(runElastic(scenario));
  for (size_t i = 0; i < runs.size(); ++i) expectRecovered(kScenarios[i], runs[i]);
}

}  // namespace
}  // namespace dt::testing
