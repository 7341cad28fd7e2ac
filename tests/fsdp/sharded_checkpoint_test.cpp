// Checkpoints of the sharded wrapper, ZeRO and DDP loaded by each other at other world sizes
// (threads as ranks): a sharded checkpoint written at world 4 continues bitwise at 4, within
// reassociation at 2 (sharded) and 3 (DDP, ZeRO), and back; consolidation gives the plain
// model; the reshard-on-membership-change path: a group that lost a rank rebinds and reloads
// the checkpoint, a joiner receives its shards from the members without one.
#include <mutex>

#include <gtest/gtest.h>

#include "checkpoint/transfer.h"
#include "common/strings.h"
#include "tests/fsdp/harness.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

constexpr double kReassociation = 1e-5;

RunSpec spec(Wrapper wrapper, bool joining = false) {
  RunSpec s;
  s.wrapper = wrapper;
  s.sharded.joining = joining;
  return s;
}

// Trains [0, saveAt) with `wrapper` at `world` and saves a checkpoint of step saveAt.
void trainAndSave(Wrapper wrapper, int world, int64_t saveAt, const CheckpointDir& dir) {
  withRanks(world, [&](int, const std::shared_ptr<ProcessGroup>& group) {
    TrainingRank job(spec(wrapper), group);
    job.train(0, saveAt);
    TrainingState state = job.state();
    state.step = saveAt;
    dir.save(state, group.get());
  });
}

// Loads the newest checkpoint of `dir` with `wrapper` at `world`, trains to `until`; returns
// rank 0's full parameters right after the load (after) and at the end (final).
struct Resumed {
  std::vector<Tensor> afterLoad, final;
};
Resumed resume(Wrapper wrapper, int world, const CheckpointDir& dir, int64_t until, bool saveAtEnd = false) {
  Resumed out;
  withRanks(world, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    TrainingRank job(spec(wrapper), group);
    TrainingState state = job.state();
    dir.load(*dir.latestAgreed(*group), state, group.get());
    auto after = job.fullParameters();
    job.train(state.step, until);
    auto final = job.fullParameters();
    if (saveAtEnd) {
      TrainingState end = job.state();
      end.step = until;
      dir.save(end, group.get());
    }
    if (rank == 0) out = {std::move(after), std::move(final)};
  });
  return out;
}

TEST(ShardedCheckpoint, WrittenAtFourContinuesAtFourTwoAndThreeByEitherWrapperAndBack) {
  const auto reference = trainedParameters(spec(Wrapper::Sharded), 4, 10);
  TempDir dir;
  const CheckpointDir checkpoints(dir.path(), 10);
  trainAndSave(Wrapper::Sharded, 4, 5, checkpoints);

  EXPECT_TRUE(bitwiseEqual(resume(Wrapper::Sharded, 4, checkpoints, 10).final, reference))
      << "the same world size continues bit for bit";
  EXPECT_LT(relativeDifference(reference, resume(Wrapper::Ddp, 3, checkpoints, 10).final), kReassociation) << "DDP at 3";
  EXPECT_LT(relativeDifference(reference, resume(Wrapper::Zero1, 3, checkpoints, 10).final), kReassociation) << "ZeRO at 3";
  // The sharded wrapper at 2, which saves step 10; then back at 4: the loaded parameters are
  // exactly the ones saved, and both continue alike.
  const Resumed two = resume(Wrapper::Sharded, 2, checkpoints, 10, /*saveAtEnd=*/true);
  EXPECT_LT(relativeDifference(reference, two.final), kReassociation) << "sharded at 2";
  const Resumed back = resume(Wrapper::Sharded, 4, checkpoints, 12);
  EXPECT_TRUE(bitwiseEqual(back.afterLoad, two.final)) << "resharded from 2 to 4, the values are the saved ones";
  EXPECT_TRUE(checkpoints.readManifest(*checkpoints.latest()).worldSize == 2);
}

