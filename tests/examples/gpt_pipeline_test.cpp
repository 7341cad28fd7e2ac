// examples/gpt --pp under dtrun: the training loop drives the pipeline (train/loop.h). On a tiny
// GPT (4 blocks, dropout off, a fixed seed) every schedule at p = 2 on two processes trains the
// same curve as one process at the same global batch, PP=2 x DP=2 on four processes the same as
// DDP over two (the same data split per replica), and with tensor parallelism inside the stages
// PP=2 x TP=2 (with and without SP) as one process, PP=2 x TP=2 x DP=2 on eight as DDP over two:
// each logged step's loss and gradient norm (the metrics file, 6 significant digits) within 1e-4
// relative, and so is the validation loss at the end (through the stages, forward only).
// Checkpoints hold the stages under the unsplit names: a PP=2 run resumes bitwise at
// PP=2, at PP=1 (one process), a PP=1 run's checkpoint at PP=2 and a PP=2 x TP=2 one at PP=1,
// each finishing on the uninterrupted run's curve. A schedule file of one's own trains the same
// curve, or is refused before the first step. What does not compose yet is refused in one line
// naming the flag and its value.
// PP=2 x DP=2 with ZeRO-1, ZeRO-2 or the fully sharded wrapper over the replicas trains as one
// process (clipping over the stages' shards included; PP=2 x TP=2 x DP=2 on eight as DDP over
// two), each stage gathered once per step however
// many micro-batches (the wrapper's count), and its checkpoint resumes bitwise at the same layout
// and at PP=1. The sample at the end (the stages' parameters gathered to the first pipeline) is
// the one an unsplit process draws from the same parameters (the run's own final checkpoint).
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/strings.h"
#include "tests/launcher/dtrun_process.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;

// 4 blocks: interleaved (v = 2) and zbv need p * 2 = 4 stages at p = 2.
const std::vector<std::string> kTiny{"--layers", "4", "--heads", "2", "--width", "32", "--context", "16", "--dropout", "0",
                                     "--global-batch", "8", "--steps", "4", "--warmup", "1", "--eval-every", "0",
                                     "--eval-windows", "8", "--log-every", "1", "--sample-tokens", "0",
                                     "--checkpoint-dir", "none", "--seed", "5"};

struct Point {
  double loss = 0, gradNorm = 0;
  std::optional<double> valLoss;  // where the step evaluated (the last step: --eval-every 0)
};

std::vector<std::string> gptArgv(int nproc, const std::vector<std::string>& extra) {
  std::vector<std::string> argv{DTRUN_PATH, "--standalone", "--nproc", std::to_string(nproc), GPT_PATH};
  argv.insert(argv.end(), kTiny.begin(), kTiny.end());
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

struct GptRun {
  ProcessResult result;
  std::map<int64_t, Point> curve;
};

// Each logged step's loss and gradient norm from the metrics file rank 0 wrote (to `metrics`,
// or a temporary file).
GptRun train(int nproc, const std::vector<std::string>& extra, std::string metrics = "") {
  std::optional<TempDir> dir;
  if (metrics.empty()) metrics = (dir.emplace().path() / "m.jsonl").string();
  std::vector<std::string> args = extra;
  args.insert(args.end(), {"--metrics", metrics});
  GptRun run{runProcess(gptArgv(nproc, args), 120s), {}};
  const ProcessResult& r = run.result;
  EXPECT_EQ(r.exitCode, 0) << join(extra, " ") << "\n" << r.out << r.err;
  std::map<int64_t, Point>& curve = run.curve;
  static const std::regex line(R"re("step": (\d+).*"loss": ([-0-9.e+]+).*"grad_norm": ([-0-9.e+]+))re");
  static const std::regex valLine(R"re("val_loss": ([-0-9.e+]+))re");
  std::ifstream in(metrics);
  for (std::string text; std::getline(in, text);) {
    std::smatch m;
    if (!std::regex_search(text, m, line)) continue;
    Point& point = curve[std::stoll(m[1].str())];
    point = {std::stod(m[2].str()), std::stod(m[3].str()), std::nullopt};
    if (std::regex_search(text, m, valLine)) point.valLoss = std::stod(m[1].str());
  }
  EXPECT_EQ(curve.size(), 4u) << join(extra, " ") << "\n" << r.out << r.err;
  return run;
}
std::map<int64_t, Point> trainCurve(int nproc, const std::vector<std::string>& extra) { return train(nproc, extra).curve; }

// rank -> the final parameters' fingerprint it printed (under --pp: of its stage).
std::map<int, std::string> fingerprints(const std::string& out) {
  static const std::regex line(R"(gpt: rank (\d+)/\d+ final parameters fingerprint ([0-9a-f]{16}))");
  std::map<int, std::string> seen;
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) seen[std::stoi((*it)[1])] = (*it)[2];
  return seen;
}

