#include "tensor/autograd/autograd.h"

#include <algorithm>
#include <atomic>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "common/check.h"
#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/anomaly.h"
#include "tensor/internal/detail.h"
#include "tensor/internal/op_scope.h"
#include "tensor/ops.h"

namespace dt {

void AutogradMetaDeleter::operator()(AutogradMeta* meta) const { delete meta; }

// ---- grad mode ----------------------------------------------------------------------------------

namespace {
thread_local bool tGradMode = true;
std::atomic<uint64_t> gNextSequenceNr{0};
std::atomic<int> gNextHookHandle{1};

struct GraphTask {
  std::vector<std::function<void()>> callbacks;
  GraphTask* parent = nullptr;  // the pass this one runs inside (re-entrant backward)
};
thread_local GraphTask* tCurrentTask = nullptr;
}  // namespace

bool gradModeEnabled() { return tGradMode; }
void setGradMode(bool enabled) { tGradMode = enabled; }

void zeroGrads(std::vector<Tensor>& params, bool setToNone) {
  for (Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    if (setToNone) {
      p.setGrad(Tensor());
    } else {
      NoGradGuard noGrad;
      g.zero_();
    }
  }
}

// ---- Node -------------------------------------------------------------------------------------------

Node::Node() : sequenceNr_(gNextSequenceNr.fetch_add(1, std::memory_order_relaxed)) {}

int Node::addPreHook(uint32_t outputNr, GradHook hook) {
  const int handle = gNextHookHandle.fetch_add(1);
  preHooks_.push_back(PreHook{handle, outputNr, std::move(hook)});
  return handle;
}

void Node::removePreHook(int handle) {
  std::erase_if(preHooks_, [&](const PreHook& h) { return h.handle == handle; });
}

Tensor Node::runPreHooks(uint32_t outputNr, Tensor grad) {
  for (auto& h : preHooks_) {
    if (h.outputNr != outputNr) continue;
    Tensor replaced = h.fn(grad);
    if (replaced.defined()) grad = std::move(replaced);
  }
  return grad;
}

TensorList Node::applySome(const TensorList& gradOutputs, const std::vector<bool>& which) {
  (void)gradOutputs;
  (void)which;
  throw InvalidArgument(str(name(), " cannot split its backward (splitsGradients() is false)"));
}

// ---- SavedTensor ----------------------------------------------------------------------------------

SavedTensor::SavedTensor(const Tensor& t, bool isOutput) {
  if (!t.defined()) return;
  wasDefined_ = true;
  version_ = t.version();
  if (t.autogradMeta() != nullptr) tensorName_ = t.autogradMeta()->name;
  // Outputs are stored without autograd metadata to avoid the cycle
  // output -> gradFn -> saved output; inputs likewise (no double backward).
  data_ = detail::shallowCopy(t);
  (void)isOutput;
}

Tensor SavedTensor::unpack(const Node& owner) const {
  if (released_) {
    throw InvalidArgument(str("Trying to backward through the graph a second time (", owner.name(),
                              " already freed its saved tensors). Specify retainGraph=true on the first backward "
                              "if you need to run backward twice."));
  }
  if (!wasDefined_) return Tensor();
  if (data_.version() != version_) {
    throw InvalidArgument(str("one of the variables needed for gradient computation has been modified by an "
                              "inplace operation: [",
                              data_.describe(), "]", tensorName_.empty() ? "" : " named '" + tensorName_ + "'",
                              ", saved by ", owner.name(), ", is at version ", data_.version(), "; expected version ",
                              version_, " instead. Hint: clone() the tensor before modifying it in place."));
  }
  return data_;
}

// ---- Tensor autograd members -------------------------------------------------------------------------

AutogradMeta& Tensor::ensureAutogradMeta() const {
  TensorImpl* i = unsafeImpl();
  if (i == nullptr) throw InvalidArgument("autograd call on an undefined tensor");
  if (!i->autograd) i->autograd.reset(new AutogradMeta());
  return *i->autograd;
}

bool Tensor::requiresGrad() const {
  AutogradMeta* m = autogradMeta();
  return m != nullptr && (m->requiresGrad || m->gradFn != nullptr);
}

Tensor& Tensor::setRequiresGrad(bool flag) {
  AutogradMeta* m = autogradMeta();
  if (m != nullptr && m->gradFn) {
    if (!flag) {
      throw InvalidArgument(str("setRequiresGrad(false) on non-leaf tensor ", describe(), " (output of ",
                                m->gradFn->name(), "); use detach()"));
    }
    return *this;
  }
  if (flag && !isFloatingPoint(dtype())) {
    throw InvalidArgument(str("only floating point tensors can require gradients, got ", describe()));
  }
  ensureAutogradMeta().requiresGrad = flag;
  return *this;
}

Tensor Tensor::grad() const {
  AutogradMeta* m = autogradMeta();
  return m ? m->grad : Tensor();
}

void Tensor::setGrad(const Tensor& g) {
  if (g.defined() && (g.sizes() != sizes() || g.dtype() != dtype())) {
    throw InvalidArgument(str("setGrad: gradient ", g.describe(), " does not match tensor ", describe()));
  }
  ensureAutogradMeta().grad = g;
}

std::shared_ptr<Node> Tensor::gradFn() const {
  AutogradMeta* m = autogradMeta();
  return m ? m->gradFn : nullptr;
}

bool Tensor::isLeaf() const { return gradFn() == nullptr; }

Tensor Tensor::detach() const { return detail::shallowCopy(*this); }

Tensor& Tensor::detach_() {
  if (AutogradMeta* m = autogradMeta()) {
    m->gradFn.reset();
    m->requiresGrad = false;
  }
  return *this;
}

void Tensor::retainGrad() {
  AutogradMeta& m = ensureAutogradMeta();
  if (!m.gradFn) {
    if (!m.requiresGrad) throw InvalidArgument(str("retainGrad() on ", describe(), " which does not require grad"));
    return;  // leaves keep their grad anyway
  }
  if (m.retainsGrad) return;
  m.retainsGrad = true;
  // Weak reference: the hook lives in the node, which must not keep the tensor alive.
  std::weak_ptr<TensorImpl> weak = weakImpl();
  m.retainGradHook = m.gradFn->addPreHook(m.outputNr, [weak](const Tensor& g) -> Tensor {
    std::shared_ptr<TensorImpl> raw = weak.lock();
    if (raw && raw->autograd) {
      Tensor& slot = raw->autograd->grad;
      if (!slot.defined()) {
        slot = g.clone();
      } else {
        NoGradGuard ng;
        slot = dt::add(slot, g);  // qualified: Tensor::add would be found first here
      }
    }
    return Tensor();
  });
}

bool Tensor::retainsGrad() const {
  AutogradMeta* m = autogradMeta();
  return m != nullptr && m->retainsGrad;
}

int Tensor::registerHook(std::function<Tensor(const Tensor&)> hook) {
  if (!requiresGrad()) {
    throw InvalidArgument(str("registerHook on ", describe(), " which does not require grad"));
  }
  AutogradMeta& m = ensureAutogradMeta();
  if (m.gradFn) return m.gradFn->addPreHook(m.outputNr, std::move(hook));
  const int handle = gNextHookHandle.fetch_add(1);
  m.hooks.push_back(AutogradMeta::Hook{handle, std::move(hook)});
  return handle;
}

void Tensor::removeHook(int handle) {
  AutogradMeta* m = autogradMeta();
  if (m == nullptr) return;
  std::erase_if(m->hooks, [&](const AutogradMeta::Hook& h) { return h.handle == handle; });
  std::erase_if(m->postAccumulateHooks, [&](const AutogradMeta::PostHook& h) { return h.handle == handle; });
  if (m->gradFn) m->gradFn->removePreHook(handle);
}

int Tensor::registerPostAccumulateGradHook(std::function<void(Tensor&)> hook) {
  if (!isLeaf() || !requiresGrad()) {
    throw InvalidArgument(str("registerPostAccumulateGradHook needs a leaf tensor that requires grad, got ",
                              describe(), isLeaf() ? " (does not require grad)" : " (not a leaf)"));
  }
  AutogradMeta& m = ensureAutogradMeta();
  const int handle = gNextHookHandle.fetch_add(1);
  m.postAccumulateHooks.push_back(AutogradMeta::PostHook{handle, std::move(hook)});
  return handle;
}

void Tensor::backward(const Tensor& g, bool retainGraph) const {
  dt::backward({*this}, g.defined() ? TensorList{g} : TensorList{}, retainGraph);
}

void Tensor::setName(const std::string& n) { ensureAutogradMeta().name = n; }

std::string Tensor::name() const {
  AutogradMeta* m = autogradMeta();
  return m ? m->name : std::string();
}

// ---- AccumulateGrad ----------------------------------------------------------------------------------

AccumulateGrad::AccumulateGrad(Tensor leaf) : Node(kRunFirst), leaf_(std::move(leaf)) {}

TensorList AccumulateGrad::apply(TensorList&& grads) {
  Tensor g = std::move(grads.at(0));
  if (!g.defined()) return {};
  AutogradMeta& m = leaf_.ensureAutogradMeta();
  for (auto& h : m.hooks) {
    Tensor replaced = h.fn(g);
    if (replaced.defined()) g = std::move(replaced);
  }
  NoGradGuard noGrad;
  if (g.sizes() != leaf_.sizes()) {
    throw InvalidArgument(str("AccumulateGrad: gradient ", g.describe(), " does not match parameter ",
                              leaf_.describe()));
  }
  if (!m.grad.defined() && m.gradBuffer.defined()) {
    m.gradBuffer.copy_(g);
    m.grad = m.gradBuffer;
  } else if (!m.grad.defined()) {
    // Steal the incoming buffer when nobody else holds it (saves a copy per parameter).
    if (g.isContiguous() && g.dtype() == leaf_.dtype() && g.useCount() == 1 &&
        g.unsafeImpl()->storage.useCount() == 1 &&
        g.storageOffset() == 0 && static_cast<size_t>(g.nbytes()) == g.storage().nbytes()) {
      m.grad = detail::shallowCopy(g);
    } else {
      m.grad = g.to(leaf_.dtype()).clone();
    }
  } else {
    addInPlace(m.grad, g);
  }
  for (auto& h : m.postAccumulateHooks) h.fn(leaf_);
  return {};
}

// ---- recording helpers ---------------------------------------------------------------------------------

namespace autograd {

bool needsGrad(std::initializer_list<const Tensor*> inputs) {
  if (!tGradMode) return false;
  for (const Tensor* t : inputs) {
    if (t != nullptr && t->defined() && t->requiresGrad()) return true;
  }
  return false;
}

bool needsGrad(const TensorList& inputs) {
  if (!tGradMode) return false;
  for (const Tensor& t : inputs) {
    if (t.defined() && t.requiresGrad()) return true;
  }
  return false;
}

Edge edgeFor(const Tensor& t) {
  if (!t.defined() || !t.requiresGrad()) return Edge{};
  AutogradMeta& m = t.ensureAutogradMeta();
  if (m.gradFn) return Edge{m.gradFn, m.outputNr};
  return Edge{gradAccumulator(t), 0};
}

std::shared_ptr<Node> gradAccumulator(const Tensor& leaf) {
  if (!leaf.defined() || !leaf.isLeaf() || !leaf.requiresGrad()) {
    throw InvalidArgument(str("gradAccumulator needs a leaf tensor that requires grad, got ", leaf.describe(),
                              leaf.defined() && !leaf.isLeaf() ? " (not a leaf)" : " (does not require grad)"));
  }
  AutogradMeta& m = leaf.ensureAutogradMeta();
  std::shared_ptr<Node> acc = m.gradAccumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(leaf);
    m.gradAccumulator = acc;
  }
  return acc;
}

void setGradBuffer(const Tensor& leaf, const Tensor& view) {
  if (view.defined() && (view.sizes() != leaf.sizes() || view.dtype() != leaf.dtype() ||
                         view.device() != leaf.device())) {
    throw InvalidArgument(str("setGradBuffer: buffer ", view.describe(), " does not match tensor ", leaf.describe()));
  }
  leaf.ensureAutogradMeta().gradBuffer = view;
}

namespace {
void setHistory(Tensor& out, const std::shared_ptr<Node>& node, uint32_t nr) {
  AutogradMeta& m = out.ensureAutogradMeta();
  m.gradFn = node;
  m.outputNr = nr;
  m.requiresGrad = false;
}
}  // namespace

void recordNode(const std::shared_ptr<Node>& node, const TensorList& inputs, std::initializer_list<Tensor*> outputs) {
  if (detail::anomalyMayBeActive()) [[unlikely]] node->setAnomalyRecord(detail::anomalyRecordFor(node->name(), inputs));
  auto& edges = node->nextEdges();
  edges.clear();
  edges.reserve(inputs.size());
  for (const Tensor& t : inputs) edges.push_back(edgeFor(t));
  node->setNumOutputs(static_cast<uint32_t>(outputs.size()));
  uint32_t nr = 0;
  for (Tensor* out : outputs) setHistory(*out, node, nr++);
}

void recordNode(const std::shared_ptr<Node>& node, const TensorList& inputs, std::vector<Tensor>& outputs) {
  if (detail::anomalyMayBeActive()) [[unlikely]] node->setAnomalyRecord(detail::anomalyRecordFor(node->name(), inputs));
  auto& edges = node->nextEdges();
  edges.clear();
  for (const Tensor& t : inputs) edges.push_back(edgeFor(t));
  node->setNumOutputs(static_cast<uint32_t>(outputs.size()));
  uint32_t nr = 0;
  for (Tensor& out : outputs) setHistory(out, node, nr++);
}

void rebaseHistory(Tensor& self, const std::shared_ptr<Node>& node, uint32_t outputNr) {
  setHistory(self, node, outputNr);
}

}  // namespace autograd

