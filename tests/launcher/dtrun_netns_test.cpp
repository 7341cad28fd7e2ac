// Several machines for real, on one machine: three network namespaces
// ("hosts" 10.231.0.1-3, joined by a bridge in a fourth namespace), one dtrun
// in each. The ranks exchange data through node 0's store across the
// "network"; then a link is cut, or one host's dtrun is killed, and every
// other host must report it and exit non-zero within the node timeout.
// Skipped (with the reason) where namespaces cannot be created.
#include <csignal>
#include <map>
#include <regex>
#include <thread>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "tests/launcher/dtrun_process.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::AnyOf;
using ::testing::HasSubstr;

const std::string kDtrun = DTRUN_PATH;
const std::string kWorker = WORKER_PATH;

ProcessResult sh(const std::string& command) { return runProcess({"/bin/sh", "-c", command}, 30s); }

// Three hosts and a switch; removed in the destructor whatever happened.
class Hosts {
 public:
  Hosts() : tag_(str("dt", getpid() % 100000)) {}
  ~Hosts() {
    for (const auto& ns : created_) sh("ip netns del " + ns + " 2>/dev/null");
  }

  // Empty string on success, else why it could not be built.
  std::string build() {
    if (geteuid() != 0) return "not root (network namespaces need CAP_SYS_ADMIN)";
    if (sh("command -v ip").exitCode != 0) return "the ip tool (iproute2) is not installed";
    const std::string sw = ns("sw");
    if (auto r = sh("ip netns add " + sw); r.exitCode != 0) return "cannot create a network namespace: " + r.err;
    created_.push_back(sw);
    std::string error = run({"ip -n " + sw + " link add br0 type bridge", "ip -n " + sw + " link set br0 up"});
    for (int h = 0; h < 3 && error.empty(); ++h) {
      const std::string host = ns(hostName(h));
      if (auto r = sh("ip netns add " + host); r.exitCode != 0) return "cannot create a network namespace: " + r.err;
      created_.push_back(host);
      const std::string v = vethName(h), vs = vethName(h) + "s";
      error = run({str("ip link add ", v, " type veth peer name ", vs), str("ip link set ", v, " netns ", host),
                   str("ip link set ", vs, " netns ", sw), str("ip -n ", sw, " link set ", vs, " master br0 up"),
                   str("ip -n ", host, " addr add ", address(h), "/24 dev ", v), str("ip -n ", host, " link set ", v, " up"),
                   str("ip -n ", host, " link set lo up")});
    }
    if (!error.empty()) return error;
    // The bridge forwards once its ports are up; wait until host 2 reaches host 0.
    for (int i = 0; i < 50; ++i) {
      if (sh(str("ip netns exec ", ns(hostName(2)), " ping -c1 -W1 ", address(0), " >/dev/null 2>&1")).exitCode == 0) return "";
      if (sh("command -v ping").exitCode != 0) {
        std::this_thread::sleep_for(1s);
        return "";
      }
      std::this_thread::sleep_for(100ms);
    }
    return "";
  }

  std::string ns(const std::string& name) const { return tag_ + name; }
  static std::string hostName(int h) { return str("h", h); }
  static std::string address(int h) { return str("10.231.0.", h + 1); }
  std::string vethName(int h) const { return str(tag_, "v", h); }
  std::string cutLink(int h) { return run({str("ip -n ", ns("sw"), " link set ", vethName(h), "s down")}); }

