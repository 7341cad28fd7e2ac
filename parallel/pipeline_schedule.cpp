#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "common/check.h"
#include "common/errors.h"
#include "common/strings.h"

namespace dt::pipeline {

const char* toString(ActionKind kind) {
  switch (kind) {
    case ActionKind::F: return "F";
    case ActionKind::B: return "B";
    case ActionKind::I: return "I";
    case ActionKind::W: return "W";
    case ActionKind::SendF: return "SEND_F";
    case ActionKind::RecvF: return "RECV_F";
    case ActionKind::SendB: return "SEND_B";
    case ActionKind::RecvB: return "RECV_B";
  }
  return "?";
}

bool isCompute(ActionKind kind) {
  return kind == ActionKind::F || kind == ActionKind::B || kind == ActionKind::I ||
         kind == ActionKind::W;
}

std::string toString(const Action& action, bool showChunk) {
  std::string text = str(toString(action.kind), action.microBatch);
  if (showChunk || action.chunk != 0) text += str("c", action.chunk);
  return text;
}

const char* toString(Placement placement) {
  return placement == Placement::V ? "v" : "interleaved";
}

int Schedule::stageOf(int rank, int chunk) const {
  DT_REQUIRE(rank >= 0 && rank < p, "pipeline schedule ", name, ": rank ", rank,
             " is outside [0, ", p, ")");
  DT_REQUIRE(chunk >= 0 && chunk < v, "pipeline schedule ", name, ": chunk ", chunk,
             " is outside [0, ", v, ")");
  if (placement == Placement::V) return chunk == 0 ? rank : 2 * p - 1 - rank;
  return chunk * p + rank;
}

int Schedule::rankOfStage(int stage) const {
  DT_REQUIRE(stage >= 0 && stage < numStages(), "pipeline schedule ", name, ": stage ", stage,
             " is outside [0, ", numStages(), ")");
  if (placement == Placement::V) return stage < p ? stage : 2 * p - 1 - stage;
  return stage % p;
}

int Schedule::chunkOfStage(int stage) const {
  DT_REQUIRE(stage >= 0 && stage < numStages(), "pipeline schedule ", name, ": stage ", stage,
             " is outside [0, ", numStages(), ")");
  if (placement == Placement::V) return stage < p ? 0 : 1;
  return stage / p;
}

namespace {

// A bound on p*v*m so that a typo in a user's text ("m=80000000") is refused with a reason
// instead of allocating gigabytes of bookkeeping.
constexpr long long kMaxWork = 1'000'000;

constexpr size_t kActionKinds = 8;  // ActionKind's values, F through RecvB

std::string title(const Schedule& s) {
  return str("pipeline schedule ", s.name.empty() ? "(unnamed)" : s.name, " p=", s.p, " m=",
             s.m, " v=", s.v);
}

// The stage a communication action's data comes from or goes to; -1 or numStages() when
// that edge leaves the pipeline.
int otherStage(const Schedule& s, int rank, const Action& a) {
  int stage = s.stageOf(rank, a.chunk);
  switch (a.kind) {
    case ActionKind::SendF:
    case ActionKind::RecvB: return stage + 1;
    case ActionKind::RecvF:
    case ActionKind::SendB: return stage - 1;
    default: return stage;
  }
}

ActionKind counterpart(ActionKind kind) {
  switch (kind) {
    case ActionKind::SendF: return ActionKind::RecvF;
    case ActionKind::RecvF: return ActionKind::SendF;
    case ActionKind::SendB: return ActionKind::RecvB;
    case ActionKind::RecvB: return ActionKind::SendB;
    default: return kind;
  }
}

// Where each rank's actions sit: index of (kind, micro-batch, chunk) in its list, -1 if absent.
class Positions {
 public:
  explicit Positions(const Schedule& s) : m_(s.m), v_(s.v) {
    table_.assign(static_cast<size_t>(s.p) * kActionKinds * s.m * s.v, -1);
  }
  int& at(int rank, ActionKind kind, int microBatch, int chunk) {
    return table_[index(rank, kind, microBatch, chunk)];
  }
  int at(int rank, ActionKind kind, int microBatch, int chunk) const {
    return table_[index(rank, kind, microBatch, chunk)];
  }
  // The B, or else the I, of (micro-batch, chunk): what the previous stage's gradient needs.
  int inputGrad(int rank, int microBatch, int chunk) const {
    int b = at(rank, ActionKind::B, microBatch, chunk);
    return b >= 0 ? b : at(rank, ActionKind::I, microBatch, chunk);
  }