// ---- engine ---------------------------------------------------------------------------------------------

namespace {

struct NodeState {
  int dependencies = 0;
  TensorList inputs;  // gradient buffer per output of the node
};

void accumulateInto(Tensor& slot, Tensor g) {
  if (!g.defined()) return;
  if (!slot.defined()) {
    slot = std::move(g);
    return;
  }
  // The first gradient may be shared with someone else (e.g. a hook kept it): never modify it in place.
  slot = add(slot, g);
}

}  // namespace

struct WeightGradients::State {
  struct DeferredNode {
    std::shared_ptr<Node> node;
    TensorList grads;         // the node's incoming gradients, after its pre-hooks
    std::vector<bool> which;  // the edges into weight accumulators
  };
  std::vector<DeferredNode> nodes;
  // Per weight accumulator: deferred contributions still to come, and their sum so far.
  std::unordered_map<Node*, int> remaining;
  std::unordered_map<Node*, Tensor> sums;
  std::vector<std::function<void()>> callbacks;  // queued during the first pass
  bool ran = false;
};

namespace {

// What backwardDeferringWeights asks of runGraph.
struct Deferral {
  std::unordered_set<const Node*> weightAccumulators;
  WeightGradients::State* out = nullptr;
};

struct CompareSeq {
  bool operator()(const Node* a, const Node* b) const { return a->sequenceNr() < b->sequenceNr(); }
};

// Runs the graph from the root edges; captureFor (optional) collects the
// gradients flowing into the given edges instead of running them.
// deferral (optional) keeps the weight gradients for later (backwardDeferringWeights).
void runGraph(const std::vector<Edge>& rootEdges, TensorList rootGrads, bool retainGraph,
              const std::vector<Edge>* captureFor, TensorList* captured, Deferral* deferral = nullptr) {
  // Dependencies: how many edges point at each node among those reachable.
  std::unordered_map<Node*, NodeState> state;
  std::vector<Node*> stack;
  std::unordered_set<Node*> seen;
  for (const Edge& e : rootEdges) {
    if (e.node && seen.insert(e.node.get()).second) stack.push_back(e.node.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->nextEdges()) {
      if (!e.node) continue;
      state[e.node.get()].dependencies++;
      if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
    }
  }
  std::unordered_map<Node*, size_t> captureIndex;
  if (captureFor != nullptr) {
    captured->assign(captureFor->size(), Tensor());
  }

  std::priority_queue<Node*, std::vector<Node*>, CompareSeq> ready;
  // Keep nodes alive while running even if a node releases its edges.
  std::vector<std::shared_ptr<Node>> keepAlive;
  auto deliver = [&](const Edge& e, Tensor g) {
    NodeState& s = state[e.node.get()];
    if (s.inputs.size() < e.node->numOutputs()) s.inputs.resize(e.node->numOutputs());
    accumulateInto(s.inputs[e.inputNr], std::move(g));
  };
  for (size_t i = 0; i < rootEdges.size(); ++i) {
    const Edge& e = rootEdges[i];
    if (!e.node) continue;
    deliver(e, rootGrads[i]);
    keepAlive.push_back(e.node);
  }
  for (const Edge& e : rootEdges) {
    if (e.node && state[e.node.get()].dependencies == 0) {
      state[e.node.get()].dependencies = -1;  // queued
      ready.push(e.node.get());
    }
  }

  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    NodeState& s = state[node];
    TensorList grads = std::move(s.inputs);
    grads.resize(node->numOutputs());
    if (node->hasPreHooks()) {
      for (uint32_t i = 0; i < grads.size(); ++i) {
        if (grads[i].defined()) grads[i] = node->runPreHooks(i, grads[i]);
      }
    }
    // Capture mode: gradients requested for these edges are taken, not propagated.
    bool capturedHere = false;
    if (captureFor != nullptr) {
      for (size_t c = 0; c < captureFor->size(); ++c) {
        const Edge& ce = (*captureFor)[c];
        if (ce.node.get() == node) {
          (*captured)[c] = grads[ce.inputNr];
          capturedHere = true;
        }
      }
    }
    if (capturedHere && dynamic_cast<AccumulateGrad*>(node) != nullptr) {
      continue;  // grad(): do not touch .grad of the inputs
    }
    if (node->released()) {
      throw InvalidArgument(str("Trying to backward through the graph a second time (", node->name(),
                                " was already run and freed). Specify retainGraph=true on the first backward if "
                                "you need to run backward twice."));
    }
    TensorList out;
    const bool anyGrad = std::any_of(grads.begin(), grads.end(), [](const Tensor& t) { return t.defined(); });
    const detail::IncomingGradients incoming(grads);
    std::vector<bool> weightEdges;
    if (deferral != nullptr && anyGrad && node->splitsGradients()) {
      const auto& edges = node->nextEdges();
      weightEdges.resize(edges.size());
      bool anyWeight = false;
      for (size_t i = 0; i < edges.size(); ++i) {
        weightEdges[i] = edges[i].node != nullptr && deferral->weightAccumulators.count(edges[i].node.get()) > 0;
        anyWeight = anyWeight || weightEdges[i];
      }
      if (!anyWeight) weightEdges.clear();
    }
    const bool deferring = !weightEdges.empty();
    if (deferring) {
      std::vector<bool> now(weightEdges.size());
      for (size_t i = 0; i < now.size(); ++i) now[i] = !weightEdges[i] && node->nextEdges()[i].valid();
      if (std::find(now.begin(), now.end(), true) != now.end()) {
        NoGradGuard noGrad;
        detail::BackwardScope profileScope(*node);
        out = node->applySome(grads, now);
      }
      for (size_t i = 0; i < weightEdges.size(); ++i) {
        if (weightEdges[i]) deferral->out->remaining[node->nextEdges()[i].node.get()]++;
      }
      deferral->out->nodes.push_back({node->shared_from_this(), std::move(grads), std::move(weightEdges)});
    } else if (anyGrad) {  // all-zero (undefined) gradients contribute nothing downstream
      NoGradGuard noGrad;
      detail::BackwardScope profileScope(*node);
      out = node->apply(std::move(grads));
    }
    detail::anomalyCheckBackward(*node, incoming, out);
    if (!retainGraph && !deferring) {  // a deferring node still needs its saved tensors
      node->releaseVariables();
      if (dynamic_cast<AccumulateGrad*>(node) == nullptr) node->markReleased();
    }
    const auto& edges = node->nextEdges();
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.node) continue;
      if (i < out.size() && out[i].defined()) deliver(e, std::move(out[i]));
      NodeState& ns = state[e.node.get()];
      if (--ns.dependencies == 0) {
        ns.dependencies = -1;
        keepAlive.push_back(e.node);
        ready.push(e.node.get());
      }
    }
  }
}

