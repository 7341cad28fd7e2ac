// examples/gpt under dtrun --elastic with pipeline parallelism: 4 processes as {dp: 2, pp: 2}
// (two pipeline replicas of two stages each). A rank SIGKILLed during a step takes its replica
// out: its stage partner leaves cleanly (one line on stderr, exit 0), the other replica rebuilds
// its pipeline over the new group, takes the whole global batch (the same m micro-batches, twice
// the rows), redoes the step and finishes the job. Every logged step's loss and gradient norm
// (the metrics file) equals an undisturbed run's within 1e-4 relative: the same examples per
// step, the gradient averaged over one replica instead of two (the same mean, summed in another
// order). With --max-restarts the replica comes back whole, each joiner receiving its stage from
// the member at its pp coordinate, and the job ends at full size. PP=2 x TP=2 x DP=2 on eight:
// a replica of four leaves whole and the other rebinds its TP layers too.
// Sharded replicas (--sharding fsdp, zero2) go back to the newest checkpoint with their stages cut
// for the smaller dp group (four ranks, eight at dp 4 to 3, and PP=2 x TP=2 x DP=2), on the
// undisturbed curve; their joiners receive their shards from the members.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>

#include "common/strings.h"
#include "tests/examples/gpt_curve.h"
#include "tests/launcher/dtrun_process.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

constexpr int64_t kSteps = 8;

struct Job {
  ProcessResult result;
  Curve curve;  // rank 0's metrics file
};

Job runJob(const fs::path& out, const std::vector<std::string>& env, const std::vector<std::string>& dtrunExtra = {},
           int nproc = 4, const std::vector<std::string>& gptExtra = {}) {
  std::vector<std::string> argv{DTRUN_PATH, "--standalone", "--elastic", "--nproc", std::to_string(nproc)};
  argv.insert(argv.end(), dtrunExtra.begin(), dtrunExtra.end());
  // Two micro-batches of 2 rows per replica at dp 2, of 4 rows at dp 1.
  for (const char* a : {GPT_PATH, "--layers", "2", "--heads", "2", "--width", "32", "--context", "16", "--dropout", "0",
                        "--global-batch", "8", "--warmup", "2", "--eval-every", "0", "--eval-windows", "8", "--log-every", "1",
                        "--sample-tokens", "0", "--pp", "2", "--micro-batches", "2", "--checkpoint-dir", "none", "--seed", "5"}) {
    argv.push_back(a);
  }
  const std::string metrics = (out / "m.jsonl").string();
  for (const std::string& a : std::vector<std::string>{"--steps", std::to_string(kSteps), "--metrics", metrics}) argv.push_back(a);
  argv.insert(argv.end(), gptExtra.begin(), gptExtra.end());
  // Generous: four processes on two busy cores; a hang shows as the deadline, not a pass.
  ProcessResult result = runProcess(argv, 240s, env);
  return {std::move(result), readCurve(metrics)};
}

// A sharded job's flags with a checkpoint every 2 steps in `dir` (a lost rank's rows come back from there).
std::vector<std::string> checkpointedIn(const TempDir& dir, std::vector<std::string> flags) {
  flags.insert(flags.end(), {"--checkpoint-dir", (dir.path() / "ckpt").string(), "--checkpoint-every", "2"});
  return flags;
}

