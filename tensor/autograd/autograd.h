// Reverse-mode autograd: graph nodes, the engine, hooks and grad mode.
//
// Contract:
//  * Ops on tensors that require grad (while grad mode is on) record a Node
//    whose edges point at the nodes of their inputs. Leaves get an
//    AccumulateGrad node, held weakly by the leaf and strongly by the graph.
//  * backward(roots, grads) runs on the calling thread. A node runs once all
//    nodes that feed it have delivered their gradients (dependency counts);
//    among ready nodes the one created last runs first, so gradients arrive in
//    reverse order of the forward pass, except that a ready AccumulateGrad
//    runs before any other node (a leaf's .grad and its hooks are done as soon
//    as its gradient is known, which lets DDP start reducing it). Without retainGraph the saved tensors
//    are freed as each node runs; a second backward then throws.
//  * Hooks: tensor hooks (Tensor::registerHook) may replace a gradient;
//    post-accumulate-grad hooks run right after a leaf's .grad is updated;
//    Tensor::removeHook removes either kind by handle.
//  * queueCallback(fn) (only during backward) runs fn after the pass, on the
//    thread running it, in queue order; callbacks may queue more. Every
//    queued callback runs even if an earlier one throws; the first exception
//    then propagates out of backward() and the engine is left clean (not in
//    backward). In a re-entrant backward (backward called from inside a
//    node, as activation checkpointing does) CallbackPass::Outermost queues
//    on the outermost pass, so fn runs only when the whole backward is over.
//  * A leaf's AccumulateGrad node is created on first use and held weakly by
//    the leaf; autograd::gradAccumulator(leaf) returns it, and whoever keeps
//    that pointer keeps the same node for every later graph (what DDP needs
//    to recognise a parameter in the graph).
//  * Gradient buffers: autograd::setGradBuffer(leaf, view) names storage the
//    leaf's gradient lives in. When .grad is undefined, accumulation copies
//    the incoming gradient into that view and points .grad at it instead of
//    allocating, so zeroGrads(setToNone) followed by backward reuses it
//    (gradient-as-bucket-view costs no allocation and no copy-back).
//  * Grad mode is per thread (NoGradGuard). Graphs must not be shared between
//    threads running backward concurrently.
//  * In-place changes to a tensor saved for backward are caught by the
//    version counter when backward unpacks it (InvalidArgument with the op and
//    tensor named, PyTorch's wording).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace dt {

struct AnomalyRecord;  // tensor/autograd/anomaly.h

struct Edge {
  std::shared_ptr<Node> node;
  uint32_t inputNr = 0;
  bool valid() const { return node != nullptr; }
};

using TensorList = std::vector<Tensor>;

// A tensor saved for backward, with the version it had when saved.
class SavedTensor {
 public:
  SavedTensor() = default;
  // isOutput: the tensor is an output of the saving node (stored detached to
  // avoid a reference cycle; the graph is not differentiated twice).
  SavedTensor(const Tensor& t, bool isOutput = false);
  // Returns the tensor, or throws if it was modified in place since saving or freed.
  Tensor unpack(const Node& owner) const;
  void reset() {
    data_ = Tensor();
    released_ = true;
  }
  bool defined() const { return data_.defined() || released_; }

 private:
  Tensor data_;
  uint32_t version_ = 0;
  bool released_ = false;
  bool wasDefined_ = false;
  std::string tensorName_;
};

class Node : public std::enable_shared_from_this<Node> {
 public:
  Node();
  // Nodes that must run as soon as they are ready (AccumulateGrad).
  static constexpr uint64_t kRunFirst = UINT64_MAX;
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // Gradients w.r.t. this node's outputs in; gradients w.r.t. its inputs out
  // (one per edge; undefined tensors mean zero).
  virtual TensorList apply(TensorList&& gradOutputs) = 0;
  // Split backward (backwardDeferringWeights): computes only the gradients of
  // the inputs i with which[i] set (the others come back undefined) and keeps
  // the saved tensors, so that the node can be asked again for the rest. A
  // node that returns false from splitsGradients() always runs whole.
  virtual bool splitsGradients() const { return false; }
  virtual TensorList applySome(const TensorList& gradOutputs, const std::vector<bool>& which);
  virtual std::string name() const = 0;
  // Frees saved tensors (called after apply unless the graph is retained).
  virtual void releaseVariables() {}

