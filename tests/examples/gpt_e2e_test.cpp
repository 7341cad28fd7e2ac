// examples/gpt end to end under dtrun, on a tiny configuration of the real job (Debian's
// fortunes): 1, 2 and 4 ranks with the same global batch reach the same validation loss
// (within 1 %), a seed and world size give bitwise the same model, and resuming from a
// checkpoint is exact; the metrics file and the sample are written; --tp 2 (with and without
// --sp, over DDP, ZeRO-2 and fsdp) reaches DDP's validation loss and draws a sample, its
// checkpoints resume at --tp 1 and under other shardings, and the combinations not built yet
// are refused in one line. Elastic --tp: gpt_elastic_test.cpp.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include <gtest/gtest.h>

#include "common/strings.h"
#include "tests/launcher/dtrun_process.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;

const std::vector<std::string> kTiny{"--layers", "1", "--heads", "2", "--width", "32", "--context", "16",
                                     "--global-batch", "8", "--steps", "30", "--warmup", "3", "--eval-every", "0",
                                     "--eval-windows", "48", "--log-every", "10", "--sample-tokens", "24"};

ProcessResult runGpt(int nproc, const std::vector<std::string>& extra) {
  std::vector<std::string> argv{DTRUN_PATH, "--standalone", "--nproc", std::to_string(nproc), GPT_PATH};
  argv.insert(argv.end(), kTiny.begin(), kTiny.end());
  argv.insert(argv.end(), extra.begin(), extra.end());
  ProcessResult r = runProcess(argv, 120s);
  EXPECT_EQ(r.exitCode, 0) << r.out << r.err;
  return r;
}

std::optional<double> validationLoss(const std::string& out) {
  static const std::regex done(R"(gpt: done: .*validation loss ([0-9.]+))");
  std::smatch m;
  if (!std::regex_search(out, m, done)) return std::nullopt;
  return std::stod(m[1].str());
}

// The fingerprint every rank printed (a test failure, and "", when they differ or one is missing).
std::string fingerprint(const std::string& out, int world) {
  static const std::regex line(R"(gpt: rank (\d+)/\d+ final parameters fingerprint ([0-9a-f]{16}))");
  std::map<int, std::string> seen;
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) seen[std::stoi((*it)[1])] = (*it)[2];
  EXPECT_EQ(static_cast<int>(seen.size()), world) << out;
  for (const auto& [rank, f] : seen) {
    EXPECT_EQ(f, seen.begin()->second) << "rank " << rank << " differs\n" << out;
  }
  return seen.empty() ? "" : seen.begin()->second;
}

TEST(GptE2e, OneTwoAndFourRanksReachTheSameValidationLossAndASeedRepeats) {
  std::map<int, double> loss;
  std::string twoRanks;
  for (int world : {1, 2, 4}) {
    const ProcessResult r = runGpt(world, {"--checkpoint-dir", "none"});
    const auto v = validationLoss(r.out);
    ASSERT_TRUE(v) << r.out;
    loss[world] = *v;
    if (world == 2) twoRanks = fingerprint(r.out, 2);
    if (world == 4) fingerprint(r.out, 4);
    EXPECT_NE(r.out.find("gpt: sample (temperature"), std::string::npos) << r.out;
  }
  EXPECT_LT(loss[1], 4.5);  // it learned: an untrained byte model scores ln 256 = 5.55
  for (int world : {2, 4}) {
    EXPECT_LT(std::fabs(loss[world] - loss[1]) / loss[1], 0.01) << "world " << world << ": " << loss[world] << " vs " << loss[1];
  }
  const ProcessResult again = runGpt(2, {"--checkpoint-dir", "none"});
  EXPECT_EQ(fingerprint(again.out, 2), twoRanks) << "the same seed and world size must give the same parameters";
  const ProcessResult otherSeed = runGpt(2, {"--checkpoint-dir", "none", "--seed", "3", "--steps", "4", "--warmup", "1"});
  EXPECT_NE(fingerprint(otherSeed.out, 2), twoRanks);
}

