// examples/trainer under a real SLURM cluster (two emulated nodes, started by tests/launcher's
// ctest fixture slurm_fixture.sh, fixture dtrun_slurm): the job submitted with sbatch both ways,
// srun of one dtrun per node and srun of the trainer itself (initProcessGroup reads SLURM's
// variables), and SLURM's pre-emption signal (scancel --signal=USR1) checkpointing the job so
// that the next submission resumes it. SLURM tests never skip: without a cluster they fail.
#include <csignal>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sys/stat.h>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "tests/examples/trainer_harness.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

const std::string kConf = "/tmp/slurm-dtrun-launcher/slurm.conf";  // slurm_fixture.sh's cluster
const std::vector<std::string> kEnv = {"SLURM_CONF=" + kConf};

std::string clusterProblem() {
  if (!fs::exists(kConf)) return "no cluster at " + kConf + " (the dtrun_slurm fixture did not start one; see its output)";
  const auto ping = runProcess({"/bin/sh", "-c", "scontrol ping"}, 30s, kEnv);
  if (ping.exitCode != 0 || ping.out.find("UP") == std::string::npos) return "scontrol ping failed: " + ping.out + ping.err;
  return "";
}

#define REQUIRE_CLUSTER()                                         \
  do {                                                            \
    if (const std::string why = clusterProblem(); !why.empty()) { \
      FAIL() << "SLURM cluster unavailable: " << why;             \
    }                                                             \
  } while (0)

ProcessResult shell(const std::string& command, std::chrono::milliseconds timeout = 180s) {
  return runProcess({"/bin/bash", "-c", command}, timeout, kEnv);
}