  uint64_t sequenceNr() const { return sequenceNr_; }
  std::vector<Edge>& nextEdges() { return nextEdges_; }
  const std::vector<Edge>& nextEdges() const { return nextEdges_; }
  uint32_t numOutputs() const { return numOutputs_; }
  void setNumOutputs(uint32_t n) { numOutputs_ = n; }

  // Pre-hooks on one output's gradient (tensor hooks of non-leaf tensors).
  using GradHook = std::function<Tensor(const Tensor&)>;
  int addPreHook(uint32_t outputNr, GradHook hook);
  void removePreHook(int handle);
  Tensor runPreHooks(uint32_t outputNr, Tensor grad);
  bool hasPreHooks() const { return !preHooks_.empty(); }

  bool released() const { return released_; }
  void markReleased() { released_ = true; }

  // Where the op that made this node was created; set only in anomaly mode (anomaly.h).
  const std::shared_ptr<const AnomalyRecord>& anomalyRecord() const { return anomalyRecord_; }
  void setAnomalyRecord(std::shared_ptr<const AnomalyRecord> record) { anomalyRecord_ = std::move(record); }
  // The tensors this node saved for backward, for anomaly mode's report (was a
  // saved tensor already non-finite?); nullopt when the node does not say.
  // Called right after apply(), before releaseVariables().
  virtual std::optional<TensorList> savedTensorsForReport() const { return std::nullopt; }

 protected:
  explicit Node(uint64_t sequenceNr) : sequenceNr_(sequenceNr) {}

 private:
  struct PreHook {
    int handle;
    uint32_t outputNr;
    GradHook fn;
  };
  uint64_t sequenceNr_;
  uint32_t numOutputs_ = 1;
  std::vector<Edge> nextEdges_;
  std::vector<PreHook> preHooks_;
  bool released_ = false;
  std::shared_ptr<const AnomalyRecord> anomalyRecord_;
};

struct AutogradMeta {
  bool requiresGrad = false;
  Tensor grad;
  std::shared_ptr<Node> gradFn;
  uint32_t outputNr = 0;
  std::weak_ptr<Node> gradAccumulator;
  bool retainsGrad = false;
  int retainGradHook = -1;
  std::string name;
  // Leaf hooks: run before accumulation (may replace the gradient).
  struct Hook {
    int handle;
    std::function<Tensor(const Tensor&)> fn;
  };
  std::vector<Hook> hooks;
  struct PostHook {
    int handle;
    std::function<void(Tensor&)> fn;
  };
  std::vector<PostHook> postAccumulateHooks;
  // Storage an undefined .grad is re-created in (setGradBuffer); may be undefined.
  Tensor gradBuffer;
};

// Accumulates incoming gradients into a leaf's .grad, then runs its
// post-accumulate-grad hooks.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(Tensor leaf);
  TensorList apply(TensorList&& grads) override;
  std::string name() const override { return "AccumulateGrad"; }
  const Tensor& variable() const { return leaf_; }

 private:
  Tensor leaf_;
};

// ---- grad mode ---------------------------------------------------------------------
bool gradModeEnabled();
void setGradMode(bool enabled);

