// dtrun --rdzv-backend etcd with real etcd members (tests/store/etcd_test_support.h)
// and real dtrain workers: two emulated nodes (two dtruns on loopback) meet in
// etcd, the workers' store is etcd itself and they allreduce; losing one etcd
// member of three in the middle changes nothing; TLS with a client
// certificate plus user/password reach the workers; bad endpoints, a lonely node and a
// node rank claimed twice are one clear error each. Elastic through etcd: no
// node is special, so losing node 0 (its dtrun and its workers) leaves the
// others training, and a dtrun started again on its machine rejoins.
#include <csignal>
#include <fstream>
#include <memory>
#include <regex>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "tests/launcher/dtrun_process.h"
#include "tests/store/etcd_test_support.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

const std::string kDtrun = DTRUN_PATH;
const std::string kWorker = DTRAIN_WORKER_PATH;
const std::string kElasticWorker = ELASTIC_WORKER_PATH;

std::vector<std::string> dtrun(const EtcdCluster& cluster, const std::string& id, std::vector<std::string> extra,
                               std::vector<std::string> program) {
  std::vector<std::string> argv = {kDtrun, "--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints(),
                                   "--rdzv-id", id, "--monitor-interval", "200ms", "--node-timeout", "2s",
                                   "--kill-grace", "2s", "--rdzv-timeout", "60s"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

TEST(DtrunEtcd, TwoNodesAllreduceThroughEtcdAndLoseAnEtcdMemberUnnoticed) {
  EtcdCluster cluster({.members = 3});
  // No --node-rank: the nodes get ranks in the order they join.
  ChildProcess a(dtrun(cluster, "job-a", {"--nnodes", "2", "--nproc", "2"}, {kWorker, "steps", "12", "100"}));
  ChildProcess b(dtrun(cluster, "job-a", {"--nnodes", "2", "--nproc", "2"}, {kWorker, "steps", "12", "100"}));
  ASSERT_TRUE(a.waitForOutput("step 3", 60s)) << a.output() << b.output();
  cluster.kill(0);  // the member every client started on
  const auto ra = a.wait(90s);
  const auto rb = b.wait(90s);
  ASSERT_EQ(ra.exitCode, 0) << ra.out << ra.err;
  ASSERT_EQ(rb.exitCode, 0) << rb.out << rb.err;
  const std::string out = ra.out + rb.out;
  for (int rank = 0; rank < 4; ++rank) EXPECT_THAT(out, HasSubstr(str("rank ", rank, " allreduce ok world 4 restart 0")));
  // Both node ranks were handed out.
  EXPECT_THAT(ra.err + rb.err, HasSubstr("(node 0/2)"));
  EXPECT_THAT(ra.err + rb.err, HasSubstr("(node 1/2)"));
  // The same id again: a new round, not the old job's keys.
  ChildProcess c(dtrun(cluster, "job-a", {"--nnodes", "2", "--node-rank", "1"}, {kWorker, "allreduce", "2"}));
  ChildProcess d(dtrun(cluster, "job-a", {"--nnodes", "2", "--node-rank", "0"}, {kWorker, "allreduce", "2"}));
  const auto rc = c.wait(60s), rd = d.wait(60s);
  EXPECT_EQ(rc.exitCode, 0) << rc.out << rc.err;
  EXPECT_EQ(rd.exitCode, 0) << rd.out << rd.err;
  EXPECT_THAT(rc.out + rd.out, HasSubstr("allreduce ok world 2"));
}

TEST(DtrunEtcd, TlsAndCredentialsReachTheWorkers) {
  // alice may use /dtrain/secure/: the job's keys (its id is "secure").
  EtcdCluster cluster({.tls = true, .clientCertAuth = true, .auth = true, .authPrefix = "/dtrain/secure"});
  const auto& certs = cluster.certificates();
  const std::vector<std::string> security = {"--nnodes", "2", "--rdzv-ca", certs.ca, "--rdzv-cert", certs.clientCert,
                                             "--rdzv-key", certs.clientKey, "--rdzv-user", EtcdCluster::kUser};
  const std::vector<std::string> env = {str("DT_RDZV_PASSWORD=", EtcdCluster::kPassword)};
  ChildProcess a(dtrun(cluster, "secure", security, {kWorker, "allreduce", "3"}), env);
  ChildProcess b(dtrun(cluster, "secure", security, {kWorker, "allreduce", "3"}), env);
  const auto ra = a.wait(60s), rb = b.wait(60s);
  ASSERT_EQ(ra.exitCode, 0) << ra.out << ra.err;
  ASSERT_EQ(rb.exitCode, 0) << rb.out << rb.err;
  EXPECT_THAT(ra.out + rb.out, HasSubstr("allreduce ok world 2"));
  // A wrong password: one clear error, at once.
  const auto bad = runProcess(dtrun(cluster, "secure", security, {kWorker, "allreduce", "1"}), 30s,
                              {"DT_RDZV_PASSWORD=wrong"});
  EXPECT_EQ(bad.exitCode, 1);
  EXPECT_THAT(bad.err, HasSubstr("authentication failed"));
  EXPECT_THAT(bad.err, HasSubstr(cluster.endpoint(0)));
}

TEST(DtrunEtcd, ElasticJobLosesNode0GoesOnAndTheNodeRejoins) {
  EtcdCluster cluster({.members = 3});
  // Three nodes of two workers (--nnodes 2:3, all three there at the start); rank 0 (on node
  // 0) kills its own dtrun and itself in step 20: node 0's other worker dies with its dtrun,
  // its lease expires, and the other nodes post its members dead. Then one etcd member is
  // killed (nothing shows), and node 0's machine starts a dtrun again: it joins the running
  // job as node 3 and its two workers are admitted; six ranks finish.
  const std::vector<std::string> worker = {kElasticWorker, "300", "30", "0", "20", "node"};
  auto node = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"--nnodes", "2:3", "--nproc", "2", "--elastic"};
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<ChildProcess>(dtrun(cluster, "elastic-etcd", args, worker));
  };
  std::vector<std::unique_ptr<ChildProcess>> nodes;
  // A lease of 60 s: the loss is seen through the watch connections that node 0's dtrun had to
  // each other node, which its kernel closed (no waiting for the lease).
  for (int rank = 0; rank < 3; ++rank) nodes.push_back(node({"--node-rank", std::to_string(rank), "--node-timeout", "60s"}));
  ASSERT_TRUE(nodes[1]->waitForOutput("go on from step", 60s)) << nodes[0]->output() << nodes[1]->output();
  cluster.kill(1);
  const auto lost = nodes[0]->wait(60s);
  EXPECT_NE(lost.exitCode, 0) << "node 0's dtrun was killed";
  nodes.push_back(node({"--node-timeout", "60s"}));  // node 0 again, without a node rank: a fresh one
  for (size_t i = 1; i < nodes.size(); ++i) {
    const auto r = nodes[i]->wait(120s);
    ASSERT_EQ(r.exitCode, 0) << "dtrun " << i << ":\n" << r.out << r.err;
    EXPECT_THAT(r.err, ::testing::Not(HasSubstr("finished without")));
    if (i < 3) {
      EXPECT_THAT(r.err, HasSubstr("node 0 is lost (node 0's dtrun closed its watch connection without finishing: its "
                                   "process is gone"));
    } else {
      EXPECT_THAT(r.err, HasSubstr("this node joins it as node 3"));
    }
    // Members 2-5 on nodes 1 and 2; the rejoined node's workers are members 6 and 7.
    for (int member : i == 1 ? std::vector<int>{2, 3} : i == 2 ? std::vector<int>{4, 5} : std::vector<int>{6, 7}) {
      const std::regex line(str("member ", member, " rank [0-9]/6 epoch [0-9]+ state ([0-9]+) expected ([0-9]+)"));
      std::smatch match;
      ASSERT_TRUE(std::regex_search(r.out, match, line)) << "member " << member << ":\n" << r.out << r.err;
      EXPECT_EQ(match[1].str(), match[2].str()) << "member " << member;
    }
  }
}

