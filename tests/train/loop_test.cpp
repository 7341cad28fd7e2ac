// The training loop library (train/loop.h) through programs on it, under dtrun: the docs'
// minimal trainer killed and replaced under --elastic, user state carried through a kill, a
// join and a resume at another world size, pre-emption by SIGTERM at a random step with a
// bitwise resume, and misuse that reads as an error at the call instead of a hang.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include "common/strings.h"
#include "tests/examples/trainer_harness.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

const std::string kMinimalTrainer = MINIMAL_TRAINER_PATH;
const std::string kLoopWorker = LOOP_WORKER_PATH;

// The minimal trainer's last line per rank: rank -> {fingerprint, test accuracy}.
std::map<int, std::pair<std::string, double>> minimalResults(const std::string& out) {
  static const std::regex line(R"(minimal_trainer: rank (\d+)/\d+ done after \d+ steps; fingerprint ([0-9a-f]{16}); test accuracy ([0-9.]+))");
  std::map<int, std::pair<std::string, double>> results;
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) {
    results[std::stoi((*it)[1])] = {(*it)[2], std::stod((*it)[3])};
  }
  return results;
}

struct WorkerLine {
  int64_t steps = 0, counter = 0;
  std::string ema, params;
  double emaSum = 0;
  bool stopped = false;
};
// loop_worker's last line per rank.
std::map<int, WorkerLine> workerLines(const std::string& out) {
  static const std::regex line(
      R"(loop_worker: rank (\d+)/\d+ steps (\d+) counter (\d+) ema ([0-9a-f]{16}) ema_sum (\S+) params ([0-9a-f]{16}) stopped (\d))");
  std::map<int, WorkerLine> lines;
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) {
    lines[std::stoi((*it)[1])] = {std::stoll((*it)[2]), std::stoll((*it)[3]), (*it)[4], (*it)[6], std::stod((*it)[5]),
                                  (*it)[7] == "1"};
  }
  return lines;
}

class TrainLoop : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    data_ = new TempDir();
    writeFashionSlice(data_->path(), 1280, 500);  // 10 steps of 128 an epoch
  }
  static void TearDownTestSuite() { delete data_; }
  static TempDir* data_;
};
TempDir* TrainLoop::data_ = nullptr;

TEST_F(TrainLoop, TheDocsMinimalTrainerSurvivesAKillAndAReplacement) {
  TempDir reference, out;
  const auto undisturbed = runProcess(dtrunProgram(4, {"--elastic"}, kMinimalTrainer, {data_->path().string(), reference.path() / "ck", "100"}), 180s);
  ASSERT_EQ(undisturbed.exitCode, 0) << undisturbed.out << undisturbed.err;
  const auto expected = minimalResults(undisturbed.out);
  ASSERT_EQ(expected.size(), 4u) << undisturbed.out;

  // Member 2 dies in step 30's backward with buckets in flight; its replacement joins by step 60.
  const auto r = runProcess(dtrunProgram(4, {"--elastic", "--max-restarts", "1"}, kMinimalTrainer, {data_->path().string(), out.path() / "ck", "100"}),
                            180s, {"DT_TEST_FAIL_AT=2:30:backward", "DT_TEST_STEP_PAUSE_MS=20", "DT_TEST_WAIT_FOR_JOINER_AT=60",
                                   str("DT_TEST_RECORD_SAMPLES=", (out.path() / "samples").string())});
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("go on from step 30 without rank 2 exited: signal SIGKILL"));
  EXPECT_EQ(countOccurrences(r.out, "joined at step"), 1) << r.out;
  const auto results = minimalResults(r.out);
  ASSERT_EQ(results.size(), 4u) << r.out;
  for (const auto& [rank, result] : results) {
    EXPECT_EQ(result.first, results.at(0).first) << "rank " << rank << "\n" << r.out;
    EXPECT_NEAR(result.second, expected.at(0).second, 0.003) << "rank " << rank;
  }
  const auto seen = examplesByEpoch(out.path() / "samples", 5);
  ASSERT_EQ(seen.size(), 10u);
  for (const auto& [epoch, ids] : seen) {
    EXPECT_EQ(ids.size(), 1280u) << "epoch " << epoch;
    EXPECT_EQ(std::set<int64_t>(ids.begin(), ids.end()).size(), ids.size()) << "epoch " << epoch;
  }
}

