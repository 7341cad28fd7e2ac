// dtrun's live status page during a real job (issue 41): the docs' minimal trainer on 4 ranks
// under dtrun --elastic --max-restarts 1 --status-port 0, one rank SIGKILLed mid-run and
// replaced. The test waits (by polling /status.json, with generous deadlines) until the death,
// the survivors' recovery and the replacement's admission have happened; then /status.json
// must show them and the members, /metrics must parse as Prometheus text, and Debian's headless
// Chromium must render the page (members table, step, the death and the recovery, the charts
// drawn by Chart.js from dtrun's /chart.js) and save a screenshot (status_page.png in the
// test's working folder, or in DT_TEST_OUTPUT_DIR). Nothing here is timed: the steps are slowed
// (DT_TEST_STEP_PAUSE_MS) only so the job is still running when the browser looks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <thread>

#include "common/json.h"
#include "common/strings.h"
#include "tests/examples/trainer_harness.h"
#include "tests/launcher/status_test_support.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

const std::string kMinimalTrainer = MINIMAL_TRAINER_PATH;
// Debian's package; scripts/setup.sh installs it.
const std::string kChromium = "/usr/bin/chromium";

std::string readFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

bool hasEvent(const json::Value& status, const std::string& kind) {
  for (const auto& e : status.get("events").items()) {
    if (e.get("kind").asString() == kind) return true;
  }
  return false;
}

// Polls /status.json until `done` holds (or the deadline): the job's events come when they come.
json::Value waitForStatus(uint16_t port, ChildProcess& dtrun, std::chrono::seconds deadline,
                          const std::function<bool(const json::Value&)>& done, std::string& last) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  json::Value status;
  while (std::chrono::steady_clock::now() < until) {
    const HttpReply reply = httpGet(port, "/status.json");
    if (reply.status == 200) {
      last = reply.body;
      status = json::parse(reply.body, "/status.json");
      if (done(status)) return status;
    } else {
      last = str("HTTP ", reply.status, ": ", reply.body);
    }
    // A short wait between polls (not a guess at how long the job takes); dtrun's output is
    // drained meanwhile so its pipes never fill.
    dtrun.waitForOutput("\x01never printed\x01", 200ms);
  }
  return status;
}

