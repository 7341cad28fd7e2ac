// examples/gpt under dtrun --elastic with tensor parallelism: 4 processes as {dp: 2, tp: 2}
// (two model replicas of two ranks each). A rank SIGKILLed during a step takes its replica
// out: its partner leaves cleanly (one line on stderr, exit 0), the other replica redoes the
// step in place with the same global batch and finishes the job: dtrun exits 0, the final
// parameters (the final checkpoint's, by global name) are an undisturbed run's within 1e-5
// relative, and every step trained on the same examples as the undisturbed run, once. With
// --max-restarts the replica comes back whole and the job ends at full size. TP inside the
// sharded wrappers (--sharding fsdp, zero2) goes back to the newest checkpoint instead (a lost
// replica's rows have no other copy), its wrapper cut again for the smaller dp group, and every
// logged step stays on an undisturbed sharded run's curve; its joiners receive their rows.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "common/strings.h"
#include "tensor/nn/safetensors.h"
#include "tests/examples/gpt_curve.h"
#include "tests/launcher/dtrun_process.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

constexpr int64_t kSteps = 12;

ProcessResult runJob(const fs::path& out, const std::vector<std::string>& env, const std::vector<std::string>& dtrunExtra = {},
                     const std::vector<std::string>& gptExtra = {}) {
  std::vector<std::string> argv{DTRUN_PATH, "--standalone", "--elastic", "--nproc", "4"};
  argv.insert(argv.end(), dtrunExtra.begin(), dtrunExtra.end());
  for (const char* a : {GPT_PATH, "--layers", "1", "--heads", "2", "--width", "32", "--context", "16", "--dropout", "0",
                              "--global-batch", "8", "--warmup", "3", "--eval-every", "0", "--eval-windows", "16",
                              "--log-every", "4", "--sample-tokens", "0", "--tp", "2", "--checkpoint-every", "0"}) {
    argv.push_back(a);
  }
  for (const std::string& a : std::vector<std::string>{"--steps", std::to_string(kSteps), "--checkpoint-dir", (out / "ckpt").string()}) {
    argv.push_back(a);
  }
  argv.insert(argv.end(), gptExtra.begin(), gptExtra.end());
  std::vector<std::string> environment{str("DT_TEST_RECORD_SAMPLES=", (out / "samples").string())};
  environment.insert(environment.end(), env.begin(), env.end());
  // Generous: four processes on two busy cores; a hang shows as the deadline, not a pass.
  return runProcess(argv, 240s, environment);
}

// The model's tensors of the final checkpoint (every rank's file), by global name.
std::map<std::string, std::vector<float>> finalModel(const fs::path& out) {
  std::map<std::string, std::vector<float>> model;
  for (const auto& entry : fs::directory_iterator(out / "ckpt")) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(str("step-", std::string(8 - std::to_string(kSteps).size(), '0'), kSteps)) ||
        entry.path().extension() != ".safetensors") {
      continue;
    }
    for (const auto& [key, tensor] : loadSafetensors(entry.path()).tensors) {
      if (key.starts_with("model.")) model[key] = tensor.toVector<float>();
    }
  }
  return model;
}

// Max-abs difference over the whole model relative to the reference's max-abs.
double relativeDifference(const std::map<std::string, std::vector<float>>& reference,
                          const std::map<std::string, std::vector<float>>& run) {
  double diff = 0, scale = 0;
  EXPECT_EQ(reference.size(), run.size());
  for (const auto& [name, x] : reference) {
    const auto it = run.find(name);
    if (it == run.end()) {
      ADD_FAILURE() << name << " is missing from the disturbed run's final checkpoint";
      continue;
    }
    EXPECT_EQ(x.size(), it->second.size()) << name;
    for (size_t i = 0; i < x.size() && i < it->second.size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::fabs(x[i] - it->second[i])));
      scale = std::max(scale, static_cast<double>(std::fabs(x[i])));
    }
  }
  return scale > 0 ? diff / scale : diff;
}