TEST_F(TrainLoop, UserStateSurvivesAKillAJoinAndAResumeAtAnotherWorldSize) {
  TempDir reference, out;
  const std::string data = data_->path().string();
  const auto undisturbed = runProcess(dtrunProgram(4, {}, kLoopWorker, {data, reference.path().string(), "60"}), 180s);
  ASSERT_EQ(undisturbed.exitCode, 0) << undisturbed.out << undisturbed.err;
  const WorkerLine expected = workerLines(undisturbed.out).at(0);
  EXPECT_EQ(expected.counter, 60);

  // 40 steps at 4 ranks; member 1 dies in step 12 and its replacement joins by step 30.
  const auto killed = runProcess(dtrunProgram(4, {"--elastic", "--max-restarts", "1"}, kLoopWorker, {data, out.path().string(), "40", "--pause-ms", "30"}),
                                 180s, {"DT_TEST_FAIL_AT=1:12:forward", "DT_TEST_WAIT_FOR_JOINER_AT=30"});
  ASSERT_EQ(killed.exitCode, 0) << killed.out << killed.err;
  EXPECT_EQ(countOccurrences(killed.out, "joined at step"), 1) << killed.out;
  auto lines = workerLines(killed.out);
  ASSERT_EQ(lines.size(), 4u) << killed.out;
  for (const auto& [rank, line] : lines) {
    EXPECT_EQ(line.counter, 40) << "rank " << rank << " (the joiner's counter came with the state)";
    EXPECT_EQ(line.ema, lines.at(0).ema) << "rank " << rank << ": the moving average differs";
  }

  // The same folder at 2 ranks: the counter and the average continue from step 40's checkpoint.
  const auto resumed = runProcess(dtrunProgram(2, {}, kLoopWorker, {data, out.path().string(), "60"}), 180s);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.out << resumed.err;
  EXPECT_THAT(resumed.out, HasSubstr("resumed from"));
  EXPECT_THAT(resumed.out, HasSubstr("(step 40, "));
  lines = workerLines(resumed.out);
  ASSERT_EQ(lines.size(), 2u) << resumed.out;
  for (const auto& [rank, line] : lines) {
    EXPECT_EQ(line.counter, 60) << "rank " << rank;
    EXPECT_EQ(line.ema, lines.at(0).ema) << "rank " << rank;
    // Other world sizes sum in other orders; a moving average restarted at step 40 from the
    // weights would be off by far more.
    EXPECT_NEAR(line.emaSum, expected.emaSum, 1e-4 * std::max(1.0, std::abs(expected.emaSum))) << "rank " << rank;
  }
}

TEST_F(TrainLoop, SigtermAtARandomStepThenResumeIsBitwise) {
  TempDir reference, out;
  const std::vector<std::string> extra = {"--micro-batches", "2", "--clip", "0.5", "--pause-ms", "15"};
  auto args = [&](const TempDir& dir) {
    std::vector<std::string> a = {data_->path().string(), dir.path().string(), "60"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const auto uninterrupted = runProcess(dtrunProgram(2, {}, kLoopWorker, args(reference)), 180s);
  ASSERT_EQ(uninterrupted.exitCode, 0) << uninterrupted.out << uninterrupted.err;
  const WorkerLine expected = workerLines(uninterrupted.out).at(0);

  std::mt19937 random(std::random_device{}());
  const auto delay = std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 300)(random));
  {
    ChildProcess job(dtrunProgram(2, {}, kLoopWorker, args(out)));
    ASSERT_TRUE(job.waitForOutput("step 10/60", 120s)) << job.output();
    std::this_thread::sleep_for(delay);  // a random step after the 10th
    job.signal(SIGTERM);
    const auto r = job.wait(120s);
    ASSERT_EQ(r.exitCode, 128 + SIGTERM) << "dtrun reports the signal it got\n" << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("stopped by SIGTERM after step"));
    const auto lines = workerLines(r.out);
    ASSERT_EQ(lines.size(), 2u) << r.out;
    std::printf("SIGTERM %lld ms after step 10: stopped after step %lld\n", static_cast<long long>(delay.count()),
                static_cast<long long>(lines.at(0).steps));
    EXPECT_TRUE(lines.at(0).stopped && lines.at(1).stopped);
    EXPECT_EQ(lines.at(0).params, lines.at(1).params);
  }
  const auto resumed = runProcess(dtrunProgram(2, {}, kLoopWorker, args(out)), 180s);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.out << resumed.err;
  EXPECT_THAT(resumed.out, HasSubstr("resumed from"));
  const auto lines = workerLines(resumed.out);
  ASSERT_EQ(lines.size(), 2u) << resumed.out;
  EXPECT_EQ(lines.at(0).params, expected.params) << "the resumed run's parameters are not the uninterrupted run's";
  EXPECT_EQ(lines.at(0).ema, expected.ema);
  EXPECT_EQ(lines.at(0).counter, 60);
}

