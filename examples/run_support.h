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
#include "train/support.h"

namespace examples {

int64_t parsePositive(const std::string& program, const std::string& value, const std::string& flag,
                      int64_t minimum = 1);
double parseDouble(const std::string& program, const std::string& value, const std::string& flag, double minimum,
                   double maximum);
std::string choice(const std::string& program, const std::string& value, const std::string& flag,
                   const std::vector<std::string>& allowed);

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

// main()'s body: line-buffered stdout (whole lines reach dtrun and SLURM's files), and an
// exception printed as "<program> (rank R/W): <what>" with exit code 1.
int runMain(const std::string& program, const std::function<int()>& body);

}  // namespace examples