  std::vector<std::string> dtrunOn(int h, const std::string& linger, const std::vector<std::string>& extra = {},
                                   int nodes = 3, std::vector<std::string> worker = {kWorker, "exchange"}) const {
    std::vector<std::string> argv = {"/usr/bin/env", "ip", "netns", "exec", ns(hostName(h)), "/usr/bin/env",
                                     "DT_STORE_TOKEN=netns-secret", "TEST_LINGER_MS=" + linger,
                                     "DT_GLOO_HOSTNAME=" + address(h), kDtrun,
                                     "--nnodes", std::to_string(nodes), "--node-rank", std::to_string(h),
                                     "--master-addr", address(0), "--master-port", "29400", "--nproc", "2",
                                     "--monitor-interval", "200ms", "--node-timeout", "3s", "--kill-grace", "2s",
                                     "--rdzv-timeout", "30s"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.insert(argv.end(), worker.begin(), worker.end());
    return argv;
  }

 private:
  std::string run(const std::vector<std::string>& commands) {
    for (const auto& command : commands) {
      if (auto r = sh(command); r.exitCode != 0) return command + ": " + r.err;
    }
    return "";
  }
  std::string tag_;
  std::vector<std::string> created_;
};

TEST(DtrunNetns, ThreeHostsExchangeDataThenSurviveACutLinkAndAKilledHost) {
  Hosts hosts;
  if (const std::string why = hosts.build(); !why.empty()) GTEST_SKIP() << "network namespaces unavailable: " << why;

  // 1. A job across the three hosts: ranks 0-1 on host 0, 2-3 on host 1, 4-5 on host 2.
  {
    std::vector<std::unique_ptr<ChildProcess>> nodes;
    for (int h = 0; h < 3; ++h) nodes.push_back(std::make_unique<ChildProcess>(hosts.dtrunOn(h, "0")));
    for (int h = 0; h < 3; ++h) {
      const auto r = nodes[static_cast<size_t>(h)]->wait(60s);
      EXPECT_EQ(r.exitCode, 0) << "host " << h << ": " << r.err;
      for (int local = 0; local < 2; ++local) {
        const int rank = 2 * h + local;
        EXPECT_THAT(r.out, HasSubstr(str("[rank ", rank, "] rank ", rank, " group ", h, " sum 21 expected 21"))) << r.out;
      }
    }
  }

  // 2. Cut host 2's link while the job runs: hosts 0 and 1 lose its heartbeats,
  //    host 2 loses the store; all three stop non-zero well within 20 s.
  {
    std::vector<std::unique_ptr<ChildProcess>> nodes;
    for (int h = 0; h < 3; ++h) nodes.push_back(std::make_unique<ChildProcess>(hosts.dtrunOn(h, "60000")));
    for (int h = 0; h < 3; ++h) ASSERT_TRUE(nodes[static_cast<size_t>(h)]->waitForOutput("lingering", 30s, 2)) << nodes[static_cast<size_t>(h)]->output();
    ASSERT_EQ(hosts.cutLink(2), "");
    const auto cutAt = std::chrono::steady_clock::now();
    for (int h = 0; h < 3; ++h) {
      const auto r = nodes[static_cast<size_t>(h)]->wait(40s);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - cutAt).count();
      EXPECT_FALSE(r.timedOut) << "host " << h;
      EXPECT_NE(r.exitCode, 0) << "host " << h << ": " << r.err;
      EXPECT_LT(seconds, 20) << "host " << h << " took too long to notice";
      EXPECT_THAT(r.err, HasSubstr("dtrun: job failed")) << "host " << h;
      if (h < 2) {
        EXPECT_THAT(r.err, HasSubstr("node 2 stopped sending heartbeats")) << r.err;
      } else {
        EXPECT_THAT(r.err, AnyOf(HasSubstr("no answer from the job's store"), HasSubstr("lost the job's store"))) << r.err;
      }
    }
  }
}

#ifdef DTRAIN_WORKER_PATH
// Two hosts with two ranks each: the ranks of a host share memory, the hosts
// talk through Gloo (hierarchical allreduce), and every rank gets the same bits.
TEST(DtrunNetns, TwoHostsOfTwoRanksAllreduceThroughSharedMemoryAndGloo) {
  Hosts hosts;
  if (const std::string why = hosts.build(); !why.empty()) GTEST_SKIP() << "network namespaces unavailable: " << why;
  std::vector<std::unique_ptr<ChildProcess>> nodes;
  for (int h = 0; h < 2; ++h) {
    nodes.push_back(std::make_unique<ChildProcess>(hosts.dtrunOn(h, "0", {}, 2, {DTRAIN_WORKER_PATH, "backend"})));
  }
  for (int h = 0; h < 2; ++h) {
    const auto r = nodes[static_cast<size_t>(h)]->wait(90s);
    EXPECT_EQ(r.exitCode, 0) << "host " << h << ": " << r.out << r.err;
    for (int local = 0; local < 2; ++local) {
      const int rank = 2 * h + local;
      EXPECT_THAT(r.out, HasSubstr(str("[rank ", rank, "] rank ", rank, " backend shm+gloo ok"))) << r.out << r.err;
    }
  }
}
#endif

