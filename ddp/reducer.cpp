#include "ddp/reducer.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <unordered_set>
#include <utility>

#include "common/check.h"
#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/autograd.h"
#include "tensor/ops.h"
#include "tensor/profiler.h"

namespace dt {
namespace {

// Profiler track ids of DDP buckets: far above any thread number.
constexpr uint64_t kDdpTrackBase = uint64_t{1} << 32;

using Clock = std::chrono::steady_clock;

double msBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// True when `grad` is exactly `view` (same memory, same geometry).
bool aliases(const Tensor& grad, const Tensor& view) {
  return grad.defined() && grad.storage().data() == view.storage().data() &&
         grad.storageOffset() == view.storageOffset() && grad.sizes() == view.sizes() &&
         grad.strides() == view.strides();
}

// dst = src * scale in one pass (the common case: a fresh float gradient
// into its bucket), else a copy and an in-place scale.
void scaleInto(Tensor& dst, const Tensor& src, double scale) {
  if (src.isContiguous() && src.dtype() == dst.dtype() && dst.isContiguous() && src.device().isCpu() &&
      (src.dtype() == DType::Float32 || src.dtype() == DType::Float64)) {
    const int64_t n = src.numel();
    if (src.dtype() == DType::Float32) {
      const float factor = static_cast<float>(scale);
      const float* in = src.data<float>();
      float* out = dst.data<float>();
      for (int64_t i = 0; i < n; ++i) out[i] = in[i] * factor;
    } else {
      const double* in = src.data<double>();
      double* out = dst.data<double>();
      for (int64_t i = 0; i < n; ++i) out[i] = in[i] * scale;
    }
    dst.bumpVersion();
    return;
  }
  dst.copy_(src);
  if (scale != 1.0) mul_(dst, scale);
}

std::string bucketList(const std::vector<size_t>& buckets) {
  std::vector<int> values(buckets.begin(), buckets.end());
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  return formatRanges(values);
}

}  // namespace

struct Reducer::Bucket {
  Tensor buffer;               // flat, one dtype and device
  std::vector<size_t> params;  // in buffer order
  size_t pending = 0;          // params not ready yet this iteration
  WorkPtr work;
};

// Times of one iteration; shared with Work callbacks, which may outlive it.
struct Reducer::Timing {
  Clock::time_point backwardStart{};
  bool backwardStarted = false;
  int64_t firstLaunchNs = 0;
  bool launched = false;
  bool passEnded = false;
  size_t launchedInBackward = 0;
  std::atomic<int64_t> lastDoneNs{0};
};

Reducer::Reducer(std::vector<Tensor> params, std::vector<std::string> names, std::shared_ptr<ProcessGroup> group,
                 ReducerOptions options)
    : params_(std::move(params)),
      names_(std::move(names)),
      group_(std::move(group)),
      options_(options),
      hook_(allreduceHook()),
      alive_(std::make_shared<char>(0)),
      timing_(std::make_shared<Timing>()) {
  if (params_.empty()) throw InvalidArgument("Reducer: no parameters to reduce");
  if (names_.size() != params_.size()) {
    throw InvalidArgument(str("Reducer: ", names_.size(), " names for ", params_.size(), " parameters"));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    accumulators_.push_back(autograd::gradAccumulator(params_[i]));
    paramInfo_.push_back({params_[i].nbytes(), params_[i].dtype(), params_[i].device()});
  }
  ready_.assign(params_.size(), 0);
  hookCalls_.assign(params_.size(), 0);
  if (options_.bucketOrder.empty()) {
    buildBuckets(reverseOrder(params_.size()));
  } else {
    std::vector<uint8_t> seen(params_.size(), 0);
    bool permutation = options_.bucketOrder.size() == params_.size();
    for (size_t p : options_.bucketOrder) permutation = permutation && p < params_.size() && !seen[p]++;
    if (!permutation) {
      throw InvalidArgument(str("[", who(), "] DDP: the bucket order lists ", options_.bucketOrder.size(),
                                " parameter indices but must be a permutation of the model's ", params_.size(),
                                " parameters (was it saved for another model?)"));
    }
    buildBuckets(options_.bucketOrder);
    rebuilt_ = true;  // the layout was settled in an earlier run: no rebuild
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    hookHandles_.push_back(params_[i].registerPostAccumulateGradHook([this, i](Tensor&) { onGradReady(i); }));
  }
}

Reducer::~Reducer() {
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].removeHook(hookHandles_[i]);
    autograd::setGradBuffer(params_[i], Tensor());
  }
  // Buckets still on the wire must not be freed under the backend.
  for (auto& work : abandoned_) {
    try {
      work->wait();
    } catch (const std::exception&) {  // already reported by the iteration that failed
    }
  }
  for (auto& bucket : buckets_) {
    if (!bucket->work) continue;
    try {
      bucket->work->wait();
    } catch (const std::exception&) {
    }
  }
}

