// dtrun with real dtrain workers: initProcessGroup reads dtrun's environment
// and joins the launcher's store; restarts re-create the group on the
// surviving store; the hang watchdog reads the process group's progress keys.
#include <regex>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "tests/launcher/dtrun_process.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kDtrun = DTRUN_PATH;
const std::string kWorker = DTRAIN_WORKER_PATH;

TEST(DtrunDtrain, ProcessGroupOverTheLauncherStore) {
  const auto r = runProcess({kDtrun, "--standalone", "--nproc", "3", kWorker, "allreduce", "5"}, 120s);
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  for (int rank = 0; rank < 3; ++rank) EXPECT_THAT(r.out, HasSubstr(str("rank ", rank, " allreduce ok world 3 restart 0")));
}

TEST(DtrunDtrain, RestartRecreatesTheGroupOnTheSurvivingStore) {
  const auto r = runProcess({kDtrun, "--standalone", "--nproc", "2", "--max-restarts", "1", "--kill-grace", "5s", kWorker, "restart"}, 150s);
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("root cause: rank 1"));
  EXPECT_THAT(r.err, HasSubstr("restarting the worker group (restart 1 of 1)"));
  EXPECT_THAT(r.out, HasSubstr("rank 0 allreduce ok world 2 restart 1"));
  EXPECT_THAT(r.out, HasSubstr("rank 1 allreduce ok world 2 restart 1"));
}

TEST(DtrunDtrain, HangWatchdogReadsTheProcessGroupsProgress) {
  // The watchdog counts from the job's start until the first collective: the
  // three ranks must start and finish one within --hang-timeout for the report
  // to name one for each, so it leaves room for a loaded machine.
  const auto r = runProcess({kDtrun, "--standalone", "--nproc", "3", "--hang-timeout", "8s", "--monitor-interval", "200ms",
                             "--kill-grace", "3s", kWorker, "hang"},
                            120s);
  EXPECT_EQ(r.exitCode, 124) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("hang watchdog: no rank completed a collective for"));
  // Every rank's last completed collective is named ("#<seq> allreduce").
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_TRUE(std::regex_search(r.err, std::regex(str("rank ", rank, ": #[0-9]+ allreduce")))) << r.err;
  }
  EXPECT_LT(r.seconds, 60);
}

// The same hang with --log-dir: before stopping the workers dtrun asks them for their flight
// records (SIGUSR2), then prints the analysis after its summary; dtrun analyze reads the same.
TEST(DtrunDtrain, FailedJobPrintsTheFlightRecordersStory) {
  TempDir logs;
  const auto r = runProcess({kDtrun, "--standalone", "--nproc", "3", "--hang-timeout", "8s", "--monitor-interval", "200ms",
                             "--kill-grace", "3s", "--log-dir", logs.path().string(), "--run-id", "frtest", kWorker, "hang"},
                            120s);
  EXPECT_EQ(r.exitCode, 124) << r.out << r.err;
  const std::string dir = (logs.path() / "frtest" / "attempt0").string();
  EXPECT_THAT(r.err, HasSubstr(str("dtrun: what the ranks' flight records say (dtrun analyze ", dir, "):")));
  EXPECT_THAT(r.err, HasSubstr("first difference at #4:"));
  EXPECT_THAT(r.err, HasSubstr("ranks 0 and 2 issued allreduce #4 (float32[4], sum)"));
  EXPECT_THAT(r.err, HasSubstr("rank 1 never issued #4 (its last issued: allreduce #3 (float32[4], sum), done"));
  const auto analyzed = runProcess({kDtrun, "analyze", dir}, 60s);
  EXPECT_EQ(analyzed.exitCode, 0) << analyzed.out << analyzed.err;
  EXPECT_THAT(analyzed.out, HasSubstr("rank 1 never issued #4"));
  const auto empty = runProcess({kDtrun, "analyze", logs.path().string()}, 60s);
  EXPECT_EQ(empty.exitCode, 1);
  EXPECT_THAT(empty.err, HasSubstr("no flight recorder dumps (flight_rank*.json) in"));
}

// The same hang on two nodes, each with a log folder of its own (as on two machines): every
// dtrun posts its workers' flight records to the job's store and copies the other node's, so
// both print the story of all four ranks, and node 0's folder ends with every rank's dump.
TEST(DtrunDtrain, TwoNodesEachPrintTheWholeJobsFlightStory) {
  const PortReservation reservation;
  TempDir logs0, logs1;
  auto node = [&](int rank, const TempDir& logs) {
    return std::vector<std::string>{kDtrun, "--nnodes", "2", "--node-rank", std::to_string(rank), "--master-addr", "127.0.0.1",
                                    "--master-port", reservation.text(), "--nproc", "2", "--rdzv-timeout", "60s",
                                    "--hang-timeout", "8s", "--monitor-interval", "200ms", "--kill-grace", "3s",
                                    "--log-dir", logs.path().string(), "--run-id", "frnodes", kWorker, "hang"};
  };
  ChildProcess n0(node(0, logs0));
  ChildProcess n1(node(1, logs1));
  const auto r0 = n0.wait(120s);
  const auto r1 = n1.wait(120s);
  EXPECT_EQ(r0.exitCode, 124) << r0.out << r0.err;
  for (const auto* r : {&r0, &r1}) {
    EXPECT_THAT(r->err, HasSubstr("first difference at #4:")) << r->err;
    EXPECT_THAT(r->err, HasSubstr("ranks 0, 2-3 issued allreduce #4 (float32[4], sum)")) << r->err;
    EXPECT_THAT(r->err, HasSubstr("rank 1 never issued #4")) << r->err;
    EXPECT_THAT(r->err, Not(HasSubstr("did not arrive"))) << r->err;
  }
  const auto analyzed = runProcess({kDtrun, "analyze", (logs0.path() / "frnodes" / "attempt0").string()}, 60s);
  EXPECT_EQ(analyzed.exitCode, 0) << analyzed.err;
  EXPECT_THAT(analyzed.out, HasSubstr("ranks 0, 2-3 issued allreduce #4")) << "node 0's folder holds node 1's dumps too\n"
                                                                               << analyzed.out;
}

}  // namespace
}  // namespace dt::testing