TEST(DtrunNetns, KilledHostDtrunIsReportedByTheOthers) {
  Hosts hosts;
  if (const std::string why = hosts.build(); !why.empty()) GTEST_SKIP() << "network namespaces unavailable: " << why;
  std::vector<std::unique_ptr<ChildProcess>> nodes;
  for (int h = 0; h < 3; ++h) nodes.push_back(std::make_unique<ChildProcess>(hosts.dtrunOn(h, "60000")));
  for (int h = 0; h < 3; ++h) ASSERT_TRUE(nodes[static_cast<size_t>(h)]->waitForOutput("lingering", 30s, 2)) << nodes[static_cast<size_t>(h)]->output();
  // `ip netns exec` execs dtrun, so this pid is host 1's dtrun itself.
  nodes[1]->signal(SIGKILL);
  const auto killedAt = std::chrono::steady_clock::now();
  for (int h : {0, 2}) {
    const auto r = nodes[static_cast<size_t>(h)]->wait(40s);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killedAt).count();
    EXPECT_NE(r.exitCode, 0) << "host " << h << ": " << r.err;
    EXPECT_LT(seconds, 10) << "a killed dtrun's watch connection closes at once";
    // Host 0 sees host 1's watch connection close; host 2 hears it from host 0 through the store.
    EXPECT_THAT(r.err, HasSubstr("node 1's dtrun closed its watch connection without finishing")) << "host " << h << ": " << r.err;
  }
}

#ifdef ELASTIC_WORKER_PATH
// dtrun --elastic across three hosts of two ranks, of which the first rank of host `lostHost`
// SIGKILLs its own dtrun and itself at step 15, so that host and both its ranks vanish at once.
// Checks that the lost host's dtrun died of it and that the four ranks of the other two hosts
// finish in place with every step applied exactly once (renumbered 0-3 in member order); returns
// the survivors' results by host for the caller's own checks.
std::map<int, ProcessResult> loseAHost(Hosts& hosts, int lostHost, const std::vector<std::string>& flags) {
  std::vector<std::unique_ptr<ChildProcess>> nodes;
  for (int h = 0; h < 3; ++h) {
    nodes.push_back(std::make_unique<ChildProcess>(hosts.dtrunOn(
        h, "0", flags, 3, {ELASTIC_WORKER_PATH, "40", "5", std::to_string(2 * lostHost), "15", "node"})));
  }
  const auto lost = nodes[static_cast<size_t>(lostHost)]->wait(60s);
  EXPECT_EQ(lost.exitCode, 128 + SIGKILL) << lost.err;
  std::map<int, ProcessResult> survivors;
  for (int h = 0; h < 3; ++h) {
    if (h == lostHost) continue;
    const auto r = nodes[static_cast<size_t>(h)]->wait(90s);
    EXPECT_EQ(r.exitCode, 0) << "host " << h << ": " << r.out << r.err;
    for (int local = 0; local < 2; ++local) {
      const int newRank = 2 * (h > lostHost ? h - 1 : h) + local;
      EXPECT_THAT(r.out, HasSubstr(str("member ", 2 * h + local, " rank ", newRank, "/4 epoch 1 state 1914")))
          << "host " << h << ": " << r.out << r.err;
      EXPECT_THAT(r.out, HasSubstr("expected 1914 lost ")) << r.out;
    }
    EXPECT_THAT(r.out, HasSubstr(str("was lost with node ", lostHost))) << "host " << h << ": " << r.out;
    survivors[h] = r;
  }
  return survivors;
}

