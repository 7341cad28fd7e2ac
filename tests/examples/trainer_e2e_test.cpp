// examples/trainer end to end through dtrun (CPU, a few seconds each): it learns Fashion-MNIST
// with every rank ending identical; 1, 2 and 4 ranks agree; a SIGKILLed worker is named and the
// restarted job resumes from the last checkpoint to the bits of an uninterrupted run; SIGTERM
// and SIGUSR1 checkpoint and exit cleanly; corrupt checkpoints and data files are clear errors
// that name the file and leave the checkpoints untouched.
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "tensor/device.h"
#include "tests/examples/trainer_harness.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A job long enough to be interrupted after its first checkpoint (the signal lands with 900
// of its 1000 steps, a second or more, still to run), on a slice of the data.
std::vector<std::string> interruptibleJob(const fs::path& data) {
  return {"--data", data.string(), "--steps", "1000", "--global-batch", "64", "--dropout", "0.1",
          "--checkpoint-every", "100", "--log-every", "100", "--no-eval"};
}

std::string outputOf(const ProcessResult& r) { return r.out + r.err; }

TEST(TrainerE2E, FourRanksLearnFashionMnistAndEndWithIdenticalParameters) {
  TempDir dir;
  // The real dataset files, as installed by scripts/setup.sh (the trainer's default --data).
  const auto r = runProcess(dtrunTrainer(4, {"--steps", "150", "--log-every", "50", "--checkpoint-every", "50", "--keep", "2",
                                             "--checkpoint-dir", (dir.path() / "ck").string()}),
                            170s);
  const std::string out = outputOf(r);
  ASSERT_EQ(r.exitCode, 0) << out;
  EXPECT_THAT(out, HasSubstr("Fashion-MNIST train: 60000 examples"));
  EXPECT_THAT(out, HasSubstr("global batch 128 (32 per rank)"));
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(epoch 1/1  step 100/150  loss [0-9.]+  [0-9]+ samples/s  elapsed \S+  left \S+)"))) << out;
  const auto loss = finalValue(out, "train loss");
  const auto accuracy = finalValue(out, "test accuracy");
  ASSERT_TRUE(loss && accuracy) << out;
  EXPECT_LT(*loss, 0.65) << "150 steps of AdamW take the training loss from 2.3 to about 0.5";
  EXPECT_GT(*accuracy, 0.78) << "on the 10,000 test images";
  EXPECT_FALSE(commonFingerprint(out, 4).empty());
  EXPECT_EQ(countOccurrences(out, "(spread across ranks 0)"), 4) << out;
  EXPECT_TRUE(fs::exists(dir.path() / "ck" / (checkpointName(150) + ".json"))) << "final checkpoint";
  EXPECT_TRUE(fs::exists(dir.path() / "ck" / (checkpointName(100) + ".safetensors"))) << "periodic checkpoint";
  EXPECT_FALSE(fs::exists(dir.path() / "ck" / (checkpointName(50) + ".json"))) << "--keep 2 removed the oldest";
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path() / "ck"), fs::directory_iterator()), 4) << "two checkpoints, two files each";
}