 private:
  size_t index(int rank, ActionKind kind, int microBatch, int chunk) const {
    return ((static_cast<size_t>(rank) * kActionKinds + static_cast<size_t>(kind)) * m_ +
            static_cast<size_t>(microBatch)) * v_ + static_cast<size_t>(chunk);
  }
  int m_, v_;
  std::vector<int> table_;
};

void requireShape(const Schedule& s) {
  DT_REQUIRE(s.p >= 1, title(s), ": p=", s.p, " pipeline ranks (needs p >= 1)");
  DT_REQUIRE(s.m >= 1, title(s), ": m=", s.m, " micro-batches (needs m >= 1)");
  DT_REQUIRE(s.v >= 1, title(s), ": v=", s.v, " chunks per rank (needs v >= 1)");
  DT_REQUIRE(s.placement != Placement::V || s.v == 2, title(s),
             ": the V placement holds exactly 2 chunks per rank, not v=", s.v);
  DT_REQUIRE(static_cast<long long>(s.p) * s.m * s.v <= kMaxWork, title(s),
             ": p*m*v=", static_cast<long long>(s.p) * s.m * s.v, " exceeds the ", kMaxWork,
             " stage-micro-batches this checker simulates");
  DT_REQUIRE(static_cast<int>(s.ranks.size()) == s.p, title(s), ": has ", s.ranks.size(),
             " rank lists for p=", s.p, " ranks");
}

[[noreturn]] void fail(const Schedule& s, const std::vector<ActionRef>& marks,
                       const std::string& what) {
  std::string listing = actionGrid(s, marks);
  if (!listing.empty() && listing.back() == '\n') listing.pop_back();
  throw InvalidArgument(str(title(s), " is invalid: ", what, "\n", listing));
}

std::string at(const Schedule& s, int rank, int index) {
  return str("rank ", rank, " action #", index, " ", toString(s.ranks[rank][index], s.v > 1));
}

// ---- Generators' shared parts. ----

Schedule emptySchedule(std::string name, int p, int m, int v, Placement placement) {
  Schedule s;
  s.name = std::move(name);
  s.p = p;
  s.m = m;
  s.v = v;
  s.placement = placement;
  s.ranks.assign(static_cast<size_t>(std::max(p, 0)), {});
  return s;
}

void requireParameters(const std::string& name, int p, int m, int v) {
  DT_REQUIRE(p >= 1, "pipeline schedule ", name, ": p=", p,
             " is not a number of pipeline ranks (needs p >= 1)");
  DT_REQUIRE(m >= 1, "pipeline schedule ", name, ": m=", m,
             " is not a number of micro-batches (needs m >= 1)");
  DT_REQUIRE(v >= 1, "pipeline schedule ", name, ": v=", v,
             " is not a number of chunks per rank (needs v >= 1)");
  DT_REQUIRE(static_cast<long long>(p) * m * v <= kMaxWork, "pipeline schedule ", name,
             ": p*m*v=", static_cast<long long>(p) * m * v, " exceeds ", kMaxWork);
}

// Unit-cost start and end of every compute in `orders` when data moves for free and at once:
// the timeline the generated communication must not slow down.
struct Span {
  double start = 0, end = 0;
};

std::vector<std::vector<Span>> idealTimes(const Schedule& s,
                                          const std::vector<std::vector<Action>>& orders) {
  const int stages = s.numStages();
  auto slot = [&](int microBatch, int stage) {
    return static_cast<size_t>(microBatch) * stages + stage;
  };
  const size_t cells = static_cast<size_t>(s.m) * stages;
  std::vector<double> forwardEnd(cells, -1), inputGradEnd(cells, -1), weightReady(cells, -1);
  std::vector<std::vector<Span>> spans(s.p);
  std::vector<size_t> next(s.p, 0);
  std::vector<double> clock(s.p, 0);
  const Costs unit;
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s.p; ++r) {
      while (next[r] < orders[r].size()) {
        const Action& a = orders[r][next[r]];
        const int stage = s.stageOf(r, a.chunk);
        double ready = clock[r];
        bool blocked = false;
        auto need = [&](double end) {
          if (end < 0) blocked = true;
          ready = std::max(ready, end);
        };
        double cost = unit.f;
        switch (a.kind) {
          case ActionKind::F:
            if (stage > 0) need(forwardEnd[slot(a.microBatch, stage - 1)]);
            break;
          case ActionKind::B:
          case ActionKind::I:
            cost = a.kind == ActionKind::B ? unit.b : unit.i;
            need(forwardEnd[slot(a.microBatch, stage)]);
            if (stage + 1 < stages) need(inputGradEnd[slot(a.microBatch, stage + 1)]);
            break;
          case ActionKind::W:
            cost = unit.w;
            need(weightReady[slot(a.microBatch, stage)]);
            break;
          default: DT_INTERNAL_CHECK(false, "generators order computes only");
        }
        if (blocked) break;
        const double end = ready + cost;
        spans[r].push_back({ready, end});
        if (a.kind == ActionKind::F) forwardEnd[slot(a.microBatch, stage)] = end;
        if (a.kind == ActionKind::B || a.kind == ActionKind::I)
          inputGradEnd[slot(a.microBatch, stage)] = end;
        if (a.kind == ActionKind::I) weightReady[slot(a.microBatch, stage)] = end;
        clock[r] = end;
        ++next[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < s.p; ++r)
    DT_INTERNAL_CHECK(next[r] == orders[r].size(), s.name, " generator's compute order stalls on rank ", r);
  return spans;
}

// Adds the SEND/RECV actions to per-rank compute orders. Every message gets the time its data
// is produced (t); the SEND goes right after the producing compute, the RECV right before the
// receiver's first compute that starts at or after t, and actions at the same place are ordered
// by (t, message). Along every rank the messages then appear in one global order, so under
// strict rendezvous the earliest unfinished message always has both ends at their heads: no
// deadlock. And a RECV never waits past t on a rank that would otherwise be computing, so the
// simulated timeline is the ideal one above.
Schedule withCommunication(Schedule s, const std::vector<std::vector<Action>>& orders) {
  const auto spans = idealTimes(s, orders);
  struct Placed {
    size_t position;  // before compute #position of that rank (size() = at the end)
    double time;
    std::tuple<int, int, int> message;  // direction, sending stage, micro-batch
    Action action;
    bool operator<(const Placed& o) const {
      return std::tie(position, time, message) < std::tie(o.position, o.time, o.message);
    }
  };
  std::vector<std::vector<Placed>> placed(s.p);
  // A rank's computes start in list order, one after the other: binary search on the starts.
  auto receiverPosition = [&](int rank, double time) {
    const auto& row = spans[rank];
    return static_cast<size_t>(
        std::partition_point(row.begin(), row.end(), [&](const Span& span) { return span.start < time; }) -
        row.begin());
  };
  for (int r = 0; r < s.p; ++r) {
    for (size_t k = 0; k < orders[r].size(); ++k) {
      const Action& a = orders[r][k];
      const int stage = s.stageOf(r, a.chunk);
      const double t = spans[r][k].end;
      int to = -1;
      ActionKind send = ActionKind::SendF, recv = ActionKind::RecvF;
      int direction = 0;
      if (a.kind == ActionKind::F && stage + 1 < s.numStages()) {
        to = stage + 1;
      } else if ((a.kind == ActionKind::B || a.kind == ActionKind::I) && stage > 0) {
        to = stage - 1;
        send = ActionKind::SendB;
        recv = ActionKind::RecvB;
        direction = 1;
      }
      if (to < 0 || s.rankOfStage(to) == r) continue;
      const int peer = s.rankOfStage(to);
      const auto message = std::make_tuple(direction, stage, a.microBatch);
      placed[r].push_back({k + 1, t, message, {send, a.microBatch, a.chunk}});
      placed[peer].push_back(
          {receiverPosition(peer, t), t, message, {recv, a.microBatch, s.chunkOfStage(to)}});
    }
  }
  for (int r = 0; r < s.p; ++r) {
    std::sort(placed[r].begin(), placed[r].end());
    auto& out = s.ranks[r];
    out.clear();
    size_t next = 0;
    for (size_t k = 0; k <= orders[r].size(); ++k) {
      while (next < placed[r].size() && placed[r][next].position == k)
        out.push_back(placed[r][next++].action);
      if (k < orders[r].size()) out.push_back(orders[r][k]);
    }
  }
  return s;
}

}  // namespace

int peerRank(const Schedule& schedule, int rank, const Action& action) {
  DT_REQUIRE(!isCompute(action.kind), title(schedule), ": ", toString(action, true),
             " is a compute action and has no peer");
  const int other = otherStage(schedule, rank, action);
  DT_REQUIRE(other >= 0 && other < schedule.numStages(), title(schedule), ": rank ", rank,
             "'s ", toString(action, true), " goes to stage ", other,
             ", outside the pipeline's stages [0, ", schedule.numStages(), ")");
  const int peer = schedule.rankOfStage(other);
  DT_REQUIRE(peer != rank, title(schedule), ": rank ", rank, "'s ", toString(action, true),
             " goes to stage ", other, " on the same rank, whose data stays local");
  return peer;
}

// ---- Generators. ----

Schedule gpipe(int p, int m) {
  requireParameters("GPipe", p, m, 1);
  Schedule s = emptySchedule("GPipe", p, m, 1, Placement::Interleaved);
  std::vector<std::vector<Action>> orders(p);
  for (int r = 0; r < p; ++r) {
    for (int i = 0; i < m; ++i) orders[r].push_back({ActionKind::F, i, 0});
    for (int i = 0; i < m; ++i) orders[r].push_back({ActionKind::B, i, 0});
  }
  return withCommunication(std::move(s), orders);
}

Schedule oneFOneB(int p, int m) {
  requireParameters("1F1B", p, m, 1);
  Schedule s = emptySchedule("1F1B", p, m, 1, Placement::Interleaved);
  std::vector<std::vector<Action>> orders(p);
  for (int r = 0; r < p; ++r) {
    // Rank r has p-1-r forwards in flight before its first backward can arrive.
    const int warmup = std::min(p - 1 - r, m);
    for (int i = 0; i < warmup; ++i) orders[r].push_back({ActionKind::F, i, 0});
    for (int i = 0; i < m - warmup; ++i) {
      orders[r].push_back({ActionKind::F, warmup + i, 0});
      orders[r].push_back({ActionKind::B, i, 0});
    }
    for (int i = m - warmup; i < m; ++i) orders[r].push_back({ActionKind::B, i, 0});
  }
  return withCommunication(std::move(s), orders);
}

Schedule interleavedOneFOneB(int p, int m, int v) {
  requireParameters("Interleaved1F1B", p, m, v);
  DT_REQUIRE(m % p == 0, "pipeline schedule Interleaved1F1B: m=", m,
             " is not a multiple of p=", p, " (micro-batches run in groups of p, chunk after chunk)");
  Schedule s = emptySchedule("Interleaved1F1B", p, m, v, Placement::Interleaved);
  const int total = m * v;  // chunk-forwards per rank
  // The k-th forward of a rank: micro-batch group k/(p v), chunk (k/p) mod v; backwards visit
  // the chunks in reverse, since the last chunk's backward is the first one available.
  auto forward = [&](int k) {
    return Action{ActionKind::F, (k / (p * v)) * p + k % p, (k / p) % v};
  };
  auto backward = [&](int k) {
    return Action{ActionKind::B, (k / (p * v)) * p + k % p, v - 1 - (k / p) % v};
  };
  std::vector<std::vector<Action>> orders(p);
  for (int r = 0; r < p; ++r) {
    // Megatron's warm-up: the round trip to the last stage and back, plus v-1 more groups.
    // With m == p everything fits in warm-up.
    const int warmup = m == p ? total : std::min((p - r - 1) * 2 + (v - 1) * p, total);
    for (int k = 0; k < warmup; ++k) orders[r].push_back(forward(k));
    for (int k = 0; k < total - warmup; ++k) {
      orders[r].push_back(forward(warmup + k));
      orders[r].push_back(backward(k));
    }
    for (int k = total - warmup; k < total; ++k) orders[r].push_back(backward(k));
  }
  return withCommunication(std::move(s), orders);
}

namespace {

// ZBV's list scheduler, in unit time steps (F = I = W = 1 per chunk).
// Priorities on a free rank: an I whose gradient has arrived (the previous stage waits for
// it), the deeper chunk first; a W when `pendingLimit` of them wait (bounds the state W
// holds); an F, the deeper chunk first, while fewer than inFlightLimit chunk-forwards wait
// for their I (the activation memory); any pending W (it fills what would be bubble), oldest
// first.
std::vector<std::vector<Action>> zeroBubbleOrders(const Schedule& s, int inFlightLimit, int pendingLimit) {
  const int p = s.p, m = s.m, v = s.v, stages = s.numStages();
  auto slot = [&](int microBatch, int stage) { return static_cast<size_t>(microBatch) * stages + stage; };
  std::vector<long long> forwardEnd(static_cast<size_t>(m) * stages, -1);
  std::vector<long long> inputGradEnd(static_cast<size_t>(m) * stages, -1);
  std::vector<std::vector<int>> forwards(p, std::vector<int>(v, 0)), inputGrads = forwards;
  std::vector<std::vector<Action>> pendingW(p);  // per rank, oldest first
  std::vector<size_t> pendingHead(p, 0);
  std::vector<int> inFlight(p, 0);
  std::vector<long long> freeAt(p, 0);
  std::vector<std::vector<Action>> orders(p);
  long long remaining = 3LL * m * v * p;
  const long long limit = 10LL * (3LL * m * v + p) + 10;
  for (long long time = 0; remaining > 0; ++time) {
    DT_INTERNAL_CHECK(time < limit, s.name, " list scheduler made no progress by time ", time);
    auto done = [&](long long end) { return end >= 0 && end <= time; };
    for (int r = 0; r < p; ++r) {
      if (freeAt[r] > time) continue;
      const size_t pending = pendingW[r].size() - pendingHead[r];
      std::optional<Action> chosen;
      for (int c = v - 1; c >= 0 && !chosen; --c) {
        const int stage = s.stageOf(r, c), i = inputGrads[r][c];
        if (i < m && done(forwardEnd[slot(i, stage)]) &&
            (stage + 1 == stages || done(inputGradEnd[slot(i, stage + 1)]))) {
          chosen = Action{ActionKind::I, i, c};
          inputGradEnd[slot(i, stage)] = time + 1;
          ++inputGrads[r][c];
          --inFlight[r];
          pendingW[r].push_back({ActionKind::W, i, c});
        }
      }
      if (!chosen && pending >= static_cast<size_t>(pendingLimit)) chosen = pendingW[r][pendingHead[r]++];
      for (int c = v - 1; c >= 0 && !chosen && inFlight[r] < inFlightLimit; --c) {
        const int stage = s.stageOf(r, c), f = forwards[r][c];
        if (f < m && (stage == 0 || done(forwardEnd[slot(f, stage - 1)]))) {
          chosen = Action{ActionKind::F, f, c};
          forwardEnd[slot(f, stage)] = time + 1;
          ++forwards[r][c];
          ++inFlight[r];
        }
      }
      if (!chosen && pending > 0) chosen = pendingW[r][pendingHead[r]++];
      if (!chosen) continue;
      orders[r].push_back(*chosen);
      freeAt[r] = time + 1;
      --remaining;
    }
  }
  return orders;
}

}  // namespace

Schedule zeroBubbleH1(int p, int m, int maxPendingWeightGrads) {
  requireParameters("ZB-H1", p, m, 1);
  DT_REQUIRE(m >= p, "pipeline schedule ZB-H1: m=", m, " is below p=", p,
             " (the deferred weight gradients fill the bubble only with m >= p micro-batches)");
  const int pending = maxPendingWeightGrads == 0 ? p : maxPendingWeightGrads;
  DT_REQUIRE(pending >= 1 && pending <= p, "pipeline schedule ZB-H1: at most ", maxPendingWeightGrads,
             " pending weight gradients per rank; it must be 1 to p=", p, " (0: p)");
  Schedule s = emptySchedule("ZB-H1", p, m, 1, Placement::Interleaved);
  // 1F1B's order with B split into I and W, rank r's W running `delay` = min(r, pending - 1)
  // I's late (the paper's ZB-H1): a later rank has fewer forwards in flight (p - r), so its
  // deferred W fill the room those leave, and no rank ever keeps more than p micro-batches'
  // state between an F and its W, 1F1B's rank 0 (a deferred W keeps about a forward's worth).
  // Rank 0 defers none: its bubble is the wait for the first gradient, which no W can fill.
  std::vector<std::vector<Action>> orders(p);
  for (int r = 0; r < p; ++r) {
    const int warmup = p - 1 - r, delay = std::min(r, pending - 1);
    auto inputGrad = [&](int i) {
      orders[r].push_back({ActionKind::I, i, 0});
      if (i >= delay) orders[r].push_back({ActionKind::W, i - delay, 0});
    };
    for (int i = 0; i < warmup; ++i) orders[r].push_back({ActionKind::F, i, 0});
    for (int i = 0; i < m - warmup; ++i) {
      orders[r].push_back({ActionKind::F, warmup + i, 0});
      inputGrad(i);
    }
    for (int i = m - warmup; i < m; ++i) inputGrad(i);
    for (int i = m - delay; i < m; ++i) orders[r].push_back({ActionKind::W, i, 0});
  }
  return withCommunication(std::move(s), orders);
}

Schedule zeroBubbleV(int p, int m) {
  requireParameters("ZBV", p, m, 2);
  DT_REQUIRE(m % p == 0, "pipeline schedule ZBV: m=", m, " is not a multiple of p=", p,
             " (its list schedule reaches the bubble formula for m = p, 2p, 3p, ...)");
  Schedule s = emptySchedule("ZBV", p, m, 2, Placement::V);
  // 2p chunk-forwards of half a stage each: the activations of p whole stages, 1F1B's rank 0.
  auto orders = zeroBubbleOrders(s, 2 * p, p);
  return withCommunication(std::move(s), orders);
}

// ---- Validation. ----

namespace {

// Fills positions, checking ranges, duplicates and that every SEND/RECV crosses ranks.
void indexActions(const Schedule& s, Positions& positions) {
  for (int r = 0; r < s.p; ++r) {
    const auto& list = s.ranks[r];
    for (int k = 0; k < static_cast<int>(list.size()); ++k) {
      const Action& a = list[k];
      if (a.microBatch < 0 || a.microBatch >= s.m)
        fail(s, {{r, k}}, str(at(s, r, k), ": micro-batch ", a.microBatch, " is outside [0, ", s.m, ")"));
      if (a.chunk < 0 || a.chunk >= s.v)
        fail(s, {{r, k}}, str(at(s, r, k), ": chunk ", a.chunk, " is outside [0, ", s.v, ")"));
      int& position = positions.at(r, a.kind, a.microBatch, a.chunk);
      if (position >= 0)
        fail(s, {{r, position}, {r, k}},
             str(at(s, r, k), " appears twice on the rank (also #", position, ")"));
      position = k;
      if (isCompute(a.kind)) continue;
      const int other = otherStage(s, r, a);
      if (other < 0 || other >= s.numStages())
        fail(s, {{r, k}}, str(at(s, r, k), " crosses the pipeline's edge: stage ",
                               s.stageOf(r, a.chunk), " has no ",
                               other < 0 ? "previous" : "next", " stage"));
      if (s.rankOfStage(other) == r)
        fail(s, {{r, k}}, str(at(s, r, k), ": stage ", other,
                               " is on the same rank, whose data stays local (no SEND/RECV)"));
    }
  }
}

// Each (micro-batch, stage) computed once, each cross-rank edge carried once each way.
void checkCompleteness(const Schedule& s, const Positions& positions) {
  const bool chunks = s.v > 1;
  for (int stage = 0; stage < s.numStages(); ++stage) {
    const int r = s.rankOfStage(stage), c = s.chunkOfStage(stage);
    for (int i = 0; i < s.m; ++i) {
      auto missing = [&](ActionKind kind, int rank, int chunk, const std::string& why) {
        fail(s, {}, str("rank ", rank, " has no ", toString(Action{kind, i, chunk}, chunks),
                        " (micro-batch ", i, ", stage ", stage, "): ", why));
      };
      const int b = positions.at(r, ActionKind::B, i, c);
      const int in = positions.at(r, ActionKind::I, i, c);
      const int w = positions.at(r, ActionKind::W, i, c);
      if (positions.at(r, ActionKind::F, i, c) < 0)
        missing(ActionKind::F, r, c, "every micro-batch runs every stage's forward once");
      if (b >= 0 && in >= 0)
        fail(s, {{r, b}, {r, in}}, str("rank ", r, " runs both B and I for micro-batch ", i,
                                       " of stage ", stage, ": a backward is B or I + W, once"));
      if (b < 0 && in < 0)
        missing(ActionKind::B, r, c, "every forward needs a backward, B or I + W");
      if (in >= 0 && w < 0)
        missing(ActionKind::W, r, c, "an I's weight gradient must run as a W");
      if (w >= 0 && in < 0)
        fail(s, {{r, w}}, str(at(s, r, w), " has no I: W follows the split backward only"));
      if (stage + 1 < s.numStages() && s.rankOfStage(stage + 1) != r) {
        const int next = s.rankOfStage(stage + 1), nextChunk = s.chunkOfStage(stage + 1);
        if (positions.at(r, ActionKind::SendF, i, c) < 0)
          missing(ActionKind::SendF, r, c, str("stage ", stage + 1, " on rank ", next, " needs the activation"));
        if (positions.at(next, ActionKind::RecvF, i, nextChunk) < 0)
          missing(ActionKind::RecvF, next, nextChunk, str("stage ", stage, " on rank ", r, " sends it"));
        if (positions.at(next, ActionKind::SendB, i, nextChunk) < 0)
          missing(ActionKind::SendB, next, nextChunk, str("stage ", stage, " on rank ", r, " needs the gradient"));
        if (positions.at(r, ActionKind::RecvB, i, c) < 0)
          missing(ActionKind::RecvB, r, c, str("stage ", stage + 1, " on rank ", next, " sends it"));
      }
    }
  }
}

// What each action needs earlier in its own rank's list.
void checkLocalOrder(const Schedule& s, const Positions& positions) {
  const bool chunks = s.v > 1;
  for (int r = 0; r < s.p; ++r) {
    const auto& list = s.ranks[r];
    for (int k = 0; k < static_cast<int>(list.size()); ++k) {
      const Action& a = list[k];
      const int stage = s.stageOf(r, a.chunk);
      auto requireBefore = [&](int position, const Action& needed, const std::string& why) {
        if (position < k) return;  // present (completeness holds) and earlier
        fail(s, {{r, k}, {r, position}},
             str(at(s, r, k), " runs before ", toString(needed, chunks), " (#", position, "), ", why));
      };
      switch (a.kind) {
        case ActionKind::F:
          if (stage == 0) break;
          if (s.rankOfStage(stage - 1) == r) {
            const int c = s.chunkOfStage(stage - 1);
            requireBefore(positions.at(r, ActionKind::F, a.microBatch, c),
                          {ActionKind::F, a.microBatch, c}, "the previous stage's forward on this rank");
          } else {
            requireBefore(positions.at(r, ActionKind::RecvF, a.microBatch, a.chunk),
                          {ActionKind::RecvF, a.microBatch, a.chunk}, "which receives its input");
          }
          break;
        case ActionKind::B:
        case ActionKind::I:
          requireBefore(positions.at(r, ActionKind::F, a.microBatch, a.chunk),
                        {ActionKind::F, a.microBatch, a.chunk}, "the forward it differentiates");
          if (stage + 1 == s.numStages()) break;
          if (s.rankOfStage(stage + 1) == r) {
            const int c = s.chunkOfStage(stage + 1);
            const int position = positions.inputGrad(r, a.microBatch, c);
            requireBefore(position, s.ranks[r][position],
                          "the next stage's backward on this rank, whose gradient it needs");
          } else {
            requireBefore(positions.at(r, ActionKind::RecvB, a.microBatch, a.chunk),
                          {ActionKind::RecvB, a.microBatch, a.chunk}, "which receives its output's gradient");
          }
          break;
        case ActionKind::W:
          requireBefore(positions.at(r, ActionKind::I, a.microBatch, a.chunk),
                        {ActionKind::I, a.microBatch, a.chunk}, "whose gradients W uses");
          break;
        case ActionKind::SendF:
          requireBefore(positions.at(r, ActionKind::F, a.microBatch, a.chunk),
                        {ActionKind::F, a.microBatch, a.chunk}, "which produces what it sends");
          break;
        case ActionKind::SendB: {
          const int position = positions.inputGrad(r, a.microBatch, a.chunk);
          requireBefore(position, s.ranks[r][position], "which produces what it sends");
          break;
        }
        case ActionKind::RecvF:
        case ActionKind::RecvB: break;
      }
    }
  }
}

// Runs the lists with blocking, unbuffered sends: a SEND and its RECV complete together, when
// both are at the heads of their ranks' lists.
void checkRendezvous(const Schedule& s, const Positions& positions) {
  std::vector<int> next(s.p, 0);
  auto size = [&](int r) { return static_cast<int>(s.ranks[r].size()); };
  // The peer and the index of the action matching rank r's communication action a.
  auto match = [&](int r, const Action& a) {
    const int other = otherStage(s, r, a);
    const int peer = s.rankOfStage(other);
    return std::make_pair(peer, positions.at(peer, counterpart(a.kind), a.microBatch,
                                             s.chunkOfStage(other)));
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s.p; ++r) {
      while (next[r] < size(r)) {
        const Action& a = s.ranks[r][next[r]];
        if (isCompute(a.kind)) {
          ++next[r];
          progress = true;
          continue;
        }
        auto [peer, position] = match(r, a);
        if (next[peer] != position) break;
        ++next[r];
        ++next[peer];
        progress = true;
      }
    }
  }
  std::vector<ActionRef> stuck;
  std::vector<std::string> waits;
  for (int r = 0; r < s.p; ++r) {
    if (next[r] == size(r)) continue;
    const Action& a = s.ranks[r][next[r]];
    auto [peer, position] = match(r, a);
    stuck.push_back({r, next[r]});
    std::string peerState = next[peer] < size(peer)
                                ? str("it is blocked at ", at(s, peer, next[peer]))
                                : str("it has finished");
    waits.push_back(str(at(s, r, next[r]), " waits for rank ", peer, " to reach its #", position,
                        " ", toString(s.ranks[peer][position], s.v > 1), " (", peerState, ")"));
  }
  if (!stuck.empty())
    fail(s, stuck, str("deadlock under blocking send/recv: ", join(waits, "; ")));
}

std::vector<std::string> tokens(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream in(line);
  for (std::string token; in >> token;) out.push_back(token);
  return out;
}

}  // namespace

void validate(const Schedule& schedule) {
  requireShape(schedule);
  Positions positions(schedule);
  indexActions(schedule, positions);
  checkCompleteness(schedule, positions);
  checkLocalOrder(schedule, positions);
  checkRendezvous(schedule, positions);
}

SimulationResult simulate(const Schedule& s, const Costs& costs) {
  for (double cost : {costs.f, costs.b, costs.i, costs.w})
    DT_REQUIRE(std::isfinite(cost) && cost > 0, "pipeline simulation: costs must be positive and finite, got F=",
               costs.f, " B=", costs.b, " I=", costs.i, " W=", costs.w);
  validate(s);
  Positions positions(s);
  for (int r = 0; r < s.p; ++r)
    for (int k = 0; k < static_cast<int>(s.ranks[r].size()); ++k) {
      const Action& a = s.ranks[r][k];
      positions.at(r, a.kind, a.microBatch, a.chunk) = k;
    }
  SimulationResult result;
  result.busy.assign(s.p, 0);
  result.idle.assign(s.p, 0);
  result.peakInFlight.assign(s.p, 0);
  result.peakPendingWeightGrads.assign(s.p, 0);
  result.timeline.assign(s.p, {});
  // Post times of SENDs, by (rank, index); a RECV waits until its SEND's is known.
  std::vector<std::vector<double>> posted(s.p);
  for (int r = 0; r < s.p; ++r) posted[r].assign(s.ranks[r].size(), -1);
  std::vector<int> next(s.p, 0);
  std::vector<double> clock(s.p, 0);
  std::vector<int> inFlight(s.p, 0), pendingW(s.p, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s.p; ++r) {
      const auto& list = s.ranks[r];
      bool waiting = false;
      while (!waiting && next[r] < static_cast<int>(list.size())) {
        const Action& a = list[next[r]];
        double cost = 0;
        switch (a.kind) {
          case ActionKind::F: cost = costs.f; ++inFlight[r]; break;
          case ActionKind::B: cost = costs.b; --inFlight[r]; break;
          case ActionKind::I: cost = costs.i; --inFlight[r]; ++pendingW[r]; break;
          case ActionKind::W: cost = costs.w; --pendingW[r]; break;
          case ActionKind::SendF:
          case ActionKind::SendB: posted[r][next[r]] = clock[r]; break;
          case ActionKind::RecvF:
          case ActionKind::RecvB: {
            const int other = otherStage(s, r, a);
            const int peer = s.rankOfStage(other);
            const int position =
                positions.at(peer, counterpart(a.kind), a.microBatch, s.chunkOfStage(other));
            const double sent = posted[peer][position];
            waiting = sent < 0;  // its SEND is not posted yet: this rank waits
            clock[r] = std::max(clock[r], sent);
            break;
          }
        }
        if (waiting) break;
        if (cost > 0) {
          result.timeline[r].push_back({next[r], clock[r], clock[r] + cost});
          clock[r] += cost;
          result.busy[r] += cost;
        }
        result.peakInFlight[r] = std::max(result.peakInFlight[r], inFlight[r]);
        result.peakPendingWeightGrads[r] = std::max(result.peakPendingWeightGrads[r], pendingW[r]);
        ++next[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < s.p; ++r)
    DT_INTERNAL_CHECK(next[r] == static_cast<int>(s.ranks[r].size()), title(s),
                      ": simulation stalled on rank ", r, " after validation passed");
  result.makespan = *std::max_element(clock.begin(), clock.end());
  double idle = 0, busy = 0;
  for (int r = 0; r < s.p; ++r) {
    result.idle[r] = result.makespan - result.busy[r];
    idle += result.idle[r];
    busy += result.busy[r];
  }
  result.bubble = busy > 0 ? idle / busy : 0;
  return result;
}

// ---- Printing and parsing. ----

namespace {

// One column of a printed grid. Appends in place: GCC 12 at -O3 flags `" " + cell` with a
// false -Wrestrict (its bug 105329), which -Werror turns into a build failure.
void appendCell(std::string& row, const std::string& cell, size_t width) {
  row += ' ';
  row += cell;
  if (cell.size() < width) row.append(width - cell.size(), ' ');
}

void trimRight(std::string& text) {
  while (!text.empty() && text.back() == ' ') text.pop_back();
}

}  // namespace

std::string grid(const Schedule& s) {
  const SimulationResult result = simulate(s);
  const int steps = static_cast<int>(std::llround(result.makespan));
  std::vector<std::vector<std::string>> cells(s.p, std::vector<std::string>(steps, "."));
  size_t width = 2;
  for (int r = 0; r < s.p; ++r) {
    for (const TimedAction& t : result.timeline[r]) {
      const int start = static_cast<int>(std::llround(t.start));
      const int end = static_cast<int>(std::llround(t.end));
      std::string label = toString(s.ranks[r][t.index], s.v > 1);
      width = std::max(width, label.size());
      cells[r][start] = label;
      for (int step = start + 1; step < end; ++step) cells[r][step] = "--";
    }
  }
  std::ostringstream out;
  out << s.name << " p=" << s.p << " m=" << s.m << " v=" << s.v
      << ": makespan " << result.makespan << ", bubble " << result.bubble
      << " (unit costs F=I=W=1, B=2)\n";
  for (int r = 0; r < s.p; ++r) {
    std::string row = str("rank ", r, ":");
    for (const std::string& cell : cells[r]) appendCell(row, cell, width);
    trimRight(row);
    out << row << "\n";
  }
  return out.str();
}

std::string actionGrid(const Schedule& s, const std::vector<ActionRef>& marks) {
  size_t columns = 0, width = 2;
  std::vector<std::vector<std::string>> cells(s.ranks.size());
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    for (size_t k = 0; k < s.ranks[r].size(); ++k) {
      std::string label = toString(s.ranks[r][k], s.v > 1);
      for (const ActionRef& mark : marks)
        if (mark.rank == static_cast<int>(r) && mark.index == static_cast<int>(k)) label.insert(0, 1, '*');
      width = std::max(width, label.size());
      cells[r].push_back(std::move(label));
    }
    columns = std::max(columns, cells[r].size());
  }
  const std::string rankLabel = str("rank ", s.ranks.empty() ? 0 : s.ranks.size() - 1, ":");
  auto pad = [](std::string text, size_t size) {
    if (text.size() < size) text += std::string(size - text.size(), ' ');
    return text;
  };
  std::ostringstream out;
  std::string header = pad("#", rankLabel.size());
  for (size_t k = 0; k < columns; ++k) appendCell(header, std::to_string(k), width);
  trimRight(header);
  out << header << "\n";
  for (size_t r = 0; r < cells.size(); ++r) {
    std::string row = pad(str("rank ", r, ":"), rankLabel.size());
    for (const std::string& cell : cells[r]) appendCell(row, cell, width);
    trimRight(row);
    out << row << "\n";
  }
  return out.str();
}

std::string format(const Schedule& s) {
  std::ostringstream out;
  out << "schedule " << s.name << " p=" << s.p << " m=" << s.m << " v=" << s.v
      << " placement=" << toString(s.placement) << "\n";
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    out << "rank " << r << ":";
    for (const Action& a : s.ranks[r]) out << " " << toString(a, s.v > 1);
    out << "\n";
  }
  return out.str();
}

namespace {

[[noreturn]] void parseError(int line, const std::string& token, const std::string& expected) {
  throw InvalidArgument(str("pipeline schedule text, line ", line,
                            token.empty() ? std::string() : str(": token '", token, "'"),
                            ": expected ", expected));
}

// A non-negative decimal integer spanning all of `text` (no sign, no overflow), else -1.
long long parseCount(std::string_view text) {
  if (text.empty() || text.size() > 9) return -1;
  long long value = 0;
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return -1;
    value = value * 10 + (c - '0');
  }
  return value;
}

constexpr const char* kActionSyntax =
    "an action: F, B, I, W, SEND_F, RECV_F, SEND_B or RECV_B, a micro-batch number, and "
    "optionally c<chunk> (F3, SEND_B0c1)";

Action parseAction(const Schedule& s, int line, const std::string& token) {
  static const std::pair<const char*, ActionKind> kinds[] = {
      {"SEND_F", ActionKind::SendF}, {"RECV_F", ActionKind::RecvF}, {"SEND_B", ActionKind::SendB},
      {"RECV_B", ActionKind::RecvB}, {"F", ActionKind::F},          {"B", ActionKind::B},
      {"I", ActionKind::I},          {"W", ActionKind::W}};
  std::string_view rest(token);
  Action a;
  bool known = false;
  for (const auto& [prefix, kind] : kinds) {
    if (rest.starts_with(prefix)) {
      a.kind = kind;
      rest.remove_prefix(std::string_view(prefix).size());
      known = true;
      break;
    }
  }
  if (!known) parseError(line, token, kActionSyntax);
  const size_t c = rest.find('c');
  const long long microBatch = parseCount(rest.substr(0, c));
  const long long chunk = c == std::string_view::npos ? 0 : parseCount(rest.substr(c + 1));
  if (microBatch < 0 || chunk < 0) parseError(line, token, kActionSyntax);
  if (microBatch >= s.m) parseError(line, token, str("a micro-batch below m=", s.m));
  if (chunk >= s.v) parseError(line, token, str("a chunk below v=", s.v));
  a.microBatch = static_cast<int>(microBatch);
  a.chunk = static_cast<int>(chunk);
  return a;
}

}  // namespace

