// dtrun's live status page without a job: the ranks' records (store/status_records.h), the
// collector reading a store that holds what a job writes (launcher/status.h), the JSON and
// Prometheus renderings, and the HTTP server (launcher/status_server.h) over real sockets.
// The page under a real job, in headless Chromium: tests/train/status_page_e2e_test.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include "common/errors.h"
#include "common/json.h"
#include "common/strings.h"
#include "launcher/options.h"
#include "launcher/status.h"
#include "launcher/status_server.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"
#include "store/membership.h"
#include "store/status_records.h"
#include "tests/launcher/status_test_support.h"
#include "tests/testing/testing.h"

namespace dt::launcher {
namespace {

using ::testing::HasSubstr;
using testing::httpGet;
using testing::parsePrometheusText;

TEST(StatusRecords, EachRecordReadsBackAndSeparatorsInTextsCannotShiftFields) {
  const status::RankRecord r{1700000000123, 40, 100, 0.5, 61234.5, "samples", 123456789, 2, 4, "host\twith tab"};
  const auto back = status::decodeRankRecord(status::encode(r));
  ASSERT_TRUE(back.has_value()) << status::encode(r);
  EXPECT_EQ(back->timeMs, r.timeMs);
  EXPECT_EQ(back->step, 40);
  EXPECT_EQ(back->steps, 100);
  EXPECT_DOUBLE_EQ(back->loss, 0.5);
  EXPECT_DOUBLE_EQ(back->rate, 61234.5);
  EXPECT_EQ(back->unit, "samples");
  EXPECT_EQ(back->rssBytes, 123456789);
  EXPECT_EQ(back->rank, 2);
  EXPECT_EQ(back->world, 4);
  EXPECT_EQ(back->host, "host with tab");

  const status::CurvePoint p{20, std::nan(""), 1000, {{"val loss", 2.5}, {"a=b", 0.25}}};
  const auto point = status::decodeCurvePoint(status::encode(p));
  ASSERT_TRUE(point.has_value());
  EXPECT_EQ(point->step, 20);
  EXPECT_TRUE(std::isnan(point->loss));
  ASSERT_EQ(point->metrics.size(), 2u);
  EXPECT_EQ(point->metrics[0].first, "val loss");
  EXPECT_DOUBLE_EQ(point->metrics[0].second, 2.5);
  EXPECT_EQ(point->metrics[1].first, "a_b");

  const auto event = status::decodeEvent(status::encode(status::EventRecord{5, "recovery", "line one\nline\ttwo"}));
  ASSERT_TRUE(event.has_value());
  EXPECT_EQ(event->kind, "recovery");
  EXPECT_EQ(event->text, "line one line two");

  for (const char* bad : {"", "1\t2", "x\t1\t2\t3\t4\tsamples\t5\t6\t7\th", "1\t2\t3\tloss\t4\tsamples\t5\t6\t7\th"}) {
    EXPECT_FALSE(status::decodeRankRecord(bad).has_value()) << bad;
  }
  EXPECT_FALSE(status::decodeCurvePoint("1\t2\t3\tnoequals").has_value());
  EXPECT_FALSE(status::decodeEvent("notanumber\tkind\ttext").has_value());
  EXPECT_GT(status::residentBytes(), 0);
}

// What a 4-rank elastic job writes: records, progress, heartbeats, a death, a joiner, the
// loop's recovery and checkpoint events, a straggler report and curve points.
void writeJob(Store& store) {
  for (int m = 0; m < 4; ++m) {
    status::postRank(store, m, {1000 + m, 40, 100, 0.75, 5000, "samples", (m + 1) * 1000000, m, 4, str("host", m)});
    store.set(str("dt/progress/", m), str(80 + m, " allreduce"));
    membership::beat(store, m, 7);
  }
  status::postCurvePoint(store, {0, std::nan(""), 0, {{"test_accuracy", 0.1}}});
  status::postCurvePoint(store, {20, 1.5, 4000, {}});
  status::postCurvePoint(store, {40, 0.75, 5000, {{"test_accuracy", 0.6}}});
  status::postEvent(store, {2000, "checkpoint", "trainer: checkpoint at step 25 (periodic) written to ck/step-25"});
  membership::postDeath(store, 2, "exited: signal SIGKILL");
  status::postEvent(store, {3000, "recovery", "trainer: epoch 1 of the job: 3 rank(s) go on from step 41 without rank 2 (member 2)"});
  const int joiner = membership::newMemberId(store, 4);
  membership::registerJoiner(store, joiner);
  store.add("dt/straggler/count", 1);
  store.set("dt/straggler/1", "1\t1\ttrainer: rank 1 (host host1) is a straggler at step 30: ...");
}

TEST(StatusCollector, ReadsMembersEventsAndCurvesFromTheStore) {
  auto store = std::make_shared<HashStore>();
  StatusCollector collector(store, {"run7", true, std::chrono::milliseconds(1000)});
  collector.poll();
  EXPECT_EQ(collector.view().state, "starting");
  EXPECT_TRUE(collector.view().members.empty()) << "no attempt yet";

  collector.beginAttempt(0, 4);
  writeJob(*store);
  collector.poll();
  const JobView v = collector.view();
  EXPECT_EQ(v.runId, "run7");
  EXPECT_EQ(v.state, "running");
  EXPECT_EQ(v.storeError, "");
  ASSERT_EQ(v.members.size(), 5u) << "four of the start and the joiner";
  for (int m : {0, 1, 3}) {
    const MemberView& member = v.members[static_cast<size_t>(m)];
    EXPECT_EQ(member.state, "running") << m;
    EXPECT_EQ(member.step, 40);
    EXPECT_EQ(member.rank, m);
    EXPECT_EQ(member.host, str("host", m));
    EXPECT_EQ(member.rssBytes, (m + 1) * 1000000);
    EXPECT_EQ(member.lastOp, str("#", 80 + m, " allreduce"));
    EXPECT_GE(member.heartbeatAgeS, 0.0);
  }
  EXPECT_EQ(v.members[2].state, "dead");
  EXPECT_EQ(v.members[2].reason, "exited: signal SIGKILL");
  EXPECT_EQ(v.members[4].member, 4);
  EXPECT_EQ(v.members[4].state, "joining");
  EXPECT_EQ(v.step, 40);
  EXPECT_EQ(v.steps, 100);
  EXPECT_DOUBLE_EQ(v.loss, 0.75);
  EXPECT_DOUBLE_EQ(v.rate, 5000);
  ASSERT_EQ(v.curve.size(), 3u);
  EXPECT_EQ(v.curve[2].metrics.at(0).first, "test_accuracy");

  std::vector<std::string> kinds;
  for (const JobEvent& e : v.events) kinds.push_back(e.kind);
  EXPECT_THAT(kinds, ::testing::ElementsAre("start", "death", "join", "checkpoint", "recovery", "straggler"));
  EXPECT_EQ(v.events[1].text, "rank 2 died: exited: signal SIGKILL");
  EXPECT_EQ(v.events[2].text, "member 4 registered to join the running job");

  // The next poll reads only what is new, and the joiner shows running once it writes.
  status::postRank(*store, 4, {5000, 45, 100, 0.7, 5100, "samples", 1000, 3, 4, "host9"});
  status::postCurvePoint(*store, {40, 0.7, 5100, {}});  // a step logged again after a recovery
  collector.poll();
  const JobView w = collector.view();
  EXPECT_EQ(w.events.size(), v.events.size());
  EXPECT_EQ(w.members[4].state, "running");
  EXPECT_EQ(w.members[4].rank, 3);
  EXPECT_EQ(w.step, 45);
  ASSERT_EQ(w.curve.size(), 3u) << "the newer point for step 40 replaced the older";
  EXPECT_DOUBLE_EQ(w.curve.back().loss, 0.7);

  collector.finish("succeeded");
  collector.poll();
  const JobView f = collector.view();
  EXPECT_EQ(f.state, "finished");
  EXPECT_EQ(f.members[0].state, "finished");
  EXPECT_EQ(f.members[2].state, "dead");
  EXPECT_EQ(f.events.back().kind, "finish");
}

TEST(StatusCollector, AProgramOffTheLoopShowsRunningOnceItsProcessGroupRecordsACollective) {
  auto store = std::make_shared<HashStore>();
  StatusCollector collector(store, {"run10", false, std::chrono::milliseconds(1000)});
  collector.beginAttempt(0, 2);
  store->set("dt/progress/1", "3 broadcast");
  collector.poll();
  const JobView v = collector.view();
  ASSERT_EQ(v.members.size(), 2u);
  EXPECT_EQ(v.members[0].state, "starting") << "no sign of life yet";
  EXPECT_EQ(v.members[0].heartbeatAgeS, -1.0);
  EXPECT_EQ(v.members[1].state, "running");
  EXPECT_EQ(v.members[1].lastOp, "#3 broadcast");
  EXPECT_EQ(v.members[1].step, -1) << "no loop, no step";
  EXPECT_EQ(v.step, -1);
  for (const auto& s : parsePrometheusText(prometheusText(v))) {
    EXPECT_NE(s.name, "dtrain_job_step") << "an unknown step is left out, not written as -1";
  }
}

TEST(StatusCollector, AMemberThatLeftWithItsReplicaShowsWhy) {
  auto store = std::make_shared<HashStore>();
  StatusCollector collector(store, {"run12", true, std::chrono::milliseconds(1000)});
  collector.beginAttempt(0, 2);
  membership::beat(*store, 0, 1);
  membership::beat(*store, 1, 1);
  collector.poll();
  EXPECT_EQ(collector.view().members[1].state, "running");
  membership::beat(*store, 0, 2);  // member 0 beats on; member 1 leaves and stops
  membership::postLeft(*store, 1, "its tensor-parallel group lost member 3");
  collector.poll();
  const JobView v = collector.view();
  EXPECT_EQ(v.members[0].state, "running");
  EXPECT_EQ(v.members[1].state, "left");
  EXPECT_EQ(v.members[1].reason, "its tensor-parallel group lost member 3");
}

TEST(StatusCollector, ARestartedGroupIsReadUnderItsRestartPrefix) {
  auto store = std::make_shared<HashStore>();
  StatusCollector collector(store, {"run11", false, std::chrono::milliseconds(1000)});
  collector.beginAttempt(0, 2);
  status::postRank(*store, 0, {1, 30, 100, 0.9, 10, "samples", 1, 0, 2, "a"});
  status::postCurvePoint(*store, {20, 0.9, 10, {}});
  collector.poll();
  EXPECT_EQ(collector.view().members[0].step, 30);
  // Restart 1 (dtrun --max-restarts): the workers' keys live under restart1/ and resume from a checkpoint at 25.
  collector.beginAttempt(1, 2);
  PrefixStore restart("restart1", store);
  status::postRank(restart, 1, {2, 40, 100, 0.8, 12, "samples", 1, 1, 2, "b"});
  status::postCurvePoint(restart, {40, 0.8, 12, {}});
  status::postEvent(restart, {3, "checkpoint", "at 40"});
  collector.poll();
  const JobView v = collector.view();
  EXPECT_EQ(v.attempt, 1);
  EXPECT_EQ(v.members[0].state, "starting") << "a new process, not seen yet";
  EXPECT_EQ(v.members[1].step, 40);
  EXPECT_EQ(v.members[1].host, "b");
  ASSERT_EQ(v.curve.size(), 2u);
  EXPECT_EQ(v.curve[1].step, 40);
  EXPECT_EQ(v.events.back().text, "at 40");
  EXPECT_EQ(v.events[v.events.size() - 2].text, "restart 1: 2 worker(s) started");
}

TEST(StatusCollector, JsonAndPrometheusRenderTheView) {
  auto store = std::make_shared<HashStore>();
  StatusCollector collector(store, {"run\"8", true, std::chrono::milliseconds(1000)});
  collector.beginAttempt(0, 4);
  writeJob(*store);
  collector.poll();
  const JobView v = collector.view();

  const json::Value doc = json::parse(statusJson(v), "status.json");
  EXPECT_EQ(doc.get("run_id").asString(), "run\"8");
  EXPECT_EQ(doc.get("step").asInt(), 40);
  EXPECT_EQ(doc.get("members").items().size(), 5u);
  EXPECT_EQ(doc.get("members").items()[2].get("state").asString(), "dead");
  EXPECT_TRUE(doc.get("curve").items()[0].get("loss").isNull()) << "NaN is null in JSON";
  EXPECT_EQ(doc.get("events").items()[1].get("kind").asString(), "death");

  const std::string text = prometheusText(v);
  std::map<std::string, double> series;
  for (const auto& s : parsePrometheusText(text)) {
    std::string key = s.name;
    for (const auto& [k, value] : s.labels) key += str(" ", k, "=", value);
    series[key] = s.value;
  }
  EXPECT_EQ(series.at("dtrain_job_step"), 40) << text;
  EXPECT_EQ(series.at("dtrain_job_loss"), 0.75);
  EXPECT_EQ(series.at("dtrain_job_throughput unit=samples"), 5000);
  EXPECT_EQ(series.at("dtrain_job_metric name=test_accuracy"), 0.6);
  EXPECT_EQ(series.at("dtrain_job_members state=running"), 3);
  EXPECT_EQ(series.at("dtrain_job_members state=dead"), 1);
  EXPECT_EQ(series.at("dtrain_job_events_total kind=death"), 1);
  EXPECT_EQ(series.at("dtrain_member_step host=host1 member=1 rank=1"), 40);
  EXPECT_EQ(series.at("dtrain_member_up host=host2 member=2 rank=2 state=dead"), 0);
  EXPECT_EQ(series.at("dtrain_member_rss_bytes host=host3 member=3 rank=3"), 4000000);
  EXPECT_EQ(series.count("dtrain_member_step host= member=4 rank=-1"), 0u) << "no step before its first record";

  // The strict reader refuses what a scraper would.
  EXPECT_THROW(parsePrometheusText("dtrain_x 1\n"), std::runtime_error);
  EXPECT_THROW(parsePrometheusText("# TYPE dtrain_x gauge\ndtrain_x{a=\"1} 1\n"), std::runtime_error);
  EXPECT_THROW(parsePrometheusText("# TYPE dtrain_x gauge\ndtrain_x one\n"), std::runtime_error);
}

TEST(StatusCollector, AStoreThatFailsIsNamedOnThePage) {
  auto store = std::make_shared<HashStore>();
  StatusCollector collector(store, {"run9", false, std::chrono::milliseconds(1000)});
  collector.beginAttempt(0, 2);
  store->set("dt/status/curve/count", "1");  // counted, but the point never came
  store->setTimeout(std::chrono::milliseconds(50));
  collector.poll();
  EXPECT_THAT(collector.view().storeError, HasSubstr("dt/status/curve/1"));
  store->set("dt/status/curve/1", status::encode(status::CurvePoint{10, 1.0, 100, {}}));
  collector.poll();
  EXPECT_EQ(collector.view().storeError, "");
  EXPECT_EQ(collector.view().curve.size(), 1u) << "read on the next poll";
}

StatusServer::Config serverConfig(const std::string& token = "") {
  StatusServer::Config c;
  c.token = token;
  c.json = [] { return std::string("{\"ok\": true}"); };
  c.metrics = [] { return std::string("# TYPE dtrain_x gauge\ndtrain_x 1\n"); };
  return c;
}

TEST(StatusServer, ServesThePageChartJsJsonAndMetrics) {
  StatusServer server(serverConfig());
  ASSERT_GT(server.port(), 0);
  EXPECT_EQ(server.url(), str("http://127.0.0.1:", server.port(), "/"));
  const auto page = httpGet(server.port(), "/");
  ASSERT_EQ(page.status, 200) << page.body;
  EXPECT_THAT(page.headers, HasSubstr("Content-Type: text/html"));
  EXPECT_THAT(page.body, HasSubstr("<canvas id=\"loss-chart\">"));
  EXPECT_EQ(page.body, std::string(statusPageHtml()));

  std::ifstream in(kChartJsPath, std::ios::binary);
  ASSERT_TRUE(in) << kChartJsPath << " is missing: install libjs-chart.js (scripts/setup.sh does)";
  const std::string chart((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto js = httpGet(server.port(), "/chart.js");
  ASSERT_EQ(js.status, 200);
  EXPECT_EQ(js.body.size(), chart.size());
  EXPECT_EQ(js.body, chart);

  EXPECT_EQ(httpGet(server.port(), "/status.json").body, "{\"ok\": true}");
  const auto metrics = httpGet(server.port(), "/metrics");
  EXPECT_THAT(metrics.headers, HasSubstr("text/plain; version=0.0.4"));
  EXPECT_EQ(parsePrometheusText(metrics.body).size(), 1u);

  const auto head = httpGet(server.port(), "/status.json", "", std::chrono::seconds(30), "HEAD");
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.body, "");
  EXPECT_EQ(httpGet(server.port(), "/nothing").status, 404);
  EXPECT_EQ(httpGet(server.port(), "/status.json", "", std::chrono::seconds(30), "POST").status, 405);
}

TEST(StatusServer, ATokenIsRequiredWhenSetByQueryOrBearer) {
  StatusServer server(serverConfig("s3cret"));
  EXPECT_EQ(server.url(), str("http://127.0.0.1:", server.port(), "/?token=s3cret"));
  const auto refused = httpGet(server.port(), "/status.json");
  EXPECT_EQ(refused.status, 403);
  EXPECT_THAT(refused.body, HasSubstr("needs the token"));
  EXPECT_EQ(httpGet(server.port(), "/?token=wrong").status, 403);
  EXPECT_EQ(httpGet(server.port(), "/metrics?token=s3cre").status, 403);
  EXPECT_EQ(httpGet(server.port(), "/status.json?token=s3cret").status, 200);
  EXPECT_EQ(httpGet(server.port(), "/chart.js?x=1&token=s3cret").status, 200);
  EXPECT_EQ(httpGet(server.port(), "/metrics", "Authorization: Bearer s3cret\r\n").status, 200);
  EXPECT_EQ(httpGet(server.port(), "/metrics", "authorization: bearer wrong\r\n").status, 403);
}

TEST(StatusServer, BadClientsLoseOnlyTheirOwnConnection) {
  StatusServer server(serverConfig());
  EXPECT_EQ(httpGet(server.port(), "/", std::string(20000, 'x') + "\r\n").status, -1) << "a head over 16 KiB is dropped";
  EXPECT_EQ(httpGet(server.port(), "garbage").status, 400);
  EXPECT_EQ(httpGet(server.port(), "/status.json").status, 200) << "and the server goes on";
}

TEST(StatusServer, SetUpErrorsNameThePortTheAddressOrTheFile) {
  StatusServer first(serverConfig());
  StatusServer::Config busy = serverConfig();
  busy.port = first.port();
  testing::expectThrowsWith<Error>([&] { StatusServer second(busy); },
                                   {str("--status-port ", first.port(), " on 127.0.0.1 is in use"), "pass another port, or 0"});
  StatusServer::Config noChart = serverConfig();
  noChart.chartJsPath = "/nonexistent/chart.min.js";
  testing::expectThrowsWith<Error>([&] { StatusServer server(noChart); },
                                   {"Chart.js at /nonexistent/chart.min.js, which is missing: install Debian's libjs-chart.js"});
  StatusServer::Config badBind = serverConfig();
  badBind.bind = "no-such-host.invalid";
  testing::expectThrowsWith<Error>([&] { StatusServer server(badBind); },
                                   {"--status-bind \"no-such-host.invalid\" does not resolve"});
}

TEST(StatusServer, LoopbackAndTargets) {
  EXPECT_TRUE(isLoopbackAddress("127.0.0.1"));
  EXPECT_TRUE(isLoopbackAddress("127.1.2.3"));
  EXPECT_TRUE(isLoopbackAddress("::1"));
  EXPECT_TRUE(isLoopbackAddress("localhost"));
  EXPECT_FALSE(isLoopbackAddress("0.0.0.0"));
  EXPECT_FALSE(isLoopbackAddress("10.0.0.1"));
  EXPECT_FALSE(isLoopbackAddress("example.org"));
  const RequestTarget t = parseTarget("/status%2Ejson?a=1&token=ab%2Bc&b");
  EXPECT_EQ(t.path, "/status.json");
  EXPECT_EQ(t.token, "ab+c");
}

TEST(StatusOptions, PortAndBindParseWithTheirFallbacks) {
  const auto lookup = [](const std::string& name) -> std::optional<std::string> {
    if (name == "DT_STATUS_BIND") return std::string("0.0.0.0");
    return std::nullopt;
  };
  const auto none = parseCommandLine({"./trainer"}, [](const std::string&) { return std::nullopt; });
  EXPECT_EQ(none.options.statusPort, -1) << "no page unless asked";
  EXPECT_EQ(none.options.statusBind, "127.0.0.1");
  const auto r = parseCommandLine({"--status-port", "0", "./trainer"}, lookup);
  EXPECT_EQ(r.options.statusPort, 0);
  EXPECT_EQ(r.options.statusBind, "0.0.0.0");
  testing::expectThrowsWith<InvalidArgument>([&] { parseCommandLine({"--status-port", "70000", "./trainer"}, lookup); },
                                             {"--status-port", "70000", "a port number from 0 to 65535"});
  EXPECT_THAT(helpText(), HasSubstr("--status-port"));
  EXPECT_THAT(helpText(), HasSubstr("DT_STATUS_BIND"));
}

}  // namespace
}  // namespace dt::launcher
