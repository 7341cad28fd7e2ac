// examples/trainer under dtrun --elastic: a rank SIGKILLed during a step (in
// forward, in backward with buckets in flight, after its commit vote, while a
// checkpoint is written) is left behind and the others redo or keep the step
// in place. The trajectory holds: up to the step before the kill the
// parameters are bitwise an undisturbed run's, after the redone step within
// 1e-5 of them, the final test accuracy within 0.3 points; every example of
// the epoch is trained on exactly once (from the recorded example ids).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include "common/strings.h"
#include "tensor/nn/safetensors.h"
#include "tests/examples/trainer_harness.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

// 4 ranks, 10 epochs of a 1280-example slice (10 steps of 128 each): 100 steps, dropping the
// short last batch so that every epoch's examples are each seen exactly once.
constexpr int64_t kSteps = 100;
constexpr int64_t kKillStep = 37;

std::vector<std::string> job(const fs::path& data, const fs::path& out, const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"--data", data.string(), "--steps", std::to_string(kSteps), "--drop-last", "--log-every",
                                   "20", "--checkpoint-dir", (out / "ckpt").string(), "--checkpoint-every", "25",
                                   "--dump-at", str(kKillStep, ",", kKillStep + 1), "--dump-dir", (out / "dump").string(),
                                   "--record-samples", (out / "samples").string()};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// Two parameter dumps' difference: the max-abs difference relative to the first's max-abs, and
// the root-mean-square difference relative to the first's root mean square.
struct DumpDifference {
  double maxAbs = 0, rms = 0;
  bool bitwise = false;
};
DumpDifference compareDumps(const fs::path& a, const fs::path& b) {
  const auto x = loadSafetensors(a), y = loadSafetensors(b);
  double diff = 0, scale = 0, squaredDiff = 0, squared = 0;
  bool bitwise = x.tensors.size() == y.tensors.size();
  for (size_t k = 0; k < x.tensors.size() && k < y.tensors.size(); ++k) {
    EXPECT_EQ(x.tensors[k].first, y.tensors[k].first);
    const auto xs = x.tensors[k].second.toVector<float>(), ys = y.tensors[k].second.toVector<float>();
    EXPECT_EQ(xs.size(), ys.size()) << x.tensors[k].first;
    for (size_t i = 0; i < xs.size() && i < ys.size(); ++i) {
      const double d = std::fabs(static_cast<double>(xs[i]) - ys[i]);
      diff = std::max(diff, d);
      scale = std::max(scale, static_cast<double>(std::fabs(xs[i])));
      squaredDiff += d * d;
      squared += static_cast<double>(xs[i]) * xs[i];
      bitwise = bitwise && xs[i] == ys[i];
    }
  }
  return {.maxAbs = scale > 0 ? diff / scale : diff,
          .rms = squared > 0 ? std::sqrt(squaredDiff / squared) : std::sqrt(squaredDiff),
          .bitwise = bitwise};
}

class TrainerElastic : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    data_ = new TempDir();
    writeFashionSlice(data_->path(), 1280, 500);
    reference_ = new TempDir();
    const auto r = runProcess(dtrunTrainer(4, job(data_->path(), reference_->path(), {}), {"--elastic"}), 180s);
    ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
    referenceAccuracy_ = finalValue(r.out, "test accuracy").value_or(-1);
  }
  static void TearDownTestSuite() {
    delete data_;
    delete reference_;
  }

  // Kills member 2 during kKillStep at `where` and checks everything the issue asks for.
  void expectTrajectoryKept(const std::string& where) {
    TempDir out;
    const auto r = runProcess(
        dtrunTrainer(4, job(data_->path(), out.path(), {"--fail-at", str("2:", kKillStep, ":", where)}), {"--elastic"}), 180s);
    ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr("rank 2 (pid"));
    EXPECT_THAT(r.err, HasSubstr("exited: signal SIGKILL; the elastic job goes on without it"));
    EXPECT_THAT(r.out, HasSubstr("3 rank(s) go on from step"));
    EXPECT_FALSE(commonFingerprint(r.out, 3).empty()) << "the survivors end with identical parameters";
    // Before the step in which the rank died: bitwise the undisturbed run.
    EXPECT_TRUE(compareDumps(reference_->path() / "dump" / str("step-", kKillStep, ".safetensors"),
                             out.path() / "dump" / str("step-", kKillStep, ".safetensors"))
                    .bitwise)
        << where;
    // After it (redone by three ranks, or committed by the four): the same update up to reassociation.
    EXPECT_LE(compareDumps(reference_->path() / "dump" / str("step-", kKillStep + 1, ".safetensors"),
                           out.path() / "dump" / str("step-", kKillStep + 1, ".safetensors"))
                  .maxAbs,
              1e-5)
        << where;
    const double accuracy = finalValue(r.out, "test accuracy").value_or(-10);
    EXPECT_NEAR(accuracy, referenceAccuracy_, 0.003) << where;
    // Every example of every epoch exactly once: 10 steps of 128 distinct examples per epoch.
    const auto seen = examplesByEpoch(out.path() / "samples", 4);
    ASSERT_EQ(seen.size(), 10u) << where;
    for (const auto& [epoch, ids] : seen) {
      EXPECT_EQ(ids.size(), 1280u) << where << " epoch " << epoch;
      EXPECT_EQ(std::set<int64_t>(ids.begin(), ids.end()).size(), ids.size()) << where << " epoch " << epoch;
    }
  }

  static TempDir* data_;
  static TempDir* reference_;
  static double referenceAccuracy_;
};