// As if the job had died after step 3: its newest checkpoint is step 2's.
void dropFinalCheckpoint(const std::filesystem::path& ckpt) {
  for (const auto& entry : std::filesystem::directory_iterator(ckpt)) {
    if (entry.path().filename().string().starts_with("step-00000004")) std::filesystem::remove(entry.path());
  }
}

void expectSamePoint(const Point& want, const Point& got, const std::string& what) {
  EXPECT_LT(std::fabs(got.loss - want.loss) / want.loss, 1e-4) << what << ": loss " << got.loss << " vs " << want.loss;
  EXPECT_LT(std::fabs(got.gradNorm - want.gradNorm) / want.gradNorm, 1e-4)
      << what << ": grad norm " << got.gradNorm << " vs " << want.gradNorm;
  // Under --pp the validation loss runs through the stages, forward only (Loop::pipelineLoss).
  ASSERT_EQ(got.valLoss.has_value(), want.valLoss.has_value()) << what << ": a validation loss on one side only";
  if (want.valLoss) {
    EXPECT_LT(std::fabs(*got.valLoss - *want.valLoss) / *want.valLoss, 1e-4)
        << what << ": validation loss " << *got.valLoss << " vs " << *want.valLoss;
  }
}

void expectSameCurve(const std::map<int64_t, Point>& reference, const std::map<int64_t, Point>& run, const std::string& what) {
  ASSERT_EQ(run.size(), reference.size()) << what;
  for (const auto& [step, want] : reference) {
    const auto it = run.find(step);
    ASSERT_NE(it, run.end()) << what << ": no step " << step;
    expectSamePoint(want, it->second, str(what, " step ", step));
  }
}

// A p = 2, m = 2 schedule file whose rank 1 receives and runs its forwards as `rank1Forwards` says.
std::string writeSchedule(const TempDir& dir, const std::string& rank1Forwards) {
  const std::string path = (dir.path() / "schedule.txt").string();
  std::ofstream(path) << "schedule reverse-gpipe p=2 m=2 v=1 placement=interleaved\n"
                         "rank 0: F0 SEND_F0 F1 SEND_F1 RECV_B1 B1 RECV_B0 B0\n"
                         "rank 1: " << rank1Forwards << " B1 SEND_B1 B0 SEND_B0\n";
  return path;
}

TEST(GptPipeline, EveryScheduleOnTwoRanksTrainsAsOneProcess) {
  const auto reference = trainCurve(1, {});
  for (const char* schedule : {"gpipe", "1f1b", "interleaved", "zb1", "zbv"}) {
    expectSameCurve(reference, trainCurve(2, {"--pp", "2", "--schedule", schedule, "--micro-batches", "2"}),
                    str("--pp 2 --schedule ", schedule));
  }
  // ZB-H1 with one pending weight gradient per rank (less memory, more bubble) computes the same.
  expectSameCurve(reference, trainCurve(2, {"--pp", "2", "--schedule", "zb1", "--zb-pending", "1", "--micro-batches", "2"}),
                  "--pp 2 --schedule zb1 --zb-pending 1");
  // 1F1B with fewer micro-batches than stages runs (a larger bubble), and so does a split by parameters.
  expectSameCurve(reference, trainCurve(2, {"--pp", "2", "--schedule", "1f1b", "--micro-batches", "1", "--split", "params"}),
                  "--pp 2 --micro-batches 1 --split params");
  // A schedule of one's own (--schedule-file): GPipe's forwards, the backwards in reverse order.
  const TempDir dir;
  const std::string mine = writeSchedule(dir, "RECV_F0 F0 RECV_F1 F1");
  expectSameCurve(reference, trainCurve(2, {"--pp", "2", "--schedule-file", mine}), "--pp 2 --schedule-file");
}

