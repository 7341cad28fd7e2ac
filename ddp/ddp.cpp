#include "ddp/ddp.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "checkpoint/exchange.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/autograd.h"

namespace dt {
namespace {

using Clock = std::chrono::steady_clock;

std::string describeParameter(const std::string& name, const Tensor& t) {
  return str(name, ": ", t.describe(), t.device().isCpu() ? " on cpu" : "", t.requiresGrad() ? "" : " (no grad)");
}

// Throws the same InvalidArgument on every rank when the models differ.
void verifySameModel(ProcessGroup& group, const NamedTensors& params, const std::string& who) {
  std::vector<std::string> lines;
  for (const auto& [name, t] : params) lines.push_back(describeParameter(name, t));
  requireSameOnAllRanks(group, lines, str("[", who, "] DistributedDataParallel: the ranks' models differ at"),
                        "parameter",
                        "Every rank must build the same model (same parameters in the same order, with the same "
                        "shapes, dtypes and devices) before wrapping it.");
}

std::vector<Tensor> valuesOf(const NamedTensors& named) {
  std::vector<Tensor> out;
  for (const auto& [name, t] : named) out.push_back(t);
  return out;
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module,
                                                 std::shared_ptr<ProcessGroup> group, DdpOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(std::move(options)) {
  if (!module_) throw InvalidArgument("DistributedDataParallel: module is null");
  if (!group_) throw InvalidArgument("DistributedDataParallel: process group is null");
  if (!group_->isMember()) {
    throw InvalidArgument(str("DistributedDataParallel: this rank is not a member of process group ", group_->name()));
  }
  registerModule("module", module_);
  const NamedTensors params = module_->namedParameters();
  if (options_.syncAtConstruction) verifySameModel(*group_, params, who());
  std::vector<Tensor> trained;
  std::vector<std::string> names;
  for (const auto& [name, t] : params) {
    if (!t.requiresGrad()) continue;
    trained.push_back(t);
    names.push_back(name);
  }
  if (trained.empty()) {
    throw InvalidArgument(str("[", who(), "] DistributedDataParallel: module ", module_->typeName(), " has ",
                              params.size(), " parameters and none requires grad; there is nothing to reduce"));
  }
  // Every rank starts from rank 0's values.
  std::vector<Tensor> state = valuesOf(params);
  for (const auto& t : valuesOf(module_->namedBuffers())) state.push_back(t);
  if (options_.syncAtConstruction) broadcastTensors(*group_, state, 0);

  ReducerOptions reducerOptions;
  reducerOptions.caps = {options_.firstBucketCapBytes, options_.bucketCapBytes};
  reducerOptions.gradientAsBucketView = options_.gradientAsBucketView;
  reducerOptions.findUnusedParameters = options_.findUnusedParameters;
  reducerOptions.staticGraph = options_.staticGraph;
  if (env::getBool("DT_DDP_LOG")) reducerOptions.logEvery = static_cast<int>(env::getInt("DT_DDP_LOG_EVERY"));
  if (env::getBool("DT_DDP_LOG") && reducerOptions.logEvery < 1) {
    throw InvalidArgument(str("DT_DDP_LOG_EVERY=", reducerOptions.logEvery, " must be a positive number of iterations"));
  }
  for (const std::string& name : options_.bucketOrder) {
    const auto it = std::find(names.begin(), names.end(), name);
    if (it == names.end()) {
      throw InvalidArgument(str("[", who(), "] DistributedDataParallel: the bucket order names parameter ",
                                quoteBytes(name), ", which the model has not (or does not train); was the order saved "
                                "for another model?"));
    }
    reducerOptions.bucketOrder.push_back(static_cast<size_t>(it - names.begin()));
  }
  reducer_ = std::make_unique<Reducer>(std::move(trained), std::move(names), group_, reducerOptions);
  if (options_.commHook) reducer_->setCommHook(options_.commHook);
}

DistributedDataParallel::~DistributedDataParallel() = default;

std::vector<std::string> DistributedDataParallel::bucketOrder() const {
  std::vector<std::string> names;
  for (const auto& bucket : reducer_->buckets()) names.insert(names.end(), bucket.parameters.begin(), bucket.parameters.end());
  return names;
}

void DistributedDataParallel::rebind(std::shared_ptr<ProcessGroup> group) {
  if (!group || !group->isMember()) {
    throw InvalidArgument(str("[", who(), "] DistributedDataParallel::rebind: ",
                              group ? "this rank is not a member of the new group" : "the new group is null"));
  }
  reducer_->rebind(group);
  group_ = std::move(group);
  inJoin_ = false;
}

std::string DistributedDataParallel::who() const {
  return str("rank ", group_->rank(), "/", group_->size(), " pg=", group_->name());
}

void DistributedDataParallel::registerCommHook(CommHook hook) { reducer_->setCommHook(std::move(hook)); }

void DistributedDataParallel::beforeForward() {
  if (!gradModeEnabled()) return;  // evaluation: no collectives, so one rank may run it alone
  if (inJoin_) {
    // [ranks still training, of which synchronising]; joined ranks add zeros.
    Tensor state = fromVector<int64_t>({1, requireSync_ ? 1 : 0});
    group_->allreduce(state)->wait();
  }
  if (options_.broadcastBuffers) broadcastTensors(*group_, valuesOf(module_->namedBuffers()), 0);
}

void DistributedDataParallel::afterForward(const std::vector<Tensor>& outputs, double forwardMs) {
  if (!gradModeEnabled()) return;
  reducer_->prepareForBackward(outputs, requireSync_, forwardMs);
}

Tensor DistributedDataParallel::forward(const Tensor& input) {
  const auto start = Clock::now();
  beforeForward();
  Tensor out = (*module_)(input);  // the call operator, so ops know their module path
  afterForward({out}, std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  return out;
}

std::vector<Tensor> DistributedDataParallel::forwardWith(const std::function<std::vector<Tensor>()>& body) {
  const auto start = Clock::now();
  beforeForward();
  std::vector<Tensor> outputs = body();
  afterForward(outputs, std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  return outputs;
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel* ddp)
    : ddp_(ddp), previous_(ddp->requireSync_) {
  ddp_->requireSync_ = false;
  ddp_->reducer_->setInNoSyncScope(true);
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : ddp_(other.ddp_), previous_(other.previous_) {
  other.ddp_ = nullptr;
}

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() {
  if (ddp_ == nullptr) return;
  ddp_->requireSync_ = previous_;
  ddp_->reducer_->setInNoSyncScope(!previous_);
}

DistributedDataParallel::NoSyncGuard DistributedDataParallel::noSync() { return NoSyncGuard(this); }

void DistributedDataParallel::join(const std::function<void()>& body) {
  if (options_.staticGraph) {
    throw NotSupportedError(str("[", who(), "] DistributedDataParallel::join with staticGraph: a rank that joins "
                                "before the first iteration cannot learn the graph; use findUnusedParameters"));
  }
  if (inJoin_) throw InvalidArgument(str("[", who(), "] DistributedDataParallel::join cannot be nested"));
  inJoin_ = true;
  try {
    body();
  } catch (...) {
    inJoin_ = false;
    throw;
  }
  inJoin_ = false;

  // Out of data: answer the others' collectives until every rank is out.
  bool lastToFinish = false;
  for (bool first = true;; first = false) {
    Tensor state = zeros({2}, DType::Int64);
    group_->allreduce(state)->wait();
    const auto counts = state.toVector<int64_t>();
    if (first) lastToFinish = counts[0] == 0;
    if (counts[0] == 0) break;
    if (options_.broadcastBuffers) broadcastTensors(*group_, valuesOf(module_->namedBuffers()), 0);
    if (counts[1] > 0) reducer_->shadowBackward();
  }
  // The ranks that finished last hold the trained model; the highest of them
  // is the source for everyone.
  Tensor source = fromVector<int64_t>({lastToFinish ? group_->rank() : -1});
  group_->allreduce(source, {.reduceOp = ReduceOp::Max})->wait();
  std::vector<Tensor> state = module_->parameters();
  for (const auto& t : valuesOf(module_->namedBuffers())) state.push_back(t);
  broadcastTensors(*group_, state, static_cast<int>(source.item<int64_t>()));
}

}  // namespace dt
