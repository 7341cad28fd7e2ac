// dtrun under a real SLURM cluster (two emulated nodes, started by the ctest
// fixture slurm_fixture.sh): one dtrun per node through srun, failures across
// nodes, and an sbatch script. SLURM tests never skip: without a cluster they fail with the reason.
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sys/stat.h>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/hostlist.h"
#include "common/strings.h"
#include "tests/launcher/dtrun_process.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

const std::string kDtrun = DTRUN_PATH;
const std::string kWorker = WORKER_PATH;
const std::string kConf = "/tmp/slurm-dtrun-launcher/slurm.conf";
const std::vector<std::string> kEnv = {"SLURM_CONF=" + kConf};

std::string clusterProblem() {
  if (!std::filesystem::exists(kConf)) return "no cluster at " + kConf + " (the slurm_cluster fixture did not start one; see its output)";
  const auto ping = runProcess({"/bin/sh", "-c", "scontrol ping"}, 30s, kEnv);
  if (ping.exitCode != 0 || ping.out.find("UP") == std::string::npos) return "scontrol ping failed: " + ping.out + ping.err;
  return "";
}

#define REQUIRE_CLUSTER()                                                   \
  do {                                                                      \
    if (const std::string why = clusterProblem(); !why.empty()) {           \
      FAIL() << "SLURM cluster unavailable: " << why;                       \
    }                                                                       \
  } while (0)

ProcessResult shell(const std::string& command, std::chrono::milliseconds timeout = 120s) {
  return runProcess({"/bin/bash", "-c", command}, timeout, kEnv);
}

TEST(DtrunSlurm, OneDtrunPerNodeReadsSlurmAndExchangesData) {
  REQUIRE_CLUSTER();
  // Prints the job id first so that the derived store port can be checked.
  const auto r = shell(str("srun -N2 --ntasks-per-node=1 --immediate=30 bash -c 'echo JOB=$SLURM_JOB_ID NODEID=$SLURM_NODEID; exec ",
                           kDtrun, " --nproc 2 /bin/sh -c \"", kWorker, " env && ", kWorker, " exchange\"'"));
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(JOB=(\d+))"))) << r.out;
  const std::string jobId = m[1].str();
  const std::string storeAddr = str("node1:", slurmDerivedPort(jobId));
  std::map<int, std::map<std::string, std::string>> env;
  const std::regex line(R"(\[rank (\d+)\] ENV ([A-Z_]+)=(.*))");
  for (const auto& l : split(r.out, '\n')) {
    if (std::regex_match(l, m, line)) env[std::stoi(m[1])][m[2]] = m[3];
  }
  ASSERT_EQ(env.size(), 4u) << r.out;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(env[rank]["WORLD_SIZE"], "4");
    EXPECT_EQ(env[rank]["GROUP_RANK"], std::to_string(rank / 2)) << "ranks are node-major";
    EXPECT_EQ(env[rank]["LOCAL_RANK"], std::to_string(rank % 2));
    EXPECT_EQ(env[rank]["MASTER_ADDR"], "node1") << "first host of SLURM_JOB_NODELIST";
    EXPECT_EQ(env[rank]["DT_STORE_ADDR"], storeAddr) << "store port derived from SLURM_JOB_ID";
    EXPECT_THAT(env[rank]["DT_RUN_ID"], HasSubstr(str("slurm-", jobId, "."))) << "run id from the SLURM job and step";
    EXPECT_THAT(r.out, HasSubstr(str("[rank ", rank, "] rank ", rank, " group ", rank / 2, " sum 10 expected 10")));
  }
}

TEST(DtrunSlurm, FailureOnOneNodeStopsTheOtherWithTheSameRootCause) {
  REQUIRE_CLUSTER();
  const auto r = shell(str("srun -N2 --ntasks-per-node=1 --immediate=30 ", kDtrun,
                           " --nproc 2 --monitor-interval 100ms --kill-grace 2s ", kWorker, " exit 6 3 300"));
  EXPECT_NE(r.exitCode, 0);
  EXPECT_LT(r.seconds, 60);
  const std::string all = r.out + r.err;
  EXPECT_THAT(all, HasSubstr("root cause: rank 3 (local rank 1, host node2"));
  EXPECT_THAT(all, HasSubstr("root cause: node 1 reported: rank 3"));
  EXPECT_EQ(countOccurrences(all, "dtrun: job failed"), 2) << all;
}

TEST(DtrunSlurm, SbatchScriptWithSrunAndDirectDtrun) {
  REQUIRE_CLUSTER();
  TempDir dir;
  const auto script = dir.path() / "job.sh";
  const auto output = dir.path() / "job.out";
  {
    std::ofstream out(script);
    out << "#!/bin/bash\n"
        << "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --output=" << output.string() << "\n"
        << "set -e\n"
        << "# one dtrun per node\n"
        << "srun " << kDtrun << " --nproc 2 " << kWorker << " exchange\n"
        << "# a dtrun started by the batch script itself runs a single-node job (SLURM mode stays off)\n"
        << kDtrun << " --nproc 2 --master-port 0 --prefix 'batch %r: ' " << kWorker << " env\n";
  }
  chmod(script.c_str(), 0755);
  const auto r = shell(str("sbatch --wait ", script.string()), 150s);
  std::ifstream in(output);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err << text;
  for (int rank = 0; rank < 4; ++rank) EXPECT_THAT(text, HasSubstr(str("rank ", rank, " group ", rank / 2, " sum 10 expected 10")));
  EXPECT_THAT(text, HasSubstr("batch 1: ENV WORLD_SIZE=2"));
  EXPECT_THAT(text, HasSubstr("batch 0: ENV GROUP_RANK=0"));
}

