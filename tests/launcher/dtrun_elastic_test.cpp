// dtrun --elastic on one node: a worker that dies (SIGKILL, a non-zero exit)
// or freezes (SIGSTOP, found by its stopped heartbeat) is left behind, the
// others rebuild their group in place and finish every step; below
// --min-nproc the job stops naming who is left; with --max-restarts a dead
// worker is replaced and the replacement joins the running job; with
// --nnodes MIN:MAX a node started later joins the running job and can be lost
// again; with the TCP store, losing node 0 (the store's host) is survived on node 1's standby,
// and a node joins through it afterwards; bad flag combinations are named.
#include <fstream>
#include <memory>
#include <regex>
#include <thread>

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
const std::string kWorker = ELASTIC_WORKER_PATH;

// Every listed member finished with the expected state.
void expectFinished(const ProcessResult& r, std::initializer_list<int> members, int world) {
  for (int m : members) {
    const std::regex line(str("member ", m, " rank [0-9]+/", world, " epoch [0-9]+ state ([0-9]+) expected ([0-9]+)"));
    std::smatch match;
    ASSERT_TRUE(std::regex_search(r.out, match, line)) << "member " << m << ":\n" << r.out << r.err;
    EXPECT_EQ(match[1].str(), match[2].str()) << "member " << m;
  }
}

TEST(DtrunElastic, AKilledWorkerIsLeftBehindAndTheOthersFinishInPlace) {
  const auto r = runProcess({kDtrun, "--standalone", "--nproc", "4", "--elastic", kWorker, "40", "2", "2", "15", "kill"}, 120s);
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("exited: signal SIGKILL"));
  EXPECT_THAT(r.err, HasSubstr("the elastic job goes on without it"));
  EXPECT_THAT(r.err, HasSubstr("the elastic job finished without rank 2"));
  EXPECT_THAT(r.out, HasSubstr("go on from step"));
  EXPECT_THAT(r.out, HasSubstr("rank 2 exited: signal SIGKILL"));
  expectFinished(r, {0, 1, 3}, 3);
  EXPECT_THAT(r.err, Not(HasSubstr("restarting")));
}

TEST(DtrunElastic, AFrozenWorkerIsDeclaredDeadByItsHeartbeatAndKilled) {
  const auto r = runProcess({kDtrun, "--standalone", "--nproc", "3", "--elastic", "--liveness-timeout", "2s", kWorker, "30",
                             "2", "1", "10", "stop"},
                            120s);
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("rank 1 (pid"));
  EXPECT_THAT(r.err, HasSubstr("stopped responding: no heartbeat for"));
  EXPECT_THAT(r.err, HasSubstr("frozen or hung: dtrun kills it (SIGKILL)"));
  // The kill is reported as dtrun's, with its reason; nothing guesses at another sender.
  EXPECT_THAT(r.err, HasSubstr("the elastic job finished without rank 1 (signal SIGKILL (sent by dtrun: no heartbeat for"));
  EXPECT_THAT(r.err, HasSubstr("(--liveness-timeout 2000 ms)))"));
  EXPECT_THAT(r.err, Not(HasSubstr("out-of-memory")));
  expectFinished(r, {0, 2}, 2);
}

TEST(DtrunElastic, AWorkerThatExitsWithAnErrorIsLeftBehindToo) {
  const auto r = runProcess({kDtrun, "--standalone", "--nproc", "3", "--elastic", kWorker, "20", "0", "0", "5", "exit"}, 120s);
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("rank 0 (pid"));
  EXPECT_THAT(r.err, HasSubstr("exited: exit code 3"));
  expectFinished(r, {1, 2}, 2);
}