TEST(GptPipeline, PipelineTimesDataParallelOnFourRanksTrainsAsDdpOnTwo) {
  const auto reference = trainCurve(2, {});
  for (const char* schedule : {"gpipe", "1f1b", "interleaved", "zb1", "zbv"}) {
    expectSameCurve(reference, trainCurve(4, {"--pp", "2", "--schedule", schedule, "--micro-batches", "2"}),
                    str("4 ranks --pp 2 --schedule ", schedule));
  }
}

TEST(GptPipeline, TensorParallelInsideTheStagesTrainsAsTheUnsplitModel) {
  const auto one = trainCurve(1, {});
  expectSameCurve(one, trainCurve(4, {"--pp", "2", "--tp", "2", "--schedule", "1f1b", "--micro-batches", "2"}),
                  "4 ranks --pp 2 --tp 2 --schedule 1f1b");
  expectSameCurve(one, trainCurve(4, {"--pp", "2", "--tp", "2", "--sp", "--schedule", "zb1", "--micro-batches", "2"}),
                  "4 ranks --pp 2 --tp 2 --sp --schedule zb1");
  expectSameCurve(trainCurve(2, {}), trainCurve(8, {"--pp", "2", "--tp", "2", "--schedule", "interleaved", "--micro-batches", "2"}),
                  "8 ranks --pp 2 --tp 2 --schedule interleaved (DP=2)");
}

// The step-4 line of a run resumed from step 2: the loss there is step 3's (the loop reports the
// previous step's, reduced with the next step's vote) and the gradient norm step 4's, both
// computed after the resume.
TEST(GptPipeline, CheckpointsResumeAcrossPipelineDegrees) {
  TempDir dir;
  const std::string metrics = (dir.path() / "m.jsonl").string();
  const std::string split = (dir.path() / "split").string(), plain = (dir.path() / "plain").string();
  const std::vector<std::string> pp{"--pp", "2", "--schedule", "1f1b", "--micro-batches", "2"};
  auto with = [](std::vector<std::string> flags, const std::string& ckpt) {
    flags.insert(flags.end(), {"--checkpoint-dir", ckpt, "--checkpoint-every", "2"});
    return flags;
  };
  const GptRun whole = train(2, with(pp, split), metrics);
  const auto stages = fingerprints(whole.result.out);
  EXPECT_EQ(stages.size(), 2u) << whole.result.out;
  dropFinalCheckpoint(split);
  const GptRun again = train(2, with(pp, split), metrics);
  EXPECT_NE(again.result.out.find("resumed from"), std::string::npos) << again.result.out;
  EXPECT_EQ(fingerprints(again.result.out), stages) << "a PP=2 checkpoint resumed at PP=2 must be bitwise exact";
  dropFinalCheckpoint(split);
  const GptRun unsplit = train(1, with({"--micro-batches", "2"}, split), metrics);
  EXPECT_NE(unsplit.result.out.find("resumed from"), std::string::npos) << unsplit.result.out;
  expectSamePoint(whole.curve.at(4), unsplit.curve.at(4), "PP=2 checkpoint resumed at PP=1, step 4");

  const GptRun reference = train(1, with({"--micro-batches", "2"}, plain), metrics);
  dropFinalCheckpoint(plain);
  const GptRun resumedSplit = train(2, with(pp, plain), metrics);
  EXPECT_NE(resumedSplit.result.out.find("resumed from"), std::string::npos) << resumedSplit.result.out;
  expectSamePoint(reference.curve.at(4), resumedSplit.curve.at(4), "PP=1 checkpoint resumed at PP=2, step 4");

  // Tensor-parallel stages: each rank's blocks placed in the global tensors.
  const std::string threeD = (dir.path() / "3d").string();
  const GptRun sharded = train(4, with({"--pp", "2", "--tp", "2", "--sp", "--micro-batches", "2"}, threeD), metrics);
  dropFinalCheckpoint(threeD);
  const GptRun gathered = train(1, with({"--micro-batches", "2"}, threeD), metrics);
  EXPECT_NE(gathered.result.out.find("resumed from"), std::string::npos) << gathered.result.out;
  expectSamePoint(sharded.curve.at(4), gathered.curve.at(4), "PP=2 x TP=2 checkpoint resumed at PP=1, step 4");
}

