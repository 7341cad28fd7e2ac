// What the example training programs (trainer, gpt) share: flag values and main()'s error
// handling. Stop signals, fingerprints and the like are the training library's
// (train/support.h), re-exported here; checkpoints are checkpoint/checkpoint_dir.h's.
//
// Contract: parse helpers throw dt::InvalidArgument "<program>: <flag> ..." naming the value and
// what was expected. Nothing keeps state.
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
#include "train/loop.h"
#include "train/support.h"

namespace examples {

int64_t parsePositive(const std::string& program, const std::string& value, const std::string& flag,
                      int64_t minimum = 1);
double parseDouble(const std::string& program, const std::string& value, const std::string& flag, double minimum,
                   double maximum);
std::string choice(const std::string& program, const std::string& value, const std::string& flag,
                   const std::vector<std::string>& allowed);

// --device cpu|cuda|cuda:N: `value` must parse (InvalidArgument "<program>: <flag> ..." otherwise).
std::string deviceName(const std::string& program, const std::string& value, const std::string& flag);
// The device `text` names: cuda is the GPU of this rank's local rank (as torchrun users write
// cuda:LOCAL_RANK), cuda:N one explicitly; NotSupportedError says why one is not usable here.
dt::Device deviceFor(const std::string& program, const std::string& text);

// Stop signals, time formatting, fingerprints, clearCheckpoints and parameterSpread are the
// training library's (train/support.h).
using dt::train::clearCheckpoints;
using dt::train::fingerprint;
using dt::train::formatSeconds;
using dt::train::installStopHandlers;
using dt::train::parameterSpread;
using dt::train::signalName;
using dt::train::stopSignal;

// A double with all 17 significant digits (checkpoint manifests compare them as text).
std::string exactText(double value);

// Walks argv[1..]: "--flag value" and "--flag=value" call onFlag(flag, value); a flag named in
// `switches` takes no value (onFlag(flag, "")). Returns false, calling nothing more, at
// --help/-h. A bare word or a missing value throws InvalidArgument; onFlag throws for an
// unknown flag.
bool forEachFlag(const std::string& program, int argc, char** argv, const std::vector<std::string>& switches,
                 const std::function<void(const std::string& flag, const std::string& value)>& onFlag);

// The switches only tests and benchmarks use, shared by the example programs and carried out by
// the training loop's hooks (train/loop.h): kUsage lists them for --help.
struct TestFlags {
  static constexpr const char* kUsage = R"(  --fail-at M:STEP:WHERE[,...]  to test recovery: member M SIGKILLs itself during step STEP, WHERE =
                          forward, backward, commit (after its commit vote) or checkpoint (while writing
                          one); a replacement that joined after STEP does it during its first step
  --record-samples PREFIX each rank appends "EPOCH STEP DATA_EPOCH ids..." to PREFIX.<member> for each attempt at
                          a step, before its commit vote (a redone step appears again with a later EPOCH)
  --step-log FILE         rank 0 (of the current membership) appends "STEP EPOCH WORLD NS" to FILE for each step
                          it commits (STEP from 0; EPOCH: the membership epoch, or the restart count without
                          --elastic; NS: CLOCK_REALTIME in ns), written at once; --fail-at's member appends
                          "kill STEP MEMBER NS" just before it kills itself (for bench/run_recovery_bench.sh); a
                          replacement appends "join MEMBER START_NS STEP BYTES TRANSFER_NS BROADCAST_NS NS" once
                          it has the state (START_NS: its start; BROADCAST_NS: with --measure-transfer)
  --measure-transfer      every rank waits for the others before a state transfer (so TRANSFER_NS is the
                          transfer alone), then broadcasts as many bytes in one plain broadcast, timed, to
                          compare the transfer with the group's bandwidth
  --step-pause MS         sleep MS ms at the start of every step, so that a test's kills and joins happen
                          mid-run (the trajectory is the same)
  --dump-at S1,S2,...     after these steps rank 0 writes the parameters to --dump-dir DIR
  --dump-dir DIR          (default <program>-dumps)
)";

  std::vector<std::string> failAt;
  std::string recordSamples, stepLog, dumpDir;
  bool measureTransfer = false;
  int64_t stepPauseMs = 0;
  std::vector<int64_t> dumpAt;

  // Takes `flag` if it is one of these (false otherwise); InvalidArgument names a bad value.
  bool parse(const std::string& program, const std::string& flag, const std::string& value);
  // Carries them out through `options` (test switches, hooks): the step log (its epoch outside
  // --elastic: DT_RESTART_COUNT) and rank 0's dumps of `model`'s parameters. Opens the step log.
  // `model` gives the model once it exists.
  void apply(dt::train::LoopOptions& options, std::function<std::shared_ptr<dt::nn::Module>()> model,
             const std::string& program) const;
};

// main()'s body: line-buffered stdout (whole lines reach dtrun and SLURM's files), and an
// exception printed as "<program> (rank R/W): <what>" with exit code 1.
int runMain(const std::string& program, const std::function<int()>& body);

}  // namespace examples
