// The flight recorder (process_group/flight_recorder.h) and its analysis
// (debug/flight_analysis.h) on forked ranks: what a dump holds, and the story
// the analysis tells for a rank that skips a collective, one that hangs inside
// one (SIGSTOP) and one killed in the middle of one (SIGKILL), on Gloo and shm.
#include "process_group/flight_recorder.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "common/config.h"
#include "common/errors.h"
#include "common/strings.h"
#include "debug/flight_analysis.h"
#include "process_group/process_group.h"
#include "testing/point.h"
#include "testing/spawn.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using testing::Ending;
using testing::RankContext;
using testing::RankState;
using testing::SpawnedRanks;
using testing::SpawnOptions;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string readText(const std::filesystem::path& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// Polls `done` every few ms until it holds or a generous deadline passes (never a fixed sleep).
bool eventually(const std::function<bool()>& done, std::chrono::seconds deadline = 60s) {
  const auto until = Clock::now() + deadline;
  while (!done()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

std::string analyze(const std::filesystem::path& dir) {
  std::vector<std::string> problems;
  const auto dumps = debug::readFlightDumps(dir.string(), "", &problems);
  EXPECT_TRUE(problems.empty()) << join(problems, "\n");
  return debug::analyzeFlightDumps(dumps);
}

void expectHas(const std::string& text, const std::string& needle) {
  EXPECT_NE(text.find(needle), std::string::npos) << "lacks \"" << needle << "\":\n" << text;
}

TEST(FlightRecorder, DumpHoldsEveryOpWithItsShapeStateAndContext) {
  dt::testing::TempDir dir;
  SpawnOptions options;
  options.env = {{"DT_FLIGHT_RECORDER_DIR", dir.path().string()}};
  const auto results = testing::spawn(
      2,
      [&](RankContext& ctx) -> std::string {
        ProcessGroupOptions o;
        o.backend = "shm";
        auto pg = ProcessGroup::create(ctx.store(), ctx.rank, 2, o);
        {
          const FlightContext outer("ddp bucket %d", 3);
          pg->allreduce(ones({4, 8}))->wait();
          {
            const FlightContext inner("pipeline %s", "SendF");
            WorkPtr p2p = ctx.rank == 0 ? pg->send({ones({5})}, 1) : pg->recv({zeros({5})}, 0);
            // The recorder marks a send or recv done in a thenInline callback, which runs on the
            // completing thread just after wait() is released; callbacks run in registration
            // order, so once this one has run, the recorder's has.
            std::atomic<bool> recorded{false};
            p2p->thenInline([&](Work&) { recorded = true; });
            p2p->wait();
            while (!recorded) std::this_thread::yield();
          }
          BroadcastOptions bo;
          bo.root = 1;
          pg->broadcast(zeros({7}, DType::Int64), bo)->wait();
        }
        pg->barrier()->wait();
        return dumpFlightRecorder("request");
      },
      options);
  ASSERT_TRUE(results.ok()) << results.summary();
  for (int r = 0; r < 2; ++r) {
    const std::string path = results[r].value;
    ASSERT_EQ(path, (dir.path() / str("flight_rank", r, "_request.json")).string());
    const debug::FlightDump d = debug::parseFlightDump(readText(path), path);
    EXPECT_EQ(d.rank, r);
    EXPECT_EQ(d.worldSize, 2);
    EXPECT_EQ(d.reason, "request");
    ASSERT_EQ(d.entries.size(), 4u) << readText(path);
    const auto& ar = d.entries[0];
    EXPECT_FALSE(ar.p2p);
    EXPECT_EQ(ar.op, "allreduce");
    EXPECT_EQ(ar.seq, 1u);
    EXPECT_EQ(ar.group, "default");
    EXPECT_EQ(ar.groupRank, r);
    EXPECT_EQ(ar.groupSize, 2);
    EXPECT_EQ(ar.dtype, "float32");
    EXPECT_EQ(ar.shape, (std::vector<int64_t>{4, 8}));
    EXPECT_EQ(ar.bytes, 128u);
    EXPECT_EQ(ar.reduceOp, "sum");
    EXPECT_EQ(ar.state, "done");
    EXPECT_TRUE(ar.issuedUs && ar.startedUs && ar.endedUs);
    EXPECT_LE(*ar.issuedUs, *ar.endedUs);
    EXPECT_EQ(ar.context, "ddp bucket 3");
    const auto& p2p = d.entries[1];
    EXPECT_TRUE(p2p.p2p);
    EXPECT_EQ(p2p.op, r == 0 ? "send" : "recv");
    EXPECT_EQ(p2p.seq, 1u);
    EXPECT_EQ(p2p.peer, 1 - r);
    EXPECT_EQ(p2p.state, "done");
    EXPECT_EQ(p2p.context, "pipeline SendF");
    const auto& bc = d.entries[2];
    EXPECT_EQ(bc.op, "broadcast");
    EXPECT_EQ(bc.seq, 2u);
    EXPECT_EQ(bc.dtype, "int64");
    EXPECT_EQ(bc.peer, 1);                  // the root
    EXPECT_EQ(bc.context, "ddp bucket 3");  // the inner scope restored the outer tag
    EXPECT_EQ(d.entries[3].op, "barrier");
    EXPECT_EQ(d.entries[3].context, "");
  }
  const std::string story = analyze(dir.path());
  expectHas(story, "every rank with a dump issued and completed #1-#3 alike");
}

TEST(FlightRecorder, RingKeepsTheLastEntriesAndZeroTurnsItOff) {
  dt::testing::TempDir dir;
  SpawnOptions options;
  options.env = {{"DT_FLIGHT_RECORDER_DIR", dir.path().string()}, {"DT_FLIGHT_RECORDER_ENTRIES", "8"}};
  const auto small = testing::spawn(
      1,
      [&](RankContext& ctx) -> std::string {
        auto pg = ProcessGroup::create(ctx.store(), 0, 1);
        for (int i = 0; i < 20; ++i) pg->allreduce(ones({2}))->wait();
        return dumpFlightRecorder("request");
      },
      options);
  ASSERT_TRUE(small.ok()) << small.summary();
  const debug::FlightDump d = debug::parseFlightDump(readText(small[0].value), small[0].value);
  ASSERT_EQ(d.entries.size(), 8u);
  EXPECT_EQ(d.entries.front().seq, 13u);
  EXPECT_EQ(d.entries.back().seq, 20u);
  EXPECT_EQ(d.capacity, 8u);
  EXPECT_EQ(d.recorded, 20u);

  options.env = {{"DT_FLIGHT_RECORDER_DIR", (dir.path() / "off").string()},
                 {"DT_FLIGHT_RECORDER_ENTRIES", "0"}};
  const auto off = testing::spawn(
      1,
      [&](RankContext& ctx) -> std::string {
        auto pg = ProcessGroup::create(ctx.store(), 0, 1);
        pg->allreduce(ones({2}))->wait();
        return str("[", dumpFlightRecorder("request"), "]");
      },
      options);
  ASSERT_TRUE(off.ok()) << off.summary();
  EXPECT_EQ(off[0].value, "[]");
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "off"));
}

TEST(FlightRecorder, FailureDumpsNameTheirReasonOnceAndNeverThrow) {
  dt::testing::TempDir dir;
  SpawnOptions options;
  options.env = {{"DT_FLIGHT_RECORDER_DIR", dir.path().string()}};
  const auto results = testing::spawn(1, [&](RankContext& ctx) -> std::string {
    auto pg = ProcessGroup::create(ctx.store(), 0, 1);
    pg->allreduce(ones({2}))->wait();
    // What an elastic job does when its launcher reports a dead member.
    pg->abort(std::make_exception_ptr(MemberLostError("member 3 (rank 3) exited: signal SIGKILL")));
    ProcessGroupOptions o;
    o.name = "other";
    auto other = ProcessGroup::create(ctx.store(), 0, 1, o);
    other->abort(std::make_exception_ptr(BackendError("stopped by the test")));
    auto third = ProcessGroup::create(ctx.store(), 0, 1, ProcessGroupOptions{.name = "third"});
    third->abort(std::make_exception_ptr(BackendError("a second abort")));  // the first abort's file stays
    ::setenv("DT_FLIGHT_RECORDER_DIR", "/dev/null/cannot-be-a-folder", 1);
    const std::string unwritable = dumpFlightRecorder("request");
    return str("[", unwritable, "]");
  }, options);
  ASSERT_TRUE(results.ok()) << results.summary();
  EXPECT_EQ(results[0].value, "[]");
  const auto lost = dir.path() / "flight_rank0_member_loss.json";
  ASSERT_TRUE(std::filesystem::exists(lost));
  const debug::FlightDump d = debug::parseFlightDump(readText(lost), lost.string());
  EXPECT_EQ(d.reason, "member_loss");
  expectHas(d.detail, "dt::MemberLostError: member 3 (rank 3) exited");
  const auto aborted = dir.path() / "flight_rank0_abort.json";
  ASSERT_TRUE(std::filesystem::exists(aborted));
  const debug::FlightDump a = debug::parseFlightDump(readText(aborted), aborted.string());
  expectHas(a.detail, "stopped by the test");
}

// A group destroyed and made again under the same name is told apart from the one before.
TEST(FlightRecorder, GroupMadeAgainIsAnalysedApart) {
  dt::testing::TempDir dir;
  SpawnOptions options;
  options.env = {{"DT_FLIGHT_RECORDER_DIR", dir.path().string()}};
  const auto results = testing::spawn(2, [&](RankContext& ctx) -> std::string {
    auto first = ProcessGroup::create(ctx.store(), ctx.rank, 2);
    first->allreduce(ones({2}))->wait();
    first->allreduce(ones({2}))->wait();
    first->destroy();
    auto second = ProcessGroup::create(ctx.store(), ctx.rank, 2);
    second->broadcast(ones({3}))->wait();
    return dumpFlightRecorder("request");
  }, options);
  ASSERT_TRUE(results.ok()) << results.summary();
  const std::string story = analyze(dir.path());
  expectHas(story, "group default (2 ranks, collectives #1-#2 in the dumps):");
  expectHas(story, "group default (made again: creation 2) (2 ranks, collectives #1-#1 in the dumps):");
  expectHas(story, "last completed: rank 0 broadcast #1 (float32[3], root 0)");
}

#if DT_HAVE_GLOO

class FlightRecorderFailure : public ::testing::TestWithParam<std::string> {
 protected:
  static constexpr int kWorld = 3;
  // Short: each case waits out one timeout on the survivors.
  static constexpr auto kTimeout = 3s;

  SpawnOptions options(const std::filesystem::path& dir) const {
    SpawnOptions o;
    o.env = {{"DT_FLIGHT_RECORDER_DIR", dir.string()}};
    o.deadline = 120s;
    o.killAllOnFailure = false;
    return o;
  }

  std::shared_ptr<ProcessGroup> group(RankContext& ctx) const {
    ProcessGroupOptions o;
    o.backend = GetParam();
    o.timeout = kTimeout;
    o.progressInterval = 100ms;
    o.failureReportWindow = 500ms;
    auto pg = ProcessGroup::create(ctx.store(), ctx.rank, kWorld, o);
    pg->allreduce(ones({1024}))->wait();  // #1
    pg->allreduce(ones({1024}))->wait();  // #2
    return pg;
  }

  static bool ended(SpawnedRanks& ranks, std::initializer_list<int> which) {
    for (int r : which) {
      if (ranks.state(r) != RankState::Ended) return false;
    }
    return true;
  }
};

// Rank 2 goes on without allreduce #3; ranks 0 and 1 time out in it. SIGUSR2 asks rank 2 for
// its record while it waits elsewhere.
TEST_P(FlightRecorderFailure, RankThatSkipsACollectiveIsNamed) {
  dt::testing::TempDir dir;
  SpawnedRanks ranks(
      kWorld,
      [&](RankContext& ctx) -> std::string {
        auto pg = group(ctx);
        if (ctx.rank == 2) {
          ctx.store()->get("test/go", 120s);  // skipped #3; the test releases it once it has dumped
          return "skipped";
        }
        try {
          pg->allreduce(ones({1024}))->wait();
          return "NO-FAILURE";
        } catch (const std::exception& e) {
          return describe(e);
        }
      },
      options(dir.path()));
  ASSERT_TRUE(eventually([&] { return ended(ranks, {0, 1}); })) << "ranks 0 and 1 did not fail";
  ASSERT_EQ(::kill(ranks.pid(2), SIGUSR2), 0);
  ASSERT_TRUE(eventually([&] { return std::filesystem::exists(dir.path() / "flight_rank2_signal.json"); }))
      << "rank 2 wrote no dump after SIGUSR2";
  ranks.store().set("test/go", "1");
  const auto results = ranks.wait();
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(results[r].returned()) << results.summary();
  EXPECT_NE(results[0].value.find("TimeoutError"), std::string::npos) << results[0].value;
  const std::string story = analyze(dir.path());
  std::printf("---- %s: a rank skips allreduce #3\n%s", GetParam().c_str(), story.c_str());
  expectHas(story, "first difference at #3:");
  expectHas(story, "ranks 0 and 1 issued allreduce #3 (float32[1024], sum)");
  expectHas(story, "rank 2 never issued #3 (its last issued: allreduce #2 (float32[1024], sum), done");
  expectHas(story, "#3 never finished on ranks 0-2:");
  expectHas(story, "rank 2: #3 not issued; nothing in flight at its dump");
  expectHas(story, "rank 2 (");  // its header line: the signal dump
  expectHas(story, "signal dump");
  expectHas(story, "timeout dump");
}

// Rank 2 stops (SIGSTOP) right after issuing allreduce #3 of 64 MiB, which takes the ranks tens
// of milliseconds: it is inside #3 when it stops. Ranks 0 and 1 time out in #3.
TEST_P(FlightRecorderFailure, RankThatHangsInsideACollectiveIsNamed) {
  dt::testing::TempDir dir;
  SpawnedRanks ranks(
      kWorld,
      [&](RankContext& ctx) -> std::string {
        auto pg = group(ctx);
        Tensor big = ones({16 << 20});
        WorkPtr work = pg->allreduce(big);
        if (ctx.rank == 2) ::raise(SIGSTOP);
        try {
          work->wait();
          return "NO-FAILURE";
        } catch (const std::exception& e) {
          return describe(e);
        }
      },
      options(dir.path()));
  ASSERT_TRUE(eventually([&] { return ended(ranks, {0, 1}); })) << "ranks 0 and 1 did not fail";
  ASSERT_EQ(ranks.state(2), RankState::Frozen);
  // What dtrun would see: the frozen rank wrote nothing.
  const std::string frozen = analyze(dir.path());
  std::printf("---- %s: rank 2 frozen inside allreduce #3 (before it resumes)\n%s", GetParam().c_str(),
              frozen.c_str());
  expectHas(frozen, "rank 2 left none");
  expectHas(frozen, "rank 2 of the group left no dump");
  expectHas(frozen, "ranks 0 and 1 issued allreduce #3 (float32[16777216], sum)");
  expectHas(frozen, "#3 never finished on ranks 0-2:");
  expectHas(frozen, "rank 2: no dump");
  // Resumed, it finds the group aborted by the others and writes its own record.
  ASSERT_EQ(::kill(ranks.pid(2), SIGCONT), 0);
  const auto results = ranks.wait();
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(results[r].returned()) << results.summary();
  const std::string story = analyze(dir.path());
  std::printf("---- %s: rank 2 frozen inside allreduce #3 (after it resumed)\n%s", GetParam().c_str(),
              story.c_str());
  expectHas(story, "ranks 0-2 issued allreduce #3 (float32[16777216], sum)");
  expectHas(story, "#3 never finished on ranks 0-2:");
  expectHas(story, "last completed: rank 0 allreduce #2");
}

// Rank 2 is SIGKILLed right after issuing allreduce #3 of 64 MiB.
TEST_P(FlightRecorderFailure, RankKilledInsideACollectiveIsNamed) {
  dt::testing::TempDir dir;
  SpawnOptions o = options(dir.path());
  o.plan = {testing::killAt(2, "in-allreduce-3")};
  const auto results = testing::spawn(
      kWorld,
      [&](RankContext& ctx) -> std::string {
        auto pg = group(ctx);
        Tensor big = ones({16 << 20});
        WorkPtr work = pg->allreduce(big);
        if (ctx.rank == 2) testing::point("in-allreduce-3");
        try {
          work->wait();
          return "NO-FAILURE";
        } catch (const std::exception& e) {
          return describe(e);
        }
      },
      o);
  ASSERT_EQ(results[2].ending, Ending::Killed) << results.summary();
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(results[r].returned()) << results.summary();
  const std::string story = analyze(dir.path());
  std::printf("---- %s: rank 2 killed inside allreduce #3\n%s", GetParam().c_str(), story.c_str());
  expectHas(story, "rank 2 left none");
  expectHas(story, "rank 2 of the group left no dump");
  expectHas(story, "ranks 0 and 1 issued allreduce #3 (float32[16777216], sum)");
  expectHas(story, "#3 never finished on ranks 0-2:");
  expectHas(story, "rank 0: #3 failed");
  expectHas(story, "rank 2: no dump");
}

// Rank 2 issues broadcast #3 where the others issue allreduce #3: a desync (fingerprints
// compared on both backends).
TEST_P(FlightRecorderFailure, RankThatIssuesAnotherOpIsNamed) {
  dt::testing::TempDir dir;
  const auto results = testing::spawn(kWorld, [&](RankContext& ctx) -> std::string {
    ProcessGroupOptions o;
    o.backend = GetParam();
    o.timeout = kTimeout;
    o.checkFingerprints = true;
    o.progressInterval = 100ms;
    auto pg = ProcessGroup::create(ctx.store(), ctx.rank, kWorld, o);
    pg->allreduce(ones({1024}))->wait();
    pg->allreduce(ones({1024}))->wait();
    try {
      if (ctx.rank == 2) pg->broadcast(ones({1024}))->wait();
      else pg->allreduce(ones({1024}))->wait();
      return "NO-FAILURE";
    } catch (const std::exception& e) {
      return describe(e);
    }
  }, options(dir.path()));
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(results[r].returned()) << results.summary();
  EXPECT_NE(results[0].value.find("DesyncError"), std::string::npos) << results[0].value;
  const std::string story = analyze(dir.path());
  std::printf("---- %s: rank 2 issues broadcast #3 instead of allreduce #3\n%s", GetParam().c_str(), story.c_str());
  expectHas(story, "desync dump");
  expectHas(story, "first difference at #3:");
  expectHas(story, "ranks 0 and 1 issued allreduce #3 (float32[1024], sum)");
  expectHas(story, "rank 2 issued broadcast #3 (float32[1024], root 0)");
}

INSTANTIATE_TEST_SUITE_P(Backends, FlightRecorderFailure, ::testing::Values("gloo", "shm"),
                         [](const auto& info) { return info.param; });

#endif  // DT_HAVE_GLOO

}  // namespace
}  // namespace dt