TEST(DtrunElastic, BelowTheMinimumTheJobStopsNamingWhoIsLeft) {
  const auto r = runProcess({kDtrun, "--standalone", "--nproc", "2", "--elastic", "--min-nproc", "2", kWorker, "20", "0",
                             "1", "4", "kill"},
                            120s);
  EXPECT_EQ(r.exitCode, 3) << "dtrun --help's status for a job below --min-nproc\n" << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("the elastic job stops: 1 member(s) left (member 0), fewer than the minimum of 2 (--min-nproc)"));
  EXPECT_THAT(r.err, HasSubstr("rank 1 exited: signal SIGKILL"));
  // dtrun says in one line that the job stops, and why.
  EXPECT_THAT(r.err, HasSubstr("dtrun: 1 member(s) left (member 0), below --min-nproc 2; brought below by: rank 1 "
                               "exited: signal SIGKILL: stopping the job"));
  // The summary names that as the cause, and the survivor as stopped by dtrun.
  EXPECT_THAT(r.err, HasSubstr("root cause: the elastic job stopped: 1 member(s) left (member 0), below --min-nproc 2; "
                               "brought below by: rank 1 exited: signal SIGKILL\n"));
  EXPECT_THAT(r.err, HasSubstr("stopped by dtrun: rank(s) 0"));
  EXPECT_THAT(r.err, Not(HasSubstr("rank 0 (pid"))) << "the survivor's exit is no death the job goes on without";
  EXPECT_THAT(r.err, Not(HasSubstr("also failed: rank 0")));
}

TEST(DtrunElastic, AKilledWorkerIsReplacedAndTheReplacementJoinsTheRunningJob) {
  // Member 1 dies in step 15; member 3 takes its place, is admitted at a step boundary,
  // receives the state and finishes with the others: three ranks at the end, in epoch 2
  // (the shrink, then the admission), every state exact.
  const auto r = runProcess({kDtrun, "--standalone", "--nproc", "3", "--elastic", "--max-restarts", "1", kWorker, "100",
                             "20", "1", "15", "kill"},
                            120s);
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("rank 1 is replaced by member 3 (pid"));
  EXPECT_THAT(r.err, HasSubstr("replacement 1 of 1 for local rank 1"));
  EXPECT_THAT(r.out, HasSubstr("member 3: joined at step"));
  EXPECT_THAT(r.err, HasSubstr("replaced during the job: rank 1 (signal SIGKILL"));
  EXPECT_THAT(r.err, Not(HasSubstr("finished without")));
  expectFinished(r, {0, 2, 3}, 3);
}

TEST(DtrunElastic, ANodeJoinsARunningJobAndIsLostAgain) {
  // Two emulated nodes on loopback start a --nnodes 2:3 job (after the last call for a third);
  // a third dtrun started a moment later joins it as node 3 (a fresh id) and its worker,
  // member 2, is admitted at a step boundary. In step 120 member 2 kills its dtrun and itself:
  // node 0 sees the watch connection close, posts member 2 dead, and the first two finish.
  const PortReservation reservation;
  const std::string port = reservation.text();
  auto node = [&](int rank) {
    return std::make_unique<ChildProcess>(std::vector<std::string>{
        kDtrun, "--nnodes", "2:3", "--node-rank", std::to_string(rank), "--elastic", "--master-addr", "127.0.0.1",
        "--master-port", port, "--monitor-interval", "200ms", "--node-timeout", "2s", kWorker, "200", "20", "2", "120", "node"});
  };
  auto n0 = node(0), n1 = node(1);
  std::this_thread::sleep_for(4s);  // the job starts at two after its last call (2 s)
  auto late = node(2);
  const auto r0 = n0->wait(120s), r1 = n1->wait(120s), r2 = late->wait(120s);
  ASSERT_EQ(r0.exitCode, 0) << r0.out << r0.err << r2.out << r2.err;
  ASSERT_EQ(r1.exitCode, 0) << r1.out << r1.err;
  EXPECT_NE(r2.exitCode, 0) << "the late node's dtrun was killed";
  EXPECT_THAT(r2.err, HasSubstr("this node joins it as node 3"));
  EXPECT_THAT(r2.out, HasSubstr("member 2: joined at step"));
  EXPECT_THAT(r0.err, HasSubstr("node 3 is lost"));
  EXPECT_THAT(r0.out, HasSubstr("member 0: epoch 2: 2 member(s) go on from step 120"));
  expectFinished(r0, {0}, 2);
  expectFinished(r1, {1}, 2);
}