TEST(ShardedCheckpoint, DdpAndZeroCheckpointsLoadIntoTheShardedWrapper) {
  TempDir dir;
  const CheckpointDir checkpoints(dir.path(), 10);
  trainAndSave(Wrapper::Zero2, 2, 4, checkpoints);
  const auto fromZero = resume(Wrapper::Sharded, 3, checkpoints, 8).final;
  const auto reference = trainedParameters(spec(Wrapper::Ddp), 2, 8);
  EXPECT_LT(relativeDifference(reference, fromZero), kReassociation);
}

TEST(ShardedCheckpoint, ConsolidationGivesThePlainModel) {
  TempDir dir;
  const CheckpointDir checkpoints(dir.path(), 10);
  trainAndSave(Wrapper::Sharded, 4, 3, checkpoints);
  const auto trained = resume(Wrapper::Sharded, 4, checkpoints, 3).afterLoad;
  const auto file = dir.path() / "model.safetensors";
  consolidateCheckpoint(checkpoints, *checkpoints.latest(), file);
  Generator init(99);
  nn::Gpt plain(smallGpt(), init);
  plain.load(file);
  EXPECT_TRUE(bitwiseEqual(plain.parameters(), trained));
}

// A rank is lost: the three left rebind to their new group and reload the world-4
// checkpoint resharded for three; they continue exactly as a fresh world-3 job from it.
TEST(ShardedCheckpoint, AfterLosingARankTheSurvivorsRebindAndReloadResharded) {
  TempDir dir;
  const CheckpointDir checkpoints(dir.path(), 10);
  trainAndSave(Wrapper::Sharded, 4, 5, checkpoints);
  const auto fresh = resume(Wrapper::Sharded, 3, checkpoints, 8).final;
  std::vector<Tensor> rebound;
  withRanks(4, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto job = std::make_unique<TrainingRank>(spec(Wrapper::Sharded), group);
    job->train(0, 5);
    auto survivors = group->newGroup({0, 1, 2});
    if (rank == 3) return;  // the lost rank
    job->rebind(survivors);
    TrainingState state = job->state();
    checkpoints.load(*checkpoints.latestAgreed(*survivors), state, survivors.get());
    job->train(state.step, 8);
    auto params = job->fullParameters();
    if (rank == 0) rebound = std::move(params);
    job.reset();
    survivors->destroy();
  });
  EXPECT_TRUE(bitwiseEqual(rebound, fresh));
}

// Three ranks train; a fourth joins: the members rebind to the group of four, the joiner
// builds its wrapper (joining) and every rank's new shards come from the members' old ones.
// The result is the checkpoint route's to the bit.
TEST(ShardedCheckpoint, AJoinerReceivesItsShardsFromTheMembersWithoutACheckpoint) {
  TempDir dir;
  const CheckpointDir checkpoints(dir.path(), 10);
  trainAndSave(Wrapper::Sharded, 3, 4, checkpoints);
  const auto viaCheckpoint = resume(Wrapper::Sharded, 4, checkpoints, 7).final;
  std::vector<Tensor> viaJoin;
  withRanks(4, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    auto members = group->newGroup({0, 1, 2});
    std::unique_ptr<TrainingRank> job;
    std::vector<StateTensor> held;
    if (rank < 3) {
      job = std::make_unique<TrainingRank>(spec(Wrapper::Sharded), members);
      job->train(0, 4);
      held = job->state().collect();
      job->rebind(group);
    } else {
      job = std::make_unique<TrainingRank>(spec(Wrapper::Sharded, /*joining=*/true), group);
    }
    TrainingState state = job->state();
    redistributeState(held, state, *group);
    job->train(4, 7);
    auto params = job->fullParameters();
    if (rank == 0) viaJoin = std::move(params);
    job.reset();
    if (rank < 3) members->destroy();
  });
  EXPECT_TRUE(bitwiseEqual(viaJoin, viaCheckpoint));
}

}  // namespace
}  // namespace dt::testing
