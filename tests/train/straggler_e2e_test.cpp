// Straggler detection under dtrun, through programs on the training loop (tests/train/loop_worker,
// the docs' minimal trainer) on 4 ranks: a rank slowed on purpose (DT_TEST_SLOW_RANK: 200 ms in
// each forward, or in each data wait, against a step of about a millisecond) is reported by the
// loop (stdout, the metrics file) and by dtrun with its section, a run without one reports none, and with
// --elastic --evict-stragglers dtrun kills the straggler and the job finishes on 3 ranks.
// The verdicts are the only thing timed: the slowdown is two orders of magnitude over the step,
// so neither a loaded machine nor a quiet one can hide or fake it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <set>

#include "common/strings.h"
#include "tests/examples/trainer_harness.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;

const std::string kMinimalTrainer = MINIMAL_TRAINER_PATH;
const std::string kLoopWorker = LOOP_WORKER_PATH;

// Gathers every 5 steps, a straggler after 20 slow ones: the test's run stays short.
const std::vector<std::string> kKnobs = {"DT_STRAGGLER_EVERY=5", "DT_STRAGGLER_WINDOW=20"};

std::string readFile(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<std::string> withKnobs(std::vector<std::string> extra) {
  extra.insert(extra.begin(), kKnobs.begin(), kKnobs.end());
  return extra;
}

class Stragglers : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    data_ = new TempDir();
    writeFashionSlice(data_->path(), 1280, 200);  // 10 steps of 128 an epoch
  }
  static void TearDownTestSuite() { delete data_; }
  static TempDir* data_;
};
TempDir* Stragglers::data_ = nullptr;

TEST_F(Stragglers, ASlowedRankIsReportedWithItsSectionAndAnEvenRunReportsNone) {
  TempDir out;
  const fs::path metrics = out.path() / "metrics.jsonl";
  const auto r = runProcess(dtrunProgram(4, {}, kLoopWorker, {data_->path().string(), (out.path() / "ck").string(), "40", "--metrics", metrics.string()}),
                            120s, withKnobs({"DT_TEST_SLOW_RANK=2:200"}));
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  // One report, from dtrun, naming rank 2, its host and forward.
  static const std::regex report(
      R"(dtrun: straggler: loop_worker: rank 2 \(host [^)]+\) is a straggler at step (\d+): .* for (\d+) steps; forward \d+ ms against .*: compute-bound)");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m, report)) << r.out << r.err;
  // Within the window: the first gathers that can cover 20 slow steps (a gather's figures
  // end at a multiple of 5; the first step, the slowest for everyone, may cost one gather).
  EXPECT_GE(std::stoi(m[1]), 20) << m[0];
  EXPECT_LE(std::stoi(m[1]), 25) << m[0];
  EXPECT_GE(std::stoi(m[2]), 20) << m[0];
  EXPECT_EQ(countOccurrences(r.err, "dtrun: straggler:"), 1) << "one episode, one report\n" << r.err;
  EXPECT_EQ(countOccurrences(r.out, "is a straggler"), 1) << "rank 0's line\n" << r.out;
  for (int rank = 0; rank < 4; ++rank) EXPECT_THAT(r.out, HasSubstr(str("loop_worker: rank ", rank, "/4 steps 40 ")));
  // And the metrics file has it as a line of its own.
  const std::string lines = readFile(metrics);
  EXPECT_EQ(countOccurrences(lines, "\"straggler\": \"loop_worker: rank 2 "), 1) << lines;
  EXPECT_THAT(lines, HasSubstr(str("{\"step\": ", m[1], ", \"straggler_rank\": 2, \"straggler_member\": 2, \"straggler_ratio\": ")));
  EXPECT_THAT(lines, HasSubstr("\"straggler_section\": \"forward\""));

  TempDir even;
  const auto quiet = runProcess(dtrunProgram(4, {}, kMinimalTrainer, {data_->path().string(), (even.path() / "ck").string(), "80"}),
                                120s, kKnobs);
  ASSERT_EQ(quiet.exitCode, 0) << quiet.out << quiet.err;
  EXPECT_THAT(quiet.out + quiet.err, Not(HasSubstr("straggler"))) << quiet.out << quiet.err;
}

// A rank slow to get its batches (200 ms in its data wait) is named with the data wait and
// "data-bound", not as a slow computation.
TEST_F(Stragglers, ARankSlowToGetItsDataIsReportedDataBound) {
  TempDir out;
  const auto r = runProcess(dtrunProgram(4, {}, kLoopWorker, {data_->path().string(), (out.path() / "ck").string(), "40"}), 120s,
                            withKnobs({"DT_TEST_SLOW_RANK=1:200:data"}));
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  static const std::regex report(
      R"(dtrun: straggler: loop_worker: rank 1 \(host [^)]+\) is a straggler at step \d+: .*; data wait \d+ ms against .*: data-bound)");
  EXPECT_TRUE(std::regex_search(r.err, report)) << r.out << r.err;
  EXPECT_EQ(countOccurrences(r.err, "dtrun: straggler:"), 1) << r.err;
}

TEST_F(Stragglers, EvictedUnderElasticTheJobFinishesOnTheOthers) {
  TempDir out;
  // --max-restarts: an evicted rank is not replaced all the same.
  const auto r = runProcess(dtrunProgram(4, {"--elastic", "--evict-stragglers", "--max-restarts", "1"}, kMinimalTrainer,
                                         {data_->path().string(), (out.path() / "ck").string(), "40"}),
                            120s, withKnobs({"DT_TEST_SLOW_RANK=1:200"}));
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("dtrun: straggler: minimal_trainer: rank 1 (host "));
  EXPECT_THAT(r.err, HasSubstr("rank 1 (pid "));
  EXPECT_THAT(r.err, HasSubstr(") was evicted as a straggler (--evict-stragglers): dtrun kills it (SIGKILL) and does not replace it"));
  EXPECT_THAT(r.out, HasSubstr("3 rank(s) go on from step"));
  EXPECT_THAT(r.err, HasSubstr("the elastic job finished without rank 1 (signal SIGKILL (sent by dtrun: evicted as a straggler"));
  EXPECT_THAT(r.err, Not(HasSubstr("out-of-memory")));
  EXPECT_THAT(r.err, Not(HasSubstr("is replaced by")));
  std::set<std::string> fingerprints;
  static const std::regex done(R"(minimal_trainer: rank \d/3 done after 40 steps; fingerprint ([0-9a-f]{16}))");
  for (std::sregex_iterator it(r.out.begin(), r.out.end(), done), end; it != end; ++it) fingerprints.insert((*it)[1]);
  EXPECT_EQ(countOccurrences(r.out, "/3 done after 40 steps"), 3) << r.out;
  EXPECT_EQ(fingerprints.size(), 1u) << "the three survivors hold the same model\n" << r.out;
}

TEST_F(Stragglers, EvictionWithoutElasticIsRefusedInOneLine) {
  const auto r = runProcess(dtrunProgram(2, {"--evict-stragglers"}, kMinimalTrainer, {data_->path().string(), "ck", "1"}), 30s);
  EXPECT_EQ(r.exitCode, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--evict-stragglers needs --elastic"));
}

}  // namespace
}  // namespace dt::testing