class GptElasticPipeline : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    reference_ = new TempDir();
    const Job r = runJob(reference_->path(), {});
    ASSERT_EQ(r.result.exitCode, 0) << r.result.out << r.result.err;
    curve_ = new Curve(r.curve);
  }
  static void TearDownTestSuite() {
    delete reference_;
    delete curve_;
  }

  // Every step logged once, each point the undisturbed run's (`reference`, else the suite's)
  // within 1e-4 relative.
  static void expectTheSameCurve(const Job& job, const std::string& what, const Curve* reference = nullptr) {
    dt::testing::expectTheSameCurve(job.curve, reference == nullptr ? *curve_ : *reference, kSteps, what, job.result.out);
  }

  // Member `killed` SIGKILLs itself at `step` in `phase`; `partner` is the other stage of its
  // replica (ranks 2 and 3: rank 0, which writes the metrics, stays).
  void expectTheOtherReplicaFinishes(int killed, int partner, int64_t step, const std::string& phase) {
    TempDir out;
    const Job job = runJob(out.path(), {str("DT_TEST_FAIL_AT=", killed, ":", step, ":", phase)});
    const ProcessResult& r = job.result;
    ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr(str("rank ", killed, " (pid")));
    EXPECT_THAT(r.err, HasSubstr("exited: signal SIGKILL; the elastic job goes on without it"));
    EXPECT_EQ(countOccurrences(r.err, " leaves at step "), 1) << "one line, from the partner alone\n" << r.err;
    EXPECT_THAT(r.err, HasSubstr(str("gpt: member ", partner, " leaves at step ", step, ": its pipeline replica (members 2, 3) lost rank ",
                                     killed, " exited: signal SIGKILL; the other replicas go on (2 rank(s), 1 replica(s)) and "
                                     "this process ends\n")))
        << r.err;
    EXPECT_THAT(r.out, HasSubstr(str("2 rank(s) go on from step ", step, " without rank ", killed, " exited: signal SIGKILL; member(s) ",
                                     partner, " left with their pipeline replica (1 replica(s) of 2 go on)\n")))
        << r.out;
    EXPECT_EQ(countOccurrences(r.out, "final parameters fingerprint"), 2) << "the remaining replica's two stages end\n" << r.out;
    EXPECT_THAT(r.out, HasSubstr(str("gpt: done: ", kSteps, " steps"))) << r.out;
    EXPECT_THAT(r.err, ::testing::Not(HasSubstr("Error"))) << r.err;
    expectTheSameCurve(job, str("killed member ", killed, " at step ", step, " ", phase));
  }

  // Sharded replicas (--sharding fsdp, zero1, zero2: the stages' wrapper over dp): a lost rank's rows
  // of its stages have no other copy, so the survivors go back to the newest checkpoint, their
  // stages cut again for the new dp group, and redo the steps from there. The steps before the loss
  // and those redone match the undisturbed DDP run's (the same examples and global batch; the
  // reduce-scatter's sums in another order), and the vote after the reload reports the checkpoint's
  // last loss, so the curve goes on where it was.
  static void expectShardedReplicasGoBack(const std::string& sharding, const std::string& failAt, int killed, int partner,
                                          int64_t kill, int64_t reload) {
    TempDir out;
    const Job job = runJob(out.path(), {"DT_TEST_FAIL_AT=" + failAt}, {}, 4, checkpointedIn(out, {"--sharding", sharding}));
    const ProcessResult& r = job.result;
    const std::string what = str("--sharding ", sharding, ", killed member ", failAt);
    ASSERT_EQ(r.exitCode, 0) << what << "\n" << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr(str("gpt: member ", partner, " leaves at step ", kill, ": its pipeline replica (members 2, 3) lost rank ",
                                     killed, " exited: signal SIGKILL")))
        << r.err;
    expectTwoWentBackToTheCheckpoint(r.out, r.err, killed, reload, kSteps);
    EXPECT_EQ(countOccurrences(r.out, "final parameters fingerprint"), 2) << "the remaining replica's two stages end\n" << r.out;
    expectTheSameCurve(job, what);
  }

  static TempDir* reference_;
  static Curve* curve_;
};

TempDir* GptElasticPipeline::reference_ = nullptr;
Curve* GptElasticPipeline::curve_ = nullptr;

// The last stage dies once its pipeline step is done, before the gradients' average over dp:
// its first stage leaves.
TEST_F(GptElasticPipeline, LastStageKilledItsFirstStageLeavesTheOtherReplicaFinishes) {
  expectTheOtherReplicaFinishes(3, 2, 4, "forward");
}
// The first stage dies after the average (all four ranks hold the step's gradients), before the
// commit vote: the step is redone at dp 1 all the same.
TEST_F(GptElasticPipeline, FirstStageKilledAfterTheAverageItsLastStageLeaves) {
  expectTheOtherReplicaFinishes(2, 3, 5, "backward");
}

// PP=2 x TP=2 x DP=2 on eight: a replica is four ranks. Member 5 (stage 0, tp 1 of replica 1)
// dies; its three partners leave, and replica 0 rebinds its TP layers and its pipeline onto the
// new groups. Against an undisturbed run of the same shape (TP's sums in another order put the
// PP=2 x DP=2 curve 8e-5 away, too near the bar).
TEST_F(GptElasticPipeline, ThreeDimensionalReplicaOfFourLeavesWhole) {
  TempDir reference, out;
  const Job undisturbed = runJob(reference.path(), {}, {}, 8, {"--tp", "2"});
  ASSERT_EQ(undisturbed.result.exitCode, 0) << undisturbed.result.out << undisturbed.result.err;
  const Job job = runJob(out.path(), {"DT_TEST_FAIL_AT=5:3:forward"}, {}, 8, {"--tp", "2"});
  const ProcessResult& r = job.result;
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_EQ(countOccurrences(r.err, " leaves at step 3: its pipeline replica (members 4, 5, 6, 7) lost rank 5 exited: signal "
                                    "SIGKILL; the other replicas go on (4 rank(s), 1 replica(s)) and this process ends\n"),
            3)
      << r.err;
  for (int member : {4, 6, 7}) EXPECT_THAT(r.err, HasSubstr(str("gpt: member ", member, " leaves at step 3"))) << r.err;
  EXPECT_THAT(r.out, HasSubstr("4 rank(s) go on from step 3 without rank 5 exited: signal SIGKILL; member(s) 4, 6, 7 left with "
                               "their pipeline replica (1 replica(s) of 4 go on)\n"))
      << r.out;
  EXPECT_EQ(countOccurrences(r.out, "final parameters fingerprint"), 4) << r.out;
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("Error"))) << r.err;
  expectTheSameCurve(job, "PP=2 x TP=2 x DP=2, killed member 5 at step 3 forward", &undisturbed.curve);
}