// Host 1 lost: host 0 sees the watch connection close and posts ranks 2-3 dead.
TEST(DtrunNetns, ElasticJobLosesAWholeHostAndTheOtherHostsFinishInPlace) {
  Hosts hosts;
  if (const std::string why = hosts.build(); !why.empty()) GTEST_SKIP() << "network namespaces unavailable: " << why;
  const auto survivors = loseAHost(hosts, 1, {"--elastic"});
  ASSERT_EQ(survivors.count(0), 1u);
  const auto& head = survivors.at(0);
  EXPECT_THAT(head.err, HasSubstr("node 1 is lost (node 1's dtrun closed its watch connection without finishing"))
      << head.err;
  EXPECT_THAT(head.err, HasSubstr("the elastic job goes on without them")) << head.err;
}

// Host 0 lost, whose dtrun hosts the job's TCP store: host 1's dtrun hosts its hot standby, which
// takes over when its replication connection from host 0 is closed by host 0's kernel; every
// client on hosts 1 and 2 fails over to it across the "network". --node-timeout 60s: nothing
// may wait for a timeout.
TEST(DtrunNetns, ElasticJobLosesTheStoresHostAndTheOtherHostsFinishOnItsStandby) {
  Hosts hosts;
  if (const std::string why = hosts.build(); !why.empty()) GTEST_SKIP() << "network namespaces unavailable: " << why;
  const auto survivors = loseAHost(hosts, 0, {"--elastic", "--node-timeout", "60s"});
  for (const auto& [h, r] : survivors) {
    EXPECT_THAT(r.err, HasSubstr("failed over to 10.231.0.2:")) << "host " << h << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr("node 0 is lost (node 0's dtrun closed its watch connection")) << r.err;
  }
  ASSERT_EQ(survivors.count(1), 1u);
  EXPECT_THAT(survivors.at(1).err, HasSubstr("this node hosts the hot standby of the job's store at 10.231.0.2:"));
}

// dtrun --elastic --nnodes 2:3 across three hosts: hosts 0 and 1 start the job
// (after its last call for a third); host 2's dtrun, started later, joins it
// as node 3 and its two workers (members 4 and 5) are admitted at a step
// boundary. In step 150 (or its first, if it came later) member 4 kills its
// dtrun and itself: host 2 is gone again, and the four ranks of hosts 0 and 1
// finish exactly.
TEST(DtrunNetns, ElasticJobGainsAHostWhileItRunsAndLosesItAgain) {
  Hosts hosts;
  if (const std::string why = hosts.build(); !why.empty()) GTEST_SKIP() << "network namespaces unavailable: " << why;
  const std::vector<std::string> worker = {ELASTIC_WORKER_PATH, "250", "20", "4", "150", "node"};
  auto node = [&](int h) {
    return std::make_unique<ChildProcess>(hosts.dtrunOn(h, "0", {"--elastic", "--nnodes", "2:3"}, 3, worker));
  };
  auto first = node(0), second = node(1);
  std::this_thread::sleep_for(4s);  // the job starts at two hosts 2 s after the second came
  auto late = node(2);
  const auto r2 = late->wait(90s);
  EXPECT_EQ(r2.exitCode, 128 + SIGKILL) << r2.out << r2.err;
  EXPECT_THAT(r2.err, HasSubstr("this node joins it as node 3")) << r2.err;
  EXPECT_THAT(r2.out, HasSubstr("member 4: joined at step")) << r2.out;
  const auto r0 = first->wait(90s), r1 = second->wait(90s);
  for (const auto* r : {&r0, &r1}) {
    EXPECT_EQ(r->exitCode, 0) << r->out << r->err;
    EXPECT_THAT(r->out, HasSubstr("was lost with node 3")) << r->out;
  }
  for (int rank = 0; rank < 4; ++rank) {
    const std::string& out = rank < 2 ? r0.out : r1.out;
    const std::regex line(str("member ", rank, " rank ", rank, "/4 epoch [0-9]+ state ([0-9]+) expected ([0-9]+)"));
    std::smatch match;
    ASSERT_TRUE(std::regex_search(out, match, line)) << "member " << rank << ": " << out;
    EXPECT_EQ(match[1].str(), match[2].str()) << "member " << rank;
  }
  EXPECT_THAT(r0.err, HasSubstr("node 3 is lost")) << r0.err;
}
#endif

}  // namespace
}  // namespace dt::testing
