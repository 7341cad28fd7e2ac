// End-to-end tests through the built dtrun binary with dtrun_test_worker
// (and shell/Python workers): the worker environment, exit codes and root
// cause, signals, orphans, restarts, the hang watchdog, log files, prefixes,
// several nodes on one machine, and torchrun compatibility.
#include <arpa/inet.h>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <netinet/in.h>
#include <regex>
#include <set>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "launcher/summary.h"
#include "tests/launcher/dtrun_process.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kDtrun = DTRUN_PATH;
const std::string kWorker = WORKER_PATH;

std::vector<std::string> dtrun(std::vector<std::string> args) {
  args.insert(args.begin(), kDtrun);
  return args;
}

// Lines of `text` that start with `prefix`.
std::vector<std::string> linesWith(const std::string& text, const std::string& needle) {
  std::vector<std::string> out;
  for (const auto& line : split(text, '\n')) {
    if (line.find(needle) != std::string::npos) out.push_back(line);
  }
  return out;
}

// "[rank 1] ENV RANK=1" -> map of rank -> (name -> value)
std::map<int, std::map<std::string, std::string>> parseEnvDump(const std::string& out) {
  std::map<int, std::map<std::string, std::string>> result;
  const std::regex re(R"(^\[rank (\d+)\] ENV ([A-Z_]+)=(.*)$)");
  for (const auto& line : split(out, '\n')) {
    std::smatch m;
    if (std::regex_match(line, m, re)) result[std::stoi(m[1])][m[2]] = m[3];
  }
  return result;
}