// --max-restarts: dtrun replaces the killed rank and, once it has left, its partner; the two
// register as joiners and the members admit them together, as a whole pipeline replica, each
// receiving its stage (parameters and optimizer state) from the member at its pp coordinate in
// replica 0. The members wait for them at step 5 (the test switch), so the join lands mid-run
// however slow the machine. The stages' spread over each dp group is 0 at the end.
TEST_F(GptElasticPipeline, WithMaxRestartsTheBrokenReplicaComesBackWhole) {
  TempDir out;
  const Job job = runJob(out.path(), {"DT_TEST_FAIL_AT=3:3:forward", "DT_TEST_WAIT_FOR_JOINER_AT=5"}, {"--max-restarts", "1"});
  const ProcessResult& r = job.result;
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("rank 3 is replaced by member 4")) << r.err;
  EXPECT_THAT(r.err, HasSubstr("left the job: its replica lost a member at step 3 (rank 3 exited: signal SIGKILL)")) << r.err;
  EXPECT_THAT(r.err, HasSubstr("rank 2 is replaced by member 5")) << r.err;
  EXPECT_THAT(r.out, ::testing::ContainsRegex("4 rank\\(s\\) go on from step [0-9]+ with member (4, member 5|5, member 4)\n"))
      << r.out;
  EXPECT_EQ(countOccurrences(r.out, " joined at step "), 2) << r.out;
  EXPECT_EQ(countOccurrences(r.out, "final parameters fingerprint"), 4) << "the job ends at full size\n" << r.out;
  EXPECT_EQ(countOccurrences(r.out, "(spread across ranks 0)"), 4) << r.out;
  expectTheSameCurve(job, "killed member 3 at step 3 forward, replaced");
}

TEST_F(GptElasticPipeline, ShardedReplicasGoBackToTheNewestCheckpoint) {
  // The last stage dies in step 5's pipeline step: back to step 4's checkpoint.
  expectShardedReplicasGoBack("fsdp", "3:5:forward", 3, 2, 5, 4);
  // ZeRO-2's stages, whole between steps, die with the first stage after the reduce-scatter: back to step 2.
  expectShardedReplicasGoBack("zero2", "2:3:backward", 2, 3, 3, 2);
  // After its commit vote: the others apply step 6 and meet the loss in step 7's gather of the
  // stages (a gather cut short must leave the wrapper sharded for the rebind): back to step 6.
  expectShardedReplicasGoBack("fsdp", "3:6:commit", 3, 2, 7, 6);
  // While step 4's checkpoint is written: it is incomplete, so back to step 2's.
  expectShardedReplicasGoBack("fsdp", "3:4:checkpoint", 3, 2, 4, 2);
}

// Eight ranks, PP=2 x DP=4 fully sharded, global batch 24 (3 then 4 rows per micro-batch): member
// 5 (stage 1 of replica 2) dies; three replicas go on from the checkpoint, each stage now cut in
// three over its dp group, and end with the same stages (spread 0, one fingerprint per stage).
TEST_F(GptElasticPipeline, ShardedStagesAreCutAgainForTheSmallerDataParallelGroup) {
  TempDir reference, out;
  const std::vector<std::string> flags{"--sharding", "fsdp", "--global-batch", "24"};
  const Job undisturbed = runJob(reference.path(), {}, {}, 8, checkpointedIn(reference, flags));
  ASSERT_EQ(undisturbed.result.exitCode, 0) << undisturbed.result.out << undisturbed.result.err;
  const Job job = runJob(out.path(), {"DT_TEST_FAIL_AT=5:3:forward"}, {}, 8, checkpointedIn(out, flags));
  const ProcessResult& r = job.result;
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("gpt: member 4 leaves at step 3: its pipeline replica (members 4, 5) lost rank 5 exited: signal SIGKILL; "
                               "the other replicas go on (6 rank(s), 3 replica(s)) and this process ends\n"))
      << r.err;
  EXPECT_THAT(r.out, HasSubstr("6 rank(s) go on from step 2 (the newest checkpoint: the lost shards have no other copy) without rank 5 "
                               "exited: signal SIGKILL\n"))
      << r.out;
  const std::map<int, std::string> stages = fingerprints(r.out);
  ASSERT_EQ(stages.size(), 6u) << "six ranks end, each stage's rows agreeing over its dp group\n" << r.out;
  for (int rank = 2; rank < 6; ++rank) EXPECT_EQ(stages.at(rank), stages.at(rank % 2)) << "rank " << rank << "'s stage";
  EXPECT_NE(stages.at(0), stages.at(1));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("Error"))) << r.err;
  expectTheSameCurve(job, "PP=2 x DP=4 fully sharded, killed member 5 at step 3 forward", &undisturbed.curve);
}