void Reducer::setCommHook(CommHook hook) {
  if (phase_ != Phase::Idle) {
    throw InvalidArgument(str("[", who(), "] DDP: a comm hook can only be registered between iterations"));
  }
  hook_ = hook ? std::move(hook) : allreduceHook();
}

std::string Reducer::who() const { return str("rank ", group_->rank(), "/", group_->size(), " pg=", group_->name()); }

std::string Reducer::namesOf(const std::vector<size_t>& params) const {
  constexpr size_t kShown = 12;
  std::string out;
  for (size_t i = 0; i < params.size() && i < kShown; ++i) {
    if (i) out += ", ";
    out += names_[params[i]];
  }
  if (params.size() > kShown) out += str(" and ", params.size() - kShown, " more");
  return out;
}

// ---- buckets ------------------------------------------------------------------------------------------

void Reducer::buildBuckets(const std::vector<size_t>& order) {
  const auto plan = planBuckets(paramInfo_, order, options_.caps);
  std::vector<std::unique_ptr<Bucket>> buckets;
  std::vector<size_t> bucketOf(params_.size());
  std::vector<Tensor> views(params_.size());
  for (size_t b = 0; b < plan.size(); ++b) {
    auto bucket = std::make_unique<Bucket>();
    bucket->params = plan[b];
    int64_t total = 0;
    for (size_t p : plan[b]) total += params_[p].numel();
    const Tensor& first = params_[plan[b].front()];
    bucket->buffer = zeros({total}, first.dtype(), first.device());
    int64_t offset = 0;
    for (size_t p : plan[b]) {
      views[p] = bucket->buffer.narrow(0, offset, params_[p].numel()).view(params_[p].sizes());
      offset += params_[p].numel();
      bucketOf[p] = b;
    }
    buckets.push_back(std::move(bucket));
  }
  if (options_.gradientAsBucketView) {
    // Gradients move into the new buffers (a rebuild keeps their values).
    NoGradGuard noGrad;
    for (size_t p = 0; p < params_.size(); ++p) {
      Tensor grad = params_[p].grad();
      if (grad.defined()) {
        views[p].copy_(grad);
        params_[p].setGrad(views[p]);
      }
      // With one rank the gradient needs no scaling, so accumulation writes
      // straight into the bucket. With more, a fresh gradient is scaled into
      // the bucket by the hook in one pass (cheaper than a copy then a scale).
      if (group_->size() == 1) autograd::setGradBuffer(params_[p], views[p]);
    }
  }
  buckets_ = std::move(buckets);
  bucketOf_ = std::move(bucketOf);
  views_ = std::move(views);
}

std::vector<size_t> Reducer::bucketOrder() const {
  std::vector<size_t> order;
  for (const auto& bucket : buckets_) order.insert(order.end(), bucket->params.begin(), bucket->params.end());
  return order;
}

