// Anomaly mode: finds the first op that turns a value into NaN or Inf, in
// backward and (on request) in forward.
//
//   dt::AnomalyMode anomaly;              // or DT_DETECT_ANOMALY=1 for the whole process
//   dt::Tensor loss = (*model)(x);        // call modules as module(x) so ops know their module
//   loss.backward();                      // throws dt::AnomalyError at the first culprit
//
// Contract:
//  * Records. While anomaly mode is on, every op that records an autograd node
//    stores on that node where it was created (AnomalyRecord): the forward op
//    ("log"), its inputs' dtypes and shapes, and the module path
//    (nn::currentModulePath(): "net.block.inner", the modules whose call
//    operator was running). While it is off nothing is allocated or stored.
//  * Backward check. While anomaly mode is on during backward, each node's
//    returned gradients are checked as soon as it returns; the first node that
//    returns a NaN or Inf throws AnomalyError naming the backward function, the
//    gradient's index (the index of the forward op's input it belongs to), the
//    forward record, and the cause: an incoming gradient that already held a
//    non-finite value, else a saved tensor that did (the forward pass made it),
//    else neither (the function's own formula produced it). A node made while
//    anomaly mode was off is still checked; the message then says it has no
//    record. The engine is left clean: later backward passes run normally,
//    though gradients the failed pass already accumulated into .grad stay.
//  * Forward check (AnomalyOptions::checkForward, off by default): every op that
//    can record a node checks its outputs; the first op whose output holds a
//    NaN or Inf while all its inputs are finite throws AnomalyError naming the
//    op, its inputs' shapes and the module path. An op whose inputs were
//    already non-finite is not blamed. Ops run by backward functions and
//    backward hooks are left to the backward check.
//  * Scope. Per thread, like grad mode. AnomalyMode guards nest; each restores
//    the state before it when destroyed and must be destroyed on the thread
//    that made it. A thread without a guard follows DT_DETECT_ANOMALY, read
//    once per process at the first op that asks: 1/true/on turns anomaly mode
//    on, "forward" also turns on the forward check, 0/false/off or unset leaves
//    it off; any other value throws InvalidArgument at that op (and the next).
//  * Cost. While no thread has anomaly mode on, an op pays one relaxed atomic
//    load and a predictable branch. While it is on, every check scans the
//    tensors involved (a CUDA tensor is copied to the CPU first), so expect a
//    step to run several times slower: it is a debugging mode.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/errors.h"  // AnomalyError
#include "tensor/autograd/autograd.h"

namespace dt {

struct AnomalyOptions {
  // false: a region with anomaly mode off inside one (or a process) that has it on.
  bool enabled = true;
  // Also check every op's forward outputs (see the contract above).
  bool checkForward = false;
};

// RAII: anomaly mode as given by `options` on this thread until destroyed.
class AnomalyMode {
 public:
  explicit AnomalyMode(AnomalyOptions options = {});
  ~AnomalyMode();
  AnomalyMode(const AnomalyMode&) = delete;
  AnomalyMode& operator=(const AnomalyMode&) = delete;

  // What is in force on this thread: the innermost guard, else DT_DETECT_ANOMALY.
  static AnomalyOptions current();
  static bool isEnabled() { return current().enabled; }

 private:
  bool previousSet_;
  AnomalyOptions previous_;
  bool counted_;
};

// Where the op that made an autograd node was created.
struct AnomalyRecord {
  std::string op;           // the forward op, e.g. "log"
  std::string inputs;       // its inputs, e.g. "float32[2, 3], float32[3]"
  std::string modulePath;   // e.g. "net.block.inner"; "" outside any module
  std::string moduleTypes;  // e.g. "Model > Net > Block > Inner"; "" outside any module
  // "log(float32[4]) in module net.block.inner (Model > Net > Block > Inner)"
  std::string describe() const;
};

// ---- hooks for tensor ops and the autograd engine (not for users) -----------------------------
namespace detail {

// Non-zero while some thread may have anomaly mode on: live guards, the
// environment asking for it, or the environment not read yet.
extern std::atomic<int> gAnomalyMayBeActive;
inline bool anomalyMayBeActive() noexcept {
  return gAnomalyMayBeActive.load(std::memory_order_relaxed) != 0;
}

// The forward check of an op named by its backward node ("LogBackward");
// throws AnomalyError when the op made a non-finite value from finite inputs.
void anomalyCheckForward(std::string_view backwardName, const TensorList& inputs,
                         const std::vector<Tensor*>& outputs);
// The record for a node about to be made from `inputs`; null unless anomaly
// mode is on on this thread.
std::shared_ptr<const AnomalyRecord> anomalyRecordFor(std::string_view backwardName, const TensorList& inputs);

// The gradients a node is about to receive, kept (as handles) only in anomaly
// mode so that the check after apply() can say whether one was already bad.
class IncomingGradients {
 public:
  explicit IncomingGradients(const TensorList& grads) {
    if (anomalyMayBeActive()) [[unlikely]] grads_ = grads;
  }
  const TensorList& grads() const { return grads_; }

 private:
  TensorList grads_;
};

void anomalyCheckBackwardSlow(const Node& node, const IncomingGradients& incoming, const TensorList& gradInputs);
// After node.apply() returned gradInputs: throws AnomalyError for the first non-finite one.
inline void anomalyCheckBackward(const Node& node, const IncomingGradients& incoming, const TensorList& gradInputs) {
  if (anomalyMayBeActive()) [[unlikely]] anomalyCheckBackwardSlow(node, incoming, gradInputs);
}

}  // namespace detail
}  // namespace dt