// Three dtruns of two workers on loopback, the TCP store on `port` (node 0's, with node 1's
// standby), running the elastic worker for 300 steps of 30 ms with `death` (its DIE_RANK DIE_STEP
// HOW); the killer's line goes to `stamp` too.
std::vector<std::unique_ptr<ChildProcess>> threeNodesOnTheTcpStore(const std::string& port, const std::string& stamp,
                                                                   const std::string& nodeTimeout,
                                                                   const std::vector<std::string>& death) {
  std::vector<std::unique_ptr<ChildProcess>> nodes;
  for (int rank = 0; rank < 3; ++rank) {
    std::vector<std::string> argv = {kDtrun, "--nnodes", "3", "--node-rank", std::to_string(rank), "--nproc", "2",
                                     "--elastic", "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
                                     "--master-port", port, "--node-timeout", nodeTimeout, kWorker, "300", "30"};
    argv.insert(argv.end(), death.begin(), death.end());
    nodes.push_back(std::make_unique<ChildProcess>(argv, std::vector<std::string>{"DT_TEST_KILL_STAMP=" + stamp}));
  }
  return nodes;
}

TEST(DtrunElastic, TheTcpStoreJobLosesNode0AndGoesOnWithTheOthers) {
  // Three emulated nodes of two workers on loopback with the TCP store (--rdzv-backend static):
  // node 0's dtrun hosts the store, node 1's its hot standby. In step 20 rank 0 SIGKILLs its
  // dtrun and then itself (node 0's other worker dies with its dtrun): the standby takes over
  // once the kernel closed its replication connection, every client fails over to it, nodes 1
  // and 2 post node 0's members dead when their watch connections to node 0 close, and the four
  // survivors finish exactly. --node-timeout 60s: nothing here may wait for a timeout.
  const PortReservation reservation;
  TempDir stamps;
  const std::string stamp = (stamps.path() / "killed").string();
  auto nodes = threeNodesOnTheTcpStore(reservation.text(), stamp, "60s", {"0", "20", "node"});
  const auto lost = nodes[0]->wait(120s);
  EXPECT_EQ(lost.exitCode, 128 + SIGKILL) << lost.out << lost.err;
  const auto r1 = nodes[1]->wait(120s), r2 = nodes[2]->wait(120s);
  ASSERT_EQ(r1.exitCode, 0) << r1.out << r1.err;
  ASSERT_EQ(r2.exitCode, 0) << r2.out << r2.err;
  EXPECT_THAT(r1.err, HasSubstr("this node hosts the hot standby of the job's store at 127.0.0.1:"));
  EXPECT_THAT(r1.err, HasSubstr("promoted to primary"));
  for (const auto* r : {&r1, &r2}) {
    EXPECT_THAT(r->err, HasSubstr("node 0 is lost (node 0's dtrun closed its watch connection without finishing"))
        << r->err;
    EXPECT_THAT(r->err, Not(HasSubstr("finished without")));
    EXPECT_THAT(r->out, HasSubstr("was lost with node 0")) << r->out;
  }
  expectFinished(r1, {2, 3}, 4);
  expectFinished(r2, {4, 5}, 4);
  // The kill to the survivors' first commit after it (printed, not asserted: a measure).
  std::ifstream stampFile(stamp);
  const std::string killed((std::istreambuf_iterator<char>(stampFile)), std::istreambuf_iterator<char>());
  std::smatch at, resumed;
  ASSERT_TRUE(std::regex_search(killed, at, std::regex(R"(kills its node at (\d+) ms)"))) << killed;
  const std::string survivors = r1.out + r2.out;
  int64_t last = 0;
  const std::regex commit(R"(first commit after recovery at (\d+) ms)");
  for (std::sregex_iterator it(survivors.begin(), survivors.end(), commit), end; it != end; ++it) {
    last = std::max<int64_t>(last, std::stoll((*it)[1]));
  }
  ASSERT_GT(last, 0) << survivors;
  std::printf("node 0 killed -> survivors' next commit: %lld ms (TCP store, standby on node 1)\n",
              static_cast<long long>(last - std::stoll(at[1])));
}

