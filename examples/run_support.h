// What the example training programs (trainer, gpt) share: flag values, the stop signals of
// pre-emption, time formatting and parameter fingerprints. Their checkpoints are the library's
// (checkpoint/checkpoint_dir.h).
//
// Contract: parse helpers throw dt::InvalidArgument "<program>: <flag> ..." naming the value and
// what was expected. installStopHandlers makes the first SIGTERM, SIGUSR1 or SIGINT set
// stopSignal() (the training loop polls it at a step boundary and checkpoints); a second such
// signal takes the default action at once. The handler is async-signal-safe. clearCheckpoints
// and parameterSpread are collectives (every rank calls them at the same point). Nothing else
// keeps state.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_dir.h"
#include "process_group/process_group.h"
#include "tensor/tensor.h"

namespace examples {

int64_t parsePositive(const std::string& program, const std::string& value, const std::string& flag,
                      int64_t minimum = 1);
double parseDouble(const std::string& program, const std::string& value, const std::string& flag, double minimum,
                   double maximum);
std::string choice(const std::string& program, const std::string& value, const std::string& flag,
                   const std::vector<std::string>& allowed);

// The signal that asked for a stop (0: none yet).
std::atomic<int>& stopSignal();
void installStopHandlers(const std::string& program);
std::string signalName(int sig);

// "12.3s", "4m05s", "1h02m".
std::string formatSeconds(double seconds);
// A double with all 17 significant digits (checkpoint manifests compare them as text).
std::string exactText(double value);
// FNV-1a (64 bit) over the bytes of every tensor, in order: equal fingerprints on every rank
// (and between two runs) mean bitwise equal parameters, in practice.
uint64_t fingerprint(const std::vector<dt::Tensor>& tensors);

// Walks argv[1..]: "--flag value" and "--flag=value" call onFlag(flag, value); a flag named in
// `switches` takes no value (onFlag(flag, "")). Returns false, calling nothing more, at
// --help/-h. A bare word or a missing value throws InvalidArgument; onFlag throws for an
// unknown flag.
bool forEachFlag(const std::string& program, int argc, char** argv, const std::vector<std::string>& switches,
                 const std::function<void(const std::string& flag, const std::string& value)>& onFlag);

// --resume never on a first attempt: the folder's checkpoints are deleted before any rank looks
// (CheckpointDir::clear), so a later restart resumes from this run's own checkpoints only; rank 0
// says how many on stdout unless quiet.
void clearCheckpoints(dt::ProcessGroup& group, const dt::CheckpointDir& dir, const std::string& program, bool quiet);

// The largest difference of any parameter between ranks (max - min over the group; a
// collective): 0 when every rank holds the same model.
double parameterSpread(dt::ProcessGroup& group, const std::vector<dt::Tensor>& params);

// main()'s body: line-buffered stdout (whole lines reach dtrun and SLURM's files), and an
// exception printed as "<program> (rank R/W): <what>" with exit code 1.
int runMain(const std::string& program, const std::function<int()>& body);

}  // namespace examples