// Per step, the examples the job trained on: each member's last attempt at a step in the
// newest membership epoch that attempted it (an attempt redone after a loss replaces the
// earlier one), summed over the members and divided by the ranks of a TP group (both take the
// same batch). Members 0..3, and any replacement up to member 7.
std::map<int64_t, std::vector<int64_t>> examplesByStep(const fs::path& out) {
  std::map<int64_t, std::pair<uint64_t, std::vector<std::vector<int64_t>>>> newest;  // step -> (epoch, per-member ids)
  for (int member = 0; member < 8; ++member) {
    std::ifstream in(str((out / "samples").string(), ".", member));
    std::string line;
    std::map<int64_t, std::pair<uint64_t, std::vector<int64_t>>> mine;  // this member's last attempt per step
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      uint64_t epoch = 0;
      int64_t step = 0, dataEpoch = 0, id = 0;
      fields >> epoch >> step >> dataEpoch;
      std::vector<int64_t> ids;
      while (fields >> id) ids.push_back(id);
      mine[step] = {epoch, ids};
    }
    for (const auto& [step, attempt] : mine) {
      auto& slot = newest[step];
      if (attempt.first > slot.first) slot = {attempt.first, {}};
      if (attempt.first == slot.first) slot.second.push_back(attempt.second);
    }
  }
  std::map<int64_t, std::vector<int64_t>> steps;
  for (auto& [step, slot] : newest) {
    std::vector<int64_t> all;
    for (const auto& ids : slot.second) all.insert(all.end(), ids.begin(), ids.end());
    std::sort(all.begin(), all.end());
    std::vector<int64_t> once;  // every id appears twice (the two ranks of a TP group)
    for (size_t i = 0; i < all.size(); i += 2) {
      EXPECT_TRUE(i + 1 < all.size() && all[i] == all[i + 1]) << "step " << step << ": example " << all[i]
                                                              << " was not taken by both ranks of one TP group";
      once.push_back(all[i]);
    }
    steps[step] = once;
  }
  return steps;
}