// --max-restarts: after the reload the broken replica comes back whole; each joiner's stage starts
// empty and receives its rows and optimizer state from the members (redistributed over the new dp
// groups, no checkpoint), the job ends at full size with each stage equal over its dp group, and
// the curve is the undisturbed one.
TEST_F(GptElasticPipeline, ShardedWithMaxRestartsTheReplicaComesBackAndReceivesItsShards) {
  TempDir out;
  const Job job = runJob(out.path(), {"DT_TEST_FAIL_AT=3:5:forward", "DT_TEST_WAIT_FOR_JOINER_AT=6"}, {"--max-restarts", "1"}, 4,
                         checkpointedIn(out, {"--sharding", "fsdp"}));
  const ProcessResult& r = job.result;
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("2 rank(s) go on from step 4 (the newest checkpoint: the lost shards have no other copy)")) << r.out;
  EXPECT_THAT(r.out, ::testing::ContainsRegex("4 rank\\(s\\) go on from step [0-9]+ with member (4, member 5|5, member 4)\n")) << r.out;
  EXPECT_EQ(countOccurrences(r.out, "its shards received in"), 2) << r.out;
  const std::map<int, std::string> stages = fingerprints(r.out);
  ASSERT_EQ(stages.size(), 4u) << "the job ends at full size\n" << r.out;
  EXPECT_EQ(stages.at(2), stages.at(0)) << "stage 0 over its dp group";
  EXPECT_EQ(stages.at(3), stages.at(1)) << "stage 1 over its dp group";
  expectTheSameCurve(job, "--sharding fsdp, killed member 3 at step 5 forward, replaced");
}

// PP=2 x TP=2 x DP=2 fully sharded (with SP) on eight, --max-restarts 1: member 5 dies, its three
// partners leave, replica 0 rebinds its TP layers, pipeline and stages' wrapper and goes back to
// step 2's checkpoint (each rank's rows of its TP blocks placed in the global tensors); the four
// replacements join as one replica and receive their rows, and each rank's stage ends equal to
// its dp partner's, on the undisturbed run's curve (of the same shape: TP's sums in another order).
TEST_F(GptElasticPipeline, ThreeDimensionalShardedReplicaGoesBackToTheCheckpointAndComesBack) {
  TempDir reference, out;
  const std::vector<std::string> flags{"--tp", "2", "--sp", "--sharding", "fsdp"};
  const Job undisturbed = runJob(reference.path(), {}, {}, 8, checkpointedIn(reference, flags));
  ASSERT_EQ(undisturbed.result.exitCode, 0) << undisturbed.result.out << undisturbed.result.err;
  const Job job = runJob(out.path(), {"DT_TEST_FAIL_AT=5:3:forward", "DT_TEST_WAIT_FOR_JOINER_AT=5"}, {"--max-restarts", "1"}, 8,
                         checkpointedIn(out, flags));
  const ProcessResult& r = job.result;
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_EQ(countOccurrences(r.err, " leaves at step 3: its pipeline replica (members 4, 5, 6, 7) lost rank 5 exited: signal "
                                    "SIGKILL; the other replicas go on (4 rank(s), 1 replica(s)) and this process ends\n"),
            3)
      << r.err;
  EXPECT_THAT(r.out, HasSubstr("4 rank(s) go on from step 2 (the newest checkpoint: the lost shards have no other copy) without rank 5 "
                               "exited: signal SIGKILL\n"))
      << r.out;
  EXPECT_EQ(countOccurrences(r.out, "its shards received in"), 4) << r.out;
  const std::map<int, std::string> stages = fingerprints(r.out);
  ASSERT_EQ(stages.size(), 8u) << "the job ends at full size\n" << r.out;
  for (int rank = 4; rank < 8; ++rank) EXPECT_EQ(stages.at(rank), stages.at(rank - 4)) << "rank " << rank << " against its dp partner";
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("Error"))) << r.err;
  expectTheSameCurve(job, "PP=2 x TP=2 x DP=2 fully sharded, killed member 5 at step 3 forward, replaced", &undisturbed.curve);
}

}  // namespace
}  // namespace dt::testing