std::string readFile(const fs::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

fs::path writeScript(const fs::path& dir, const std::string& name, const std::string& body) {
  const fs::path script = dir / name;
  std::ofstream(script) << "#!/bin/bash\n" << body;
  chmod(script.c_str(), 0755);
  return script;
}

std::string trainerArgs(const fs::path& dir, int steps) {
  return str("--data ", (dir / "data").string(), " --steps ", steps, " --global-batch 64 --log-every 20 --checkpoint-every 50",
             " --checkpoint-dir ", (dir / "ck").string());
}

void expectTrainedAndIdentical(const std::string& text, int world) {
  EXPECT_FALSE(commonFingerprint(text, world).empty()) << text;
  const auto accuracy = finalValue(text, "test accuracy");
  ASSERT_TRUE(accuracy) << text;
  EXPECT_GT(*accuracy, 0.6) << text;
}

TEST(TrainerSlurm, SbatchWithOneDtrunPerNode) {
  REQUIRE_CLUSTER();
  TempDir dir;
  writeFashionSlice(dir.path() / "data", 4000, 500);
  const fs::path output = dir.path() / "job.out";
  const auto script = writeScript(dir.path(), "job.sh",
                                  str("#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --time=3\n#SBATCH --output=", output.string(),
                                      "\nset -e\n# one dtrun per node, two workers each: dtrun takes nodes, ranks and the store address from SLURM\n",
                                      "srun ", kDtrunPath, " --nproc 2 ", kTrainerPath, " ", trainerArgs(dir.path(), 100), "\n"));
  const auto r = shell(str("sbatch --wait ", script.string()));
  const std::string text = readFile(output);
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err << text;
  EXPECT_THAT(text, HasSubstr("trainer: 4 rank(s)"));
  EXPECT_THAT(text, HasSubstr("[rank 3] trainer: rank 3/4"));
  expectTrainedAndIdentical(text, 4);
}

TEST(TrainerSlurm, SbatchWithSrunOfTheTrainerItself) {
  REQUIRE_CLUSTER();
  TempDir dir;
  writeFashionSlice(dir.path() / "data", 4000, 500);
  const fs::path output = dir.path() / "job.out";
  const auto script = writeScript(dir.path(), "job.sh",
                                  str("#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n#SBATCH --time=3\n#SBATCH --output=", output.string(),
                                      "\nset -e\n# no launcher: initProcessGroup reads SLURM_PROCID, SLURM_NTASKS and SLURM_JOB_NODELIST;\n",
                                      "# one intra-op thread per task, as dtrun would set when ranks share a machine\n",
                                      "export DT_NUM_THREADS=1 OMP_NUM_THREADS=1\n",
                                      "srun ", kTrainerPath, " ", trainerArgs(dir.path(), 100), "\n"));
  const auto r = shell(str("sbatch --wait ", script.string()));
  const std::string text = readFile(output);
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err << text;
  EXPECT_THAT(text, HasSubstr("trainer: 4 rank(s)"));
  expectTrainedAndIdentical(text, 4);
}

TEST(TrainerSlurm, PreemptionSignalCheckpointsAndTheNextSubmissionResumes) {
  REQUIRE_CLUSTER();
  TempDir dir;
  writeFashionSlice(dir.path() / "data", 4000, 500);
  const fs::path output = dir.path() / "job.out";
  const fs::path output2 = dir.path() / "job2.out";
  const std::string body = str("#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n#SBATCH --time=3\n",
                               "export DT_NUM_THREADS=1 OMP_NUM_THREADS=1\n",
                               "srun ", kTrainerPath, " ", trainerArgs(dir.path(), 5000), "\n");
  const auto script = writeScript(dir.path(), "job.sh", body);
  ChildProcess submit({"/bin/bash", "-c", str("sbatch --wait --parsable --output=", output.string(), " ", script.string())}, kEnv);
  // The job id comes first; then wait for the first checkpoint in the job's output.
  ASSERT_TRUE(submit.waitForOutput("\n", 60s)) << submit.output();
  const std::string jobId = trim(submit.output());
  ASSERT_TRUE(std::regex_match(jobId, std::regex(R"(\d+)"))) << submit.output();
  bool checkpointed = false;
  for (int i = 0; i < 1200 && !checkpointed; ++i) {
    checkpointed = readFile(output).find("checkpoint at step 50 ") != std::string::npos;
    if (!checkpointed) std::this_thread::sleep_for(100ms);
  }
  ASSERT_TRUE(checkpointed) << readFile(output);
  // What SLURM sends before a time limit with --signal=USR1@T, sent now.
  const auto cancel = shell(str("scancel --signal=USR1 ", jobId), 30s);
  ASSERT_EQ(cancel.exitCode, 0) << cancel.out << cancel.err;
  const auto r = submit.wait(150s);
  const std::string text = readFile(output);
  EXPECT_EQ(r.exitCode, 0) << "every task exits 0 after the checkpoint\n" << r.out << r.err << text;
  std::smatch m;
  // Every task gets the signal; rank 0 may see it itself or learn it from
  // another rank's stop request at the same step boundary.
  ASSERT_TRUE(std::regex_search(
      text, m, std::regex(R"(stopped by (SIGUSR1|a stop request on another rank) after step (\d+) of 5000)")))
      << text;
  const std::string step = m[2];
  EXPECT_EQ(countOccurrences(text, str("stopped cleanly after step ", step)), 4) << text;

  // The requeued job (here: submitted again) resumes from that checkpoint; a shorter budget
  // keeps the test short (the schedule follows the new budget).
  const auto again = writeScript(dir.path(), "job2.sh",
                                 str("#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n#SBATCH --time=3\n#SBATCH --output=", output2.string(),
                                     "\nexport DT_NUM_THREADS=1 OMP_NUM_THREADS=1\n", "srun ", kTrainerPath, " ",
                                     trainerArgs(dir.path(), std::stoi(step) + 40), "\n"));
  const auto r2 = shell(str("sbatch --wait ", again.string()));
  const std::string text2 = readFile(output2);
  ASSERT_EQ(r2.exitCode, 0) << r2.out << r2.err << text2;
  EXPECT_THAT(text2, HasSubstr(str("resumed from ", (dir.path() / "ck" / (checkpointName(std::stoll(step)) + ".json")).string())));
  expectTrainedAndIdentical(text2, 4);
}

}  // namespace
}  // namespace dt::testing