class GptElastic : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    reference_ = new TempDir();
    const ProcessResult r = runJob(reference_->path(), {});
    ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
    model_ = new std::map<std::string, std::vector<float>>(finalModel(reference_->path()));
    examples_ = new std::map<int64_t, std::vector<int64_t>>(examplesByStep(reference_->path()));
  }
  static void TearDownTestSuite() {
    delete reference_;
    delete model_;
    delete examples_;
  }

  // Member `killed` SIGKILLs itself at `step` in `phase`; `partner` is its TP group's other rank.
  void expectTheOtherReplicaFinishes(int killed, int partner, int64_t step, const std::string& phase,
                                     const std::vector<std::string>& gptExtra = {}) {
    ASSERT_FALSE(model_->empty()) << "the reference run wrote no final checkpoint";
    TempDir out;
    const ProcessResult r = runJob(out.path(), {str("DT_TEST_FAIL_AT=", killed, ":", step, ":", phase)}, {}, gptExtra);
    ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
    EXPECT_EQ(countOccurrences(r.out, "final parameters fingerprint"), 2) << "the remaining replica's two ranks end\n" << r.out;
    expectTheSameTraining(out.path(), str("killed member ", killed, " at step ", step, " ", phase));
    EXPECT_THAT(r.err, HasSubstr(str("rank ", killed, " (pid")));
    EXPECT_THAT(r.err, HasSubstr("exited: signal SIGKILL; the elastic job goes on without it"));
    // After its commit vote the step is applied (by some or all: those that did not apply it
    // in the recovery) and the loss met in the next step or the end; else the step is redone.
    const std::string at = phase == "commit" ? "" : str(" at step ", step);
    const int first = std::min(killed, partner), second = std::max(killed, partner);
    EXPECT_THAT(r.err, HasSubstr(str("gpt: member ", partner, " leaves", at))) << r.err;
    EXPECT_THAT(r.err, HasSubstr(str(": its tensor-parallel group (members ", first, ", ", second, ") lost rank ", killed,
                                     " exited: signal SIGKILL; the other replicas go on (2 rank(s), 1 replica(s)) and this "
                                     "process ends\n")))
        << r.err;
    EXPECT_THAT(r.out, HasSubstr(str("2 rank(s) go on from step", phase == "commit" ? "" : str(" ", step)))) << r.out;
    EXPECT_THAT(r.out, HasSubstr(str(" without rank ", killed, " exited: signal SIGKILL; member(s) ", partner,
                                     " left with their tensor-parallel group (1 replica(s) of 2 go on)\n")))
        << r.out;
    EXPECT_THAT(r.out, HasSubstr(str("gpt: done: ", kSteps, " steps"))) << r.out;
    EXPECT_THAT(r.err, ::testing::Not(HasSubstr("Error"))) << r.err;
  }

  // The final parameters and the examples of every step are the undisturbed run's.
  static void expectTheSameTraining(const fs::path& out, const std::string& what) {
    const double rel = relativeDifference(*model_, finalModel(out));
    EXPECT_LE(rel, 1e-5) << what;
    std::printf("%s: final parameters within %.3g of the undisturbed run's\n", what.c_str(), rel);
    const auto seen = examplesByStep(out);
    ASSERT_EQ(seen.size(), static_cast<size_t>(kSteps)) << what;
    for (const auto& [s, ids] : *examples_) {
      EXPECT_EQ(ids.size(), 8u) << "step " << s;
      EXPECT_EQ(seen.count(s) ? seen.at(s) : std::vector<int64_t>{}, ids)
          << what << ", step " << s << ": other examples than the undisturbed run's";
    }
  }

  static TempDir* reference_;
  static std::map<std::string, std::vector<float>>* model_;
  static std::map<int64_t, std::vector<int64_t>>* examples_;
};

TempDir* GptElastic::reference_ = nullptr;
std::map<std::string, std::vector<float>>* GptElastic::model_ = nullptr;
std::map<int64_t, std::vector<int64_t>>* GptElastic::examples_ = nullptr;

// The second replica breaks; its surviving rank 3 leaves.
TEST_F(GptElastic, KilledInForwardTheOtherReplicaFinishes) { expectTheOtherReplicaFinishes(2, 3, 6, "forward"); }
// The first replica breaks: rank 0 leaves (the one that decided and wrote checkpoints), and
// members 2 and 3 go on as ranks 0 and 1, their tp coordinates kept.
TEST_F(GptElastic, KilledInBackwardRankZerosReplicaLeaves) { expectTheOtherReplicaFinishes(1, 0, 7, "backward"); }
// After its commit vote: the step is applied by all, the loss met in the next step.
TEST_F(GptElastic, KilledAfterItsCommitVote) { expectTheOtherReplicaFinishes(3, 2, 5, "commit"); }
// After the last step's commit vote: the loss is met in the final evaluation, checkpoint or
// check, which the other replica recovers from and does again.
TEST_F(GptElastic, KilledAfterTheLastStepsCommitVote) { expectTheOtherReplicaFinishes(1, 0, kSteps - 1, "commit"); }
// Sequence parallelism: its layers (the norms, the dropouts) move onto the new tp group too.
// Against the TP run without SP, which sums the norms' gradients in another order (measured
// 2e-6 apart undisturbed).
TEST_F(GptElastic, KilledWithSequenceParallelism) { expectTheOtherReplicaFinishes(2, 3, 6, "backward", {"--sp"}); }
// Any rank, step and phase: the choice is printed (rerun it with the three values above).
TEST_F(GptElastic, KilledAtARandomMoment) {
  std::random_device seed;
  std::mt19937 pick(seed());
  const int killed = static_cast<int>(pick() % 4);
  const int64_t step = 1 + static_cast<int64_t>(pick() % (kSteps - 1));
  const std::string phase = std::vector<std::string>{"forward", "backward", "commit"}[pick() % 3];
  std::printf("killing member %d at step %lld in %s\n", killed, static_cast<long long>(step), phase.c_str());
  SCOPED_TRACE(str("member ", killed, " killed at step ", step, " in ", phase));
  expectTheOtherReplicaFinishes(killed, killed ^ 1, step, phase);
}