// rank -> (units, gathers, reduce-scatters) of the last step that the sharded stages reported.
std::map<int, std::array<int, 3>> shardedCounts(const std::string& out) {
  static const std::regex line(
      R"(gpt: rank (\d+)/\d+ sharded stages: (\d+) unit\(s\); last step (\d+) gather\(s\), (\d+) reduce-scatter\(s\))");
  std::map<int, std::array<int, 3>> seen;
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) {
    seen[std::stoi((*it)[1])] = {std::stoi((*it)[2]), std::stoi((*it)[3]), std::stoi((*it)[4])};
  }
  return seen;
}

TEST(GptPipeline, ShardedDataParallelOverThePipelineTrainsAsOneProcessGatheringOncePerStep) {
  // The first logged loss is rank 0's own (its replica's half of the batch, as under DDP): the
  // whole curve against DDP over two, and from step 2 on (the vote's mean over every rank), with
  // every gradient norm, against one process.
  const auto one = trainCurve(1, {}), reference = trainCurve(2, {});
  struct Case {
    const char* sharding;
    const char* schedule;
    const char* microBatches;
  };
  // zbv: rank 0 holds the first and the last stage, the tied embedding in two chunks and one shard.
  for (const Case& c : {Case{"zero1", "1f1b", "2"}, Case{"zero2", "zb1", "2"}, Case{"fsdp", "1f1b", "4"},
                        Case{"fsdp", "zbv", "2"}}) {
    const std::string what = str("4 ranks --pp 2 --sharding ", c.sharding, " --schedule ", c.schedule, " --micro-batches ",
                                 c.microBatches);
    const GptRun run =
        train(4, {"--pp", "2", "--sharding", c.sharding, "--schedule", c.schedule, "--micro-batches", c.microBatches});
    expectSameCurve(reference, run.curve, what);
    for (const auto& [step, want] : one) {
      if (step >= 2 && run.curve.count(step)) expectSamePoint(want, run.curve.at(step), str(what, " against one process, step ", step));
    }
    const auto counts = shardedCounts(run.result.out);
    EXPECT_EQ(counts.size(), 4u) << what << "\n" << run.result.out;
    for (const auto& [rank, n] : counts) {
      // Each stage's blocks and its root unit: gathered and reduced once per step, not once per micro-batch.
      EXPECT_EQ(n[0], 3) << what << " rank " << rank << ": two blocks and the root per rank";
      EXPECT_EQ(n[1], n[0]) << what << " rank " << rank << ": gathers in the last step";
      EXPECT_EQ(n[2], n[0]) << what << " rank " << rank << ": reduce-scatters in the last step";
    }
  }
  // TP inside the sharded stages: PP=2 x TP=2 x DP=2 on eight (no checkpoints: not built there).
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--sharding", "fsdp", "--schedule", "1f1b"},
        std::vector<std::string>{"--sharding", "zero2", "--sp", "--schedule", "zb1"}}) {
    std::vector<std::string> args{"--pp", "2", "--tp", "2", "--micro-batches", "2"};
    args.insert(args.end(), flags.begin(), flags.end());
    const std::string what = str("8 ranks ", join(args, " "));
    const GptRun run = train(8, args);
    expectSameCurve(reference, run.curve, what);
    EXPECT_EQ(shardedCounts(run.result.out).size(), 8u) << what << "\n" << run.result.out;
  }
}