// keepCallbacks (optional) takes the pass's callbacks instead of running them.
void runWithCallbacks(const std::function<void()>& body,
                      std::vector<std::function<void()>>* keepCallbacks = nullptr) {
  GraphTask task;
  task.parent = tCurrentTask;
  // Restores the enclosing pass however this one ends, so a throwing node or
  // callback never leaves the thread "in backward".
  struct Restore {
    GraphTask* prev;
    ~Restore() { tCurrentTask = prev; }
  } restore{tCurrentTask};
  tCurrentTask = &task;
  body();
  if (keepCallbacks != nullptr) {
    *keepCallbacks = std::move(task.callbacks);
    return;
  }
  // Callbacks may queue further callbacks; run until none is left. Each one
  // runs even if an earlier one threw (they belong to independent owners,
  // e.g. two DDP modules); the first exception is rethrown at the end.
  std::exception_ptr firstError;
  for (size_t i = 0; i < task.callbacks.size(); ++i) {
    auto fn = std::move(task.callbacks[i]);
    try {
      fn();
    } catch (...) {
      if (!firstError) firstError = std::current_exception();
    }
  }
  if (firstError) std::rethrow_exception(firstError);
}

TensorList prepareRootGrads(const TensorList& roots, const TensorList& grads) {
  if (!grads.empty() && grads.size() != roots.size()) {
    throw InvalidArgument(str("backward: got ", grads.size(), " gradients for ", roots.size(), " outputs"));
  }
  TensorList out;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    if (!r.requiresGrad()) {
      throw InvalidArgument(str("element ", i, " of tensors does not require grad and does not have a gradFn (",
                                r.describe(), ")"));
    }
    if (i < grads.size() && grads[i].defined()) {
      if (grads[i].sizes() != r.sizes()) {
        throw InvalidArgument(str("backward: gradient ", grads[i].describe(), " does not match output ", r.describe()));
      }
      out.push_back(grads[i]);
    } else {
      if (r.numel() != 1) {
        throw InvalidArgument(str("grad can be implicitly created only for scalar outputs, got ", r.describe()));
      }
      out.push_back(onesLike(r));
    }
  }
  return out;
}

}  // namespace