void Reducer::rebind(std::shared_ptr<ProcessGroup> group) {
  if (!group) throw InvalidArgument(str("[", who(), "] DDP: rebind to a null process group"));
  // Works of the old group: failed or aborted, or complete; none writes again.
  for (auto& bucket : buckets_) {
    if (bucket->work) abandoned_.push_back(std::move(bucket->work));
  }
  for (auto& work : abandoned_) {
    try {
      work->wait();
    } catch (const std::exception&) {  // the old group's failure: reported where it happened
    }
  }
  abandoned_.clear();
  const bool wasSingle = group_->size() == 1;
  group_ = std::move(group);
  phase_ = Phase::Idle;
  backwardStarted_ = false;
  // One rank accumulates straight into the bucket; several scale into it (buildBuckets).
  if (options_.gradientAsBucketView && wasSingle != (group_->size() == 1)) {
    for (size_t p = 0; p < params_.size(); ++p) {
      autograd::setGradBuffer(params_[p], group_->size() == 1 ? views_[p] : Tensor());
    }
  }
}

std::vector<DdpBucketInfo> Reducer::buckets() const {
  std::vector<DdpBucketInfo> out;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bucket = *buckets_[b];
    DdpBucketInfo info;
    info.index = b;
    info.bytes = bucket.buffer.nbytes();
    info.dtype = bucket.buffer.dtype();
    info.device = bucket.buffer.device();
    for (size_t p : bucket.params) info.parameters.push_back(names_[p]);
    out.push_back(std::move(info));
  }
  return out;
}

// ---- one iteration ----------------------------------------------------------------------------------------

void Reducer::prepareForBackward(const std::vector<Tensor>& outputs, bool sync, double forwardMs) {
  // A forward whose backward never came (or a repeated forward) is simply
  // replaced. Buckets still on the wire (from a backward that threw before
  // its end) are waited for before their buffers are written again.
  for (auto& bucket : buckets_) {
    if (bucket->work) abandoned_.push_back(std::move(bucket->work));
  }
  for (auto& work : abandoned_) {
    try {
      work->wait();
    } catch (const std::exception&) {  // reported by the iteration that failed
    }
  }
  abandoned_.clear();
  phase_ = sync ? Phase::Sync : Phase::NoSync;
  backwardStarted_ = false;
  nextToLaunch_ = 0;
  std::fill(ready_.begin(), ready_.end(), 0);
  std::fill(hookCalls_.begin(), hookCalls_.end(), 0);
  for (auto& bucket : buckets_) bucket->pending = bucket->params.size();
  unusedHere_.clear();
  savedGrads_.clear();
  readyOrder_.clear();
  timing_ = std::make_shared<Timing>();
  pendingForwardMs_ = forwardMs;
  if (!sync) return;

  if (staticGraphKnown_) {
    for (size_t p = 0; p < params_.size(); ++p) {
      if (globallyUnused_[p]) unusedHere_.push_back(p);
    }
  } else if (options_.findUnusedParameters && !options_.staticGraph) {
    // Parameters the outputs cannot reach will get no gradient: they are
    // marked ready as soon as backward starts.
    std::unordered_set<const Node*> seen;
    std::vector<const Node*> stack;
    for (const Tensor& out : outputs) {
      if (!out.defined() || !out.requiresGrad()) continue;
      const Edge edge = autograd::edgeFor(out);
      if (edge.node && seen.insert(edge.node.get()).second) stack.push_back(edge.node.get());
    }
    while (!stack.empty()) {
      const Node* node = stack.back();
      stack.pop_back();
      for (const Edge& e : node->nextEdges()) {
        if (e.node && seen.insert(e.node.get()).second) stack.push_back(e.node.get());
      }
    }
    for (size_t p = 0; p < params_.size(); ++p) {
      if (!seen.count(accumulators_[p].get())) unusedHere_.push_back(p);
    }
  }

  // Backward reaching an output starts the clock (and the iteration, even if
  // no parameter ends up with a gradient).
  std::weak_ptr<char> alive = alive_;
  for (const Tensor& out : outputs) {
    if (!out.defined() || out.gradFn() == nullptr) continue;
    out.gradFn()->addPreHook(out.autogradMeta()->outputNr, [this, alive](const Tensor&) {
      if (!alive.expired() && phase_ == Phase::Sync) beginBackward();
      return Tensor();
    });
  }
}