TEST(GptPipeline, ShardedPipelineCheckpointsResumeAtTheSameLayoutAndAtOneStage) {
  TempDir dir;
  const std::string metrics = (dir.path() / "m.jsonl").string();
  struct Case {
    int nproc;
    std::vector<std::string> flags;
  };
  // With TP inside the stages (eight ranks) each rank's rows of its TP blocks go to the global tensors.
  for (const Case& c : {Case{4, {"--sharding", "fsdp"}}, Case{4, {"--sharding", "zero2"}},
                        Case{8, {"--sharding", "fsdp", "--tp", "2", "--sp"}}}) {
    const std::string sharding = join(c.flags, " ");
    const std::string ckpt = (dir.path() / str("ckpt", c.nproc, c.flags[1])).string();
    std::vector<std::string> flags{"--pp", "2", "--micro-batches", "2", "--checkpoint-dir", ckpt, "--checkpoint-every", "2"};
    flags.insert(flags.end(), c.flags.begin(), c.flags.end());
    const GptRun whole = train(c.nproc, flags, metrics);
    const auto stages = fingerprints(whole.result.out);
    EXPECT_EQ(stages.size(), static_cast<size_t>(c.nproc)) << whole.result.out;
    dropFinalCheckpoint(ckpt);
    const GptRun again = train(c.nproc, flags, metrics);
    EXPECT_NE(again.result.out.find("resumed from"), std::string::npos) << again.result.out;
    EXPECT_EQ(fingerprints(again.result.out), stages) << "a PP=2 x --sharding " << sharding << " checkpoint resumed as it was written must be bitwise exact";
    dropFinalCheckpoint(ckpt);
    const GptRun unsplit = train(1, {"--micro-batches", "2", "--checkpoint-dir", ckpt, "--checkpoint-every", "2"}, metrics);
    EXPECT_NE(unsplit.result.out.find("resumed from"), std::string::npos) << unsplit.result.out;
    expectSamePoint(whole.curve.at(4), unsplit.curve.at(4), str("PP=2 x --sharding ", sharding, " checkpoint resumed at PP=1, step 4"));
  }
}

// Rank 0's lines after "gpt: sample (...):", without their "[rank 0] " prefix (a drawn byte may
// be a line break).
std::string sampleOf(const std::string& out) {
  const auto header = out.find("gpt: sample (temperature ");
  if (header == std::string::npos) return "";
  const auto start = out.find('\n', header);
  std::string text;
  for (const std::string& line : split(out.substr(start == std::string::npos ? out.size() : start + 1), '\n')) {
    if (line.starts_with("[rank 0] ")) text += line.substr(9) + "\n";
  }
  return text;
}

TEST(GptPipeline, TheSampleIsTheUnsplitModelsFromTheSameParameters) {
  TempDir dir;
  for (const std::vector<std::string>& layout : {std::vector<std::string>{"2", "--pp", "2", "--schedule", "zbv"},
                                                 std::vector<std::string>{"4", "--pp", "2", "--sharding", "fsdp"}}) {
    const std::string what = join(layout, " ");
    const std::string ckpt = (dir.path() / str("ckpt", layout[0])).string();
    std::vector<std::string> flags(layout.begin() + 1, layout.end());
    flags.insert(flags.end(), {"--micro-batches", "2", "--sample-tokens", "48", "--checkpoint-dir", ckpt});
    // One metrics file for both runs: the resumed one trains no step and writes no line of its own.
    const std::string metrics = (dir.path() / str("m", layout[0], ".jsonl")).string();
    const GptRun split = train(std::stoi(layout[0]), flags, metrics);
    const std::string drawn = sampleOf(split.result.out);
    EXPECT_TRUE(drawn.starts_with("The ") && drawn.size() >= 4u + 48u) << what << ": the prompt and 48 bytes\n" << split.result.out;
    // One process from that run's final checkpoint (step 4 of 4: nothing left to train) holds the
    // same parameters, bit for bit, and draws with the same seed.
    const GptRun unsplit = train(1, {"--micro-batches", "2", "--sample-tokens", "48", "--checkpoint-dir", ckpt}, metrics);
    EXPECT_NE(unsplit.result.out.find("resumed from"), std::string::npos) << unsplit.result.out;
    EXPECT_EQ(drawn, sampleOf(unsplit.result.out)) << what << "\n" << split.result.out << unsplit.result.out;
  }
}

