// Pipeline-parallel schedules as data: per-rank action lists, their generators, a validator
// that runs a schedule in one process before any step does, a timing simulator, a grid printer
// and a text format (issue 39, first phase; the runtime that executes the lists is the next).
//
//   auto s = dt::pipeline::oneFOneB(/*p=*/4, /*m=*/8);
//   dt::pipeline::validate(s);                       // throws InvalidArgument with the grid
//   auto r = dt::pipeline::simulate(s);              // r.bubble == 3/8, r.peakInFlight[0] == 4
//   std::cout << dt::pipeline::grid(s);              // rows = ranks, columns = unit time steps
//   auto mine = dt::pipeline::parse(text);           // a user's own schedule, validated the same way
//
// The model:
//  * The model's layers are split into p*v stages. Each of the p pipeline ranks (the mesh's "pp"
//    dimension) holds v of them, its chunks. Placement::Interleaved is Megatron's: chunk c of
//    rank r is stage c*p + r (v = 1 is the plain pipeline). Placement::V is ZBV's V shape with
//    v = 2: rank r holds stage r (chunk 0) and stage 2p-1-r (chunk 1), so rank p-1 holds the two
//    middle stages and rank 0 the first and the last.
//  * A schedule is, for each rank, the list of actions it runs, in order. Compute actions: F (a
//    stage's forward for one micro-batch), B (its whole backward), or the backward split in two
//    as the zero-bubble schedules do: I (the input gradient, which the previous stage waits for)
//    and W (the weight gradient, which nobody waits for and may be deferred). Each
//    (micro-batch, stage) has exactly one F and either one B or one I and one W.
//  * Communication actions are explicit, so the runtime can post them as they come: SEND_F
//    sends a stage's output activation to the next stage, RECV_F receives a stage's input from
//    the previous one, SEND_B sends the gradient of a stage's input to the previous stage,
//    RECV_B receives the gradient of a stage's output from the next. An action's chunk is the
//    local chunk it belongs to (the sender's chunk on a SEND, the receiver's on a RECV); the
//    peer follows from the placement (peerRank). Between two stages on the same rank (V's
//    middle) the data stays local and the schedule holds no SEND/RECV for it.
//
// What validate() guarantees (it throws dt::InvalidArgument naming the rank, the action index,
// what that action waits for, followed by the schedule's action grid with the action marked):
//  * Shape: p, m, v >= 1, one list per rank, V placement only with v = 2, every micro-batch in
//    [0, m) and chunk in [0, v).
//  * Completeness: every (micro-batch, stage) has one F and one B or one I + one W, never both
//    B and I; every cross-rank edge has exactly one SEND and one RECV per micro-batch and
//    direction; no SEND/RECV for a same-rank edge or past the first/last stage.
//  * Dependencies in each rank's order: F of stage s after the RECV_F (or, on the same rank, the
//    F of stage s-1); B or I of stage s after F of stage s and after the RECV_B (or the local
//    B/I of stage s+1); W after I; a SEND after the compute that produced its data.
//  * No deadlock under strict rendezvous: the lists are run with blocking, unbuffered
//    sends (a SEND completes only together with its RECV, both at the head of their ranks'
//    lists). An order that passes cannot deadlock with any transport, buffered or not, that
//    matches the messages between two ranks in the order they are posted (NCCL's send/recv
//    does; a tag per message makes any transport do it).
//
// Cost model and bubble (simulate): F costs costs.f, B costs.b, I costs.i, W costs.w;
// sends and receives cost nothing. A rank runs its list in order; a compute starts when the
// rank is free and the data it needs is local or received; a SEND is posted (like an isend)
// and the rank moves on; a RECV waits until its SEND was posted. With unit costs (F = I = W = 1,
// B = 2 = I + W) for every stage, busy_r is rank r's compute time, makespan the time the last
// rank ends (all start at 0), idle_r = makespan - busy_r, and
//     bubble = sum_r idle_r / sum_r busy_r,
// i.e. idle time over ideal compute time (equal per rank in every built-in schedule, so the
// fraction is also each rank's). The built-in schedules give exactly:
//     GPipe and 1F1B (p-1)/m;  interleaved 1F1B (p-1)/(v m);  ZB-H1 (p-1)/(3m);  ZBV (p-1)/(6m)
// (p=4, m=8: 0.375, 0.1875 with v=2, 0.125, 0.0625). The unit costs are per chunk: with v
// chunks a chunk is 1/v of a whole stage, the ideal compute per rank is 3mv units, and the
// fractions compare schedules at the same total work.
//
// Memory (simulate): peakInFlight[r] counts the (micro-batch, chunk) forwards rank r has run
// whose B or I has not run yet: their activations are alive. We count them freed at I, not W:
// W still holds the stage's inputs and output gradients (a part of the activations, the
// zero-bubble paper's accounting), which peakPendingWeightGrads[r] counts separately (I done,
// W not yet). 1F1B: min(p, m) on rank 0 (p - r on rank r); GPipe: m on every rank; ZB-H1 the
// same as 1F1B, with r + 1 pending W at most on rank r. For v > 1 the count is of chunk-forwards,
// each 1/v of a stage's activations (interleaved: 2(p-1-r) + (v-1)p + 1; ZBV: 2p).
//
// Text format (format/parse round-trip), whitespace-separated tokens, '#' to the end of a line
// is a comment, blank lines are ignored:
//     schedule 1F1B p=2 m=4 v=1 placement=interleaved
//     rank 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 ...
//     rank 1: RECV_F0 F0 B0 SEND_B0 ...
// The header comes first; then one line per rank, each rank once. An action is its kind
// (F B I W SEND_F RECV_F SEND_B RECV_B), the micro-batch, and "c<chunk>" when the chunk is not
// 0 (F3c1); format writes the chunk whenever v > 1. parse throws InvalidArgument naming the
// line, the token and what was expected; it does not validate (call validate).
//
// Contract: everything here is a pure function of its arguments (no global state): any thread,
// concurrently, never blocks. A Schedule is a plain value the caller owns.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dt::pipeline {