bool processGone(pid_t pid) {
  if (kill(pid, 0) != 0) return true;
  std::ifstream stat(str("/proc/", pid, "/stat"));
  std::string content((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto close = content.rfind(')');
  return close != std::string::npos && content.size() > close + 2 && content[close + 2] == 'Z';
}

TEST(DtrunE2E, WorkerEnvironmentContract) {
  const auto r = runProcess(dtrun({"--standalone", "--nproc", "3", kWorker, "env"}), 60s, {"OMP_NUM_THREADS=", "DT_NUM_THREADS="});
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const auto env = parseEnvDump(r.out);
  ASSERT_EQ(env.size(), 3u) << r.out;
  std::set<std::string> runIds, tokens, stores, masterPorts;
  for (int rank = 0; rank < 3; ++rank) {
    auto e = env.at(rank);
    EXPECT_EQ(e["RANK"], std::to_string(rank));
    EXPECT_EQ(e["WORLD_SIZE"], "3");
    EXPECT_EQ(e["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(e["GROUP_RANK"], "0");
    EXPECT_EQ(e["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(e["DT_RESTART_COUNT"], "0");
    EXPECT_EQ(e["DT_MAX_RESTARTS"], "0");
    EXPECT_EQ(e["OMP_NUM_THREADS"], "1");
    EXPECT_EQ(e["DT_NUM_THREADS"], "1");
    EXPECT_EQ(e["DT_STORE_TOKEN"].size(), 32u);
    runIds.insert(e["DT_RUN_ID"]);
    tokens.insert(e["DT_STORE_TOKEN"]);
    stores.insert(e["DT_STORE_ADDR"]);
    masterPorts.insert(e["MASTER_PORT"]);
  }
  EXPECT_EQ(runIds.size(), 1u);
  EXPECT_EQ(tokens.size(), 1u);
  ASSERT_EQ(stores.size(), 1u);
  ASSERT_EQ(masterPorts.size(), 1u);
  const std::string store = *stores.begin();
  ASSERT_TRUE(store.starts_with("127.0.0.1:")) << store;
  EXPECT_NE(store.substr(10), *masterPorts.begin()) << "MASTER_PORT must be a second port, not the store's";
  // Each worker leads its own process group.
  for (const auto& line : linesWith(r.out, "PGID ")) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(line, m, std::regex(R"(PGID (\d+) PID (\d+))"))) << line;
    EXPECT_EQ(m[1], m[2]) << line;
  }
  EXPECT_EQ(countOccurrences(r.err, "OMP_NUM_THREADS and DT_NUM_THREADS default to 1"), 1) << r.err;
}

TEST(DtrunE2E, ThreadDefaultsLeftAloneWhenSetOrSingleWorker) {
  auto r = runProcess(dtrun({"--standalone", "--nproc", "2", kWorker, "env"}), 60s, {"OMP_NUM_THREADS=3"});
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_EQ(parseEnvDump(r.out)[1]["OMP_NUM_THREADS"], "3");
  r = runProcess(dtrun({"--standalone", kWorker, "env"}), 60s, {"OMP_NUM_THREADS="});
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_EQ(parseEnvDump(r.out)[0]["OMP_NUM_THREADS"], "");
  EXPECT_THAT(r.err, Not(HasSubstr("default to 1")));
}

TEST(DtrunE2E, FailureExitCodeRootCauseAndSummary) {
  // Rank 1 fails after 300 ms; ranks 0 and 2 would sleep 60 s and must be stopped.
  const auto r = runProcess(dtrun({"--standalone", "--nproc", "3", kWorker, "exit", "7", "1", "300"}), 60s);
  EXPECT_EQ(r.exitCode, 7) << r.err;
  EXPECT_LT(r.seconds, 20) << "the other workers were not torn down";
  EXPECT_THAT(r.err, HasSubstr("root cause: rank 1 (local rank 1, host "));
  EXPECT_THAT(r.err, HasSubstr("exit code 7 at "));
  EXPECT_THAT(r.err, HasSubstr("| worker rank 1: failing on purpose with code 7"));
  EXPECT_THAT(r.err, HasSubstr("stopped by dtrun: rank(s) 0, 2"));
  EXPECT_THAT(r.err, HasSubstr(str("pid ")));
}

TEST(DtrunE2E, SharedMemoryTheWorkersLeftBehindIsRemoved) {
  const std::string runId = str("e2e-shm-", ::getpid());
  const auto r = runProcess(dtrun({"--standalone", "--nproc", "2", "--run-id", runId, kWorker, "leave-shm"}), 60s);
  EXPECT_EQ(r.exitCode, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr(str("left /dev/shm/dtrain-", runId, "-test-leftover-1")));
  EXPECT_THAT(r.err, HasSubstr("removed 2 shared-memory segment(s) the workers left in /dev/shm"));
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_FALSE(std::filesystem::exists(str("/dev/shm/dtrain-", runId, "-test-leftover-", rank)));
  }
}

TEST(DtrunE2E, SignalDeathGives128PlusSignal) {
  const auto r = runProcess(dtrun({"--standalone", "--nproc", "2", kWorker, "raise", "11", "1"}), 60s);
  EXPECT_EQ(r.exitCode, 128 + SIGSEGV) << r.err;
  EXPECT_THAT(r.err, HasSubstr("root cause: rank 1"));
  EXPECT_THAT(r.err, HasSubstr("signal SIGSEGV"));
}

// The worker SIGKILLs itself: dtrun did not send it, and the kernel's OOM kill count says
// whether the out-of-memory killer acted meanwhile (on this machine, a test run: it did not,
// unless the kernel does not count, or something else ran out of memory just then). The count
// is read as dtrun reads it (launcher/summary.h).

TEST(DtrunE2E, ASigkillDtrunDidNotSendSaysWhatTheOomCountShows) {
  const int64_t oomBefore = launcher::oomKillCount();
  const auto r = runProcess(dtrun({"--standalone", "--nproc", "2", kWorker, "raise", "9", "0"}), 60s);
  EXPECT_EQ(r.exitCode, 128 + SIGKILL) << r.err;
  EXPECT_THAT(r.err, HasSubstr("signal SIGKILL (not sent by dtrun"));
  if (oomBefore >= 0 && launcher::oomKillCount() == oomBefore) {
    EXPECT_THAT(r.err, HasSubstr("another process sent it")) << r.err;
  }
}

TEST(DtrunE2E, KillGraceEscalatesToSigkill) {
  // Rank 0 fails with 4 after 200 ms; rank 1 ignores SIGTERM and must be SIGKILLed after --kill-grace.
  const auto r = runProcess(dtrun({"--standalone", "--nproc", "2", "--kill-grace", "1s", kWorker, "ignoreterm"}), 60s);
  EXPECT_EQ(r.exitCode, 4) << r.err;
  EXPECT_LT(r.seconds, 15);
  EXPECT_GE(r.seconds, 1.0);
  EXPECT_THAT(r.err, HasSubstr("(--kill-grace): sending SIGKILL"));
  EXPECT_THAT(r.err, Not(HasSubstr("out-of-memory"))) << "dtrun's own SIGKILL is not an OOM kill";
}

TEST(DtrunE2E, SignalsAreForwardedToEveryWorker) {
  ChildProcess p(dtrun({"--standalone", "--nproc", "2", kWorker, "trap"}));
  ASSERT_TRUE(p.waitForOutput("ready rank", 30s, 2)) << p.output();
  p.signal(SIGUSR1);
  EXPECT_TRUE(p.waitForOutput(str("got signal ", SIGUSR1), 10s, 2)) << p.output();
  p.signal(SIGTERM);
  const auto r = p.wait(30s);
  EXPECT_THAT(r.out, HasSubstr(str("rank 0 got signal ", SIGTERM)));
  EXPECT_THAT(r.out, HasSubstr(str("rank 1 got signal ", SIGTERM)));
  EXPECT_EQ(r.exitCode, 128 + SIGTERM) << r.err;
  EXPECT_THAT(r.err, HasSubstr("dtrun received SIGTERM and forwarded it to the workers"));
  EXPECT_LT(r.seconds, 20);
}

TEST(DtrunE2E, OnlySelectedSignalsAreForwarded) {
  ChildProcess p(dtrun({"--standalone", "--nproc", "1", "--signals", "USR2,TERM", kWorker, "trap"}));
  ASSERT_TRUE(p.waitForOutput("ready rank", 30s)) << p.output();
  p.signal(SIGUSR2);
  EXPECT_TRUE(p.waitForOutput(str("got signal ", SIGUSR2), 10s)) << p.output();
  p.signal(SIGTERM);
  const auto r = p.wait(30s);
  EXPECT_EQ(r.exitCode, 128 + SIGTERM);
}

TEST(DtrunE2E, SecondSigintKillsWorkersThatIgnoreTheFirst) {
  ChildProcess p(dtrun({"--standalone", "--nproc", "2", "/bin/bash", "-c", "trap '' INT; echo ready; sleep 60"}));
  ASSERT_TRUE(p.waitForOutput("ready", 30s, 2)) << p.output();
  p.signal(SIGINT);
  // Two quick signals of one kind can merge into one; send the second once the first is in.
  ASSERT_TRUE(p.waitForOutput("received SIGINT: forwarded to the workers", 20s)) << p.output();
  p.signal(SIGINT);
  const auto r = p.wait(20s);
  EXPECT_FALSE(r.timedOut);
  EXPECT_EQ(r.exitCode, 128 + SIGINT) << r.err;
  EXPECT_THAT(r.err, HasSubstr("second SIGINT: killing the workers"));
  EXPECT_LT(r.seconds, 15) << "the default 30 s kill grace must not apply after a second SIGINT";
}

TEST(DtrunE2E, NoOrphansWhenDtrunIsKilled) {
  TempDir dir;
  ChildProcess p(dtrun({"--standalone", "--nproc", "3", kWorker, "pidfile", dir.path().string()}));
  ASSERT_TRUE(p.waitForOutput("pid written", 30s, 3)) << p.output();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 3; ++rank) {
    std::ifstream in(dir.path() / str("rank", rank, ".pid"));
    pid_t pid = 0, grandchild = 0;
    in >> pid >> grandchild;
    ASSERT_GT(pid, 0);
    ASSERT_GT(grandchild, 0);
    pids.push_back(pid);
    pids.push_back(grandchild);  // cleaned up by dtrun's guardian process
  }
  p.signal(SIGKILL);
  p.wait(10s);
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  for (pid_t pid : pids) {
    while (!processGone(pid) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(20ms);
    EXPECT_TRUE(processGone(pid)) << "worker or worker's child " << pid << " outlived a SIGKILLed dtrun";
    if (!processGone(pid)) kill(pid, SIGKILL);
  }
}

TEST(DtrunE2E, RestartsWholeGroupAndStoreSurvives) {
  const auto r = runProcess(dtrun({"--standalone", "--nproc", "2", "--max-restarts", "2", kWorker, "restart", "2"}), 90s);
  EXPECT_EQ(r.exitCode, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("attempts seen 3 restart count 2"));
  EXPECT_THAT(r.err, HasSubstr("restarting the worker group (restart 1 of 2)"));
  EXPECT_THAT(r.err, HasSubstr("restarting the worker group (restart 2 of 2)"));
  EXPECT_THAT(r.err, HasSubstr("attempt 1 of 3"));
}

TEST(DtrunE2E, RestartsExhaustedFailWithRootCause) {
  const auto r = runProcess(dtrun({"--standalone", "--nproc", "2", "--max-restarts", "1", kWorker, "restart", "5"}), 90s);
  EXPECT_EQ(r.exitCode, 3) << r.err;
  EXPECT_EQ(countOccurrences(r.err, "root cause: rank 0"), 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("no restarts left of 1"));
}

TEST(DtrunE2E, HangWatchdogNamesLastCollectiveAndBehindRanks) {
  const auto r = runProcess(dtrun({"--standalone", "--nproc", "3", "--hang-timeout", "3s", "--monitor-interval", "100ms",
                                   "--kill-grace", "2s", kWorker, "progress", "1"}),
                            60s);
  EXPECT_EQ(r.exitCode, 124) << r.err;
  EXPECT_LT(r.seconds, 20);
  EXPECT_THAT(r.err, HasSubstr("hang watchdog: no rank completed a collective for"));
  EXPECT_THAT(r.err, HasSubstr("rank 0: #5 allreduce"));
  EXPECT_THAT(r.err, HasSubstr("rank 1: #3 allreduce"));
  EXPECT_THAT(r.err, HasSubstr("Behind: rank(s) 1 (the furthest rank completed #5)"));
}

TEST(DtrunE2E, LogDirTeeAndLocalRanksFilter) {
  TempDir dir;
  const std::string logDir = dir.path().string();
  auto r = runProcess(dtrun({"--standalone", "--nproc", "2", "--log-dir", logDir, "--run-id", "job1", kWorker, "lines", "5"}), 60s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_THAT(r.out, Not(HasSubstr("L0:"))) << "without --tee, output goes to files only";
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream out(dir.path() / "job1" / "attempt0" / str("rank", rank, ".stdout"));
    std::string text((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
    EXPECT_EQ(countOccurrences(text, ":end\n"), 5) << text;
    EXPECT_EQ(countOccurrences(text, "[rank"), 0) << "files hold the raw output";
    std::ifstream err(dir.path() / "job1" / "attempt0" / str("rank", rank, ".stderr"));
    std::string errText((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
    EXPECT_THAT(errText, HasSubstr(str("stderr line from rank ", rank)));
  }
  r = runProcess(dtrun({"--standalone", "--nproc", "2", "--log-dir", logDir, "--tee", "--local-ranks-filter", "1",
                        kWorker, "lines", "3"}),
                 60s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_EQ(countOccurrences(r.out, "[rank 1] L1:"), 3) << r.out;
  EXPECT_EQ(countOccurrences(r.out, "L0:"), 0) << r.out;
}

TEST(DtrunE2E, PrefixedLinesNeverInterleave) {
  const auto r = runProcess(dtrun({"--standalone", "--nproc", "4", kWorker, "lines", "150"}), 60s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const std::regex re(R"(^\[rank (\d)\] L(\d):(\d+):([a-z])+:end$)");
  int good = 0;
  for (const auto& line : split(r.out, '\n')) {
    if (line.empty()) continue;
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, re)) << "mangled line: " << line.substr(0, 120);
    EXPECT_EQ(m[1], m[2]);
    EXPECT_EQ(line.size(), std::string("[rank 0] L0:").size() + m[3].length() + 1 + 200 + 4);
    ++good;
  }
  EXPECT_EQ(good, 600);
  EXPECT_THAT(r.err, HasSubstr("[rank 3] stderr line from rank 3"));
  const auto custom = runProcess(dtrun({"--standalone", "--nproc", "1", "--prefix", "<%h:%l> ", kWorker, "lines", "1"}), 60s);
  EXPECT_THAT(custom.out, HasSubstr(":0> L0:0:"));
}

TEST(DtrunE2E, UsageErrorsAreOneLineWithExitCode2) {
  auto r = runProcess(dtrun({"--nproc", "zero", "/bin/true"}), 30s);
  EXPECT_EQ(r.exitCode, 2);
  EXPECT_EQ(countOccurrences(r.err, "\n"), 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("accepted"));
  r = runProcess(dtrun({"--standalone", "/no/such/program"}), 30s);
  EXPECT_EQ(r.exitCode, 2);
  EXPECT_THAT(r.err, HasSubstr("cannot run \"/no/such/program\""));
  r = runProcess(dtrun({"--help"}), 30s);
  EXPECT_EQ(r.exitCode, 0);
  EXPECT_THAT(r.out, HasSubstr("DT_KILL_GRACE; default: 30s"));
  if (!std::filesystem::exists("/proc/driver/nvidia/gpus")) {
    r = runProcess(dtrun({"--standalone", "--nproc", "gpu", "/bin/true"}), 30s);
    EXPECT_EQ(r.exitCode, 2);
    EXPECT_THAT(r.err, HasSubstr("--nproc=gpu but no CUDA device was found"));
  }
  r = runProcess(dtrun({"--standalone", "/bin/true"}), 30s, {"DT_NPROC=banana"});
  EXPECT_EQ(r.exitCode, 2);
  EXPECT_THAT(r.err, HasSubstr("DT_NPROC=\"banana\""));
}

TEST(DtrunE2E, StorePortInUseIsAClearError) {
  // Node 0 of one job holds a port; a second job on the same port says so.
  const PortReservation reservation;
  const int port = reservation.port();
  ChildProcess holder(dtrun({"--master-port", std::to_string(port), "--nproc", "1", kWorker, "trap"}));
  ASSERT_TRUE(holder.waitForOutput("ready rank 0", 30s)) << holder.output();
  const auto r = runProcess(dtrun({"--master-port", std::to_string(port), kWorker, "env"}), 30s);
  EXPECT_EQ(r.exitCode, 1);
  EXPECT_THAT(r.err, HasSubstr(str("cannot host the job's store on 127.0.0.1:", port)));
  EXPECT_THAT(r.err, HasSubstr("--master-port 0"));
  holder.signal(SIGTERM);
  holder.wait(30s);
}

TEST(DtrunE2E, BusyDefaultPortFallsBackToAFreeOneOnASingleNode) {
  // Hold the default port (if someone else already holds it, it is busy all the same).
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(29500);
  const bool held = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 && listen(fd, 1) == 0;
  const auto r = runProcess(dtrun({kWorker, "env"}), 30s, {"DT_MASTER_PORT=", "DT_STANDALONE="});
  close(fd);
  EXPECT_EQ(r.exitCode, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("note: the default store port 29500 is busy")) << "held by this test: " << held;
  EXPECT_THAT(parseEnvDump(r.out)[0]["DT_STORE_ADDR"], Not(HasSubstr(":29500")));
}

TEST(DtrunE2E, TwoNodesOnLoopbackRanksNodeMajorAndExchangeData) {
  const PortReservation reservation;
  const std::string port = reservation.text();
  auto node = [&](int rank, const std::string& mode) {
    return dtrun({"--nnodes", "2", "--node-rank", std::to_string(rank), "--master-addr", "127.0.0.1", "--master-port",
                  port, "--nproc", "2", "--rdzv-timeout", "30s", kWorker, mode});
  };
  ChildProcess n1(node(1, "exchange"), {"DT_STORE_TOKEN=sharedsecret"});
  ChildProcess n0(node(0, "exchange"), {"DT_STORE_TOKEN=sharedsecret"});
  const auto r0 = n0.wait(60s);
  const auto r1 = n1.wait(60s);
  EXPECT_EQ(r0.exitCode, 0) << r0.err;
  EXPECT_EQ(r1.exitCode, 0) << r1.err;
  EXPECT_THAT(r0.out, HasSubstr("[rank 0] rank 0 group 0 sum 10 expected 10"));
  EXPECT_THAT(r0.out, HasSubstr("[rank 1] rank 1 group 0 sum 10 expected 10"));
  EXPECT_THAT(r1.out, HasSubstr("[rank 2] rank 2 group 1 sum 10 expected 10"));
  EXPECT_THAT(r1.out, HasSubstr("[rank 3] rank 3 group 1 sum 10 expected 10"));
}

TEST(DtrunE2E, MissingNodeIsARendezvousTimeoutAndSignalsStopTheWait) {
  const PortReservation reservation;
  const std::string port = reservation.text();
  auto r = runProcess(dtrun({"--nnodes", "3", "--master-port", port, "--rdzv-timeout", "1s", kWorker, "env"}), 30s);
  EXPECT_EQ(r.exitCode, 1);
  EXPECT_THAT(r.err, HasSubstr("node(s) 1-2 did not join attempt 1 within 1000 ms (--rdzv-timeout"));
  const PortReservation secondReservation;
  ChildProcess waiting(dtrun({"--nnodes", "2", "--master-port", secondReservation.text(), kWorker, "env"}),
                       {"DT_STORE_TOKEN="});
  // The note is printed once the store is up, i.e. while dtrun waits for node 1.
  ASSERT_TRUE(waiting.waitForOutput("DT_STORE_TOKEN is not set", 20s)) << waiting.output();
  waiting.signal(SIGINT);
  r = waiting.wait(20s);
  EXPECT_EQ(r.exitCode, 128 + SIGINT);
  EXPECT_THAT(r.err, HasSubstr("received SIGINT while waiting for the other nodes"));
}

TEST(DtrunE2E, TwoNodesSameNodeRankIsRejected) {
  const PortReservation reservation;
  const std::string port = reservation.text();
  auto node = [&](int rank) {
    return dtrun({"--nnodes", "2", "--node-rank", std::to_string(rank), "--master-port", port, "--nproc", "1",
                  "--rdzv-timeout", "5s", kWorker, "exchange"});
  };
  ChildProcess n0(node(0), {"TEST_LINGER_MS=3000"});
  ChildProcess first(node(1), {"TEST_LINGER_MS=3000"});
  ASSERT_TRUE(first.waitForOutput("lingering rank 1", 30s)) << first.output();  // node 1's rank is claimed
  const auto duplicate = runProcess(node(1), 30s);
  EXPECT_NE(duplicate.exitCode, 0);
  EXPECT_THAT(duplicate.err, HasSubstr("--node-rank 1 is already taken by another dtrun"));
  EXPECT_EQ(n0.wait(30s).exitCode, 0);
  EXPECT_EQ(first.wait(30s).exitCode, 0);
}

TEST(DtrunE2E, TwoNodesFailureOnOneNodeStopsBoth) {
  const PortReservation reservation;
  const std::string port = reservation.text();
  auto node = [&](int rank) {
    return dtrun({"--nnodes", "2", "--node-rank", std::to_string(rank), "--master-port", port, "--nproc", "2",
                  "--monitor-interval", "100ms", "--rdzv-timeout", "30s", kWorker, "exit", "5", "3", "500"});
  };
  ChildProcess n0(node(0));
  ChildProcess n1(node(1));
  const auto r0 = n0.wait(60s);
  const auto r1 = n1.wait(60s);
  EXPECT_EQ(r1.exitCode, 5) << r1.err;
  EXPECT_EQ(r0.exitCode, 5) << r0.err;
  EXPECT_THAT(r1.err, HasSubstr("root cause: rank 3"));
  EXPECT_THAT(r0.err, HasSubstr("root cause: node 1 reported: rank 3"));
  EXPECT_THAT(r0.err, HasSubstr("| worker rank 3: failing on purpose with code 5")) << "the remote root cause's stderr";
  EXPECT_THAT(r0.err, HasSubstr("exit code 5"));
  EXPECT_LT(r0.seconds, 20);
}

TEST(DtrunE2E, TwoNodesRestartTogether) {
  // Rank 0 (node 0) fails in attempt 0; both nodes restart, attempt 1 succeeds everywhere.
  const PortReservation reservation;
  const std::string port = reservation.text();
  auto node = [&](int rank) {
    return dtrun({"--nnodes", "2", "--node-rank", std::to_string(rank), "--master-port", port, "--nproc", "2",
                  "--max-restarts", "2", "--monitor-interval", "100ms", "--rdzv-timeout", "30s", "--kill-grace", "5s",
                  kWorker, "restart", "1"});
  };
  ChildProcess n0(node(0));
  ChildProcess n1(node(1));
  const auto r0 = n0.wait(90s);
  const auto r1 = n1.wait(90s);
  EXPECT_EQ(r0.exitCode, 0) << r0.err;
  EXPECT_EQ(r1.exitCode, 0) << r1.err;
  EXPECT_THAT(r0.out, HasSubstr("attempts seen 2 restart count 1"));
  EXPECT_THAT(r1.err, HasSubstr("root cause: node 0 reported: rank 0"));
  EXPECT_THAT(r0.err, HasSubstr("restarting the worker group (restart 1 of 2)"));
  EXPECT_THAT(r1.err, HasSubstr("restarting the worker group (restart 1 of 2)"));
}

// One node of a two-node job whose worker waits for a signal; short node
// timeouts so that a lost node is noticed quickly.
std::vector<std::string> trappingNode(const std::string& port, int nodeRank) {
  return dtrun({"--nnodes", "2", "--node-rank", std::to_string(nodeRank), "--master-port", port, "--nproc", "1",
                "--monitor-interval", "200ms", "--node-timeout", "3s", "--rdzv-timeout", "30s", kWorker, "trap"});
}

TEST(DtrunE2E, TwoNodesKilledDtrunIsNoticedByTheOther) {
  const PortReservation reservation;
  const std::string port = reservation.text();
  ChildProcess n0(trappingNode(port, 0));
  ChildProcess n1(trappingNode(port, 1));
  ASSERT_TRUE(n0.waitForOutput("ready rank 0", 30s)) << n0.output();
  ASSERT_TRUE(n1.waitForOutput("ready rank 1", 30s)) << n1.output();
  n1.signal(SIGKILL);
  const auto killedAt = std::chrono::steady_clock::now();
  const auto r0 = n0.wait(30s);
  EXPECT_NE(r0.exitCode, 0);
  // The watch connection closes with the killed dtrun: noticed at once, not after --node-timeout.
  EXPECT_THAT(r0.err, HasSubstr("root cause: node 1's dtrun closed its watch connection without finishing: its process is gone"));
  EXPECT_THAT(r0.err, HasSubstr("stopped by dtrun: rank(s) 0"));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - killedAt).count(), 10);
}

TEST(DtrunE2E, TwoNodesKilledNodeZeroIsNoticedPromptly) {
  const PortReservation reservation;
  const std::string port = reservation.text();
  ChildProcess n0(trappingNode(port, 0));
  ChildProcess n1(trappingNode(port, 1));
  ASSERT_TRUE(n0.waitForOutput("ready rank 0", 30s)) << n0.output();
  ASSERT_TRUE(n1.waitForOutput("ready rank 1", 30s)) << n1.output();
  n0.signal(SIGKILL);
  const auto killedAt = std::chrono::steady_clock::now();
  const auto r1 = n1.wait(30s);
  EXPECT_NE(r1.exitCode, 0);
  EXPECT_THAT(r1.err, HasSubstr("root cause: node 0's dtrun"));
  EXPECT_THAT(r1.err, ::testing::AnyOf(HasSubstr("died or was killed"), HasSubstr("lost the job's store")));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - killedAt).count(), 10);
}

TEST(DtrunE2E, TorchrunStyleDdpScriptRunsUnchanged) {
  const auto probe = runProcess({"/usr/bin/python3", "-c", "import torch, torch.distributed as d; print(d.is_available())"}, 120s);
  if (probe.exitCode != 0 || probe.out.find("True") == std::string::npos) {
    GTEST_SKIP() << "torch is not importable by /usr/bin/python3 (install python3-torch): " << probe.err.substr(0, 200);
  }
  const auto r = runProcess(dtrun({"--standalone", "--nproc", "2", "/usr/bin/python3", TEST_SOURCE_DIR "/torch_ddp_script.py"}), 180s,
                            {"GLOO_SOCKET_IFNAME=lo"});
  EXPECT_EQ(r.exitCode, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("[rank 0] DDP ok world=2"));
  EXPECT_THAT(r.out, HasSubstr("[rank 1] DDP ok world=2"));
}

}  // namespace
}  // namespace dt::testing