// Each refusal: the job fails, every rank's error is one line, and it names the flag and value.
void expectRefused(int nproc, const std::vector<std::string>& extra, const std::string& words, bool elastic = false) {
  std::vector<std::string> argv = gptArgv(nproc, extra);
  if (elastic) argv.insert(argv.begin() + 2, "--elastic");
  const ProcessResult r = runProcess(argv, 60s);
  EXPECT_NE(r.exitCode, 0) << join(extra, " ");
  const std::string all = r.out + r.err;
  const auto at = all.find(words);
  ASSERT_NE(at, std::string::npos) << join(extra, " ") << ": expected \"" << words << "\" in\n" << all;
  const auto begin = all.rfind('\n', at), end = all.find('\n', at);
  const std::string line = all.substr(begin == std::string::npos ? 0 : begin + 1, end == std::string::npos ? std::string::npos : end - begin - 1);
  EXPECT_NE(line.find("gpt"), std::string::npos) << line;
}

TEST(GptPipeline, RefusesWhatDoesNotComposeYetInOneLine) {
  expectRefused(2, {"--pp", "3"}, "pipeline degree 3 does not divide the world size 2");
  expectRefused(2, {"--pp", "2", "--micro-batches", "3"},
                "the global batch 8 does not split into 1 data-parallel replica(s) (world 2 / pipeline degree 2) of 3 micro-batches");
  expectRefused(2, {"--pp", "2", "--schedule", "zb1", "--micro-batches", "1"},
                "pipeline schedule \"zb1\" over 2 ranks with 1 micro-batch(es)");
  expectRefused(2, {"--pp", "2", "--schedule", "interleaved", "--micro-batches", "2", "--virtual-stages", "4"},
                "gpt: --pp 2 --schedule interleaved --virtual-stages 4 makes 8 stages but --layers is 4");
  expectRefused(2, {"--pp", "2", "--schedule", "zb1", "--micro-batches", "2", "--zb-pending", "3"},
                "at most 3 pending weight gradients per rank; it must be 1 to p=2");
  expectRefused(2, {"--pp", "2", "--schedule", "1f1b", "--zb-pending", "1"},
                "pipeline.maxPendingWeightGrads 1 bounds ZB-H1's deferred weight gradients; use schedule zb1");
  // Sharded stages under --elastic come back from the newest checkpoint after a loss: there must be one.
  expectRefused(4, {"--pp", "2", "--sharding", "fsdp"},
                "pipeline parallelism (pipeline.degree 2) with Sharding::Full under dtrun --elastic needs LoopOptions::checkpointDir",
                /*elastic=*/true);
  const TempDir dir;
  const std::string mine = writeSchedule(dir, "RECV_F0 F0 RECV_F1 F1");
  expectRefused(2, {"--pp", "2", "--schedule-file", mine, "--micro-batches", "4"},
                "(reverse-gpipe, p=2 m=2 v=1): its m is 2 but pipeline.microBatches is 4");
  // Rank 1 waits for micro-batch 1 while rank 0 sends 0 first: the validator's deadlock, before any step.
  const std::string stuck = writeSchedule(dir, "RECV_F1 F1 RECV_F0 F0");
  expectRefused(2, {"--pp", "2", "--schedule-file", stuck}, "(reverse-gpipe, p=2 m=2 v=1): pipeline schedule reverse-gpipe p=2 m=2 v=1 is invalid: deadlock");
}

}  // namespace
}  // namespace dt::testing