void Reducer::beginBackward() {
  if (backwardStarted_) return;
  backwardStarted_ = true;
  timing_->backwardStart = Clock::now();
  timing_->backwardStarted = true;
  std::weak_ptr<char> alive = alive_;
  queueCallback(
      [this, alive] {
        if (!alive.expired()) finalize();
      },
      CallbackPass::Outermost);
  for (size_t p : unusedHere_) markReady(p, true);
}

void Reducer::onGradReady(size_t param) {
  if (phase_ == Phase::NoSync) return;
  if (phase_ == Phase::Idle) {
    if (inNoSyncScope_) return;
    throw InvalidArgument(str(
        "[", who(), "] DDP: parameter '", names_[param],
        "' got a gradient outside a DDP iteration: the backward did not start from this DDP module's forward "
        "(call ddp(input), not the wrapped module), or ran a second time for one forward (that forward's "
        "reduction has already finished). Inside ddp.noSync() gradients accumulate locally instead."));
  }
  beginBackward();
  if (hookCalls_[param]++ == 0) readyOrder_.push_back(param);
  if (options_.staticGraph) {
    if (!staticGraphKnown_) return;  // first iteration: everything is reduced once the pass is over
    if (hookCalls_[param] < expectedCalls_[param]) return;
    if (hookCalls_[param] > expectedCalls_[param]) {
      throw InvalidArgument(str("[", who(), "] DDP (staticGraph): parameter '", names_[param], "' got ",
                                hookCalls_[param], " gradients in this backward but ", expectedCalls_[param],
                                " in the first iteration; with staticGraph the graph must not change between "
                                "iterations. Use findUnusedParameters instead if it does."));
    }
    markReady(param, false);
    return;
  }
  if (ready_[param]) {
    throw InvalidArgument(str("[", who(), "] DDP: parameter '", names_[param],
                              "' got a second gradient in one backward, after its bucket was reduced (a re-entrant "
                              "backward such as activation checkpointing, or a parameter shared by two such "
                              "parts?). If the graph is the same every iteration, construct DDP with "
                              "staticGraph = true, which counts the gradients each parameter gets."));
  }
  markReady(param, false);
}

void Reducer::markReady(size_t param, bool unusedHere) {
  ready_[param] = 1;
  Tensor& view = views_[param];
  Tensor grad = params_[param].grad();
  NoGradGuard noGrad;
  if (!grad.defined()) {
    view.zero_();  // contributes nothing; .grad stays undefined unless some rank used it
  } else {
    const double scale = 1.0 / group_->size();
    // A rank that did not use the parameter still contributes its .grad
    // (accumulated earlier); if no rank used it, finalize puts it back.
    if (unusedHere && options_.gradientAsBucketView) savedGrads_.emplace_back(param, grad.clone());
    if (aliases(grad, view)) {
      if (scale != 1.0) mul_(view, scale);
    } else {
      scaleInto(view, grad, scale);
      if (options_.gradientAsBucketView) params_[param].setGrad(view);
    }
  }
  Bucket& bucket = *buckets_[bucketOf_[param]];
  if (--bucket.pending == 0) launchReadyBuckets();
}