// On a GPU machine: the same job on cuda and on cpu, resumed from a checkpoint written on
// the other device; NCCL carries the gradients (one rank: NCCL 2.28 refuses two ranks per GPU).
TEST(TrainerE2E, CudaTrainsLikeCpuAndCheckpointsMoveBetweenDevices) {
  if (!deviceAvailable(Device::cuda(0))) GTEST_SKIP() << "needs a CUDA device: " << deviceUnavailableReason(Device::cuda(0));
  TempDir dir;
  writeFashionSlice(dir.path() / "data", 4000, 1000);
  const std::vector<std::string> job = {"--data", (dir.path() / "data").string(), "--steps", "200", "--global-batch", "64",
                                        "--log-every", "50", "--checkpoint-every", "100"};
  std::map<std::string, std::pair<double, double>> results;  // device -> (train loss, test accuracy)
  for (const std::string device : {"cpu", "cuda"}) {
    const auto r = runProcess(dtrunTrainer(1, job + std::vector<std::string>{"--device", device, "--checkpoint-dir",
                                                                            (dir.path() / device).string()}),
                              150s);
    ASSERT_EQ(r.exitCode, 0) << outputOf(r);
    EXPECT_THAT(outputOf(r), HasSubstr(device == "cpu" ? "rank(s) on cpu" : "rank(s) on cuda (rank 0: cuda:0)"));
    const auto loss = finalValue(outputOf(r), "train loss");
    const auto accuracy = finalValue(outputOf(r), "test accuracy");
    ASSERT_TRUE(loss && accuracy) << outputOf(r);
    results[device] = {*loss, *accuracy};
  }
  // Different kernels sum in different orders: close, not bitwise.
  EXPECT_NEAR(results["cuda"].first, results["cpu"].first, 0.05);
  EXPECT_NEAR(results["cuda"].second, results["cpu"].second, 0.02);
  // The cpu run's step-100 checkpoint resumed on cuda (checkpoints hold host copies).
  fs::remove(dir.path() / "cpu" / (checkpointName(200) + ".json"));
  fs::remove(dir.path() / "cpu" / (checkpointName(200) + ".safetensors"));
  const auto resumed = runProcess(dtrunTrainer(1, job + std::vector<std::string>{"--device", "cuda", "--checkpoint-dir",
                                                                                 (dir.path() / "cpu").string()}),
                                  150s);
  ASSERT_EQ(resumed.exitCode, 0) << outputOf(resumed);
  EXPECT_THAT(outputOf(resumed), HasSubstr("resumed from"));
  const auto accuracy = finalValue(outputOf(resumed), "test accuracy");
  ASSERT_TRUE(accuracy) << outputOf(resumed);
  EXPECT_NEAR(*accuracy, results["cpu"].second, 0.02);
}

TEST(TrainerE2E, OneTwoAndFourRanksWithTheSameGlobalBatchAgree) {
  TempDir dir;
  writeFashionSlice(dir.path() / "data", 4000, 1000);
  std::map<int, std::pair<double, double>> results;  // world -> (train loss, test accuracy)
  for (int world : {1, 2, 4}) {
    const auto r = runProcess(dtrunTrainer(world, {"--data", (dir.path() / "data").string(), "--steps", "150", "--global-batch", "64",
                                                   "--log-every", "50", "--checkpoint-dir", "none"}),
                              150s);
    ASSERT_EQ(r.exitCode, 0) << outputOf(r);
    const auto loss = finalValue(outputOf(r), "train loss");
    const auto accuracy = finalValue(outputOf(r), "test accuracy");
    ASSERT_TRUE(loss && accuracy) << outputOf(r);
    results[world] = {*loss, *accuracy};
  }
  // The ranks' batches of each step make up the same global batch at every world size, so only
  // float round-off (the order of the gradient sums) separates the runs.
  for (int world : {2, 4}) {
    EXPECT_NEAR(results[world].first, results[1].first, 0.01) << "train loss at world " << world;
    EXPECT_NEAR(results[world].second, results[1].second, 0.005) << "test accuracy at world " << world;
  }
  EXPECT_LT(results[1].first, 0.8);
}