// --max-restarts: dtrun replaces the killed rank and, once it has left, its partner; the two
// replacements register as joiners and the members admit them together, as a whole replica (one
// alone is held back), each receiving its shards from the member at its tp coordinate. The job
// ends at full size. The members wait for them at step 7 (the test switch), so the join lands
// mid-run however slow the machine.
TEST_F(GptElastic, WithMaxRestartsTheBrokenReplicaComesBackWhole) {
  ASSERT_FALSE(model_->empty()) << "the reference run wrote no final checkpoint";
  TempDir out;
  const ProcessResult r = runJob(out.path(), {"DT_TEST_FAIL_AT=2:4:forward", "DT_TEST_WAIT_FOR_JOINER_AT=7"}, {"--max-restarts", "1"});
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("rank 2 is replaced by member 4")) << r.err;
  EXPECT_THAT(r.err, HasSubstr("left the job: its replica lost a member at step 4 (rank 2 exited: signal SIGKILL)")) << r.err;
  EXPECT_THAT(r.err, HasSubstr("rank 3 is replaced by member 5")) << r.err;
  // Admitted together, in the order they registered (either may be first).
  EXPECT_THAT(r.out, ::testing::ContainsRegex("4 rank\\(s\\) go on from step [0-9]+ with member (4, member 5|5, member 4)\n"))
      << r.out;
  EXPECT_EQ(countOccurrences(r.out, " joined at step "), 2) << r.out;
  EXPECT_EQ(countOccurrences(r.out, "final parameters fingerprint"), 4) << "the job ends at full size\n" << r.out;
  EXPECT_THAT(r.out, HasSubstr("(spread across ranks 0)")) << r.out;
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("spread across ranks 1"))) << r.out;
  expectTheSameTraining(out.path(), "killed member 2 at step 4 forward, replaced");
}

// TP=2 x DP=2 inside a sharded wrapper, checkpoints every 2 steps, every step logged to
// m.jsonl (rank 0's curve).
struct ShardedRun {
  ProcessResult result;
  Curve curve;
};

ShardedRun runSharded(const TempDir& out, const std::vector<std::string>& env, const std::vector<std::string>& dtrunExtra,
                      const std::vector<std::string>& flags) {
  const fs::path metrics = out.path() / "m.jsonl";
  std::vector<std::string> gptExtra{"--log-every", "1", "--checkpoint-every", "2", "--metrics", metrics.string()};
  gptExtra.insert(gptExtra.end(), flags.begin(), flags.end());
  ProcessResult result = runJob(out.path(), env, dtrunExtra, gptExtra);
  return {std::move(result), readCurve(metrics)};
}

// Member `killed` dies at `failAt` (member:step:phase) under `--sharding sharding`; its TP
// partner leaves, and the other replica rebinds its TP layers and the wrapper over the new dp
// group (of one) and goes back to the checkpoint at step `reload`, which it does not write again.
void expectShardedGoesBack(const std::string& sharding, const std::string& failAt, int killed, int partner, int64_t kill,
                           int64_t reload) {
  TempDir reference, out;
  const ShardedRun undisturbed = runSharded(reference, {}, {}, {"--sharding", sharding});
  ASSERT_EQ(undisturbed.result.exitCode, 0) << undisturbed.result.out << undisturbed.result.err;
  const ShardedRun run = runSharded(out, {"DT_TEST_FAIL_AT=" + failAt}, {}, {"--sharding", sharding});
  const ProcessResult& r = run.result;
  const std::string what = str("TP=2 x DP=2 --sharding ", sharding, ", killed member ", failAt);
  ASSERT_EQ(r.exitCode, 0) << what << "\n" << r.out << r.err;
  const int first = std::min(killed, partner), second = std::max(killed, partner);
  EXPECT_THAT(r.err, HasSubstr(str("gpt: member ", partner, " leaves at step ", kill, ": its tensor-parallel group (members ", first,
                                   ", ", second, ") lost rank ", killed, " exited: signal SIGKILL")))
      << r.err;
  expectTwoWentBackToTheCheckpoint(r.out, r.err, killed, reload, kSteps);
  EXPECT_EQ(fingerprints(r.out).size(), 2u) << "the remaining replica's two ranks end\n" << r.out;
  expectTheSameCurve(run.curve, undisturbed.curve, kSteps, what, r.out);
}