void Reducer::launchReadyBuckets() {
  while (nextToLaunch_ < buckets_.size() && buckets_[nextToLaunch_]->pending == 0) {
    const size_t index = nextToLaunch_++;
    Bucket& bucket = *buckets_[index];
    GradBucket grad;
    grad.index = index;
    grad.count = buckets_.size();
    grad.buffer = bucket.buffer;
    for (size_t p : bucket.params) {
      grad.parameters.push_back(params_[p]);
      grad.parameterNames.push_back(names_[p]);
    }
    if (!timing_->launched) {
      timing_->launched = true;
      timing_->firstLaunchNs = nowNs();
    }
    if (!timing_->passEnded) ++timing_->launchedInBackward;
    const int64_t profiledLaunchNs = profiler::recording() ? profiler::nowNs() : -1;
    const FlightContext flightContext("ddp bucket %zu", index);
    bucket.work = hook_(*group_, grad);
    if (!bucket.work) {
      throw InvalidArgument(str("[", who(), "] DDP: the comm hook returned no Work for bucket ", index));
    }
    std::shared_ptr<Timing> timing = timing_;
    bucket.work->thenInline([timing](Work&) {
      const int64_t now = nowNs();
      int64_t seen = timing->lastDoneNs.load();
      while (seen < now && !timing->lastDoneNs.compare_exchange_weak(seen, now)) {
      }
    });
    if (profiledLaunchNs >= 0) [[unlikely]] profileBucket(index, bucket, profiledLaunchNs);
  }
}

// The bucket from launch to done as a profiler event on a track of its own
// (buckets in flight overlap, so they cannot share a thread's track).
void Reducer::profileBucket(size_t index, Bucket& bucket, int64_t launchNs) const {
  const int rank = group_->rank();
  std::string args = str("\"bucket\": ", index, ", \"bytes\": ", bucket.buffer.nbytes(), ", \"params\": ",
                         bucket.params.size());
  bucket.work->thenInline([launchNs, rank, index, args = std::move(args)](Work& work) {
    profiler::recordEvent("ddp bucket", EventCategory::Ddp, launchNs, profiler::nowNs(),
                          work.isSuccess() ? args : args + ", \"failed\": true", rank, kDdpTrackBase + index,
                          str("ddp bucket ", index));
  });
}