TEST(TrainerE2E, KilledWorkerIsNamedAndTheRestartResumesToTheBitsOfAnUninterruptedRun) {
  TempDir dir;
  writeFashionSlice(dir.path() / "data", 4000, 500);
  const auto job = interruptibleJob(dir.path() / "data");
  const auto reference = runProcess(dtrunTrainer(4, job + std::vector<std::string>{"--checkpoint-dir", (dir.path() / "ref").string()}), 150s);
  ASSERT_EQ(reference.exitCode, 0) << outputOf(reference);
  const std::string expected = commonFingerprint(outputOf(reference), 4);

  ChildProcess run(dtrunTrainer(4, job + std::vector<std::string>{"--checkpoint-dir", (dir.path() / "ck").string()},
                                {"--max-restarts", "1", "--kill-grace", "5s"}));
  ASSERT_TRUE(run.waitForOutput("checkpoint at step 100 ", 120s)) << run.output();
  const auto pid = workerPid(run.output(), 2);
  ASSERT_TRUE(pid) << run.output();
  ASSERT_EQ(::kill(*pid, SIGKILL), 0);
  const auto r = run.wait(150s);
  const std::string out = outputOf(r);
  ASSERT_EQ(r.exitCode, 0) << out;
  EXPECT_THAT(r.err, HasSubstr("root cause: rank 2 (local rank 2"));
  EXPECT_THAT(r.err, HasSubstr(str("pid ", *pid, "): signal SIGKILL")));
  EXPECT_THAT(r.err, HasSubstr("restart 1 of 1"));
  EXPECT_THAT(out, HasSubstr("trainer: resumed from"));
  EXPECT_THAT(out, HasSubstr("after restart 1"));
  EXPECT_EQ(commonFingerprint(out, 4), expected) << "resumed parameters equal the uninterrupted run's, bit for bit";
  // The final checkpoints hold the same bytes: model, optimizer state and every rank's RNG state.
  const auto a = tensorBytes(dir.path() / "ref" / (checkpointName(1000) + ".safetensors"));
  const auto b = tensorBytes(dir.path() / "ck" / (checkpointName(1000) + ".safetensors"));
  ASSERT_FALSE(a.empty());
  EXPECT_TRUE(a == b) << "final checkpoint tensors differ";
}

TEST(TrainerE2E, SigtermToDtrunCheckpointsEveryRankExitsCleanlyAndANewRunResumes) {
  TempDir dir;
  writeFashionSlice(dir.path() / "data", 4000, 500);
  const auto job = interruptibleJob(dir.path() / "data");
  const auto reference = runProcess(dtrunTrainer(4, job + std::vector<std::string>{"--checkpoint-dir", (dir.path() / "ref").string()}), 150s);
  ASSERT_EQ(reference.exitCode, 0) << outputOf(reference);
  const std::string expected = commonFingerprint(outputOf(reference), 4);

  const std::vector<std::string> args = job + std::vector<std::string>{"--checkpoint-dir", (dir.path() / "ck").string()};
  ChildProcess run(dtrunTrainer(4, args, {"--kill-grace", "30s"}));
  ASSERT_TRUE(run.waitForOutput("checkpoint at step 100 ", 120s)) << run.output();
  run.signal(SIGTERM);
  const auto r = run.wait(120s);
  const std::string out = outputOf(r);
  EXPECT_EQ(r.exitCode, 128 + SIGTERM) << "dtrun reports the signal it got (docs/launcher.md)\n" << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(stopped by SIGTERM after step (\d+) of 1000; checkpoint written)"))) << out;
  const int64_t step = std::stoll(m[1]);
  EXPECT_GE(step, 100);
  EXPECT_LT(step, 1000);
  EXPECT_EQ(countOccurrences(out, str("stopped cleanly after step ", step)), 4) << "every rank stops after the same step\n" << out;
  EXPECT_THAT(out, Not(HasSubstr("sending SIGKILL"))) << "the workers exit within the grace period";
  EXPECT_THAT(out, Not(HasSubstr("also failed")));
  EXPECT_TRUE(fs::exists(dir.path() / "ck" / (checkpointName(step) + ".json")));

  const auto resumed = runProcess(dtrunTrainer(4, args), 150s);
  const std::string out2 = outputOf(resumed);
  ASSERT_EQ(resumed.exitCode, 0) << out2;
  EXPECT_THAT(out2, HasSubstr(str("resumed from ", (dir.path() / "ck" / (checkpointName(step) + ".json")).string(), " (step ", step)));
  EXPECT_EQ(commonFingerprint(out2, 4), expected) << "stopped and resumed equals uninterrupted, bit for bit";
}

TEST(TrainerE2E, Sigusr1StopsEveryRankAtTheSameStepAndDtrunExitsZero) {
  TempDir dir;
  writeFashionSlice(dir.path() / "data", 4000, 500);
  ChildProcess run(dtrunTrainer(2, interruptibleJob(dir.path() / "data") +
                                       std::vector<std::string>{"--checkpoint-dir", (dir.path() / "ck").string()}));
  ASSERT_TRUE(run.waitForOutput("checkpoint at step 100 ", 120s)) << run.output();
  run.signal(SIGUSR1);  // dtrun forwards it and keeps running: the workers decide
  const auto r = run.wait(120s);
  const std::string out = outputOf(r);
  EXPECT_EQ(r.exitCode, 0) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(stopped by SIGUSR1 after step (\d+) of 1000)"))) << out;
  EXPECT_EQ(countOccurrences(out, str("stopped cleanly after step ", m[1].str())), 2) << out;
  EXPECT_TRUE(fs::exists(dir.path() / "ck" / (checkpointName(std::stoll(m[1])) + ".safetensors")));
}

