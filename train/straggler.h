// Straggler detection: where each rank's step time goes, and the rule that names a rank that
// stays slower than the others (docs/debugging.md "Stragglers").
//
// The loop (train/loop.h) measures, per rank and step, the wait for its batch, the step
// function's forward, backward, the rest of its own work (optimizer, clipping) and the wait on
// collectives; every StragglerOptions::every steps the ranks' window means ride on the loop's
// control all-reduce, so every rank holds everyone's (StepFigures, in rank order), and every
// rank feeds them to the same StragglerDetector, which decides the same thing everywhere.
//
// The rule: a rank's own time is its step less its communication wait (what it spends on its
// own: data wait + busy). A rank is slow at a gather when its own time exceeds threshold x the
// median of the ranks of its role (all ranks, or the ranks holding the same pipeline stage) and
// exceeds that median by at least kMinExcessMs. A rank that is slow at consecutive gathers
// covering `window` steps is a straggler; it is reported once, and again only after a gather
// at which it was not slow (an episode each). Its section is the one of data wait, forward,
// backward and other (its own time less those) with the largest excess over that section's
// median, in ms: a ratio alone would blame a section whose median is next to nothing.
//
// Contract: pure computation over plain figures (no clocks, no collectives); a detector is one
// object per rank, used from one thread. Deterministic: the same figures give the same verdict.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dt::train {

// One rank's mean times per step over a gather's window, in milliseconds.
struct StepFigures {
  double dataMs = 0;      // waiting for its batch (the prefetching loader's next())
  double forwardMs = 0;   // the step function (a pipeline: the runner's compute, F and B alike)
  double backwardMs = 0;  // the backward calls, less DDP's end-of-backward wait for its buckets
  double commMs = 0;      // blocked on collectives: the control all-reduce or commit vote, DDP's
                          // end-of-backward bucket wait (a pipeline: its idle time and dp average)
  double wallMs = 0;      // the whole step
  // wall - comm - data: the time the rank computes.
  double busyMs() const { return wallMs - commMs - dataMs; }
  // wall - comm: what the rule compares (a rank slow to get its data delays the others too).
  double ownMs() const { return wallMs - commMs; }
};

// The knobs (LoopOptions::stragglers; DT_STRAGGLER_EVERY, _THRESHOLD and _WINDOW override).
struct StragglerOptions {
  int64_t every = 10;       // steps between two gathers; 0: detection off
  double threshold = 1.5;   // own time over the median's to count as slow
  int64_t window = 40;      // steps a rank must stay slow to be a straggler
  // The environment's values where set; InvalidArgument naming a malformed or out-of-range one
  // (every >= 0, threshold > 1, window >= 1).
  static StragglerOptions fromEnvironment(StragglerOptions given);
};

// An excess under this (ms per step, own time over the median) is never slow: sub-millisecond
// steps are all scheduling noise.
constexpr double kMinExcessMs = 1.0;

struct StragglerVerdict {
  int rank = -1;
  int64_t slowSteps = 0;      // steps it has stayed slow (>= window)
  double ownMs = 0;           // its own time per step, the last gather's
  double medianOwnMs = 0;     // the median of its role's
  double ratio = 0;           // own / median
  std::string section;        // "data wait", "forward", "backward" or "other"
  double sectionMs = 0;       // its time in the section, and that section's median
  double sectionMedianMs = 0;
  // "data-bound" for data wait, else "compute-bound".
  std::string bound() const;
};

class StragglerDetector {
 public:
  StragglerDetector(double threshold, int64_t window);
  // One gather: `figures[r]` is rank r's over the last `steps` steps, `roles[r]` its role (ranks
  // are compared within a role; empty: one role). Returns the stragglers whose episode begins
  // at this gather (each rank at most once per episode), by rank.
  std::vector<StragglerVerdict> add(const std::vector<StepFigures>& figures, const std::vector<int>& roles,
                                    int64_t steps);
  // The ranks changed (an elastic loss or admission): every count starts again.
  void reset();

 private:
  double threshold_;
  int64_t window_;
  std::vector<int64_t> slowSteps_;   // per rank: steps slow in a row
  std::vector<bool> reported_;       // per rank: this episode was reported
};

// "PROGRAM: rank R (host H) is a straggler at step S: its own time 212 ms a step is 1.8x the
// median (118 ms) for 40 steps; forward 190 ms against 20 ms (9.5x): compute-bound" (host
// omitted when empty).
std::string describeStraggler(const std::string& program, const StragglerVerdict& verdict, const std::string& host,
                              int64_t step);

}  // namespace dt::train