std::vector<std::string> chromium(const std::string& url, const fs::path& profile, std::vector<std::string> extra) {
  std::vector<std::string> argv{kChromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                "--user-data-dir=" + profile.string(), "--virtual-time-budget=8000"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back(url);
  return argv;
}

TEST(StatusPage, ShowsMembersStepDeathAndRecoveryOfAnElasticRunInChromium) {
  ASSERT_EQ(::access(kChromium.c_str(), X_OK), 0)
      << kChromium << " is missing: install Debian's chromium (scripts/setup.sh does); this test needs a real browser";
  TempDir data, out, profile;
  writeFashionSlice(data.path(), 1280, 200);  // 10 steps of 128 an epoch
  ChildProcess dtrun(dtrunProgram(4, {"--elastic", "--max-restarts", "1", "--status-port", "0"}, kMinimalTrainer,
                                  {data.path().string(), (out.path() / "ck").string(), "100000"}),
                     {"DT_TEST_STEP_PAUSE_MS=40", "DT_TEST_FAIL_AT=2:30:forward"});
  ASSERT_TRUE(dtrun.waitForOutput("(Prometheus: /metrics)", 120s)) << dtrun.output();
  std::smatch m;
  const std::string output = dtrun.output();
  static const std::regex address(R"(dtrun: status page at (http://127\.0\.0\.1:(\d+)/) \(Prometheus: /metrics\))");
  ASSERT_TRUE(std::regex_search(output, m, address)) << output;
  const std::string url = m[1];
  const auto port = static_cast<uint16_t>(std::stoi(m[2]));

  // The kill at step 30, the survivors' recovery, the replacement's join and admission, and
  // every live member past its first logged step with a collective recorded (the process
  // group writes its progress key at most every second).
  std::string last;
  const json::Value status = waitForStatus(port, dtrun, 240s, [](const json::Value& s) {
    if (!hasEvent(s, "death") || !hasEvent(s, "recovery") || !hasEvent(s, "admission")) return false;
    int running = 0;
    for (const auto& member : s.get("members").items()) {
      running += member.get("state").asString() == "running" && member.get("step").asInt() > 0 &&
                 !member.get("last_op").asString().empty();
    }
    return running == 4;
  }, last);
  ASSERT_TRUE(status.isObject() && hasEvent(status, "admission")) << "the page never showed the death, recovery and admission\n"
                                                                  << last << "\n" << dtrun.output();
  const auto& members = status.get("members").items();
  ASSERT_EQ(members.size(), 5u) << last;
  EXPECT_EQ(members[2].get("state").asString(), "dead") << last;
  EXPECT_THAT(members[2].get("reason").asString(), HasSubstr("SIGKILL")) << last;
  for (size_t i : {0u, 1u, 3u, 4u}) {
    EXPECT_EQ(members[i].get("state").asString(), "running") << i << " " << last;
    EXPECT_FALSE(members[i].get("host").asString().empty()) << last;
    EXPECT_GT(members[i].get("rss_bytes").asInt(), 0) << last;
    EXPECT_THAT(members[i].get("last_op").asString(), HasSubstr("#")) << last;
  }
  EXPECT_GE(status.get("step").asInt(), 40) << last;
  EXPECT_FALSE(status.get("curve").items().empty()) << last;
  std::string deathText, recoveryText;
  for (const auto& e : status.get("events").items()) {
    if (e.get("kind").asString() == "death") deathText = e.get("text").asString();
    if (e.get("kind").asString() == "recovery") recoveryText = e.get("text").asString();
  }
  EXPECT_EQ(deathText.rfind("rank 2 died: ", 0), 0u) << deathText;
  EXPECT_THAT(recoveryText, HasSubstr("3 rank(s) go on from step"));

  // /metrics: every line Prometheus text, every metric with its TYPE (the reader is strict).
  const HttpReply metrics = httpGet(port, "/metrics");
  ASSERT_EQ(metrics.status, 200) << metrics.body;
  std::map<std::string, double> series;
  try {
    for (const auto& s : parsePrometheusText(metrics.body)) {
      std::string key = s.name;
      for (const auto& [k, v] : s.labels) key += str(" ", k, "=", v);
      series[key] = s.value;
    }
  } catch (const std::runtime_error& e) {
    FAIL() << "/metrics is not Prometheus text: " << e.what() << "\n" << metrics.body;
  }
  EXPECT_GE(series["dtrain_job_step"], 40) << metrics.body;
  EXPECT_EQ(series["dtrain_job_events_total kind=death"], 1) << metrics.body;
  EXPECT_EQ(series["dtrain_job_members state=dead"], 1) << metrics.body;
  EXPECT_EQ(series["dtrain_job_members state=running"], 4) << metrics.body;
  EXPECT_GT(series["dtrain_job_throughput unit=samples"], 0) << metrics.body;

  // The page as a browser renders it, while the job runs.
  const ProcessResult dom = runProcess(chromium(url, profile.path(), {"--dump-dom"}), 180s);
  ASSERT_EQ(dom.exitCode, 0) << dom.err;
  const std::string& html = dom.out;
  EXPECT_THAT(html, HasSubstr("class=\"member\" data-member=\"2\" data-state=\"dead\"")) << html;
  for (int member : {0, 1, 3, 4}) {
    EXPECT_THAT(html, HasSubstr(str("class=\"member\" data-member=\"", member, "\" data-state=\"running\""))) << html;
  }
  EXPECT_THAT(html, HasSubstr("class=\"event\" data-kind=\"death\"")) << html;
  EXPECT_THAT(html, HasSubstr("class=\"event\" data-kind=\"recovery\"")) << html;
  EXPECT_THAT(html, HasSubstr("rank 2 died: ")) << html;
  static const std::regex step(R"(id="job-step">(\d+) / 100000<)");
  ASSERT_TRUE(std::regex_search(html, m, step)) << html;
  EXPECT_GE(std::stoi(m[1]), 40);
  // Chart.js (served by dtrun from libjs-chart.js) drew the curves: it sizes the canvas it draws on.
  static const std::regex drawn(R"(<canvas id="loss-chart"[^>]*style="display: block;)");
  EXPECT_TRUE(std::regex_search(html, drawn)) << "Chart.js did not draw the loss curve\n" << html;

  const char* outDir = std::getenv("DT_TEST_OUTPUT_DIR");
  const fs::path shot = fs::absolute(fs::path(outDir != nullptr ? outDir : ".") / "status_page.png");
  fs::remove(shot);
  const ProcessResult screenshot =
      runProcess(chromium(url, profile.path(), {"--hide-scrollbars", "--window-size=1280,1000", "--screenshot=" + shot.string()}), 180s);
  ASSERT_EQ(screenshot.exitCode, 0) << screenshot.err;
  const std::string png = readFile(shot);
  ASSERT_GT(png.size(), 10000u) << shot;
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  std::printf("status page screenshot: %s\n", shot.string().c_str());

  // SIGTERM: the ranks stop at the next step and write a checkpoint; dtrun exits 128 + 15.
  dtrun.signal(SIGTERM);
  const ProcessResult r = dtrun.wait(180s);
  EXPECT_FALSE(r.timedOut) << r.out << r.err;
  EXPECT_EQ(r.exitCode, 128 + SIGTERM) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("stopped by SIGTERM"));
}