TEST_F(TrainLoop, MisuseReadsAsAnErrorAtTheCall) {
  const std::string data = data_->path().string();
  {
    TempDir out;
    const auto r = runProcess(dtrunProgram(1, {}, kLoopWorker, {data, out.path().string(), "5", "--other-optimizer"}), 60s);
    EXPECT_NE(r.exitCode, 0);
    EXPECT_THAT(r.err, HasSubstr("the optimizer does not update the model's parameter \"0.weight\" (float32[32, 784]"));
  }
  {
    TempDir out;
    const auto r = runProcess(dtrunProgram(1, {}, kLoopWorker, {data, out.path().string(), "5", "--no-backward"}), 60s);
    EXPECT_NE(r.exitCode, 0);
    EXPECT_THAT(r.err, HasSubstr("the loss the step function returned at step 0 does not require a gradient"));
  }
  {
    // A non-dt exception in one rank's step: named with its rank and step; the job ends, no hang.
    TempDir out;
    const auto r = runProcess(dtrunProgram(2, {}, kLoopWorker, {data, out.path().string(), "20", "--throw-at", "5"}), 120s);
    EXPECT_NE(r.exitCode, 0);
    EXPECT_FALSE(r.timedOut);
    EXPECT_THAT(r.err, HasSubstr("): the step function threw at step 5: the user's step failed on purpose"));
  }
}

// Member 1 dies in step 15's backward (reduce-scatters in flight): the others go back to step
// 10's checkpoint at world 3; its replacement joins by step 30 and receives its parts.
void expectShardedRecoveryFromTheCheckpoint(const std::string& data, const std::vector<std::string>& sharding) {
  TempDir out;
  std::vector<std::string> argv{data, out.path().string(), "40", "--pause-ms", "20"};
  argv.insert(argv.end(), sharding.begin(), sharding.end());
  const auto r = runProcess(dtrunProgram(4, {"--elastic", "--max-restarts", "1"}, kLoopWorker, argv), 240s,
                            {"DT_TEST_FAIL_AT=1:15:backward", "DT_TEST_WAIT_FOR_JOINER_AT=30"});
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("go on from step 10 (the newest checkpoint: the lost shards have no other copy) without"));
  EXPECT_THAT(r.out, HasSubstr("its shards received in"));
  const auto lines = workerLines(r.out);
  ASSERT_EQ(lines.size(), 4u) << r.out;
  for (const auto& [rank, line] : lines) {
    EXPECT_EQ(line.counter, 40) << "rank " << rank;
    EXPECT_EQ(line.params, lines.at(0).params) << "rank " << rank << ": the whole parameters differ";
    EXPECT_EQ(line.ema, lines.at(0).ema) << "rank " << rank;
  }
}

TEST_F(TrainLoop, FullyShardedUnderElasticALossGoesBackToTheCheckpointAndAJoinerGetsTheShards) {
  expectShardedRecoveryFromTheCheckpoint(data_->path().string(), {"--sharding", "full"});
}

