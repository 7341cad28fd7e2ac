// What the example training programs (trainer, gpt) share: flag values, the stop signals of
// pre-emption, time formatting, parameter fingerprints, and the per-rank RNG states that a
// checkpoint carries.
//
// Contract: parse helpers throw dt::InvalidArgument "<program>: <flag> ..." naming the value and
// what was expected. installStopHandlers makes the first SIGTERM, SIGUSR1 or SIGINT set
// stopSignal() (the training loop polls it at a step boundary and checkpoints); a second such
// signal takes the default action at once. The handler is async-signal-safe. gatherRngStates is
// a collective (every rank calls it at the same point). Nothing else keeps state.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "examples/checkpoint.h"
#include "process_group/process_group.h"
#include "tensor/generator.h"
#include "tensor/nn/safetensors.h"
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

// Every rank's generator state, gathered on every rank: int64 [4] per rank, in rank order.
std::vector<dt::Tensor> gatherRngStates(dt::ProcessGroup& group, const dt::Generator& generator);
// Restores `generator` from the checkpoint tensor "rng.rank<rank>" (int64 [4]); throws
// InvalidArgument naming `file` when it is missing or malformed.
void restoreRngState(dt::Generator& generator, const std::optional<dt::Tensor>& saved, int rank,
                     const std::string& program, const std::string& file);

// Walks argv[1..]: "--flag value" and "--flag=value" call onFlag(flag, value); a flag named in
// `switches` takes no value (onFlag(flag, "")). Returns false, calling nothing more, at
// --help/-h. A bare word or a missing value throws InvalidArgument; onFlag throws for an
// unknown flag.
bool forEachFlag(const std::string& program, int argc, char** argv, const std::vector<std::string>& switches,
                 const std::function<void(const std::string& flag, const std::string& value)>& onFlag);

// --resume never on a first attempt: rank 0 deletes the folder's checkpoints (saying how many
// on stdout unless quiet) before any rank looks, so a later restart resumes from this run's
// own checkpoints only; every rank waits at a barrier (a collective).
void clearCheckpoints(dt::ProcessGroup& group, const trainer::CheckpointDir& dir, const std::string& program, bool quiet);
// The step of the newest checkpoint in `dir` as rank 0 sees it, broadcast so that every rank
// resumes from the same one (a collective); -1 when there is none.
int64_t chooseCheckpoint(dt::ProcessGroup& group, const trainer::CheckpointDir& dir);
// Throws InvalidArgument naming the first setting whose "config.<key>" in the manifest differs.
void requireSameSettings(const trainer::Manifest& manifest, const std::vector<std::pair<std::string, std::string>>& keys,
                         const std::string& program, const std::string& file);
// A checkpoint's tensors by prefix: "model.*", "optim.*" (prefixes stripped) and "rng.rank<rank>".
struct CheckpointParts {
  dt::NamedTensors model;
  dt::NamedTensors optimizer;
  std::optional<dt::Tensor> rng;
};
CheckpointParts splitCheckpoint(const dt::NamedTensors& tensors, int rank);

// The largest difference of any parameter between ranks (max - min over the group; a
// collective): 0 when every rank holds the same model.
double parameterSpread(dt::ProcessGroup& group, const std::vector<dt::Tensor>& params);

// main()'s body: line-buffered stdout (whole lines reach dtrun and SLURM's files), and an
// exception printed as "<program> (rank R/W): <what>" with exit code 1.
int runMain(const std::string& program, const std::function<int()>& body);

}  // namespace examples