void backward(const TensorList& roots, const TensorList& grads, bool retainGraph) {
  TensorList rootGrads = prepareRootGrads(roots, grads);
  std::vector<Edge> edges;
  for (const Tensor& r : roots) edges.push_back(autograd::edgeFor(r));
  runWithCallbacks([&] { runGraph(edges, std::move(rootGrads), retainGraph, nullptr, nullptr); });
}

TensorList grad(const TensorList& outputs, const TensorList& inputs, const TensorList& gradOutputs,
                bool retainGraph) {
  TensorList rootGrads = prepareRootGrads(outputs, gradOutputs);
  std::vector<Edge> edges;
  for (const Tensor& r : outputs) edges.push_back(autograd::edgeFor(r));
  std::vector<Edge> want;
  for (const Tensor& t : inputs) {
    if (!t.requiresGrad()) throw InvalidArgument(str("grad: input ", t.describe(), " does not require grad"));
    want.push_back(autograd::edgeFor(t));
  }
  TensorList result;
  runWithCallbacks([&] { runGraph(edges, std::move(rootGrads), retainGraph, &want, &result); });
  return result;
}

WeightGradients::WeightGradients() : state_(std::make_unique<State>()) {}
WeightGradients::~WeightGradients() = default;
WeightGradients::WeightGradients(WeightGradients&&) noexcept = default;
WeightGradients& WeightGradients::operator=(WeightGradients&&) noexcept = default;

