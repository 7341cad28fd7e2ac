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
#include <optional>
#include <string>
#include <vector>

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

}  // namespace examples