void Reducer::finalize() {
  const auto passEnd = Clock::now();
  timing_->passEnded = true;
  const bool firstStatic = options_.staticGraph && !staticGraphKnown_;
  const bool exchangeUsed = firstStatic || (options_.findUnusedParameters && !staticGraphKnown_);
  const size_t world = static_cast<size_t>(group_->size());
  try {
    std::vector<size_t> missing;
    for (size_t p = 0; p < params_.size(); ++p) {
      if (ready_[p]) continue;
      if (firstStatic || (options_.findUnusedParameters && !options_.staticGraph)) {
        markReady(p, hookCalls_[p] == 0);
      } else {
        missing.push_back(p);
      }
    }
    if (!missing.empty()) {
      std::vector<size_t> waiting;
      for (size_t p : missing) waiting.push_back(bucketOf_[p]);
      throw InvalidArgument(str(
          "[", who(), "] DDP backward (iteration ", iterations_ + 1, ") ended but ", missing.size(), " of ",
          params_.size(), " parameters got no gradient: ", namesOf(missing),
          options_.staticGraph ? ". With staticGraph every parameter must get as many gradients as in the first "
                                 "iteration"
                               : ". They took no part in computing the loss on this rank",
          ", so bucket(s) ", bucketList(waiting),
          " could not be reduced. If some parameters are unused in some iterations, construct DDP with "
          "findUnusedParameters = true; otherwise make sure every parameter contributes to the output."));
    }
    DT_CHECK(nextToLaunch_ == buckets_.size(), "DDP: ", buckets_.size() - nextToLaunch_,
             " buckets not launched after every parameter was ready");

    Tensor used;
    WorkPtr usedWork;
    if (exchangeUsed) {
      used = zeros({static_cast<int64_t>(params_.size())}, DType::Int32);
      int32_t* flags = used.data<int32_t>();
      for (size_t p = 0; p < params_.size(); ++p) flags[p] = hookCalls_[p] > 0 ? 1 : 0;
      if (world > 1) usedWork = group_->allreduce(used);
    }
    for (size_t b = 0; b < buckets_.size(); ++b) {
      try {
        buckets_[b]->work->wait();
      } catch (...) {
        std::rethrow_exception(withPrefix(std::current_exception(),
                                          str("DDP bucket ", b, " of ", buckets_.size(), " (",
                                              namesOf(buckets_[b]->params), "): ")));
      }
    }
    if (usedWork) usedWork->wait();

    std::vector<uint8_t> unusedEverywhere(params_.size(), 0);
    if (used.defined()) {
      for (size_t p = 0; p < params_.size(); ++p) unusedEverywhere[p] = used.data<int32_t>()[p] == 0;
    } else if (staticGraphKnown_) {
      unusedEverywhere = globallyUnused_;
    }
    NoGradGuard noGrad;
    for (size_t p = 0; p < params_.size(); ++p) {
      if (unusedEverywhere[p]) continue;
      Tensor grad = params_[p].grad();
      if (options_.gradientAsBucketView) {
        if (!aliases(grad, views_[p])) params_[p].setGrad(views_[p]);
      } else if (grad.defined()) {
        grad.copy_(views_[p]);
      } else {
        params_[p].setGrad(views_[p].clone());
      }
    }
    // Nobody used them: their .grad is exactly what it was.
    for (auto& [p, saved] : savedGrads_) {
      if (unusedEverywhere[p]) views_[p].copy_(saved);
    }
    size_t unusedCount = 0;
    for (uint8_t u : unusedEverywhere) unusedCount += u;
    if (firstStatic) {
      expectedCalls_ = hookCalls_;
      globallyUnused_ = unusedEverywhere;
      staticGraphKnown_ = true;
    }
    const auto done = Clock::now();

    DdpIterationStats stats;
    stats.iteration = ++iterations_;
    stats.forwardMs = pendingForwardMs_;
    stats.backwardMs = timing_->backwardStarted ? msBetween(timing_->backwardStart, passEnd) : 0.0;
    const int64_t lastDone = timing_->lastDoneNs.load();
    if (timing_->launched && lastDone > 0) stats.commMs = static_cast<double>(lastDone - timing_->firstLaunchNs) / 1e6;
    stats.exposedCommMs = msBetween(passEnd, done);
    stats.bucketsLaunchedInBackward = timing_->launchedInBackward;
    stats.unusedParameters = unusedCount;
    maybeRebuild(true);
    finishIteration(stats);
  } catch (...) {
    // The next iteration starts clean; buckets still on the wire are waited
    // for before their buffers are written again.
    for (auto& bucket : buckets_) {
      if (bucket->work) abandoned_.push_back(std::move(bucket->work));
    }
    phase_ = Phase::Idle;
    throw;
  }
}

void Reducer::finishIteration(const DdpIterationStats& stats) {
  phase_ = Phase::Idle;
  last_ = stats;
  totals_.iteration = stats.iteration;
  totals_.forwardMs += stats.forwardMs;
  totals_.backwardMs += stats.backwardMs;
  totals_.commMs += stats.commMs;
  totals_.exposedCommMs += stats.exposedCommMs;
  totals_.bucketsLaunchedInBackward += stats.bucketsLaunchedInBackward;
  totals_.unusedParameters = stats.unusedParameters;
  if (options_.logEvery > 0 && group_->rank() == 0) {
    if (!loggedLayout_ && (rebuilt_ || stats.iteration >= 2)) {
      loggedLayout_ = true;
      std::fprintf(stderr, "%s", formatBucketTable().c_str());
    }
    if (stats.iteration % static_cast<uint64_t>(options_.logEvery) == 0) {
      std::fprintf(stderr,
                   "[ddp] [%s] iteration %llu: forward %.2f ms, backward %.2f ms, comm %.2f ms (exposed %.2f ms), "
                   "%zu of %zu buckets launched during backward, %zu unused parameters\n",
                   who().c_str(), static_cast<unsigned long long>(stats.iteration), stats.forwardMs,
                   stats.backwardMs, stats.commMs, stats.exposedCommMs, stats.bucketsLaunchedInBackward,
                   buckets_.size(), stats.unusedParameters);
    }
  }
}