TEST(DtrunElastic, TheTcpStoreJobLosesItsStandbysNodeToSilenceAndGoesOn) {
  // Three nodes on the TCP store; in step 20 member 2 stops node 1 whole (its dtrun, which hosts
  // the store's standby, and both workers SIGSTOPped): silence, not proof. Node 0's store stops
  // waiting for the standby after half of --node-timeout 3s and retires it (the job's writes go
  // on), node 0 declares node 1 lost when its heartbeats are 3 s old, and nodes 0 and 2 finish.
  const PortReservation reservation;
  TempDir stamps;
  const std::string stamp = (stamps.path() / "silenced").string();
  auto nodes = threeNodesOnTheTcpStore(reservation.text(), stamp, "3s", {"2", "20", "nodestop"});
  const auto r0 = nodes[0]->wait(120s), r2 = nodes[2]->wait(120s);
  ASSERT_EQ(r0.exitCode, 0) << r0.out << r0.err;
  ASSERT_EQ(r2.exitCode, 0) << r2.out << r2.err;
  EXPECT_THAT(r0.err, HasSubstr("this server goes on alone (the standby is told to retire)"));
  EXPECT_THAT(r0.err, HasSubstr("node 1 is lost (node 1 stopped sending heartbeats"));
  expectFinished(r0, {0, 1}, 4);
  expectFinished(r2, {4, 5}, 4);
  nodes[1]->killWithChildren();  // node 1's processes are still stopped
}

TEST(DtrunElastic, AfterNode0IsLostANodeJoinsThroughTheStandby) {
  // A --nnodes 2:3 job of one worker per node on loopback, the TCP store on node 0 and its hot
  // standby on node 1. Member 0 kills node 0 in step 40; a dtrun started afterwards, pointed at
  // the standby's address (which node 1's dtrun prints), joins the running job as node 3 and its
  // worker (member 2) is admitted; members 1 and 2 finish exactly.
  const PortReservation reservation;
  const std::vector<std::string> worker = {kWorker, "600", "20", "0", "40", "node"};
  auto node = [&](int rank, const std::string& port) {
    std::vector<std::string> argv = {kDtrun, "--nnodes", "2:3", "--node-rank", std::to_string(rank), "--elastic",
                                     "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", port,
                                     "--node-timeout", "60s"};
    argv.insert(argv.end(), worker.begin(), worker.end());
    return std::make_unique<ChildProcess>(argv);
  };
  auto n0 = node(0, reservation.text()), n1 = node(1, reservation.text());
  ASSERT_TRUE(n1->waitForOutput("this node hosts the hot standby of the job's store at 127.0.0.1:", 60s)) << n1->output();
  std::smatch standby;
  const std::string announced = n1->output();
  ASSERT_TRUE(std::regex_search(announced, standby, std::regex(R"(hot standby of the job's store at 127\.0\.0\.1:(\d+))")));
  const auto r0 = n0->wait(60s);
  EXPECT_EQ(r0.exitCode, 128 + SIGKILL) << r0.out << r0.err;
  auto late = node(2, standby[1].str());
  const auto r1 = n1->wait(120s), r2 = late->wait(120s);
  ASSERT_EQ(r1.exitCode, 0) << r1.out << r1.err;
  ASSERT_EQ(r2.exitCode, 0) << r2.out << r2.err;
  EXPECT_THAT(r1.err, HasSubstr("node 0 is lost (node 0's dtrun closed its watch connection without finishing"));
  EXPECT_THAT(r2.err, HasSubstr("this node joins it as node 3"));
  EXPECT_THAT(r2.out, HasSubstr("member 2: joined at step"));
  expectFinished(r1, {1}, 2);
  expectFinished(r2, {2}, 2);
}

TEST(DtrunElastic, BadCombinationsAreNamed) {
  const auto range = runProcess({kDtrun, "--nnodes", "2:3", kWorker, "1"}, 30s);
  EXPECT_EQ(range.exitCode, 2) << range.err;
  EXPECT_THAT(range.err, HasSubstr("--nnodes=2:3 needs --elastic"));
  const auto inverted = runProcess({kDtrun, "--elastic", "--nnodes", "3:2", kWorker, "1"}, 30s);
  EXPECT_EQ(inverted.exitCode, 2) << inverted.err;
  EXPECT_THAT(inverted.err, HasSubstr("--nnodes=\"3:2\" has MIN above MAX"));
  const auto bad = runProcess({kDtrun, "--standalone", "--elastic", "--liveness-timeout", "5ms", kWorker, "1"}, 30s);
  EXPECT_THAT(bad.err, HasSubstr("--liveness-timeout=\"5ms\" is too small"));
}

}  // namespace
}  // namespace dt::testing
