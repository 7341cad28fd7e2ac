// dtrun with real dtrain workers: initProcessGroup reads dtrun's environment
// and joins the launcher's store; restarts re-create the group on the
// surviving store; the hang watchdog reads the process group's progress keys.
#include <regex>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "tests/launcher/dtrun_process.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

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

}  // namespace
}  // namespace dt::testing