size_t WeightGradients::pending() const { return state_ ? state_->nodes.size() : 0; }

void WeightGradients::run() {
  if (!state_ || state_->ran) {
    throw InvalidArgument("WeightGradients::run: these weight gradients were already computed (run() is once per pass)");
  }
  State& st = *state_;
  st.ran = true;
  std::vector<State::DeferredNode> nodes = std::move(st.nodes);
  st.nodes.clear();
  runWithCallbacks([&] {
    for (State::DeferredNode& d : nodes) {
      TensorList out;
      {
        NoGradGuard noGrad;
        detail::BackwardScope profileScope(*d.node);
        const detail::IncomingGradients incoming(d.grads);
        out = d.node->applySome(d.grads, d.which);
        detail::anomalyCheckBackward(*d.node, incoming, out);
      }
      d.grads.clear();
      d.node->releaseVariables();
      d.node->markReleased();
      const auto& edges = d.node->nextEdges();
      for (size_t i = 0; i < d.which.size(); ++i) {
        if (!d.which[i]) continue;
        Node* acc = edges[i].node.get();
        Tensor& sum = st.sums[acc];
        if (i < out.size()) accumulateInto(sum, std::move(out[i]));
        if (--st.remaining[acc] > 0) continue;
        // The weight's last contribution: accumulate once, so its hooks fire once, now.
        Tensor g = std::move(sum);
        st.sums.erase(acc);
        if (g.defined()) {
          NoGradGuard noGrad;
          acc->apply(TensorList{std::move(g)});
        }
      }
      d.node.reset();
    }
    for (auto& fn : st.callbacks) queueCallback(std::move(fn));
    st.callbacks.clear();
  });
}