TempDir* TrainerElastic::data_ = nullptr;
TempDir* TrainerElastic::reference_ = nullptr;
double TrainerElastic::referenceAccuracy_ = -1;

TEST_F(TrainerElastic, KilledInForward) { expectTrajectoryKept("forward"); }
TEST_F(TrainerElastic, KilledInBackwardWithBucketsInFlight) { expectTrajectoryKept("backward"); }
TEST_F(TrainerElastic, KilledAfterItsCommitVote) { expectTrajectoryKept("commit"); }

TEST_F(TrainerElastic, KilledWhileACheckpointIsWritten) {
  TempDir out;
  const auto r = runProcess(dtrunTrainer(4, job(data_->path(), out.path(), {"--fail-at", "1:50:checkpoint"}), {"--elastic"}), 180s);
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("checkpoint at step 50 (periodic) written"));
  EXPECT_FALSE(commonFingerprint(r.out, 3).empty());
  EXPECT_NEAR(finalValue(r.out, "test accuracy").value_or(-10), referenceAccuracy_, 0.003);
}

TEST_F(TrainerElastic, AReplacementAdmittedAtACheckpointsStepWritesItWithTheOthers) {
  // A checkpoint at every step: the replacement of member 2 is admitted at a step whose
  // checkpoint the members write right after admitting it. It used to skip it and start its
  // first step: a desync on every rank (the members' checkpoint allgather against its first
  // gradient allreduce), which the test below met when an admission fell on a 25th step.
  TempDir out;
  std::vector<std::string> args = job(data_->path(), out.path(), {"--checkpoint-every", "1", "--keep", "2"});
  for (const char* extra : {"--step-pause", "40", "--fail-at", "2:10:forward"}) args.push_back(extra);
  const auto r = runProcess(dtrunTrainer(4, args, {"--elastic", "--max-restarts", "1"}), 180s);
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_EQ(countOccurrences(r.out, "joined at step"), 1) << r.out;
  EXPECT_FALSE(commonFingerprint(r.out, 4).empty()) << r.out;
  const size_t at = r.out.find("joined at step ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string joinedAt = r.out.substr(at + 15, r.out.find(' ', at + 15) - at - 15);
  EXPECT_THAT(r.out, HasSubstr(str("checkpoint at step ", joinedAt, " (periodic) written"))) << r.out;
}

TEST_F(TrainerElastic, WhenEveryMemberDiedTheReplacementsEndTheJobInsteadOfWaitingToBeAdmitted) {
  // Nobody is left to admit the four replacements: each says so within a poll and exits,
  // instead of waiting out its 5-minute join timeout.
  TempDir out;
  std::vector<std::string> args = job(data_->path(), out.path(), {});
  for (const char* extra : {"--step-pause", "20", "--fail-at", "0:20:forward,1:20:forward,2:20:forward,3:20:forward"}) {
    args.push_back(extra);
  }
  const auto r = runProcess(dtrunTrainer(4, args, {"--elastic", "--max-restarts", "1"}), 120s);
  EXPECT_NE(r.exitCode, 0) << r.out << r.err;
  EXPECT_FALSE(r.timedOut) << r.out << r.err;
  EXPECT_EQ(countOccurrences(r.err, "is replaced by member"), 4) << r.err;
  EXPECT_THAT(r.err, HasSubstr("nobody is left to admit this process: every member of epoch 0 is gone (member 0 exited: "
                               "signal SIGKILL, and 3 more)"));
  std::printf("the job ended %.1f s after its start\n", r.seconds);
}

TEST_F(TrainerElastic, KilledFiveTimesAndReplacedEachTimeTheJobEndsAtFullSize) {
  // 200 steps (20 epochs of the slice), paced at 40 ms a step so that each replacement (about
  // half a second from its start to its admission here, more on a loaded machine) joins
  // mid-run. Member 2 dies in step 10; its replacement (member 4) in step 35, or in its first
  // step if it joined later; and so on: five replacements, the last (member 8) trains to the
  // end with the other three.
  // Parameters every 20 steps, so that a run that drifts says where it left the reference.
  std::string dumps;
  for (int at = 20; at <= 200; at += 20) dumps += str(at > 20 ? "," : "", at);
  // AdamW makes this trajectory sensitive to the order of every sum, which the world size (3
  // while a replacement is on its way) and OpenBLAS's kernel decide: with the Haswell kernel the
  // 200 steps end 4e-7 from the undisturbed run; with the Cooperlake (AVX-512) kernel OpenBLAS
  // picks on this project's AMD EPYC machines, 0.10, and a plain run at world 2 instead of 4 (no
  // kill at all) ends 1e-3 from world 4's on the full data set there, 1.5e-5 with Haswell. That
  // is the optimizer's sensitivity, not the recovery's doing; the parameter bound below holds for
  // the kernel it was measured with, so the job runs that one where the CPU has it. The accuracy
  // and the example accounting below hold whatever the kernel.
  std::optional<ScopedEnv> kernel;
  if (__builtin_cpu_supports("avx2")) kernel.emplace("OPENBLAS_CORETYPE", "Haswell");
  const std::vector<std::string> longer = {"--steps", "200", "--dump-at", dumps};
  TempDir reference, out;
  const auto undisturbed = runProcess(dtrunTrainer(4, job(data_->path(), reference.path(), longer), {"--elastic"}), 180s);
  ASSERT_EQ(undisturbed.exitCode, 0) << undisturbed.out << undisturbed.err;
  std::vector<std::string> args = longer;
  for (const char* extra : {"--step-pause", "40", "--fail-at", "2:10:forward,4:35:forward,5:60:backward,6:85:commit,7:110:forward"}) {
    args.push_back(extra);
  }
  const auto r = runProcess(dtrunTrainer(4, job(data_->path(), out.path(), args), {"--elastic", "--max-restarts", "5"}), 240s);
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_EQ(countOccurrences(r.err, "is replaced by member"), 5) << r.err;
  EXPECT_THAT(r.err, HasSubstr("is replaced by member 8 "));
  EXPECT_EQ(countOccurrences(r.out, "joined at step"), 5) << r.out;
  EXPECT_THAT(r.err, HasSubstr("replaced during the job: rank 2"));
  // Back at four ranks with identical parameters, and the undisturbed run's up to reassociation.
  EXPECT_FALSE(commonFingerprint(r.out, 4).empty()) << r.out;
  const DumpDifference final = compareDumps(reference.path() / "dump" / "step-200.safetensors",
                                            out.path() / "dump" / "step-200.safetensors");
  std::printf("after 200 steps, 5 kills and 5 joins: relative difference to the undisturbed run %.3g (max-abs), %.3g (rms)\n",
              final.maxAbs, final.rms);
  for (const auto& line : split(r.out, '\n')) {
    if (line.find("joined at step") != std::string::npos) std::printf("%s\n", line.c_str());
  }
  // Reassociation only (other world sizes sum in other orders); the cosine schedule's learning
  // rate ends near zero, which keeps the difference small (rms 1.3e-7, max-abs 4e-7 to 2e-6,
  // measured over 16 runs). Judged in rms: AdamW steps every parameter by about the learning
  // rate whatever its gradient's size, so a parameter whose gradient is near zero can step one
  // way in one run and not, or the other way, in the other from a 1e-7 difference, and the
  // max-abs difference jumps by a learning rate in one step (7.7e-7 to 2.9e-4 between steps 160
  // and 180: 3 of the flake check's 15 runs on 2 cores, with 0 and 1 busy processes; reproduced,
  // max-abs 1.7e-4 with rms 3.4e-6); a few such parameters among 235k hardly move the rms. Lost
  // or repeated steps are what the example accounting below checks exactly. A longer schedule
  // still running at a high rate amplifies the difference (a 300-step run ended 9e-2 apart in
  // max-abs, its accuracy within 0.3 points all the same), so this bound is for this schedule only.
  EXPECT_LE(final.rms, 1e-4) << "every 20 steps (max-abs, rms): " << [&] {
    std::string trail;
    for (int at = 20; at <= 200; at += 20) {
      const DumpDifference d = compareDumps(reference.path() / "dump" / str("step-", at, ".safetensors"),
                                            out.path() / "dump" / str("step-", at, ".safetensors"));
      trail += str("step ", at, " ", d.maxAbs, " ", d.rms, "; ");
    }
    return trail;
  }() << "\n" << r.out << r.err;
  EXPECT_NEAR(finalValue(r.out, "test accuracy").value_or(-10), finalValue(undisturbed.out, "test accuracy").value_or(-1), 0.003);
  // No step lost, no example skipped or repeated, over every member that ever trained.
  const auto seen = examplesByEpoch(out.path() / "samples", 9);
  ASSERT_EQ(seen.size(), 20u);
  for (const auto& [epoch, ids] : seen) {
    EXPECT_EQ(ids.size(), 1280u) << "epoch " << epoch;
    EXPECT_EQ(std::set<int64_t>(ids.begin(), ids.end()).size(), ids.size()) << "epoch " << epoch;
  }
}

}  // namespace
}  // namespace dt::testing