TEST(GptE2e, ResumingFromACheckpointIsExactAndTheMetricsFileContinues) {
  TempDir dir;
  const std::string ckpt = (dir.path() / "ckpt").string(), metrics = (dir.path() / "m.jsonl").string();
  const std::vector<std::string> flags{"--checkpoint-dir", ckpt, "--checkpoint-every", "10", "--metrics", metrics};
  const ProcessResult full = runGpt(2, flags);
  const std::string uninterrupted = fingerprint(full.out, 2);
  // As if the job had died after step 20: its last checkpoint is step 20's, the metrics file
  // holds the lines up to 30 that the resumed run must replace.
  for (const char* ext : {".json", ".safetensors"}) std::filesystem::remove(dir.path() / "ckpt" / str("step-00000030", ext));
  const ProcessResult resumed = runGpt(2, flags);
  EXPECT_NE(resumed.out.find("resumed from"), std::string::npos) << resumed.out;
  EXPECT_NE(resumed.out.find("step 20"), std::string::npos) << resumed.out;
  EXPECT_EQ(fingerprint(resumed.out, 2), uninterrupted) << "resume must be bitwise exact";
  std::ifstream in(metrics);
  std::vector<int64_t> steps;
  std::string line;
  while (std::getline(in, line)) {
    for (const char* key : {"\"loss\": ", "\"val_loss\": ", "\"lr\": ", "\"grad_norm\": ", "\"tokens_per_s\": "}) {
      EXPECT_NE(line.find(key), std::string::npos) << line;
    }
    steps.push_back(std::stoll(line.substr(line.find("\"step\": ") + 8)));
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{10, 20, 30})) << "one line per logged step, none twice";
  // A run with other settings refuses the checkpoint and says which.
  std::vector<std::string> argv{DTRUN_PATH, "--standalone", "--nproc", "2", GPT_PATH};
  argv.insert(argv.end(), kTiny.begin(), kTiny.end());
  for (const char* a : {"--checkpoint-dir", ckpt.c_str(), "--lr", "0.01"}) argv.emplace_back(a);
  const ProcessResult refused = runProcess(argv, 60s);
  EXPECT_NE(refused.exitCode, 0);
  EXPECT_NE((refused.out + refused.err).find("lr = "), std::string::npos) << refused.out << refused.err;
}

// Every --sharding mode trains the job to DDP's validation loss. The model is wide enough for
// several DDP buckets, so that DDP plans them again after its first (settling) iteration: ZeRO-2
// used to free the gradient buckets in that iteration, and the new plan then copied the
// gradients out of freed memory (SIGSEGV).
TEST(GptE2e, EveryShardingModeReachesDdpsValidationLoss) {
  const std::vector<std::string> wide{"--layers",  "4", "--width", "256", "--steps", "3", "--warmup", "1",
                                      "--checkpoint-dir", "none", "--sample-tokens", "0"};
  std::map<std::string, double> loss;
  for (const char* mode : {"ddp", "zero1", "zero2", "fsdp", "fsdp-keep"}) {
    std::vector<std::string> extra = wide;
    extra.insert(extra.end(), {"--sharding", mode});
    const ProcessResult r = runGpt(2, extra);
    const auto l = validationLoss(r.out);
    ASSERT_TRUE(l.has_value()) << mode << ":\n" << r.out << r.err;
    loss[mode] = *l;
  }
  for (const auto& [mode, l] : loss) {
    EXPECT_LT(std::fabs(l - loss["ddp"]) / loss["ddp"], 1e-3) << mode << ": " << l << " vs ddp's " << loss["ddp"];
  }
}

// Four ranks as {dp: 2, tp: 2}: the same validation loss as DDP over four (the bar of the
// sharding modes above), and a checkpoint written at --tp 2 resumed at --tp 1 (its shards
// reassembled into whole tensors by name and global shape) finishes where the --tp 2 run did.
TEST(GptE2e, TensorParallelReachesDdpsValidationLossAndItsCheckpointResumesWithout) {
  TempDir dir;
  const std::string ckpt = (dir.path() / "ckpt").string();
  const auto ddp = validationLoss(runGpt(4, {"--checkpoint-dir", "none"}).out);
  ASSERT_TRUE(ddp.has_value());
  for (bool sequenceParallel : {false, true}) {
    std::vector<std::string> extra{"--tp", "2", "--checkpoint-dir", sequenceParallel ? "none" : ckpt, "--checkpoint-every", "10"};
    if (sequenceParallel) extra.emplace_back("--sp");
    const ProcessResult r = runGpt(4, extra);
    EXPECT_NE(r.out.find("TP=2"), std::string::npos) << r.out;
    const auto tp = validationLoss(r.out);
    ASSERT_TRUE(tp.has_value()) << r.out << r.err;
    EXPECT_LT(std::fabs(*tp - *ddp) / *ddp, 1e-3) << (sequenceParallel ? "--tp 2 --sp: " : "--tp 2: ") << *tp
                                                   << " vs ddp's " << *ddp;
    // The sample: rank 0's tensor-parallel group generates together (parallel_test checks the tokens).
    EXPECT_NE(r.out.find("gpt: sample (temperature"), std::string::npos) << r.out;
  }
  const auto tpLoss = validationLoss(runGpt(4, {"--tp", "2", "--checkpoint-dir", "none"}).out);
  // As if the --tp 2 job had died after step 20; it resumes without tensor parallelism.
  for (const auto& entry : std::filesystem::directory_iterator(dir.path() / "ckpt")) {
    if (entry.path().filename().string().starts_with("step-00000030")) std::filesystem::remove(entry.path());
  }
  const ProcessResult resumed = runGpt(4, {"--tp", "1", "--checkpoint-dir", ckpt});
  EXPECT_NE(resumed.out.find("resumed from"), std::string::npos) << resumed.out;
  EXPECT_NE(resumed.out.find("step 20"), std::string::npos) << resumed.out;
  const auto after = validationLoss(resumed.out);
  ASSERT_TRUE(after.has_value() && tpLoss.has_value()) << resumed.out;
  EXPECT_LT(std::fabs(*after - *tpLoss) / *tpLoss, 1e-3) << "resumed at --tp 1: " << *after << " vs --tp 2's " << *tpLoss;
}