enum class ActionKind : std::uint8_t { F, B, I, W, SendF, RecvF, SendB, RecvB };

// "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B": the text format's spelling.
const char* toString(ActionKind kind);
bool isCompute(ActionKind kind);

struct Action {
  ActionKind kind = ActionKind::F;
  int microBatch = 0;
  int chunk = 0;  // the rank's local chunk (virtual stage) in [0, v)
  bool operator==(const Action&) const = default;
};

// "F3", or "F3c1" when showChunk (the grid and the text format show it when v > 1).
std::string toString(const Action& action, bool showChunk);

enum class Placement : std::uint8_t { Interleaved, V };
const char* toString(Placement placement);  // "interleaved", "v"

struct Schedule {
  std::string name;  // one token, no whitespace ("1F1B", "ZB-H1", a user's own)
  int p = 1;         // pipeline ranks
  int m = 1;         // micro-batches per step
  int v = 1;         // chunks (virtual stages) per rank
  Placement placement = Placement::Interleaved;
  std::vector<std::vector<Action>> ranks;  // ranks[r] = rank r's actions, in order

  int numStages() const { return p * v; }
  // The global stage of rank's chunk, and back. Throw InvalidArgument when out of range.
  int stageOf(int rank, int chunk) const;
  int rankOfStage(int stage) const;
  int chunkOfStage(int stage) const;
  bool operator==(const Schedule&) const = default;
};

// The rank a SEND or RECV on `rank` talks to (the runtime's send/recv peer within the pp
// group). InvalidArgument for a compute action, an edge that leaves the pipeline, or one
// between two stages on the same rank.
int peerRank(const Schedule& schedule, int rank, const Action& action);

// ---- Generators. Each refuses bad input at once: InvalidArgument naming the value. ----

// All forwards, then all backwards (micro-batches in order). Any m >= 1.
Schedule gpipe(int p, int m);
// Rank r runs min(p-1-r, m) warm-up forwards, then one forward / one backward in turn, then
// the remaining backwards. Any m >= 1 (m < p degenerates to GPipe's timing, same formula).
Schedule oneFOneB(int p, int m);
// Megatron's interleaved 1F1B over v chunks per rank (Placement::Interleaved): micro-batches
// in groups of p run chunk after chunk. Needs m a multiple of p (so m >= p) and v >= 1.
Schedule interleavedOneFOneB(int p, int m, int v);
// Zero-bubble ZB-H1 (Qi et al., 2024): 1F1B's order with B split into I and W, rank r running
// each W min(r, k - 1) I's after its own (k = maxPendingWeightGrads, 0: p) and the rest at the
// end. Needs m >= p. A pending W keeps about what its forward kept (the input and the output
// gradient of every weight's product); rank r holds at most p - r forwards and k pending W, and
// never more than p of both together (1F1B's rank 0). With unit costs the bubble is
// (2p - 1 - k) / (3m): (p - 1) / (3m) at k = p, 2(p - 1) / (3m) at k = 1.
Schedule zeroBubbleH1(int p, int m, int maxPendingWeightGrads = 0);
// ZBV-shaped zero bubble over the V placement (v = 2; each chunk half a stage): a list
// scheduler with at most 2p chunk-forwards in flight per rank (p whole stages' worth,
// 1F1B's rank 0). Not the paper's hand-drawn ZB-V order; it reaches (p-1)/(6m) with unit costs.
// Needs m a multiple of p.
Schedule zeroBubbleV(int p, int m);

// ---- Checking and simulating. ----

void validate(const Schedule& schedule);

struct Costs {
  double f = 1, b = 2, i = 1, w = 1;
};

struct TimedAction {
  int index = 0;  // into schedule.ranks[rank]
  double start = 0, end = 0;
};

struct SimulationResult {
  double makespan = 0;
  std::vector<double> busy, idle;   // per rank
  double bubble = 0;                // sum(idle) / sum(busy)
  std::vector<int> peakInFlight;    // per rank: F done, B/I not yet
  std::vector<int> peakPendingWeightGrads;  // per rank: I done, W not yet
  std::vector<std::vector<TimedAction>> timeline;  // per rank, compute actions in order
};

// Validates, then runs the cost model above.
SimulationResult simulate(const Schedule& schedule, const Costs& costs = {});

// The unit-cost timeline: a header line, then one row per rank, one column per time step;
// a cell is the compute running then (F3, B3, I3, W3, with c<chunk> when v > 1; a B's second
// step shows "--"), "." when idle. Validates first.
std::string grid(const Schedule& schedule);

// The action lists in columns (column k = each rank's action #k, a header row numbers them),
// each (rank, index) in `marks` shown as *TOKEN; validate's errors carry it, since a schedule
// that fails may not run far enough for a timed grid.
struct ActionRef {
  int rank = 0;
  int index = 0;
};
std::string actionGrid(const Schedule& schedule, const std::vector<ActionRef>& marks = {});

std::string format(const Schedule& schedule);
Schedule parse(const std::string& text);
// parse() of a file's contents; errors name the file instead of "text" (InvalidArgument also
// when it cannot be read).
Schedule parseFile(const std::string& path);

}  // namespace dt::pipeline