TEST(StatusPage, OffLoopbackATokenIsRequiredAndABusyPortIsAnError) {
  ChildProcess dtrun(dtrunProgram(1, {"--status-bind", "0.0.0.0", "--status-port", "0"}, "/bin/sleep", {"600"}));
  ASSERT_TRUE(dtrun.waitForOutput("(Prometheus: /metrics)", 120s)) << dtrun.output();
  std::smatch m;
  const std::string output = dtrun.output();
  static const std::regex address(R"(dtrun: status page at http://[^:/]+:(\d+)/\?token=([0-9a-f]{32}) \(Prometheus: /metrics\))");
  ASSERT_TRUE(std::regex_search(output, m, address)) << output;
  const auto port = static_cast<uint16_t>(std::stoi(m[1]));
  const std::string token = m[2];
  EXPECT_EQ(httpGet(port, "/status.json").status, 403);
  EXPECT_EQ(httpGet(port, "/").status, 403);
  EXPECT_EQ(httpGet(port, "/metrics", "Authorization: Bearer " + token.substr(1) + "0\r\n").status, 403);
  const HttpReply json = httpGet(port, "/status.json?token=" + token);
  ASSERT_EQ(json.status, 200) << json.body;
  EXPECT_FALSE(json::parse(json.body, "/status.json").get("run_id").asString().empty()) << json.body;
  EXPECT_EQ(httpGet(port, "/metrics", "Authorization: Bearer " + token + "\r\n").status, 200);

  // A second job asking for the same port: a one-line error naming it, exit 1, nothing started.
  const ProcessResult busy = runProcess(dtrunProgram(1, {"--status-port", std::to_string(port)}, "/bin/true", {}), 60s);
  EXPECT_EQ(busy.exitCode, 1) << busy.out << busy.err;
  EXPECT_THAT(busy.err, HasSubstr(str("--status-port ", port, " on 127.0.0.1 is in use")));

  dtrun.signal(SIGTERM);
  const ProcessResult r = dtrun.wait(120s);
  EXPECT_FALSE(r.timedOut) << r.out << r.err;
  EXPECT_EQ(r.exitCode, 128 + SIGTERM) << r.out << r.err;
}

}  // namespace
}  // namespace dt::testing