Schedule parse(const std::string& text) {
  Schedule s;
  bool header = false;
  std::vector<bool> seen;
  std::istringstream in(text);
  int lineNumber = 0;
  for (std::string line; std::getline(in, line);) {
    ++lineNumber;
    if (const size_t hash = line.find('#'); hash != std::string::npos) line.erase(hash);
    const std::vector<std::string> words = tokens(line);
    if (words.empty()) continue;
    if (!header) {
      if (words[0] != "schedule" || words.size() < 2)
        parseError(lineNumber, words[0],
                   "the header 'schedule <name> p=<ranks> m=<micro-batches> [v=<chunks>] "
                   "[placement=interleaved|v]' first");
      s.name = words[1];
      bool hasP = false, hasM = false;
      std::set<std::string> keys;
      for (size_t w = 2; w < words.size(); ++w) {
        const std::string& word = words[w];
        const size_t eq = word.find('=');
        const std::string key = word.substr(0, eq);
        const std::string value = eq == std::string::npos ? "" : word.substr(eq + 1);
        // "p=2 ... p=4" is a typo, not a choice: taking either value would run a schedule the
        // user did not mean.
        if (!keys.insert(key).second) parseError(lineNumber, word, str("each header key once (", key, "= is given twice)"));
        if (key == "placement") {
          if (value == "interleaved") s.placement = Placement::Interleaved;
          else if (value == "v") s.placement = Placement::V;
          else parseError(lineNumber, word, "placement=interleaved or placement=v");
          continue;
        }
        if (key != "p" && key != "m" && key != "v")
          parseError(lineNumber, word, "p=<ranks>, m=<micro-batches>, v=<chunks> or placement=...");
        const long long number = parseCount(value);
        if (number < 1) parseError(lineNumber, word, str(key, "=<a positive integer>"));
        (key == "p" ? s.p : key == "m" ? s.m : s.v) = static_cast<int>(number);
        hasP |= key == "p";
        hasM |= key == "m";
      }
      if (!hasP || !hasM) parseError(lineNumber, "", str("p=<ranks> and m=<micro-batches> in the header"));
      if (s.placement == Placement::V && s.v != 2)
        parseError(lineNumber, "", str("v=2 with placement=v (the V shape holds two chunks per rank), not v=", s.v));
      if (static_cast<long long>(s.p) * s.m * s.v > kMaxWork)
        parseError(lineNumber, "", str("p*m*v at most ", kMaxWork));
      s.ranks.assign(s.p, {});
      seen.assign(s.p, false);
      header = true;
      continue;
    }
    const std::string expectedRank = str("'rank <r>:' with r in [0, ", s.p, ")");
    if (words[0] != "rank" || words.size() < 2) parseError(lineNumber, words[0], expectedRank);
    std::string number = words[1];
    if (!number.empty() && number.back() == ':') number.pop_back();
    size_t first = 2;
    if (number == words[1]) {  // "rank 0 :" with the colon apart
      if (words.size() < 3 || words[2] != ":") parseError(lineNumber, words[1], expectedRank);
      first = 3;
    }
    const long long rank = parseCount(number);
    if (rank < 0 || rank >= s.p) parseError(lineNumber, words[1], expectedRank);
    if (seen[rank]) parseError(lineNumber, words[1], str("each rank once (rank ", rank, " already has a line)"));
    seen[rank] = true;
    for (size_t w = first; w < words.size(); ++w)
      s.ranks[rank].push_back(parseAction(s, lineNumber, words[w]));
  }
  if (!header) parseError(lineNumber, "", "a 'schedule <name> p=... m=...' header (the text is empty)");
  for (int r = 0; r < s.p; ++r)
    if (!seen[r])
      throw InvalidArgument(str("pipeline schedule text: no line for rank ", r,
                                " (expected one 'rank <r>:' line for each of the p=", s.p, " ranks)"));
  return s;
}

Schedule parseFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DT_REQUIRE(in, "pipeline schedule file ", path, ": cannot be opened");
  std::ostringstream text;
  text << in.rdbuf();
  DT_REQUIRE(!in.bad(), "pipeline schedule file ", path, ": read failed");
  try {
    return parse(text.str());
  } catch (const InvalidArgument& e) {
    // parse's errors say "pipeline schedule text, line N: ..."; name the file instead.
    const std::string_view prefix = "pipeline schedule text";
    std::string_view message = e.what();
    if (message.starts_with(prefix)) message.remove_prefix(prefix.size());
    throw InvalidArgument(str("pipeline schedule file ", path, message));
  }
}

}  // namespace dt::pipeline