// TP inside ZeRO-2 and the fully sharded wrapper: DDP's validation loss, and a checkpoint
// written after step 20 (each TP block's wrapper shards placed in the global tensors) resumes
// without TP, under the other wrapper, and on two ranks, each finishing where the run did.
TEST(GptE2e, TensorParallelInsideZeroAndTheFullyShardedWrapperReachesDdpsValidationLossAndResumesAnywhere) {
  const auto ddp = validationLoss(runGpt(4, {"--checkpoint-dir", "none"}).out);
  ASSERT_TRUE(ddp.has_value());
  for (const char* sharding : {"zero2", "fsdp"}) {
    TempDir dir;
    const std::string ckpt = (dir.path() / "ckpt").string();
    const ProcessResult r =
        runGpt(4, {"--tp", "2", "--sp", "--sharding", sharding, "--checkpoint-dir", ckpt, "--checkpoint-every", "10"});
    const auto tp = validationLoss(r.out);
    ASSERT_TRUE(tp.has_value()) << sharding << ": " << r.out << r.err;
    EXPECT_LT(std::fabs(*tp - *ddp) / *ddp, 1e-3) << "--tp 2 --sp --sharding " << sharding << ": " << *tp
                                                   << " vs ddp's " << *ddp;
    // As if the job had died after step 20.
    for (const auto& entry : std::filesystem::directory_iterator(ckpt)) {
      if (entry.path().filename().string().starts_with("step-00000030")) std::filesystem::remove(entry.path());
    }
    const std::string other = std::string(sharding) == "fsdp" ? "zero2" : "fsdp";
    const std::vector<std::pair<int, std::vector<std::string>>> resumes{
        {4, {"--tp", "1", "--sharding", "ddp"}}, {4, {"--tp", "2", "--sp", "--sharding", other}}, {2, {"--tp", "2"}}};
    for (const auto& [world, flags] : resumes) {
      // Each from its own copy: a resumed run writes its own final checkpoint.
      const std::string copy = (dir.path() / str("resume", world, flags.size())).string();
      std::filesystem::copy(ckpt, copy);
      std::vector<std::string> extra = flags;
      extra.insert(extra.end(), {"--checkpoint-dir", copy});
      const ProcessResult resumed = runGpt(world, extra);
      const std::string what = str("written by --tp 2 --sharding ", sharding, ", resumed on ", world, " ranks with ", join(flags, " "));
      EXPECT_NE(resumed.out.find("resumed from"), std::string::npos) << what << "\n" << resumed.out;
      const auto after = validationLoss(resumed.out);
      ASSERT_TRUE(after.has_value()) << what << "\n" << resumed.out << resumed.err;
      EXPECT_LT(std::fabs(*after - *tp) / *tp, 1e-3) << what << ": " << *after << " vs the run's " << *tp;
    }
  }
}

TEST(GptE2e, TensorParallelShardedUnderElasticNeedsACheckpointDir) {
  std::vector<std::string> elastic{DTRUN_PATH, "--standalone", "--elastic", "--nproc", "2", GPT_PATH};
  elastic.insert(elastic.end(), kTiny.begin(), kTiny.end());
  // TP inside a sharded wrapper is elastic (gpt_elastic_test.cpp), but a lost replica's rows
  // come back only from a checkpoint: without a folder the loop refuses before training.
  for (const char* a : {"--checkpoint-dir", "none", "--tp", "2", "--sharding", "zero1"}) elastic.emplace_back(a);
  const ProcessResult refused = runProcess(elastic, 60s);
  EXPECT_NE(refused.exitCode, 0);
  EXPECT_NE((refused.out + refused.err)
                .find("gpt: tensor parallelism (tensorParallel 2) with Sharding::Zero1 under dtrun --elastic needs "
                      "LoopOptions::checkpointDir: a lost rank's shards have no other copy and come back from the newest "
                      "checkpoint; set one, or use Sharding::None (DDP over the replicas)"),
            std::string::npos)
      << refused.out << refused.err;
}

}  // namespace
}  // namespace dt::testing