class NoGradGuard {
 public:
  NoGradGuard() : prev_(gradModeEnabled()) { setGradMode(false); }
  ~NoGradGuard() { setGradMode(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// Clears the gradients of `params` (Module::zeroGrad and Optimizer::zeroGrad):
// setToNone drops them, otherwise they are zeroed in place.
void zeroGrads(std::vector<Tensor>& params, bool setToNone);

class EnableGradGuard {
 public:
  EnableGradGuard() : prev_(gradModeEnabled()) { setGradMode(true); }
  ~EnableGradGuard() { setGradMode(prev_); }
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool prev_;
};

// ---- engine ---------------------------------------------------------------------------
// Runs backward from roots; grads[i] defaults to ones for a scalar root.
void backward(const TensorList& roots, const TensorList& grads = {}, bool retainGraph = false);
// Gradients of outputs w.r.t. inputs, without touching .grad of the inputs.
TensorList grad(const TensorList& outputs, const TensorList& inputs, const TensorList& gradOutputs = {},
                bool retainGraph = false);
// During backward: runs fn once the current backward pass finishes (throws
// InvalidArgument when no backward pass is running on this thread).
// Innermost: the pass that is running now; Outermost: the first backward on
// this thread's stack of re-entrant passes (they differ only inside a
// backward called from a node).
enum class CallbackPass { Innermost, Outermost };
void queueCallback(std::function<void()> fn, CallbackPass pass = CallbackPass::Innermost);
bool inBackward();

// ---- deferred weight gradients (zero-bubble pipeline schedules) -----------------------------
// backwardDeferringWeights runs backward like backward() except for the
// gradients of `weights` (leaves that require grad): a node that feeds a
// weight's accumulator computes the gradients of its other inputs now and
// keeps what the weight's gradient needs (its incoming gradient and saved
// tensors) in the returned WeightGradients. The pass's input gradients (what a
// pipeline stage sends upstream) are therefore ready without the weight
// gradient products, which the schedule runs later to fill its bubble.
//  * run() computes the deferred gradients, node by node in the order the pass
//    met them, and accumulates each weight's .grad once, when its last
//    deferred contribution is in: the weight's hooks and post-accumulate hooks
//    fire then, so DDP or a sharded wrapper sees a parameter ready only when
//    its gradient really is. Callbacks queued during the first pass
//    (queueCallback) run at the end of run(), not of the first pass: the
//    backward is over only when its weight gradients are.
//  * The built-in ops and custom Functions split (a Function's backward is
//    called twice and learns which half from ctx.needsInputGrad). A node that
//    cannot split (activation checkpointing's recompute, a hand-written Node)
//    runs whole in the first pass; a weight it feeds accumulates then, and
//    once more in run() if split nodes feed it too.
//  * run() once, on the thread that ran the pass; a WeightGradients dropped
//    without run() frees what it kept and its gradients are lost. Not
//    thread-safe; movable, not copyable.
class WeightGradients {
 public:
  WeightGradients();
  ~WeightGradients();
  WeightGradients(WeightGradients&&) noexcept;
  WeightGradients& operator=(WeightGradients&&) noexcept;
  WeightGradients(const WeightGradients&) = delete;
  WeightGradients& operator=(const WeightGradients&) = delete;

  void run();
  // Nodes whose weight gradients wait for run(); 0 after run().
  size_t pending() const;

  struct State;

 private:
  friend WeightGradients backwardDeferringWeights(const TensorList&, const TensorList&, const TensorList&);
  std::unique_ptr<State> state_;
};
WeightGradients backwardDeferringWeights(const TensorList& roots, const TensorList& grads,
                                         const TensorList& weights);

// ---- recording helpers for ops ---------------------------------------------------------------
namespace autograd {

// True if grad mode is on and any input requires grad.
bool needsGrad(std::initializer_list<const Tensor*> inputs);
bool needsGrad(const TensorList& inputs);
// The edge for a tensor input (its gradFn/output, or its leaf accumulator).
Edge edgeFor(const Tensor& t);
// Wires node's edges to inputs and makes it the gradFn of outputs.
void recordNode(const std::shared_ptr<Node>& node, const TensorList& inputs, std::initializer_list<Tensor*> outputs);
void recordNode(const std::shared_ptr<Node>& node, const TensorList& inputs, std::vector<Tensor>& outputs);
// Makes output `outputNr` of node the history of `self` (replaces self's gradFn):
// an in-place op's result, or an output of a custom function (function.h).
void rebaseHistory(Tensor& self, const std::shared_ptr<Node>& node, uint32_t outputNr = 0);
// Sums grad over broadcast dims so it has `shape`.
Tensor sumToShape(const Tensor& grad, const Shape& shape);

// The leaf's AccumulateGrad node (created when missing). Hold the pointer to
// keep the node, and so its identity in every later graph, stable.
std::shared_ptr<Node> gradAccumulator(const Tensor& leaf);
// Makes `view` (same shape and dtype as the leaf, any storage) the buffer the
// leaf's gradient is accumulated into when .grad is undefined; an undefined
// view releases it. Does not change .grad itself.
void setGradBuffer(const Tensor& leaf, const Tensor& view);

}  // namespace autograd

}  // namespace dt