#ifdef DTRAIN_WORKER_PATH
// Two emulated nodes share one kernel and network namespace, so by default
// they would share memory; DT_HOST_ID from the node name makes them two
// hosts: shared memory within a node, Gloo between the nodes.
TEST(DtrunSlurm, TwoNodesAllreduceHierarchicallyWithHostIdsFromTheNodeNames) {
  REQUIRE_CLUSTER();
  const auto r = shell(str("srun -N2 --ntasks-per-node=1 --immediate=30 bash -c 'DT_HOST_ID=$SLURMD_NODENAME "
                           "DT_GLOO_HOSTNAME=127.0.0.1 exec ", kDtrun, " --nproc 2 ", DTRAIN_WORKER_PATH, " backend'"));
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_THAT(r.out, HasSubstr(str("[rank ", rank, "] rank ", rank, " backend shm+gloo ok"))) << r.out << r.err;
  }
  // Without the override the two emulated nodes are one host: all shared memory.
  const auto same = shell(str("srun -N2 --ntasks-per-node=1 --immediate=30 ", kDtrun, " --nproc 2 ", DTRAIN_WORKER_PATH,
                              " backend"));
  ASSERT_EQ(same.exitCode, 0) << same.out << same.err;
  EXPECT_THAT(same.out, HasSubstr("[rank 3] rank 3 backend shm ok")) << same.out << same.err;
}
#endif

#ifdef ELASTIC_WORKER_PATH
// dtrun --elastic on two SLURM nodes: rank 2 (node 1) SIGKILLs its node's dtrun
// and itself at step 15, so node 1 and both its ranks are gone. Node 0 (which
// hosts the store) sees the watch connection close, posts ranks 2-3 dead, and
// its two ranks finish in place with every step applied exactly once.
TEST(DtrunSlurm, ElasticJobLosesNodeOneAndNodeZeroFinishesInPlace) {
  REQUIRE_CLUSTER();
  const auto r = shell(str("srun -N2 --ntasks-per-node=1 --immediate=30 --kill-on-bad-exit=0 --wait=0 ", kDtrun,
                           " --nproc 2 --elastic --min-nproc 2 ", ELASTIC_WORKER_PATH, " 40 5 2 15 node"));
  // srun reports the task that was killed; node 0's own result is in its output.
  EXPECT_NE(r.exitCode, 0) << r.out << r.err;
  const std::string all = r.out + r.err;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_THAT(r.out, HasSubstr(str("member ", rank, " rank ", rank, "/2 epoch 1 state 1914 expected 1914 lost ")))
        << all;
  }
  EXPECT_THAT(r.out, HasSubstr("was lost with node 1")) << all;
  EXPECT_THAT(all, HasSubstr("node 1 is lost (node 1's dtrun closed its watch connection without finishing")) << all;
  EXPECT_THAT(all, HasSubstr("the elastic job goes on without them")) << all;
  EXPECT_EQ(countOccurrences(all, "state 1914 expected 1914"), 2) << all;
}

// dtrun --elastic --nnodes 1:2 under SLURM: one srun job starts the elastic job
// on node1 (after its last call, with MIN = 1 node); a second srun job, on
// node2, runs a dtrun that joins it (--slurm off: it names node 0's store) as
// node 2, and its workers (members 2 and 3) are admitted. In step 150 (or its
// first, if it came later) member 2 kills its dtrun and itself: node1's two
// ranks finish exactly without them.
TEST(DtrunSlurm, ElasticJobGainsANodeFromAnotherSrunAndLosesItAgain) {
  REQUIRE_CLUSTER();
  const PortReservation reservation;
  const std::string common = str(" --nnodes 1:2 --elastic --nproc 2 --master-port ", reservation.port(),
                                 " --monitor-interval 200ms --node-timeout 2s ");
  const std::string worker = str(ELASTIC_WORKER_PATH, " 400 20 2 150 node");
  ChildProcess first({"/bin/bash", "-c", str("srun -N1 -w node1 --immediate=30 ", kDtrun, common, worker)}, kEnv);
  std::this_thread::sleep_for(5s);  // node1's job starts 2 s after it came (MIN = 1)
  const auto second = shell(str("srun -N1 -w node2 --immediate=30 --kill-on-bad-exit=0 ", kDtrun,
                                " --slurm off --node-rank 1 --master-addr node1", common, worker));
  const auto r = first.wait(120s);
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err << second.out << second.err;
  EXPECT_NE(second.exitCode, 0) << "the joined node's dtrun was killed";
  EXPECT_THAT(second.err, HasSubstr("this node joins it as node 2")) << second.err;
  EXPECT_THAT(second.out, HasSubstr("member 2: joined at step")) << second.out;
  EXPECT_THAT(r.err, HasSubstr("node 2 is lost")) << r.err;
  for (int rank = 0; rank < 2; ++rank) {
    const std::regex line(str("member ", rank, " rank ", rank, "/2 epoch [0-9]+ state ([0-9]+) expected ([0-9]+)"));
    std::smatch match;
    ASSERT_TRUE(std::regex_search(r.out, match, line)) << "member " << rank << ": " << r.out << r.err;
    EXPECT_EQ(match[1].str(), match[2].str()) << "member " << rank;
  }
}
#endif

}  // namespace
}  // namespace dt::testing
