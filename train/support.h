// What a training program needs around its loop, and the loop itself uses: the stop signals
// of pre-emption, time formatting, checks that every rank holds the same parameters, and the
// metrics file.
//
// Contract: installStopHandlers makes the first SIGTERM, SIGUSR1 or SIGINT set stopSignal()
// (a loop polls it at a step boundary and checkpoints); a second such signal takes the
// default action at once. The handler is async-signal-safe; installing it again is harmless.
// clearCheckpoints and parameterSpread are collectives (every rank calls them at the same
// point). Nothing else keeps state; everything is thread-safe but the collectives.
#pragma once

#include <atomic>
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint_dir.h"
#include "process_group/process_group.h"
#include "tensor/tensor.h"

namespace dt::train {

// The signal that asked for a stop (0: none yet).
std::atomic<int>& stopSignal();
// Throws dt::Error naming `program` when sigaction fails.
void installStopHandlers(const std::string& program);
std::string signalName(int sig);

// "12.3s", "4m05s", "1h02m".
std::string formatSeconds(double seconds);
// FNV-1a (64 bit) over the bytes of every tensor, in order: equal fingerprints on every rank
// (and between two runs) mean bitwise equal parameters, in practice.
uint64_t fingerprint(const std::vector<Tensor>& tensors);
// The largest difference of any parameter between ranks (max - min over the group; a
// collective): 0 when every rank holds the same model.
double parameterSpread(ProcessGroup& group, const std::vector<Tensor>& params);
// Removes every checkpoint of the folder before any rank looks (CheckpointDir::clear), so
// that a later restart resumes from this run's own checkpoints only; rank 0 says how many on
// stdout unless quiet. A collective.
void clearCheckpoints(ProcessGroup& group, const CheckpointDir& dir, const std::string& program, bool quiet);

// A metrics file: one JSON object per logged step ({"step": S, "<name>": value, ...}; a value
// that is not finite is null), the format scripts/plot_metrics.py reads. A run that resumed at
// step `keepThrough` keeps the lines up to it and drops the rest (they were logged by a run
// whose later steps are redone). InvalidArgument names the file when it cannot be written.
// One writer per file (rank 0's); not thread-safe.
class MetricsFile {
 public:
  MetricsFile(const std::string& path, int64_t keepThrough, const std::string& program);
  // `texts` follow the numbers as JSON strings (an event's line: "straggler").
  void write(int64_t step, const std::vector<std::pair<std::string, double>>& values,
             const std::vector<std::pair<std::string, std::string>>& texts = {});

 private:
  std::ofstream out_;
};

}  // namespace dt::train