WeightGradients backwardDeferringWeights(const TensorList& roots, const TensorList& grads,
                                         const TensorList& weights) {
  TensorList rootGrads = prepareRootGrads(roots, grads);
  std::vector<Edge> edges;
  for (const Tensor& r : roots) edges.push_back(autograd::edgeFor(r));
  WeightGradients result;
  Deferral deferral;
  deferral.out = result.state_.get();
  std::vector<std::shared_ptr<Node>> accumulators;  // keeps each weight's node for the pass
  for (const Tensor& w : weights) {
    if (!w.defined() || !w.requiresGrad()) continue;  // frozen weights have no gradient to defer
    if (!w.isLeaf()) {
      throw InvalidArgument(str("backwardDeferringWeights: weight ", w.describe(),
                                w.name().empty() ? "" : " '" + w.name() + "'", " is not a leaf (output of ",
                                w.gradFn()->name(), "); pass parameters"));
    }
    accumulators.push_back(autograd::gradAccumulator(w));
    deferral.weightAccumulators.insert(accumulators.back().get());
  }
  runWithCallbacks([&] { runGraph(edges, std::move(rootGrads), false, nullptr, nullptr, &deferral); },
                   &result.state_->callbacks);
  return result;
}

void queueCallback(std::function<void()> fn, CallbackPass pass) {
  GraphTask* task = tCurrentTask;
  if (task == nullptr) {
    throw InvalidArgument("queueCallback: no backward pass is running on this thread");
  }
  if (pass == CallbackPass::Outermost) {
    while (task->parent != nullptr) task = task->parent;
  }
  task->callbacks.push_back(std::move(fn));
}

bool inBackward() { return tCurrentTask != nullptr; }

}  // namespace dt
