// Pipeline schedules as data (parallel/pipeline_schedule.h), all in one process: every built-in
// schedule for p in {2, 4}, m in {p, 2p, 4p}, v in {1, 2} validates, and its unit-cost bubble
// and peak in-flight counts equal the formulas; the text format round-trips; a swapped
// send/recv pair, missing or misplaced actions, bad text and bad parameters are refused with
// messages that say where. One small grid is pinned so that any change to it shows. ZB-H1 with a
// bound k on pending weight gradients: the bubble (2p - 1 - k) / (3m) for every k.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include "common/errors.h"
#include "parallel/pipeline_schedule.h"

namespace dt::pipeline {
namespace {

constexpr double kTolerance = 1e-12;

struct Case {
  int p, m;
};

std::vector<Case> sweep() {
  std::vector<Case> cases;
  for (int p : {2, 4})
    for (int m : {p, 2 * p, 4 * p}) cases.push_back({p, m});
  return cases;
}

// The message of the InvalidArgument that `body` throws, or a failure naming what it threw.
template <typename Body>
std::string invalidArgument(Body&& body) {
  try {
    body();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected dt::InvalidArgument, got " << describe(e);
    return {};
  }
  ADD_FAILURE() << "expected dt::InvalidArgument, nothing was thrown";
  return {};
}

// Validates, round-trips through the text format, and returns the unit-cost simulation.
SimulationResult checkedSimulation(const Schedule& s) {
  EXPECT_NO_THROW(validate(s));
  const Schedule again = parse(format(s));
  EXPECT_EQ(again, s) << format(s);
  EXPECT_NO_THROW(validate(again));
  return simulate(s);
}

// The most micro-batches whose state `rank` keeps at once between an F and its W (or B): in
// flight and pending weight gradients together, each counted as a whole forward's worth.
int peakHeldBetweenForwardAndWeightGrad(const Schedule& s, int rank) {
  int held = 0, peak = 0;
  for (const Action& a : s.ranks[rank]) {
    if (a.kind == ActionKind::F) peak = std::max(peak, ++held);
    if (a.kind == ActionKind::B || a.kind == ActionKind::W) --held;
  }
  return peak;
}

int count(const Schedule& s, int rank, ActionKind kind) {
  int n = 0;
  for (const Action& a : s.ranks[rank]) n += a.kind == kind;
  return n;
}

TEST(PipelineSchedule, GPipeBubbleIsPMinusOneOverMAndEveryRankHoldsAllMicroBatches) {
  for (auto [p, m] : sweep()) {
    SCOPED_TRACE(::testing::Message() << "p=" << p << " m=" << m);
    const Schedule s = gpipe(p, m);
    const SimulationResult r = checkedSimulation(s);
    EXPECT_NEAR(r.bubble, double(p - 1) / m, kTolerance);
    EXPECT_NEAR(r.makespan, 3.0 * m + 3.0 * (p - 1), kTolerance);
    for (int rank = 0; rank < p; ++rank) {
      EXPECT_EQ(r.peakInFlight[rank], m) << "rank " << rank;
      EXPECT_NEAR(r.busy[rank], 3.0 * m, kTolerance);
      EXPECT_NEAR(r.idle[rank], 3.0 * (p - 1), kTolerance);
    }
  }
}

TEST(PipelineSchedule, OneFOneBBubbleIsPMinusOneOverMAndRankRHoldsPMinusR) {
  for (auto [p, m] : sweep()) {
    SCOPED_TRACE(::testing::Message() << "p=" << p << " m=" << m);
    const Schedule s = oneFOneB(p, m);
    const SimulationResult r = checkedSimulation(s);
    EXPECT_NEAR(r.bubble, double(p - 1) / m, kTolerance);
    EXPECT_EQ(r.peakInFlight[0], p);
    for (int rank = 0; rank < p; ++rank) {
      EXPECT_EQ(r.peakInFlight[rank], p - rank) << "rank " << rank;
      EXPECT_EQ(r.peakPendingWeightGrads[rank], 0);
      EXPECT_EQ(count(s, rank, ActionKind::F), m);
      EXPECT_EQ(count(s, rank, ActionKind::B), m);
    }
  }
}

// The bubble of 1F1B and GPipe does not depend on the cost of F and B, as long as every stage
// costs the same: (m + p - 1)(f + b) against m (f + b).
TEST(PipelineSchedule, OneFOneBAndGPipeBubbleHoldsForOtherUniformCosts) {
  for (const Costs costs : {Costs{2, 5, 1, 1}, Costs{1, 3, 1, 1}, Costs{0.5, 0.75, 1, 1}}) {
    SCOPED_TRACE(::testing::Message() << "F=" << costs.f << " B=" << costs.b);
    EXPECT_NEAR(simulate(oneFOneB(4, 8), costs).bubble, 3.0 / 8, kTolerance);
    EXPECT_NEAR(simulate(gpipe(4, 8), costs).bubble, 3.0 / 8, kTolerance);
  }
}

TEST(PipelineSchedule, InterleavedBubbleIsPMinusOneOverVM) {
  for (auto [p, m] : sweep()) {
    for (int v : {1, 2}) {
      SCOPED_TRACE(::testing::Message() << "p=" << p << " m=" << m << " v=" << v);
      const Schedule s = interleavedOneFOneB(p, m, v);
      EXPECT_EQ(s.placement, Placement::Interleaved);
      const SimulationResult r = checkedSimulation(s);
      EXPECT_NEAR(r.bubble, double(p - 1) / (v * m), kTolerance);
      EXPECT_NEAR(r.makespan, 3.0 * m * v + 3.0 * (p - 1), kTolerance);
      // Megatron's warm-up: 2(p-1-r) + (v-1)p chunk-forwards, then one more before the first
      // backward; with m == p every forward is warm-up.
      for (int rank = 0; rank < p; ++rank) {
        const int expected = m == p ? m * v : std::min(2 * (p - 1 - rank) + (v - 1) * p + 1, m * v);
        EXPECT_EQ(r.peakInFlight[rank], expected) << "rank " << rank;
      }
    }
  }
}

TEST(PipelineSchedule, ZeroBubbleH1BubbleIsPMinusOneOverThreeMWithOneFOneBsMemory) {
  for (auto [p, m] : sweep()) {
    SCOPED_TRACE(::testing::Message() << "p=" << p << " m=" << m);
    const Schedule s = zeroBubbleH1(p, m);
    const SimulationResult r = checkedSimulation(s);
    EXPECT_NEAR(r.bubble, double(p - 1) / (3 * m), kTolerance);
    EXPECT_NEAR(r.makespan, 3.0 * m + (p - 1), kTolerance);
    for (int rank = 0; rank < p; ++rank) {
      EXPECT_EQ(r.peakInFlight[rank], p - rank) << "rank " << rank;
      EXPECT_LE(r.peakPendingWeightGrads[rank], rank + 1) << "rank " << rank;
      // 1F1B's memory: rank 0's p forwards, the most any rank of 1F1B keeps.
      EXPECT_LE(peakHeldBetweenForwardAndWeightGrad(s, rank), p) << "rank " << rank;
      EXPECT_EQ(count(s, rank, ActionKind::B), 0);
      EXPECT_EQ(count(s, rank, ActionKind::I), m);
      EXPECT_EQ(count(s, rank, ActionKind::W), m);
    }
  }
}

// The bound on pending W (each keeps about a forward's activations): every k from 1 to p, the
// bubble (2p - 1 - k) / (3m), between 1F1B's and ZB-H1's, and never more than k pending.
TEST(PipelineSchedule, ZeroBubbleH1WithFewerPendingWeightGradsTradesBubbleForMemory) {
  for (int p : {2, 3, 4, 8}) {
    for (int m : {p, p + 1, 2 * p, 4 * p + 3}) {
      for (int k = 1; k <= p; ++k) {
        SCOPED_TRACE(::testing::Message() << "p=" << p << " m=" << m << " k=" << k);
        const Schedule s = zeroBubbleH1(p, m, k);
        const SimulationResult r = checkedSimulation(s);
        EXPECT_NEAR(r.bubble, double(2 * p - 1 - k) / (3 * m), kTolerance);
        for (int rank = 0; rank < p; ++rank) {
          EXPECT_EQ(r.peakInFlight[rank], p - rank) << "rank " << rank;
          EXPECT_LE(r.peakPendingWeightGrads[rank], k) << "rank " << rank;
          EXPECT_LE(peakHeldBetweenForwardAndWeightGrad(s, rank), p) << "rank " << rank;
        }
      }
    }
  }
  EXPECT_EQ(zeroBubbleH1(4, 8, 0).ranks, zeroBubbleH1(4, 8).ranks) << "0 is p";
  EXPECT_EQ(zeroBubbleH1(4, 8, 4).ranks, zeroBubbleH1(4, 8).ranks);
  EXPECT_NE(invalidArgument([] { zeroBubbleH1(4, 8, 5); }).find("at most 5 pending weight gradients per rank; it must be 1 to p=4"),
            std::string::npos);
  EXPECT_NE(invalidArgument([] { zeroBubbleH1(4, 8, -1); }).find("it must be 1 to p=4"), std::string::npos);
}

TEST(PipelineSchedule, ZeroBubbleVBubbleIsPMinusOneOverSixMOnTheVPlacement) {
  for (auto [p, m] : sweep()) {
    SCOPED_TRACE(::testing::Message() << "p=" << p << " m=" << m);
    const Schedule s = zeroBubbleV(p, m);
    EXPECT_EQ(s.placement, Placement::V);
    EXPECT_EQ(s.v, 2);
    const SimulationResult r = checkedSimulation(s);
    EXPECT_NEAR(r.bubble, double(p - 1) / (6 * m), kTolerance);
    EXPECT_NEAR(r.makespan, 6.0 * m + (p - 1), kTolerance);
    for (int rank = 0; rank < p; ++rank) EXPECT_LE(r.peakInFlight[rank], 2 * p) << "rank " << rank;
    // The V's tip: stages p-1 and p both on rank p-1, handed over without a SEND/RECV.
    for (const Action& a : s.ranks[p - 1])
      EXPECT_FALSE((a.kind == ActionKind::SendF && a.chunk == 0) ||
                   (a.kind == ActionKind::RecvF && a.chunk == 1))
          << toString(a, true);
  }
  EXPECT_NE(invalidArgument([] { zeroBubbleV(4, 6); }).find("m=6 is not a multiple of p=4"),
            std::string::npos);
  EXPECT_NE(invalidArgument([] { zeroBubbleV(4, 2); }).find("m=2"), std::string::npos);
}

TEST(PipelineSchedule, TheIssuesNumbersForFourRanksAndEightMicroBatches) {
  EXPECT_NEAR(simulate(gpipe(4, 8)).bubble, 0.375, kTolerance);
  EXPECT_NEAR(simulate(oneFOneB(4, 8)).bubble, 0.375, kTolerance);
  EXPECT_NEAR(simulate(interleavedOneFOneB(4, 8, 2)).bubble, 0.1875, kTolerance);
  EXPECT_NEAR(simulate(zeroBubbleH1(4, 8)).bubble, 0.125, kTolerance);
  EXPECT_NEAR(simulate(zeroBubbleV(4, 8)).bubble, 0.0625, kTolerance);
  EXPECT_EQ(peakHeldBetweenForwardAndWeightGrad(oneFOneB(4, 8), 0), 4);
  for (int rank = 0; rank < 4; ++rank) EXPECT_LE(peakHeldBetweenForwardAndWeightGrad(zeroBubbleH1(4, 8), rank), 4);
  EXPECT_EQ(simulate(oneFOneB(4, 8)).peakInFlight[0], 4);
  EXPECT_EQ(simulate(gpipe(4, 8)).peakInFlight[0], 8);
}

TEST(PipelineSchedule, FewerMicroBatchesThanRanksWorkForGPipeAndOneFOneBAndAreRefusedElsewhere) {
  for (int m : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "m=" << m);
    EXPECT_NEAR(checkedSimulation(gpipe(4, m)).bubble, 3.0 / m, kTolerance);
    const SimulationResult r = checkedSimulation(oneFOneB(4, m));
    EXPECT_NEAR(r.bubble, 3.0 / m, kTolerance);
    EXPECT_EQ(r.peakInFlight[0], m);
    EXPECT_NE(invalidArgument([&] { zeroBubbleH1(4, m); }).find(std::to_string(m)), std::string::npos);
    EXPECT_NE(invalidArgument([&] { interleavedOneFOneB(4, m, 2); }).find("m=" + std::to_string(m)),
              std::string::npos);
  }
}

TEST(PipelineSchedule, BadParametersAreRefusedNamingTheValue) {
  EXPECT_NE(invalidArgument([] { gpipe(0, 4); }).find("p=0"), std::string::npos);
  EXPECT_NE(invalidArgument([] { oneFOneB(2, 0); }).find("m=0"), std::string::npos);
  EXPECT_NE(invalidArgument([] { oneFOneB(-1, 4); }).find("p=-1"), std::string::npos);
  EXPECT_NE(invalidArgument([] { interleavedOneFOneB(4, 8, 0); }).find("v=0"), std::string::npos);
  EXPECT_NE(invalidArgument([] { interleavedOneFOneB(4, 6, 2); }).find("m=6 is not a multiple of p=4"),
            std::string::npos);
  EXPECT_NE(invalidArgument([] { zeroBubbleH1(4, 3); }).find("m=3 is below p=4"), std::string::npos);
  EXPECT_NE(invalidArgument([] { zeroBubbleH1(0, 3); }).find("p=0"), std::string::npos);
  EXPECT_NE(invalidArgument([] { gpipe(1000, 1000000); }).find("exceeds"), std::string::npos);
  EXPECT_NE(invalidArgument([] { simulate(oneFOneB(2, 2), Costs{0, 2, 1, 1}); }).find("F=0"),
            std::string::npos);
}

TEST(PipelineSchedule, OneRankIsAPipelineWithoutBubbleOrCommunication) {
  for (const Schedule& s : {gpipe(1, 3), oneFOneB(1, 3), interleavedOneFOneB(1, 3, 2), zeroBubbleH1(1, 3),
                            zeroBubbleV(1, 3)}) {
    SCOPED_TRACE(s.name);
    EXPECT_NEAR(checkedSimulation(s).bubble, 0, kTolerance);
    for (const Action& a : s.ranks[0]) EXPECT_TRUE(isCompute(a.kind)) << toString(a, true);
  }
}

// The grid and the text of the smallest interesting schedule, pinned: a change in the
// generator or the printer shows up here first.
TEST(PipelineSchedule, OneFOneBTwoRanksFourMicroBatchesGridAndTextArePinned) {
  const Schedule s = oneFOneB(2, 4);
  EXPECT_EQ(grid(s),
            "1F1B p=2 m=4 v=1: makespan 15, bubble 0.25 (unit costs F=I=W=1, B=2)\n"
            "rank 0: F0 F1 .  .  B0 -- F2 B1 -- F3 B2 -- .  B3 --\n"
            "rank 1: .  F0 B0 -- F1 B1 -- F2 B2 -- F3 B3 -- .  .\n");
  EXPECT_EQ(format(s),
            "schedule 1F1B p=2 m=4 v=1 placement=interleaved\n"
            "rank 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 SEND_F2 RECV_B1 B1 F3 SEND_F3 RECV_B2 B2 RECV_B3 B3\n"
            "rank 1: RECV_F0 F0 RECV_F1 B0 SEND_B0 F1 B1 RECV_F2 SEND_B1 F2 B2 RECV_F3 SEND_B2 F3 B3 SEND_B3\n");
}

TEST(PipelineSchedule, GridShowsChunksWhenThereAreSeveral) {
  const std::string text = grid(interleavedOneFOneB(2, 2, 2));
  EXPECT_NE(text.find("F0c1"), std::string::npos) << text;
  EXPECT_NE(text.find("B1c0"), std::string::npos) << text;
  EXPECT_NE(text.find("bubble 0.25"), std::string::npos) << text;
}

// The swap the issue names: rank 0 waits for a gradient before it sends the activation that
// rank 1 waits for first. Each list on its own is in a valid order; together they deadlock.
TEST(PipelineSchedule, SwappedSendAndReceiveIsADeadlockReportedWithTheGrid) {
  std::string text = format(oneFOneB(2, 4));
  const std::string pair = "SEND_F2 RECV_B1";
  ASSERT_NE(text.find(pair), std::string::npos);
  text.replace(text.find(pair), pair.size(), "RECV_B1 SEND_F2");
  const Schedule swapped = parse(text);
  const std::string message = invalidArgument([&] { validate(swapped); });
  EXPECT_NE(message.find("deadlock"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 0 action #7 RECV_B1 waits for rank 1 to reach its #8 SEND_B1"),
            std::string::npos) << message;
  EXPECT_NE(message.find("rank 1 action #7 RECV_F2 waits for rank 0 to reach its #8 SEND_F2"),
            std::string::npos) << message;
  // The grid, with both stuck actions marked.
  EXPECT_NE(message.find("\nrank 0: F0"), std::string::npos) << message;
  EXPECT_NE(message.find("*RECV_B1"), std::string::npos) << message;
  EXPECT_NE(message.find("*RECV_F2"), std::string::npos) << message;
  EXPECT_THROW(simulate(swapped), InvalidArgument);
  EXPECT_THROW(grid(swapped), InvalidArgument);
}

// The same kind of swap on four ranks in the middle of the pipeline.
TEST(PipelineSchedule, SwappedPairBetweenMiddleRanksIsADeadlock) {
  Schedule s = oneFOneB(4, 8);
  auto& list = s.ranks[1];
  // Rank 1's first SEND_F that has a RECV_B right after it, swapped.
  bool swapped = false;
  for (size_t k = 0; k + 1 < list.size() && !swapped; ++k) {
    if (list[k].kind == ActionKind::SendF && list[k + 1].kind == ActionKind::RecvB) {
      std::swap(list[k], list[k + 1]);
      swapped = true;
    }
  }
  ASSERT_TRUE(swapped) << format(s);
  const std::string message = invalidArgument([&] { validate(s); });
  EXPECT_NE(message.find("deadlock"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1 action #"), std::string::npos) << message;
}

TEST(PipelineSchedule, MissingAndMisplacedActionsAreRefusedNamingRankAndAction) {
  const std::string good = format(oneFOneB(2, 2));
  auto edited = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    return invalidArgument([&] { validate(parse(text)); });
  };
  // A RECV dropped: its SEND has no partner.
  std::string message = edited("RECV_F1 ", "");
  EXPECT_NE(message.find("rank 1 has no RECV_F1"), std::string::npos) << message;
  // A forward before the receive of its input.
  message = edited("RECV_F0 F0", "F0 RECV_F0");
  EXPECT_NE(message.find("rank 1 action #0 F0 runs before RECV_F0 (#1)"), std::string::npos) << message;
  EXPECT_NE(message.find("*F0"), std::string::npos) << message;
  // A send before the compute that produces its data.
  message = edited("F0 SEND_F0", "SEND_F0 F0");
  EXPECT_NE(message.find("rank 0 action #0 SEND_F0 runs before F0 (#1)"), std::string::npos) << message;
  // An action twice.
  message = edited("F1 SEND_F1", "F1 F1 SEND_F1");
  EXPECT_NE(message.find("appears twice"), std::string::npos) << message;
  // A backward that is missing.
  message = edited(" B1\n", "\n");
  EXPECT_NE(message.find("has no B1"), std::string::npos) << message;
  // B and I for the same micro-batch and stage.
  message = edited("RECV_B1 B1", "RECV_B1 B1 I1 W1");
  EXPECT_NE(message.find("both B and I"), std::string::npos) << message;
  // A receive past the pipeline's first stage.
  message = edited("rank 0: F0", "rank 0: RECV_F1 F0");
  EXPECT_NE(message.find("has no previous stage"), std::string::npos) << message;
}

// A hand-written V-shape schedule (ZBV's placement, p=2, v=2): rank 0 holds stages 0 and 3,
// rank 1 stages 1 and 2, whose hand-over stays on rank 1 without a SEND/RECV.
constexpr const char* kVShape =
    "# two ranks, one micro-batch, V placement\n"
    "schedule mine p=2 m=1 v=2 placement=v\n"
    "rank 0: F0c0 SEND_F0c0 RECV_F0c1 F0c1 B0c1 SEND_B0c1 RECV_B0c0 B0c0  # first and last stage\n"
    "\n"
    "rank 1: RECV_F0c0 F0c0 F0c1 SEND_F0c1 RECV_B0c1 B0c1 B0c0 SEND_B0c0\n";

TEST(PipelineSchedule, UserScheduleWithVPlacementValidatesAndNamesPeers) {
  const Schedule s = parse(kVShape);
  EXPECT_EQ(s.placement, Placement::V);
  EXPECT_EQ(s.stageOf(0, 1), 3);
  EXPECT_EQ(s.stageOf(1, 1), 2);
  EXPECT_EQ(s.rankOfStage(2), 1);
  EXPECT_EQ(peerRank(s, 0, {ActionKind::SendF, 0, 0}), 1);
  EXPECT_EQ(peerRank(s, 0, {ActionKind::RecvF, 0, 1}), 1);
  EXPECT_THROW(peerRank(s, 1, {ActionKind::SendF, 0, 0}), InvalidArgument);  // stage 1 -> 2 is local
  const SimulationResult r = checkedSimulation(s);
  EXPECT_NEAR(r.makespan, 12, kTolerance);  // one micro-batch through four stages and back
  EXPECT_EQ(parse(format(s)), s);

  std::string local = kVShape;
  local.replace(local.find("F0c0 F0c1"), 9, "F0c0 SEND_F0c0 F0c1");
  const std::string message = invalidArgument([&] { validate(parse(local)); });
  EXPECT_NE(message.find("is on the same rank"), std::string::npos) << message;
}

TEST(PipelineSchedule, BadTextIsRefusedNamingLineTokenAndWhatWasExpected) {
  struct Bad {
    std::string text, expected;
  };
  const std::vector<Bad> cases = {
      {"", "expected a 'schedule <name> p=... m=...' header"},
      {"rank 0: F0\n", "line 1: token 'rank': expected the header"},
      {"schedule s p=2\n", "line 1: expected p=<ranks> and m=<micro-batches>"},
      {"schedule s p=0 m=2\n", "line 1: token 'p=0': expected p=<a positive integer>"},
      {"schedule s p=2 m=2 x=1\n", "token 'x=1'"},
      {"schedule s p=2 m=2 p=4\n", "token 'p=4': expected each header key once (p= is given twice)"},
      {"schedule s p=2 m=2 v=2 placement=v placement=interleaved\n", "(placement= is given twice)"},
      {"schedule s p=2 m=2 placement=zigzag\n", "token 'placement=zigzag': expected placement=interleaved or placement=v"},
      {"schedule s p=2 m=2 v=1 placement=v\n", "v=2 with placement=v"},
      {"schedule s p=2 m=2\n# fine\nrank 0: F0 X3\n", "line 3: token 'X3': expected an action"},
      {"schedule s p=2 m=2\nrank 0: F\n", "token 'F': expected an action"},
      {"schedule s p=2 m=2\nrank 0: F-1\n", "token 'F-1'"},
      {"schedule s p=2 m=2\nrank 0: F2\n", "token 'F2': expected a micro-batch below m=2"},
      {"schedule s p=2 m=2\nrank 0: F0c1\n", "token 'F0c1': expected a chunk below v=1"},
      {"schedule s p=2 m=2\nrank 0: F0c\n", "token 'F0c'"},
      {"schedule s p=2 m=2\nrank 2: F0\n", "line 2: token '2:': expected 'rank <r>:' with r in [0, 2)"},
      {"schedule s p=2 m=2\nrank 0: F0\nrank 0: F1\n", "line 3: token '0:': expected each rank once"},
      {"schedule s p=2 m=2\nrank 0: F0\n", "no line for rank 1"},
      {"schedule s p=2 m=2\nstage 0: F0\n", "line 2: token 'stage'"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.text);
    const std::string message = invalidArgument([&] { parse(bad.text); });
    EXPECT_NE(message.find(bad.expected), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
  }
}

TEST(PipelineSchedule, TextAcceptsCommentsBlankLinesAndASeparateColon) {
  const Schedule s = parse(
      "  # a comment line\n"
      "schedule 1F1B p=1 m=1   # trailing comment\n"
      "\n"
      "rank 0 : F0 B0\n");
  EXPECT_EQ(s.name, "1F1B");
  EXPECT_EQ(s.v, 1);
  ASSERT_EQ(s.ranks.size(), 1u);
  EXPECT_EQ(s.ranks[0], (std::vector<Action>{{ActionKind::F, 0, 0}, {ActionKind::B, 0, 0}}));
  EXPECT_NO_THROW(validate(s));
}

TEST(PipelineSchedule, AScheduleFileIsReadAndItsErrorsNameTheFile) {
  // The process id keeps concurrent runs (the Release and sanitizer builds side by side) apart.
  const std::string path =
      ::testing::TempDir() + "pipeline_schedule_test_" + std::to_string(getpid()) + ".txt";
  {
    std::ofstream out(path);
    out << kVShape;
  }
  EXPECT_EQ(parseFile(path), parse(kVShape));
  {
    std::ofstream out(path);
    out << "schedule s p=2 m=2\nrank 0: F0 Q1\n";
  }
  std::string message = invalidArgument([&] { parseFile(path); });
  EXPECT_NE(message.find("pipeline schedule file " + path + ", line 2: token 'Q1'"), std::string::npos)
      << message;
  std::remove(path.c_str());
  message = invalidArgument([&] { parseFile(path); });
  EXPECT_NE(message.find("cannot be opened"), std::string::npos) << message;
}

}  // namespace
}  // namespace dt::pipeline