TEST(TrainerE2E, CorruptCheckpointIsNamedAndNothingIsOverwritten) {
  TempDir dir;
  writeFashionSlice(dir.path() / "data", 2000, 200);
  const fs::path ck = dir.path() / "ck";
  const std::vector<std::string> first{"--data", (dir.path() / "data").string(), "--steps", "40", "--global-batch", "32",
                                       "--checkpoint-every", "20", "--checkpoint-dir", ck.string(), "--no-eval"};
  ASSERT_EQ(runProcess(dtrunTrainer(2, first), 120s).exitCode, 0);
  // A longer run would resume from step 40 and write more checkpoints, if it could read step 40.
  std::vector<std::string> longer = first;
  longer[3] = "80";
  const fs::path tensors = ck / (checkpointName(40) + ".safetensors");
  const fs::path manifest = ck / (checkpointName(40) + ".json");
  const auto good = folderSnapshot(ck);

  {  // One flipped byte in the middle of the tensors: the manifest's CRC-32 catches it.
    std::fstream f(tensors, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(fs::file_size(tensors) / 2));
    char c = 0;
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(fs::file_size(tensors) / 2));
    c = static_cast<char>(c ^ 0x10);
    f.write(&c, 1);
  }
  auto before = folderSnapshot(ck);
  auto r = runProcess(dtrunTrainer(2, longer), 120s);
  EXPECT_NE(r.exitCode, 0);
  EXPECT_THAT(outputOf(r), HasSubstr(str("checkpoint file ", tensors.string(), " is corrupt")));
  EXPECT_TRUE(folderSnapshot(ck) == before) << "no checkpoint written, removed or changed";

  // A truncated manifest.
  {
    std::ofstream(tensors, std::ios::binary | std::ios::trunc) << good.at(tensors.filename().string());
    std::ofstream(manifest, std::ios::binary | std::ios::trunc) << good.at(manifest.filename().string()).substr(0, 100);
  }
  before = folderSnapshot(ck);
  r = runProcess(dtrunTrainer(2, longer), 120s);
  EXPECT_NE(r.exitCode, 0);
  EXPECT_THAT(outputOf(r), HasSubstr(str("checkpoint manifest ", manifest.string(), " is corrupt")));
  EXPECT_TRUE(folderSnapshot(ck) == before);

  // A manifest whose tensors file is gone.
  std::ofstream(manifest, std::ios::binary | std::ios::trunc) << good.at(manifest.filename().string());
  fs::remove(tensors);
  before = folderSnapshot(ck);
  r = runProcess(dtrunTrainer(2, longer), 120s);
  EXPECT_NE(r.exitCode, 0);
  EXPECT_THAT(outputOf(r), HasSubstr(str("names ", tensors.string(), ", which does not exist")));
  EXPECT_TRUE(folderSnapshot(ck) == before);
}

