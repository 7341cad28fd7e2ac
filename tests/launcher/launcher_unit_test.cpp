// Unit tests of dtrun's pure parts: command line, worker environment, output
// lines, failure summary, SLURM mode, hang report.
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/errors.h"
#include "launcher/coordinator.h"
#include "launcher/flight_gather.h"
#include "launcher/options.h"
#include "launcher/output.h"
#include "launcher/slurm.h"
#include "launcher/summary.h"
#include "launcher/worker_env.h"
#include "tests/testing/testing.h"

namespace dt::launcher {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

EnvLookup envFrom(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

ParseResult parse(std::vector<std::string> args, std::map<std::string, std::string> vars = {}) {
  return parseCommandLine(args, envFrom(std::move(vars)));
}

TEST(LauncherArgs, DefaultsMatchHelp) {
  const auto r = parse({"./trainer", "--lr", "0.1"});
  const auto& o = r.options;
  EXPECT_EQ(o.nprocSpec, "1");
  EXPECT_EQ(o.nnodes, 1);
  EXPECT_EQ(o.masterPort, 29500);
  EXPECT_EQ(o.killGrace, std::chrono::seconds(30));
  EXPECT_EQ(o.maxRestarts, 0);
  EXPECT_EQ(o.signals, (std::vector<int>{SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2}));
  EXPECT_EQ(o.hangTimeout.count(), 0);
  // Program arguments that look like options are the program's.
  EXPECT_EQ(o.program, (std::vector<std::string>{"./trainer", "--lr", "0.1"}));
  const std::string help = helpText();
  for (const char* needle : {"--nproc", "DT_NPROC", "default: 1", "--master-port", "default: 29500", "--kill-grace",
                             "default: 30s", "--signals", "INT,TERM,HUP,QUIT,USR1,USR2", "--max-restarts",
                             "--monitor-interval", "--log-dir", "--tee", "--local-ranks-filter", "--run-id",
                             "--standalone", "--bind", "--hang-timeout", "--nnodes", "--node-rank", "--master-addr"}) {
    EXPECT_THAT(help, HasSubstr(needle));
  }
}

TEST(LauncherArgs, LongFormsEqualsFormAndDoubleDash) {
  const auto r = parse({"--nproc=4", "--nnodes", "2", "--node-rank=1", "--master-addr", "10.0.0.1", "--master-port",
                        "1234", "--max-restarts", "3", "--kill-grace", "250ms", "--signals", "TERM,SIGUSR1,2",
                        "--tee", "--log-dir", "/tmp/x", "--local-ranks-filter", "0,2-3", "--hang-timeout", "5min",
                        "--prefix", "none", "--", "prog", "--nproc", "9"});
  const auto& o = r.options;
  EXPECT_EQ(o.nprocSpec, "4");
  EXPECT_EQ(o.nnodes, 2);
  EXPECT_EQ(o.nodeRank, 1);
  EXPECT_EQ(o.masterAddr, "10.0.0.1");
  EXPECT_EQ(o.masterPort, 1234);
  EXPECT_EQ(o.maxRestarts, 3);
  EXPECT_EQ(o.killGrace.count(), 250);
  EXPECT_EQ(o.signals, (std::vector<int>{SIGTERM, SIGUSR1, SIGINT}));
  EXPECT_TRUE(o.tee);
  EXPECT_EQ(o.logDir, "/tmp/x");
  EXPECT_EQ(*o.localRanksFilter, (std::vector<int>{0, 2, 3}));
  EXPECT_EQ(o.hangTimeout, std::chrono::minutes(5));
  EXPECT_EQ(o.prefix, "");
  EXPECT_EQ(o.program, (std::vector<std::string>{"prog", "--nproc", "9"}));
}

TEST(LauncherArgs, EnvironmentFallbackAndCommandLinePrecedence) {
  auto r = parse({"prog"}, {{"DT_NPROC", "3"}, {"DT_MAX_RESTARTS", "2"}, {"DT_KILL_GRACE", "5"}, {"DT_TEE", "1"}});
  EXPECT_EQ(r.options.nprocSpec, "3");
  EXPECT_EQ(r.options.maxRestarts, 2);
  EXPECT_EQ(r.options.killGrace, std::chrono::seconds(5));
  EXPECT_TRUE(r.options.tee);
  r = parse({"--nproc", "5", "prog"}, {{"DT_NPROC", "3"}});
  EXPECT_EQ(r.options.nprocSpec, "5");
  // torchrun spellings carry over.
  r = parse({"--nproc_per_node", "2", "prog"});
  EXPECT_EQ(r.options.nprocSpec, "2");
}

TEST(LauncherArgs, InvalidValuesSayWhatIsAccepted) {
  using dt::testing::expectThrowsWith;
  expectThrowsWith<InvalidArgument>([] { parse({"--nproc", "zero", "p"}); }, {"--nproc", "\"zero\"", "accepted", "cpu, gpu or auto"});
  expectThrowsWith<InvalidArgument>([] { parse({"--nproc", "0", "p"}); }, {"--nproc", "accepted"});
  expectThrowsWith<InvalidArgument>([] { parse({"--master-port", "70000", "p"}); }, {"--master-port", "0 to 65535"});
  expectThrowsWith<InvalidArgument>([] { parse({"--kill-grace", "soon", "p"}); }, {"--kill-grace", "30s"});
  expectThrowsWith<InvalidArgument>([] { parse({"--signals", "KILL", "p"}); }, {"--signals", "not a forwardable signal"});
  expectThrowsWith<InvalidArgument>([] { parse({"--signals", "FOO", "p"}); }, {"\"FOO\"", "INT,TERM"});
  expectThrowsWith<InvalidArgument>([] { parse({"--local-ranks-filter", "3-1", "p"}); }, {"--local-ranks-filter", "0,2-3"});
  expectThrowsWith<InvalidArgument>([] { parse({"--bogus", "p"}); }, {"unknown option", "--bogus"});
  expectThrowsWith<InvalidArgument>([] { parse({"--nproc"}); }, {"--nproc needs a value"});
  expectThrowsWith<InvalidArgument>([] { parse({"--nproc", "2"}); }, {"no program given"});
  expectThrowsWith<InvalidArgument>([] { parse({"--nnodes", "2", "--node-rank", "2", "p"}); }, {"--node-rank=2", "0 to 1"});
  expectThrowsWith<InvalidArgument>([] { parse({"--tee=maybe", "p"}); }, {"--tee", "true/false"});
  expectThrowsWith<InvalidArgument>([] { parse({"p"}, {{"DT_NNODES", "x"}}); }, {"DT_NNODES", "\"x\""});
  expectThrowsWith<InvalidArgument>([] { parse({"--slurm", "maybe", "p"}); }, {"auto, on, off"});
  expectThrowsWith<InvalidArgument>([] { parse({"--nnodes", "2", "--master-port", "0", "p"}); }, {"--master-port=0"});
  const std::string message = expectThrowsWith<InvalidArgument>([] { parse({"--run-id", "a b", "p"}); }, {"--run-id"});
  EXPECT_EQ(message.find('\n'), std::string::npos) << "errors are one line";
}

TEST(LauncherArgs, HelpVersionAndStandalone) {
  EXPECT_TRUE(parse({"--help"}).help);
  EXPECT_TRUE(parse({"-h", "x"}).help);
  EXPECT_TRUE(parse({"--version"}).version);
  const auto r = parse({"--standalone", "--master-port", "1234", "p"});
  EXPECT_EQ(r.options.masterPort, 0);
  EXPECT_EQ(r.options.masterAddr, "127.0.0.1");
}

TEST(LauncherArgs, ResolveNproc) {
  auto gpus = [](int n) { return [n] { return n; }; };
  EXPECT_EQ(resolveNproc("3", gpus(0), gpus(8)), 3);
  EXPECT_EQ(resolveNproc("cpu", gpus(2), gpus(8)), 8);
  EXPECT_EQ(resolveNproc("gpu", gpus(2), gpus(8)), 2);
  EXPECT_EQ(resolveNproc("auto", gpus(2), gpus(8)), 2);
  EXPECT_EQ(resolveNproc("auto", gpus(0), gpus(8)), 8);
  dt::testing::expectThrowsWith<InvalidArgument>([&] { resolveNproc("gpu", gpus(0), gpus(8)); },
                                                 {"--nproc=gpu", "no CUDA device"});
}

TEST(LauncherArgs, SignalNames) {
  EXPECT_EQ(signalName(SIGKILL), "SIGKILL");
  EXPECT_EQ(signalName(SIGSEGV), "SIGSEGV");
  EXPECT_EQ(signalName(77), "signal 77");
  EXPECT_EQ(parseSignalList("none", "x"), std::vector<int>{});
}

TEST(LauncherEnv, WorkerContract) {
  WorkerIdentity id;
  id.rank = 5;
  id.worldSize = 8;
  id.localRank = 1;
  id.localWorldSize = 4;
  id.groupRank = 1;
  id.numNodes = 2;
  id.masterAddr = "10.0.0.1";
  id.masterPort = 40001;
  id.storeAddr = "10.0.0.1:29500";
  id.storeToken = "tok";
  id.storeStandby = "10.0.0.2:41000";
  id.runId = "job7";
  id.restartCount = 2;
  id.maxRestarts = 3;
  const auto env = buildWorkerEnv({"PATH=/bin", "RANK=99", "HOME=/root", "DT_STORE_TOKEN=old"}, id);
  const std::map<std::string, std::string> expected = {
      {"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "1"},
      {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "40001"}, {"DT_STORE_ADDR", "10.0.0.1:29500"},
      {"DT_STORE_TOKEN", "tok"}, {"DT_STORE_STANDBY", "10.0.0.2:41000"}, {"DT_RUN_ID", "job7"}, {"DT_RESTART_COUNT", "2"}, {"DT_MAX_RESTARTS", "3"},
      {"OMP_NUM_THREADS", "1"}, {"DT_NUM_THREADS", "1"}, {"PATH", "/bin"}, {"HOME", "/root"},
      {"TORCHELASTIC_RESTART_COUNT", "2"}};
  for (const auto& [name, value] : expected) EXPECT_EQ(lookupEntry(env.entries, name), value) << name;
  EXPECT_TRUE(env.threadsDefaulted);
  // Each name once.
  std::map<std::string, int> counts;
  for (const auto& e : env.entries) counts[e.substr(0, e.find('='))]++;
  for (const auto& [name, count] : counts) EXPECT_EQ(count, 1) << name;
}

TEST(LauncherEnv, ThreadsLeftAloneForOneWorkerOrWhenSet) {
  WorkerIdentity id;
  auto env = buildWorkerEnv({"PATH=/bin"}, id);
  EXPECT_FALSE(env.threadsDefaulted);
  EXPECT_EQ(lookupEntry(env.entries, "OMP_NUM_THREADS"), "");
  id.localWorldSize = 2;
  env = buildWorkerEnv({"OMP_NUM_THREADS=4", "DT_NUM_THREADS=3"}, id);
  EXPECT_FALSE(env.threadsDefaulted);
  EXPECT_EQ(lookupEntry(env.entries, "OMP_NUM_THREADS"), "4");
  EXPECT_EQ(lookupEntry(env.entries, "DT_NUM_THREADS"), "3");
}

TEST(LauncherOutput, LineSplitterHoldsPartialLines) {
  LineSplitter splitter(8);
  std::vector<std::string> lines;
  splitter.feed("ab", lines);
  EXPECT_TRUE(lines.empty());
  splitter.feed("c\nde\n\nf", lines);
  EXPECT_EQ(lines, (std::vector<std::string>{"abc", "de", ""}));
  lines.clear();
  splitter.feed("0123456789", lines);  // longer than maxLine: cut
  EXPECT_EQ(lines, (std::vector<std::string>{"f0123456"}));
  lines.clear();
  splitter.flush(lines);
  EXPECT_EQ(lines, (std::vector<std::string>{"789"}));
}

TEST(LauncherOutput, PrefixExpansion) {
  EXPECT_EQ(expandPrefix("[rank %r] ", 3, 1, 0, "h"), "[rank 3] ");
  EXPECT_EQ(expandPrefix("%h/%n/%l:%r 100%% %x", 3, 1, 2, "gpu1"), "gpu1/2/1:3 100% %x");
}

WorkerOutcome outcome(int rank, bool signaled, int code, int64_t t, bool stopped = false) {
  WorkerOutcome o;
  o.rank = rank;
  o.localRank = rank;
  o.host = "hostA";
  o.pid = 1000 + rank;
  o.signaled = signaled;
  o.code = code;
  o.timeMs = t;
  o.stoppedByLauncher = stopped;
  return o;
}

TEST(LauncherSummary, RootCauseIsEarliestOwnFailure) {
  std::vector<WorkerOutcome> outs = {outcome(0, true, SIGTERM, 900, true), outcome(1, false, 3, 500),
                                     outcome(2, false, 4, 400), outcome(3, false, 0, 100)};
  ASSERT_TRUE(rootCause(outs));
  EXPECT_EQ(*rootCause(outs), 2u);
  EXPECT_EQ(exitCodeOf(outs[2]), 4);
  EXPECT_EQ(exitCodeOf(outcome(0, true, SIGSEGV, 0)), 128 + SIGSEGV);
  std::vector<WorkerOutcome> none = {outcome(0, false, 0, 1), outcome(1, true, SIGTERM, 2, true)};
  EXPECT_FALSE(rootCause(none));
  // Reaped at the same millisecond (seen in CI under load: a SIGKILLed rank 2 and the three whose
  // collectives then failed): the signal is the cause, not the lowest rank's error exit.
  std::vector<WorkerOutcome> together = {outcome(0, false, 1, 700), outcome(1, false, 1, 700),
                                         outcome(2, true, SIGKILL, 700), outcome(3, false, 1, 700)};
  EXPECT_EQ(rootCause(together), 2u);
}

TEST(LauncherSummary, FormatNamesHostPidCodeTimeTailAndStopped) {
  SummaryInput in;
  in.runId = "r1";
  in.startMs = 1'700'000'000'000;
  auto failed = outcome(2, false, 7, in.startMs + 1500);
  failed.stderrTail = {"line a", "Traceback: boom"};
  in.outcomes = {outcome(0, true, SIGTERM, in.startMs + 1600, true), outcome(1, true, SIGTERM, in.startMs + 1600, true),
                 failed, outcome(3, true, SIGKILL, in.startMs + 1550)};
  const std::string text = formatSummary(in);
  EXPECT_THAT(text, HasSubstr("root cause: rank 2 (local rank 2, host hostA, pid 1002): exit code 7 at 2023-11-14 22:13:21.500 UTC (1.500 s after start)"));
  EXPECT_THAT(text, HasSubstr("| Traceback: boom"));
  EXPECT_THAT(text, HasSubstr("also failed: rank 3"));
  EXPECT_THAT(text, HasSubstr("signal SIGKILL (not sent by dtrun: the out-of-memory killer or another process"));
  // A SIGKILL dtrun did not send says what the kernel's OOM kill count shows, not a guess.
  auto unexplained = outcome(3, true, SIGKILL, 0);
  unexplained.oomKillsMeanwhile = 0;
  EXPECT_THAT(describeOutcome(unexplained), HasSubstr("nor by the out-of-memory killer, which killed nothing while it ran"));
  EXPECT_THAT(describeOutcome(unexplained), HasSubstr("another process sent it"));
  unexplained.oomKillsMeanwhile = 2;
  EXPECT_THAT(describeOutcome(unexplained),
              HasSubstr("the kernel's out-of-memory killer killed 2 process(es) while it ran (/proc/vmstat oom_kill)"));
  EXPECT_THAT(text, HasSubstr("stopped by dtrun: rank(s) 0-1"));
  // A SIGKILL that dtrun sent is not called an OOM kill.
  auto killed = outcome(0, true, SIGKILL, 0);
  killed.killedByLauncher = true;
  EXPECT_THAT(describeOutcome(killed), Not(HasSubstr("out-of-memory")));
  // ... and says why dtrun sent it.
  killed.killReason = "no heartbeat for 2.2 s (--liveness-timeout 2s)";
  EXPECT_EQ(describeOutcome(killed), "signal SIGKILL (sent by dtrun: no heartbeat for 2.2 s (--liveness-timeout 2s))");
  in.externalCause = "node 1 reported: rank 5 ended with exit code 3";
  EXPECT_THAT(formatSummary(in), HasSubstr("root cause: node 1 reported: rank 5"));
}

TEST(LauncherSlurm, OneTaskPerNodeStepFillsNodes) {
  LaunchOptions o;
  const bool used = applySlurm(o, envFrom({{"SLURM_STEP_ID", "0"}, {"SLURM_STEP_NUM_TASKS", "3"},
                                           {"SLURM_STEP_NUM_NODES", "3"}, {"SLURM_NNODES", "3"},
                                           {"SLURM_NODEID", "2"}, {"SLURM_JOB_NODELIST", "gpu-a[07-09],gpu-b3"},
                                           {"SLURM_STEP_NODELIST", "gpu-a[08-09],gpu-b3"}, {"SLURM_JOB_ID", "12345"}}));
  EXPECT_TRUE(used);
  EXPECT_EQ(o.nnodes, 3);
  EXPECT_EQ(o.nodeRank, 2);
  EXPECT_EQ(o.masterAddr, "gpu-a08");
  EXPECT_EQ(o.masterPort, 20000 + 12345 % 10000);
  EXPECT_EQ(o.runId, "slurm-12345.0");
}

TEST(LauncherSlurm, UserOptionsWinAndAutoSkipsOtherSteps) {
  LaunchOptions o;
  o.masterPort = 4000;
  o.masterPortSet = true;
  const auto vars = envFrom({{"SLURM_STEP_ID", "1"}, {"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_STEP_NUM_NODES", "2"},
                             {"SLURM_NNODES", "2"}, {"SLURM_NODEID", "0"}, {"SLURM_JOB_NODELIST", "n[1-2]"},
                             {"SLURM_JOB_ID", "7"}});
  EXPECT_TRUE(applySlurm(o, vars));
  EXPECT_EQ(o.masterPort, 4000);
  EXPECT_EQ(o.masterAddr, "n1");
  // Several tasks per node, or a batch script without srun: auto leaves it alone.
  LaunchOptions p;
  EXPECT_FALSE(applySlurm(p, envFrom({{"SLURM_STEP_ID", "0"}, {"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_STEP_NUM_NODES", "2"},
                                      {"SLURM_NNODES", "2"}, {"SLURM_NODEID", "0"}, {"SLURM_JOB_NODELIST", "n[1-2]"},
                                      {"SLURM_JOB_ID", "7"}})));
  EXPECT_FALSE(applySlurm(p, envFrom({{"SLURM_NNODES", "2"}, {"SLURM_JOB_ID", "7"}})));
  EXPECT_EQ(p.nnodes, 1);
  p.slurm = "on";
  dt::testing::expectThrowsWith<InvalidArgument>([&] { applySlurm(p, envFrom({{"SLURM_JOB_ID", "7"}})); },
                                                 {"SLURM_NNODES", "srun"});
}

TEST(LauncherWatchdog, HangReportNamesLastCollectiveAndBehindRanks) {
  const std::string report = formatHangReport({"12 allreduce", "11 allreduce", ""});
  EXPECT_THAT(report, HasSubstr("rank 0: #12 allreduce"));
  EXPECT_THAT(report, HasSubstr("rank 1: #11 allreduce"));
  EXPECT_THAT(report, HasSubstr("rank 2: no collective completed"));
  EXPECT_THAT(report, HasSubstr("Behind: rank(s) 1-2 (the furthest rank completed #12)"));
  EXPECT_THAT(formatHangReport({"3 barrier", "3 barrier"}), HasSubstr("No rank is behind"));
}

TEST(LauncherWatchdog, FailureRecordRoundTrip) {
  const auto d = decodeFailure(encodeFailure(3, 1234, 1, "rank 5 (host h\tx) ended"));
  EXPECT_EQ(d.code, 3);
  EXPECT_EQ(d.timeMs, 1234);
  EXPECT_EQ(d.node, 1);
  EXPECT_EQ(d.description, "rank 5 (host h\tx) ended");
}

// The other nodes' flight records travel as one packed value: the dumps of a folder (nothing
// else there), into another folder that keeps a dump it holds already; a budget leaves out the
// largest files and counts them; a damaged pack is one error naming where.
TEST(LauncherFlightGather, PackedDumpsLandInAnotherFolderOnce) {
  testing::TempDir from, to;
  const auto write = [](const std::filesystem::path& path, const std::string& text) { std::ofstream(path) << text; };
  write(from.path() / "flight_rank2_signal.json", "{\"rank\": 2}\n");
  write(from.path() / "flight_rank3_timeout.json", std::string(300, 'x'));
  write(from.path() / "rank2.stderr", "not a dump");
  write(to.path() / "flight_rank2_signal.json", "mine");
  const PackedFlightFiles all = packFlightFiles(from.path().string(), 1 << 20);
  EXPECT_EQ(all.files, 2);
  EXPECT_EQ(all.leftOut, 0);
  EXPECT_EQ(unpackFlightFiles(all.bytes, to.path().string(), "node 1"), 1);
  std::ifstream kept(to.path() / "flight_rank2_signal.json"), copied(to.path() / "flight_rank3_timeout.json");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(kept), {}), "mine");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(copied), {}), std::string(300, 'x'));
  EXPECT_FALSE(std::filesystem::exists(to.path() / "rank2.stderr"));

  const PackedFlightFiles small = packFlightFiles(from.path().string(), 100);
  EXPECT_EQ(small.files, 1) << "the smaller dump fits";
  EXPECT_EQ(small.leftOut, 1);

  testing::expectThrowsWith<InvalidArgument>([&] { unpackFlightFiles(all.bytes.substr(0, all.bytes.size() - 10), to.path().string(), "node 1"); },
                                             {"flight records from node 1", "does not fit"});
  testing::expectThrowsWith<InvalidArgument>(
      [&] { unpackFlightFiles("../evil.json\n4\nabcd", to.path().string(), "node 7"); }, {"node 7", "\"../evil.json\""});
}

}  // namespace
}  // namespace dt::launcher