// Fully sharded: member 3 dies in step 5's forward, back to step 4's checkpoint.
TEST(GptElasticSharded, FullyShardedTensorParallelGoesBackToTheNewestCheckpoint) {
  expectShardedGoesBack("fsdp", "3:5:forward", 3, 2, 5, 4);
}
// ZeRO-2: member 2 dies after step 7's backward, when the survivors hold the step's reduced
// gradients (which the redone step must not add to): back to step 6's.
TEST(GptElasticSharded, ZeroTwoTensorParallelGoesBackToTheNewestCheckpoint) {
  expectShardedGoesBack("zero2", "2:7:backward", 2, 3, 7, 6);
}

// --max-restarts, fully sharded with SP: after going back to step 4 the broken replica comes
// back whole at step 7's boundary (the test switch holds the members there); each joiner's
// wrapper starts empty and receives its rows of its TP blocks from the members (redistributed
// over the new group, no checkpoint), each rank ends equal to its dp partner, and every step is
// on the undisturbed curve.
TEST(GptElasticSharded, WithMaxRestartsTheReplicaComesBackAndReceivesItsRows) {
  TempDir reference, out;
  const std::vector<std::string> flags{"--sharding", "fsdp", "--sp"};
  const ShardedRun undisturbed = runSharded(reference, {}, {}, flags);
  ASSERT_EQ(undisturbed.result.exitCode, 0) << undisturbed.result.out << undisturbed.result.err;
  const ShardedRun run =
      runSharded(out, {"DT_TEST_FAIL_AT=2:5:forward", "DT_TEST_WAIT_FOR_JOINER_AT=7"}, {"--max-restarts", "1"}, flags);
  const ProcessResult& r = run.result;
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("rank 2 is replaced by member 4")) << r.err;
  EXPECT_THAT(r.err, HasSubstr("rank 3 is replaced by member 5")) << r.err;
  EXPECT_THAT(r.out, HasSubstr("2 rank(s) go on from step 4 (the newest checkpoint: the lost shards have no other copy)")) << r.out;
  EXPECT_THAT(r.out, ::testing::ContainsRegex("4 rank\\(s\\) go on from step [0-9]+ with member (4, member 5|5, member 4)\n"))
      << r.out;
  EXPECT_EQ(countOccurrences(r.out, "its shards received in"), 2) << r.out;
  const std::map<int, std::string> ranks = fingerprints(r.out);
  ASSERT_EQ(ranks.size(), 4u) << "the job ends at full size\n" << r.out;
  EXPECT_EQ(ranks.at(2), ranks.at(0)) << "tp rank 0 over its dp group";
  EXPECT_EQ(ranks.at(3), ranks.at(1)) << "tp rank 1 over its dp group";
  EXPECT_NE(ranks.at(0), ranks.at(1)) << "the two TP ranks hold different shards";
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("Error"))) << r.err;
  expectTheSameCurve(run.curve, undisturbed.curve, kSteps, "TP=2 (SP) x DP=2 fsdp, killed member 2 at step 5 forward, replaced",
                     r.out);
}

}  // namespace
}  // namespace dt::testing