TEST(TrainerE2E, CorruptOrMissingDatasetFilesAreNamedAndNothingIsOverwritten) {
  TempDir dir;
  const fs::path data = dir.path() / "data";
  writeFashionSlice(data, 1000, 200);
  const fs::path ck = dir.path() / "ck";
  std::vector<std::string> args{"--data", data.string(), "--steps", "20", "--global-batch", "32", "--checkpoint-dir", ck.string()};
  ASSERT_EQ(runProcess(dtrunTrainer(2, args), 120s).exitCode, 0);
  args[3] = "60";  // would train on and write checkpoints
  const auto before = folderSnapshot(ck);

  const fs::path images = data / "train-images-idx3-ubyte.gz";
  const std::string imageBytes = folderSnapshot(data).at(images.filename().string());
  std::ofstream(images, std::ios::binary | std::ios::trunc) << imageBytes.substr(0, imageBytes.size() / 2);
  auto r = runProcess(dtrunTrainer(2, args), 120s);
  EXPECT_NE(r.exitCode, 0);
  EXPECT_THAT(outputOf(r), HasSubstr(str("IDX file ", images.string(), " is truncated")));

  std::ofstream(images, std::ios::binary | std::ios::trunc) << imageBytes;
  const fs::path labels = data / "t10k-labels-idx1-ubyte.gz";
  std::ofstream(labels, std::ios::binary | std::ios::trunc) << "this is not an IDX file at all";
  r = runProcess(dtrunTrainer(2, args), 120s);
  EXPECT_NE(r.exitCode, 0);
  EXPECT_THAT(outputOf(r), HasSubstr(str("IDX file ", labels.string(), " is not an IDX file")));

  fs::remove(labels);
  r = runProcess(dtrunTrainer(2, args), 120s);
  EXPECT_NE(r.exitCode, 0);
  EXPECT_THAT(outputOf(r), HasSubstr(str("IDX file ", labels.string(), " does not exist")));

  r = runProcess(dtrunTrainer(1, {"--data", (dir.path() / "nowhere").string()}), 60s);
  EXPECT_NE(r.exitCode, 0);
  EXPECT_THAT(outputOf(r), HasSubstr("nowhere does not exist (install Debian's dataset-fashion-mnist package"));

  EXPECT_TRUE(folderSnapshot(ck) == before) << "the checkpoints are untouched";
}

TEST(TrainerE2E, BadSettingsAreOneLineErrorsWithTheValues) {
  TempDir dir;
  writeFashionSlice(dir.path() / "data", 1000, 100);
  const std::string data = (dir.path() / "data").string();
  auto r = runProcess(dtrunTrainer(3, {"--data", data, "--global-batch", "64"}), 60s);
  EXPECT_NE(r.exitCode, 0);
  EXPECT_THAT(outputOf(r), HasSubstr("--global-batch 64 is not divisible by the world size 3"));

  r = runProcess(dtrunTrainer(1, {"--device", "gpu"}), 60s);
  EXPECT_NE(r.exitCode, 0);
  EXPECT_THAT(outputOf(r), HasSubstr("--device \"gpu\" is not one of cpu, cuda, cuda:N"));

  if (!deviceAvailable(Device::cuda(0))) {
    r = runProcess(dtrunTrainer(1, {"--device", "cuda"}), 60s);
    EXPECT_NE(r.exitCode, 0);
    EXPECT_THAT(outputOf(r), HasSubstr("trainer: --device cuda (cuda:0) is not usable here: " +
                                       deviceUnavailableReason(Device::cuda(0)) + "; use --device cpu"));
  }

  r = runProcess(dtrunTrainer(1, {"--lr", "fast"}), 60s);
  EXPECT_NE(r.exitCode, 0);
  EXPECT_THAT(outputOf(r), HasSubstr("--lr \"fast\" is not a number"));

  // Resuming with other settings than the checkpoint's is refused, naming both values.
  const std::string ck = (dir.path() / "ck").string();
  ASSERT_EQ(runProcess(dtrunTrainer(2, {"--data", data, "--steps", "10", "--global-batch", "32", "--checkpoint-dir", ck}), 60s).exitCode, 0);
  r = runProcess(dtrunTrainer(2, {"--data", data, "--steps", "10", "--global-batch", "16", "--checkpoint-dir", ck}), 60s);
  EXPECT_NE(r.exitCode, 0);
  EXPECT_THAT(outputOf(r), HasSubstr("was written with global_batch = 32 but this run has global_batch = 16"));
  // --resume never starts afresh (and clears the old run's checkpoints).
  r = runProcess(dtrunTrainer(2, {"--data", data, "--steps", "10", "--global-batch", "16", "--checkpoint-dir", ck, "--resume", "never"}), 60s);
  EXPECT_EQ(r.exitCode, 0) << outputOf(r);
  EXPECT_THAT(outputOf(r), HasSubstr("--resume never: removed 1 checkpoint(s) of an earlier run"));
}

}  // namespace
}  // namespace dt::testing