TEST(DtrunEtcd, ANodeSilentButNotDeadIsLostWhenItsLeaseRunsOut) {
  EtcdCluster cluster({.members = 1});
  // Three nodes of two workers; in step 20 member 4 stops node 2 whole (its dtrun and both
  // workers SIGSTOPped): its watch connections stay open, so only its lease can tell, after
  // --node-timeout 3s. The other nodes declare it lost and finish without it.
  const std::vector<std::string> worker = {kElasticWorker, "300", "30", "4", "20", "nodestop"};
  // The stopped node's dtrun forwards nothing more: its worker also writes the line to a file.
  TempDir stamps;
  const std::string stamp = (stamps.path() / "silenced").string();
  std::vector<std::unique_ptr<ChildProcess>> nodes;
  for (int rank = 0; rank < 3; ++rank) {
    nodes.push_back(std::make_unique<ChildProcess>(
        dtrun(cluster, "silent-node", {"--nnodes", "2:3", "--nproc", "2", "--elastic", "--node-rank", std::to_string(rank), "--node-timeout", "3s"},
              worker),
        std::vector<std::string>{"DT_TEST_KILL_STAMP=" + stamp}));
  }
  for (int i = 0; i < 2; ++i) {
    const auto r = nodes[static_cast<size_t>(i)]->wait(180s);
    ASSERT_EQ(r.exitCode, 0) << "dtrun " << i << ":\n" << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr("node 2 is lost (")) << r.err;
    for (int member : i == 0 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}) {
      const std::regex line(str("member ", member, " rank [0-9]/4 epoch [0-9]+ state ([0-9]+) expected ([0-9]+)"));
      std::smatch match;
      ASSERT_TRUE(std::regex_search(r.out, match, line)) << "member " << member << ":\n" << r.out << r.err;
      EXPECT_EQ(match[1].str(), match[2].str()) << "member " << member;
    }
  }
  // The silence to the survivors' first commit after it (reported, not asserted: a measure).
  std::smatch stopped, resumed;
  std::ifstream stampFile(stamp);
  const std::string silent((std::istreambuf_iterator<char>(stampFile)), std::istreambuf_iterator<char>());
  EXPECT_THAT(silent, HasSubstr("member 4: silences its node at")) << "member 4 never stopped its node";
  const std::string survivor = nodes[0]->output();
  if (std::regex_search(silent, stopped, std::regex(R"(silences its node at (\d+) ms)")) &&
      std::regex_search(survivor, resumed, std::regex(R"(first commit after recovery at (\d+) ms)"))) {
    std::printf("node silent -> survivors' next commit: %lld ms (--node-timeout 3s)\n",
                std::stoll(resumed[1]) - std::stoll(stopped[1]));
  }
  nodes[2]->killWithChildren();  // node 2's processes are still stopped
}