std::string Reducer::formatBucketTable() const {
  std::string out = str("[ddp] [", who(), "] ", buckets_.size(), " buckets", rebuilt_ ? " (rebuilt from the observed gradient order)" : "",
                        ":\n[ddp]   bucket      bytes  dtype     params  first .. last\n");
  for (const auto& info : buckets()) {
    char line[256];
    std::snprintf(line, sizeof line, "[ddp]   %6zu %10zu  %-8s %7zu  %s .. %s\n", info.index, info.bytes,
                  std::string(toString(info.dtype)).c_str(), info.parameters.size(), info.parameters.front().c_str(),
                  info.parameters.back().c_str());
    out += line;
  }
  return out;
}

// ---- rebuild and join ---------------------------------------------------------------------------------------

void Reducer::maybeRebuild(bool contribute) {
  if (rebuilt_) return;
  const size_t n = params_.size();
  std::vector<size_t> order;
  if (contribute) {
    // Parameters that never got a gradient go last.
    order = readyOrder_;
    std::vector<uint8_t> listed(n, 0);
    for (size_t p : order) listed[p] = 1;
    for (size_t p : reverseOrder(n)) {
      if (!listed[p]) order.push_back(p);
    }
  }
  if (group_->size() > 1) {
    // Rank 0's order wins so that every rank builds the same buckets.
    Tensor message = zeros({static_cast<int64_t>(n + 1)}, DType::Int64);
    if (group_->rank() == 0 && contribute) {
      int64_t* data = message.data<int64_t>();
      data[0] = 1;
      for (size_t i = 0; i < n; ++i) data[i + 1] = static_cast<int64_t>(order[i]);
    }
    group_->broadcast(message, {.root = 0})->wait();
    const int64_t* data = message.data<int64_t>();
    if (data[0] == 0) return;  // rank 0 had no order (it had joined): try again next iteration
    order.assign(n, 0);
    for (size_t i = 0; i < n; ++i) order[i] = static_cast<size_t>(data[i + 1]);
  } else if (!contribute) {
    return;
  }
  rebuilt_ = true;
  if (planBuckets(paramInfo_, order, options_.caps) == currentPlan()) return;
  buildBuckets(order);
}

std::vector<std::vector<size_t>> Reducer::currentPlan() const {
  std::vector<std::vector<size_t>> plan;
  for (const auto& bucket : buckets_) plan.push_back(bucket->params);
  return plan;
}

void Reducer::shadowBackward() {
  if (phase_ != Phase::Idle) {
    throw InvalidArgument(str("[", who(), "] DDP: a joined rank cannot shadow a backward while its own is pending"));
  }
  std::vector<WorkPtr> works;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    // Fresh zeros: the joined rank's own gradients stay as they are.
    GradBucket grad;
    grad.index = b;
    grad.count = buckets_.size();
    grad.buffer = zerosLike(buckets_[b]->buffer);
    for (size_t p : buckets_[b]->params) {
      grad.parameters.push_back(params_[p]);
      grad.parameterNames.push_back(names_[p]);
    }
    works.push_back(hook_(*group_, grad));
  }
  if (options_.findUnusedParameters && !staticGraphKnown_ && group_->size() > 1) {
    works.push_back(group_->allreduce(zeros({static_cast<int64_t>(params_.size())}, DType::Int32)));
  }
  for (auto& work : works) work->wait();
  maybeRebuild(false);
}

}  // namespace dt