// ZeRO's parts are cut on DDP's bucket layout, which a resumed run restores before it cuts
// them (a fresh run settles it with one iteration first): the resumed run is bitwise the
// uninterrupted one, clipping's partial norms included.
TEST_F(TrainLoop, ZeroTwoResumesBitwise) {
  TempDir out;
  const std::vector<std::string> argv{data_->path().string(), out.path().string(), "30", "--sharding", "zero2", "--clip", "1"};
  const auto full = runProcess(dtrunProgram(2, {}, kLoopWorker, argv), 120s);
  ASSERT_EQ(full.exitCode, 0) << full.out << full.err;
  const auto uninterrupted = workerLines(full.out);
  ASSERT_EQ(uninterrupted.size(), 2u) << full.out;
  EXPECT_EQ(uninterrupted.at(0).params, uninterrupted.at(1).params);
  EXPECT_EQ(uninterrupted.at(0).counter, 30);
  // As if the job had died after step 20: resumed at world 2 from step 20's checkpoint.
  for (const char* ext : {".json", ".safetensors"}) std::filesystem::remove(out.path() / str("step-00000030", ext));
  const auto resumed = runProcess(dtrunProgram(2, {}, kLoopWorker, argv), 120s);
  ASSERT_EQ(resumed.exitCode, 0) << resumed.out << resumed.err;
  EXPECT_THAT(resumed.out, HasSubstr("resumed from"));
  const auto lines = workerLines(resumed.out);
  ASSERT_EQ(lines.size(), 2u) << resumed.out;
  EXPECT_EQ(lines.at(0).params, uninterrupted.at(0).params) << "the resumed ZeRO run is not the uninterrupted one";
  EXPECT_EQ(lines.at(0).ema, uninterrupted.at(0).ema);
}

// A checkpoint written by another mode has no DDP bucket order: the resumed ZeRO run settles
// DDP's buckets before it cuts its parts (cutting them again after the state was loaded read
// past the optimizer's state, found by a mutation of the order's restore).
TEST_F(TrainLoop, ZeroTwoResumesACheckpointOfTheFullyShardedMode) {
  TempDir out;
  const auto full = runProcess(dtrunProgram(2, {}, kLoopWorker, {data_->path().string(), out.path().string(), "20", "--sharding", "full"}), 120s);
  ASSERT_EQ(full.exitCode, 0) << full.out << full.err;
  const auto zero = runProcess(
      dtrunProgram(2, {}, kLoopWorker, {data_->path().string(), out.path().string(), "30", "--sharding", "zero2", "--clip", "1"}), 120s);
  ASSERT_EQ(zero.exitCode, 0) << zero.out << zero.err;
  EXPECT_THAT(zero.out, HasSubstr("resumed from"));
  const auto lines = workerLines(zero.out);
  ASSERT_EQ(lines.size(), 2u) << zero.out;
  EXPECT_EQ(lines.at(0).counter, 30);
  EXPECT_EQ(lines.at(0).params, lines.at(1).params) << "the ranks' parameters differ";
}

// ZeRO's optimizer state of a lost rank has no other copy either: the others rebuild ZeRO and
// the optimizer for the new group and go back to the newest checkpoint; a joiner receives its
// parts from the members.
TEST_F(TrainLoop, ZeroTwoUnderElasticALossGoesBackToTheCheckpointAndAJoinerGetsItsParts) {
  expectShardedRecoveryFromTheCheckpoint(data_->path().string(), {"--sharding", "zero2", "--clip", "1"});
}

TEST_F(TrainLoop, AProfileWindowAndAnomalyModeAreOptions) {
  const std::string data = data_->path().string();
  {
    TempDir out, traces;
    const auto r = runProcess(dtrunProgram(2, {}, kLoopWorker, {data, out.path().string(), "8", "--profile", traces.path().string()}), 120s);
    ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("profile of steps 3-4 written to"));
    for (int rank = 0; rank < 2; ++rank) {
      const std::string trace = folderSnapshot(traces.path())[str("trace-", rank, ".json")];
      EXPECT_THAT(trace, HasSubstr("\"allreduce\"")) << "rank " << rank;
      EXPECT_THAT(trace, HasSubstr("LinearBackward")) << "rank " << rank;
    }
  }
  {
    // An infinity made in step 4's backward: named with the op that made it, and the job ends.
    TempDir out;
    const auto r = runProcess(dtrunProgram(2, {}, kLoopWorker, {data, out.path().string(), "8", "--anomaly", "--nan-at", "4"}), 120s);
    EXPECT_NE(r.exitCode, 0);
    EXPECT_FALSE(r.timedOut);
    EXPECT_THAT(r.err, HasSubstr("SqrtBackward")) << r.err;
  }
}

}  // namespace
}  // namespace dt::testing