TEST(DtrunEtcd, BadInputIsOneClearErrorEach) {
  EtcdCluster cluster;
  // A lonely node: the others use another id (or are not started).
  const auto lonely = runProcess(dtrun(cluster, "nobody-else", {"--nnodes", "2", "--rdzv-timeout", "1s"},
                                       {kWorker, "allreduce", "1"}),
                                 30s);
  EXPECT_EQ(lonely.exitCode, 1);
  EXPECT_THAT(lonely.err, HasSubstr("1 of 2 nodes joined job nobody-else"));
  EXPECT_THAT(lonely.err, HasSubstr(cluster.endpoint(0)));
  EXPECT_THAT(lonely.err, HasSubstr("--rdzv-id nobody-else"));
  // Nothing listens there.
  const auto unreachable = runProcess({kDtrun, "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id",
                                       "x", "--rdzv-timeout", "1s", kWorker, "allreduce", "1"},
                                      30s);
  EXPECT_EQ(unreachable.exitCode, 1);
  EXPECT_THAT(unreachable.err, HasSubstr("cannot use the rendezvous etcd at 127.0.0.1:1"));
  EXPECT_THAT(unreachable.err, HasSubstr("Is etcd running"));
  EXPECT_LT(unreachable.seconds, 20);
  // Two dtruns claiming one node rank.
  ChildProcess first(dtrun(cluster, "twice", {"--nnodes", "2", "--node-rank", "0"}, {kWorker, "allreduce", "1"}));
  std::this_thread::sleep_for(1s);  // it claims node 0 within milliseconds of starting
  const auto second = runProcess(dtrun(cluster, "twice", {"--nnodes", "2", "--node-rank", "0"}, {kWorker, "allreduce", "1"}), 30s);
  EXPECT_EQ(second.exitCode, 1) << second.err;
  EXPECT_THAT(second.err, HasSubstr("--node-rank 0 of job twice is already taken"));
  first.signal(SIGTERM);
  first.wait(30s);
  // Usage errors.
  const auto noEndpoint = runProcess({kDtrun, "--rdzv-backend", "etcd", "--rdzv-id", "x", kWorker}, 10s);
  EXPECT_EQ(noEndpoint.exitCode, 2);
  EXPECT_THAT(noEndpoint.err, HasSubstr("needs --rdzv-endpoint"));
  const auto v2 = runProcess({kDtrun, "--rdzv-backend", "etcd-v2", kWorker}, 10s);
  EXPECT_EQ(v2.exitCode, 2);
  EXPECT_THAT(v2.err, HasSubstr("etcd 3.6 removed the v2 API"));
}

}  // namespace
}  // namespace dt::testing
