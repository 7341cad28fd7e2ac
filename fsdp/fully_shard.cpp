#include "fsdp/fully_shard.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <utility>

#include "checkpoint/exchange.h"
#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/autograd.h"
#include "tensor/autograd/function.h"
#include "tensor/profiler.h"

namespace dt {
namespace {

using Clock = std::chrono::steady_clock;

// Profiler tracks of the sharded wrapper: far above any thread number and DDP's buckets.
constexpr uint64_t kShardedTrackBase = uint64_t{3} << 32;
// Before a unit's gather, every rank sends its trailer (the unit's number and the phase);
// before its reduce-scatter, a one-hot of the unit's number modulo kReduceSlots is summed, so
// the world size lands in the slot of the unit every rank reduced.
constexpr int64_t kGatherTrailer = 2;
constexpr int64_t kReduceSlots = 16;
enum Phase : int { kForward = 0, kBackward = 1, kFull = 2 };
const char* phaseName(int phase) { return phase == kForward ? "forward" : phase == kBackward ? "backward" : "full"; }

double msSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// `t` takes `like`'s memory and geometry and keeps its identity: its autograd metadata, its
// hooks and its version counter (saved tensors stay valid), as Module::to does.
void repoint(const Tensor& t, const Tensor& like) {
  TensorImpl& impl = *t.unsafeImpl();
  const TensorImpl& from = *like.unsafeImpl();
  impl.storage = from.storage;
  impl.sizes = from.sizes;
  impl.strides = from.strides;
  impl.offset = from.offset;
  impl.dtype = from.dtype;
  impl.refreshGeometry();
}

// The identity whose backward runs when the gradient reaches a unit's input: the unit's
// backward is over there, so its gradients can be reduced.
struct PostBackwardTrigger : autograd::Function<PostBackwardTrigger> {
  static constexpr std::string_view name = "ShardedUnitPostBackward";
  static Tensor forward(autograd::FunctionContext& ctx, const Tensor& x, std::function<void()> onBackward) {
    ctx.set("onBackward", std::move(onBackward));
    return x;
  }
  static Tensor backward(autograd::FunctionContext& ctx, const TensorList& grads) {
    ctx.get<std::function<void()>>("onBackward")();
    return grads.at(0);
  }
};

}  // namespace

namespace fsdp_detail {

struct ShardParam {
  std::string name;
  Tensor param;  // the model's tensor: this rank's rows, or the whole tensor while gathered
  Shape shape;
  int64_t rows = 1, rowNumel = 1, shardRows = 0, localRows = 0;
  int64_t shardOffset = 0;  // in the unit's flat shard
  int64_t fullOffset = 0;   // in the unit's gathered storage
  Tensor shard;             // the optimizer's leaf: [shardRows, ...] view of the flat shard
  int lateGradHook = -1;

  Shape shardShape() const {
    Shape s = shape.empty() ? Shape{1} : shape;
    s[0] = shardRows;
    return s;
  }
  Tensor localView() const { return shard.narrow(0, 0, localRows); }
  int64_t globalOffset(int rank) const { return std::min(rows, rank * shardRows) * rowNumel; }
};

enum class UnitState { Sharded, Gathering, Gathered };

struct Unit {
  size_t index = 0;
  std::string name;
  nn::Module* module = nullptr;
  bool isRoot = false;
  std::vector<ShardParam> params;
  DType dtype = DType::Float32;
  Device device = Device::cpu();
  int64_t shardNumel = 0, fullNumel = 0;
  int64_t shardRegion = 0;  // where its shards start in the wrapper's shard buffer
  Tensor shardFlat;  // this rank's shards, the parameters' dtype (a view of the shard buffer)
  Tensor fullFlat;   // the gathered parameters, compute dtype; its storage is freed while sharded
  UnitState state = UnitState::Sharded;
  std::vector<int> hookHandles;
  // A gather in flight: the trailer's (unit number, phase) collective, then one per parameter.
  WorkPtr gatherWork, trailerWork;
  Tensor trailerIn, trailerOut;
  Tensor gatherSource;               // the shards in the compute dtype (a cast copy, or the shards)
  std::vector<Tensor> gatherTemps;   // padded results of the parameters whose rows W does not divide
  int gatherPhase = kForward;
  // This iteration.
  uint64_t forwardIteration = UINT64_MAX;  // the last iteration whose forward ran it
  bool backwardDone = false;
  Tensor accumulated;  // noSync: the unit's full gradients so far, flat, the parameters' dtype
  WorkPtr reduceWork;
  std::vector<Tensor> reduceInputs;  // the whole gradients on the wire (kept until done)
  Tensor reduceSlots, reduceOut;
};

}  // namespace fsdp_detail

using fsdp_detail::ShardParam;
using fsdp_detail::Unit;
using fsdp_detail::UnitState;

struct FullyShardedDataParallel::Impl {
  Impl(FullyShardedDataParallel& owner, FullyShardOptions options) : owner(owner), options(std::move(options)) {}

  FullyShardedDataParallel& owner;
  FullyShardOptions options;
  std::shared_ptr<ProcessGroup> group;
  std::vector<std::unique_ptr<Unit>> units;  // options.units order, root last
  std::vector<std::pair<size_t, size_t>> paramOrder;  // namedParameters() order -> (unit, param)
  // Every unit's shards in one buffer: one allocation, rounded up by the allocator once, not
  // once per unit.
  Tensor shardBuffer;
  std::shared_ptr<char> alive = std::make_shared<char>(0);
  int rootHook[2] = {-1, -1};

  uint64_t iteration = 0;
  bool iterationActive = false;    // a training forward ran; its backward has not finished
  bool trainingIteration = false;  // grad mode was on at the root's forward
  bool backwardStarted = false;
  bool inRootForward = false;
  bool requireSync = true;
  bool summoned = false;
  std::vector<size_t> forwardOrder;      // this iteration
  std::vector<size_t> lastForwardOrder;  // the previous one (prefetch order)
  ShardedIterationStats last, totals, current;

  int rank() const { return group->rank(); }
  int world() const { return group->size(); }
  std::string who() const { return str("rank ", group->rank(), "/", group->size(), " pg=", group->name()); }
  DType computeDtype() const { return options.mixedPrecision.paramDtype; }
  Unit& root() { return *units.back(); }

  // ---- layout --------------------------------------------------------------------------------

  void layOut(Unit& u) {
    const int64_t w = world();
    int64_t shardAt = 0, fullAt = 0;
    for (ShardParam& p : u.params) {
      p.rows = p.shape.empty() ? 1 : p.shape[0];
      const int64_t numel = shapeNumel(p.shape);
      p.rowNumel = p.shape.empty() ? 1 : (p.rows > 0 ? numel / p.rows : shapeNumel(Shape(p.shape.begin() + 1, p.shape.end())));
      p.shardRows = (p.rows + w - 1) / w;
      p.localRows = std::clamp<int64_t>(p.rows - rank() * p.shardRows, 0, p.shardRows);
      p.shardOffset = shardAt;
      p.fullOffset = fullAt;
      shardAt += p.shardRows * p.rowNumel;
      fullAt += numel;
    }
    u.shardNumel = shardAt;
    u.fullNumel = fullAt;
  }

  // A fresh shard buffer: this rank's rows of each parameter (its model tensor still whole)
  // when copyValues, zeros otherwise; the optimizer's leaves keep their identity. Then the
  // model's tensors hold their rows.
  void allocateShards(bool copyValues) {
    NoGradGuard noGrad;
    int64_t total = 0;
    for (auto& u : units) {
      u->shardRegion = total;
      total += u->shardNumel;
    }
    const Unit& any = paramOrder.empty() ? *units.front() : *units[paramOrder.front().first];
    for (auto& u : units) {  // a unit without parameters still gathers its trailer with the others' dtype
      if (u->params.empty()) {
        u->dtype = any.dtype;
        u->device = any.device;
      }
    }
    shardBuffer = zeros({total}, any.dtype, any.device);
    for (auto& owned : units) {
      Unit& u = *owned;
      u.shardFlat = shardBuffer.narrow(0, u.shardRegion, u.shardNumel);
      for (ShardParam& p : u.params) {
        Tensor view = shardBuffer.narrow(0, u.shardRegion + p.shardOffset, p.shardRows * p.rowNumel).view(p.shardShape());
        if (copyValues && p.localRows > 0) {
          const Tensor whole = p.param.detach().reshape(p.shape.empty() ? Shape{1} : p.shape);
          view.narrow(0, 0, p.localRows).copy_(whole.narrow(0, rank() * p.shardRows, p.localRows));
        }
        if (!p.shard.defined()) {
          p.shard = view.detach();
          p.shard.setRequiresGrad(true);
        } else {
          repoint(p.shard, view);
          p.shard.setGrad(Tensor());
          p.shard.bumpVersion();
        }
        repoint(p.param, p.localView());
      }
      if (!u.fullFlat.defined()) u.fullFlat = empty({std::max<int64_t>(u.fullNumel, 1)}, computeDtype(), u.device);
      releaseFull(u);
    }
  }

  // The gathered storage's bytes go; tensors saved for backward keep pointing at it.
  static void releaseFull(Unit& u) {
    Storage full = u.fullFlat.storage();
    full.resizeBytes(0);
  }

  // ---- gathers ------------------------------------------------------------------------------

  size_t gatheredUnits() const {
    size_t n = 0;
    for (const auto& u : units) n += (!u->isRoot && u->state != UnitState::Sharded) ? 1 : 0;
    return n;
  }

  void recordCollective(const WorkPtr& work, const char* kind, const Unit& u, int64_t startNs, size_t bytes, int track) {
    // The Work's completion time for the profiler (thenInline also asks the backend to start
    // an op it might otherwise leave to whoever waits: the point of a prefetch).
    const bool profiling = profiler::recording();
    std::string args = str("\"unit\": \"", u.name, "\", \"bytes\": ", bytes);
    const int r = rank();
    const uint64_t trackId = kShardedTrackBase + 2 * u.index + static_cast<uint64_t>(track);
    std::string trackName = str("sharded ", kind, " ", u.name);
    work->thenInline([profiling, startNs, r, trackId, kind, args = std::move(args), trackName = std::move(trackName)](Work& w) {
      if (!profiling || !profiler::recording()) return;
      profiler::recordEvent(kind[0] == 'g' ? "sharded gather" : "sharded reduce-scatter", EventCategory::Sharded, startNs,
                            profiler::nowNs(), w.isSuccess() ? args : args + ", \"failed\": true", r, trackId, trackName);
    });
  }

  // Rank r's k rows of a parameter with rows % W == 0 land exactly at rows [r k, (r + 1) k)
  // of the whole tensor: its collectives read and write the parameter's own memory. Others go
  // through a padded buffer.
  bool direct(const ShardParam& p) const { return p.rows % world() == 0; }

  void launchGather(Unit& u, int phase) {
    if (u.state != UnitState::Sharded) return;
    const int64_t w = world();
    NoGradGuard noGrad;
    // The whole parameters' memory now: the collectives write into it.
    Storage full = u.fullFlat.storage();
    full.resizeBytes(static_cast<size_t>(std::max<int64_t>(u.fullNumel, 1)) * itemSize(computeDtype()));
    const int64_t startNs = profiler::recording() ? profiler::nowNs() : 0;
    const FlightContext flightContext("fsdp unit %zu %s gather", u.index, u.name.c_str());
    // First the unit's number and the phase: ranks that run different units find out below.
    u.trailerIn = fromVector<int64_t>({static_cast<int64_t>(u.index), phase}).to(u.device);
    u.trailerOut = empty({w * kGatherTrailer}, DType::Int64, u.device);
    u.trailerWork = group->allgatherIntoTensor(u.trailerOut, u.trailerIn);
    std::vector<WorkPtr> works{u.trailerWork};
    u.gatherSource = computeDtype() == u.dtype ? u.shardFlat : u.shardFlat.to(computeDtype());
    size_t bytes = 0;
    for (ShardParam& p : u.params) {
      if (p.shardRows == 0) continue;
      const Tensor in = u.gatherSource.narrow(0, p.shardOffset, p.shardRows * p.rowNumel);
      Tensor out = direct(p) ? u.fullFlat.narrow(0, p.fullOffset, shapeNumel(p.shape))
                             : empty({w * p.shardRows * p.rowNumel}, computeDtype(), u.device);
      if (!direct(p)) u.gatherTemps.push_back(out);
      works.push_back(group->allgatherIntoTensor(out, in));
      bytes += out.nbytes();
    }
    u.gatherWork = works.size() == 1 ? works[0] : allOf(str("sharded gather of unit ", u.name), std::move(works));
    recordCollective(u.gatherWork, "gather", u, startNs, bytes, 0);
    u.gatherPhase = phase;
    u.state = UnitState::Gathering;
    ++current.gathers;
    current.gatherBytes += bytes;
    current.peakGatheredUnits = std::max(current.peakGatheredUnits, gatheredUnits());
  }

  // The ranks' trailers (unit number, phase) disagree with this rank's: throws naming them.
  void checkTrailers(const Unit& u) {
    const std::vector<int64_t> trailers = u.trailerOut.to(Device::cpu()).toVector<int64_t>();
    bool same = true;
    for (int r = 0; r < world(); ++r) {
      same = same && trailers[static_cast<size_t>(r * kGatherTrailer)] == static_cast<int64_t>(u.index) &&
             trailers[static_cast<size_t>(r * kGatherTrailer + 1)] == trailers[1];
    }
    if (same) return;
    std::map<std::string, std::vector<int>> ran;  // what each rank gathered
    for (int r = 0; r < world(); ++r) {
      const auto idx = static_cast<size_t>(trailers[static_cast<size_t>(r * kGatherTrailer)]);
      const int phase = static_cast<int>(trailers[static_cast<size_t>(r * kGatherTrailer + 1)]);
      const std::string unitName = idx < units.size() ? str("'", units[idx]->name, "'") : str("#", idx);
      ran[str("unit ", unitName, " (", phaseName(phase), ")")].push_back(r);
    }
    std::string detail;
    for (const auto& [what, ranks] : ran) {
      if (!detail.empty()) detail += "; ";
      detail += str("rank", ranks.size() > 1 ? "s " : " ", formatRanges(ranks), " gathered ", what);
    }
    throw DesyncError(str("[", who(), "] sharded unit '", u.name, "' (", phaseName(u.gatherPhase), ", iteration ",
                          iteration, "): the ranks gathered different units in one collective: ", detail,
                          ". Every rank must wrap the same units and run them in the same order (no data-dependent "
                          "skipping or reordering of units)"));
  }

  void dropGatherBuffers(Unit& u) {
    u.gatherWork.reset();
    u.trailerWork.reset();
    u.gatherSource = u.trailerIn = u.trailerOut = Tensor();
    u.gatherTemps.clear();
  }

  void finishGather(Unit& u, bool backwardPhase) {
    if (u.state == UnitState::Gathered) return;
    if (u.state == UnitState::Sharded) launchGather(u, backwardPhase ? kBackward : kForward);
    const auto start = Clock::now();
    try {
      u.gatherWork->wait();
      checkTrailers(u);
    } catch (...) {
      std::exception_ptr error = withPrefix(std::current_exception(),
                                            str("sharded unit '", u.name, "' ", phaseName(u.gatherPhase), " gather: "));
      // A parameter collective of another unit's shape fails in the backend; the trailers (the
      // first collective, which did arrive) say which units the ranks ran.
      if (u.trailerWork && u.trailerWork->isSuccess()) {
        try {
          checkTrailers(u);
        } catch (const DesyncError&) {
          error = std::current_exception();
        }
      }
      dropGatherBuffers(u);
      releaseFull(u);
      u.state = UnitState::Sharded;
      std::rethrow_exception(error);
    }
    (backwardPhase ? current.backwardWaitMs : current.forwardWaitMs) += msSince(start);
    NoGradGuard noGrad;
    size_t temp = 0;
    for (ShardParam& p : u.params) {
      if (p.shardRows > 0 && !direct(p)) {
        const Tensor& out = u.gatherTemps[temp++];
        u.fullFlat.narrow(0, p.fullOffset, shapeNumel(p.shape)).copy_(out.narrow(0, 0, shapeNumel(p.shape)));
      }
      repoint(p.param, u.fullFlat.narrow(0, p.fullOffset, shapeNumel(p.shape)).view(p.shape));
    }
    dropGatherBuffers(u);
    u.state = UnitState::Gathered;
  }

  void reshard(Unit& u) {
    if (u.state == UnitState::Sharded) return;
    if (u.state == UnitState::Gathering) {
      try {
        u.gatherWork->wait();  // its buffers must outlive the collective
      } catch (const std::exception&) {  // reported by whoever needed the result
      }
      dropGatherBuffers(u);
    }
    for (ShardParam& p : u.params) repoint(p.param, p.localView());
    releaseFull(u);
    u.state = UnitState::Sharded;
  }

  // Starts the gathers of the `options.prefetch` units after `after` in `order` (the bound
  // permitting), so that they arrive while this one computes.
  void prefetch(const std::vector<size_t>& order, size_t after, int phase) {
    if (options.prefetch <= 0 || summoned) return;
    auto it = std::find(order.begin(), order.end(), after);
    if (it == order.end()) return;
    int started = 0;
    const bool bounded = options.reshardAfterForward || phase == kBackward;
    for (++it; it != order.end() && started < options.prefetch; ++it) {
      Unit& next = *units[*it];
      if (next.state != UnitState::Sharded) continue;
      if (phase == kBackward && next.backwardDone) continue;
      if (bounded && gatheredUnits() >= static_cast<size_t>(options.maxGatheredUnits)) return;
      launchGather(next, phase);
      ++started;
    }
  }

  std::vector<size_t> backwardOrder() const { return {forwardOrder.rbegin(), forwardOrder.rend()}; }

  // ---- forward ------------------------------------------------------------------------------

  // Leftovers of an iteration whose backward never came (or failed): in-flight collectives
  // are waited for, everything is resharded, unreduced gradients are dropped.
  void abandonIteration() {
    for (auto& u : units) {
      if (u->reduceWork) {
        try {
          u->reduceWork->wait();
        } catch (const std::exception&) {  // reported by the backward that failed
        }
      }
      u->reduceWork.reset();
      u->reduceInputs.clear();
      u->reduceSlots = u->reduceOut = Tensor();
      reshard(*u);
      for (ShardParam& p : u->params) p.param.setGrad(Tensor());
    }
    iterationActive = false;
    inRootForward = false;
  }

  // An iteration that threw in the root's forward or in its backward (e.g. its group was
  // aborted when a member died): it never finishes by itself, since the end of backward
  // (finalize) runs only when the whole pass succeeds. One whose backward has not begun is
  // pending, not failed.
  bool iterationFailed() const {
    return !summoned && !inBackward() && (inRootForward || (iterationActive && backwardStarted));
  }

  Tensor onRootPreForward(const Tensor& input) {
    if (summoned || inRootForward) return {};
    if (inBackward()) {
      finishGather(root(), true);
      return {};
    }
    beginIteration();
    if (input.defined() && options.mixedPrecision.castForwardInputs && isFloatingPoint(input.dtype()) &&
        input.dtype() != computeDtype()) {
      return input.to(computeDtype());
    }
    return {};
  }

  void beginIteration() {
    if (iterationActive || root().state != UnitState::Sharded) abandonIteration();
    ++iteration;
    current = ShardedIterationStats{};
    current.iteration = iteration;
    forwardOrder.clear();
    backwardStarted = false;
    trainingIteration = gradModeEnabled();
    iterationActive = trainingIteration;
    for (auto& u : units) u->backwardDone = false;
    inRootForward = true;
    launchGather(root(), kForward);
    // The first unit's gather travels with the root's.
    const std::vector<size_t> order = lastForwardOrder.empty() ? defaultOrder() : lastForwardOrder;
    if (!order.empty() && options.prefetch > 0) launchGather(*units[order.front()], kForward);
    finishGather(root(), false);
  }

  std::vector<size_t> defaultOrder() const {
    std::vector<size_t> order;
    for (size_t i = 0; i + 1 < units.size(); ++i) order.push_back(i);
    return order;
  }

  Tensor onRootPostForward(const Tensor& output) {
    if (summoned || !inRootForward) return {};
    Tensor out = output;
    if (options.mixedPrecision.outputDtype && out.defined() && isFloatingPoint(out.dtype()) &&
        out.dtype() != *options.mixedPrecision.outputDtype) {
      out = out.to(*options.mixedPrecision.outputDtype);
    }
    afterRootForward({out});
    return out;
  }

  void afterRootForward(const std::vector<Tensor>& outputs) {
    inRootForward = false;
    current.peakGatheredUnits = std::max(current.peakGatheredUnits, gatheredUnits());
    bool differentiable = false;
    for (const Tensor& out : outputs) differentiable = differentiable || (out.defined() && out.gradFn() != nullptr);
    if (!trainingIteration || !differentiable) {
      // No backward comes: nothing stays gathered.
      for (auto& u : units) reshard(*u);
      iterationActive = false;
      finishStats();
      return;
    }
    std::weak_ptr<char> token = alive;
    const uint64_t it = iteration;
    for (const Tensor& out : outputs) {
      if (!out.defined() || out.gradFn() == nullptr) continue;
      out.gradFn()->addPreHook(out.autogradMeta()->outputNr, [this, token, it](const Tensor&) {
        if (!token.expired()) onBackwardStart(it);
        return Tensor();
      });
    }
    // Backward begins with the unit the forward ended with: start its gather now.
    const auto order = backwardOrder();
    if (!order.empty()) launchGather(*units[order.front()], kBackward);
  }

  Tensor onUnitPreForward(Unit& u, const Tensor& x) {
    if (summoned) return {};
    if (inBackward()) {
      // A recomputation (activation checkpointing around the unit's call): it runs while the
      // unit is gathered for its backward.
      finishGather(u, true);
      prefetch(backwardOrder(), u.index, kBackward);
      return triggerAfterBackward(u, x);
    }
    if (u.forwardIteration == iteration) {
      throw InvalidArgument(str("[", who(), "] sharded unit '", u.name, "' ran twice in one forward (iteration ",
                                iteration, "); a unit may run once per iteration: make each use its own unit, or "
                                "wrap the module that calls it twice"));
    }
    u.forwardIteration = iteration;
    forwardOrder.push_back(u.index);
    finishGather(u, false);
    prefetch(lastForwardOrder.empty() ? defaultOrder() : lastForwardOrder, u.index, kForward);
    return trainingIteration ? triggerAfterBackward(u, x) : Tensor();
  }

  Tensor triggerAfterBackward(Unit& u, const Tensor& x) {
    if (!gradModeEnabled() || !x.defined() || !x.requiresGrad()) return {};
    std::weak_ptr<char> token = alive;
    const uint64_t it = iteration;
    Unit* unit = &u;
    return PostBackwardTrigger::apply(x, std::function<void()>([this, token, it, unit] {
      if (!token.expired()) onPostBackward(*unit, it);
    }));
  }

  Tensor onUnitPostForward(Unit& u, const Tensor& output) {
    if (summoned || inBackward()) return {};
    if (trainingIteration && output.defined() && output.gradFn() != nullptr) {
      std::weak_ptr<char> token = alive;
      const uint64_t it = iteration;
      Unit* unit = &u;
      output.gradFn()->addPreHook(output.autogradMeta()->outputNr, [this, token, it, unit](const Tensor&) {
        if (!token.expired()) onPreBackward(*unit, it);
        return Tensor();
      });
    }
    if (options.reshardAfterForward || !trainingIteration) reshard(u);
    return {};
  }

  // ---- backward -----------------------------------------------------------------------------

  void onBackwardStart(uint64_t it) {
    if (it != iteration || !iterationActive || backwardStarted) return;
    backwardStarted = true;
    std::weak_ptr<char> token = alive;
    queueCallback(
        [this, token, it] {
          if (!token.expired()) finalize(it);
        },
        CallbackPass::Outermost);
  }

  void onPreBackward(Unit& u, uint64_t it) {
    if (it != iteration || !iterationActive) return;
    onBackwardStart(it);
    finishGather(u, true);
    prefetch(backwardOrder(), u.index, kBackward);
  }

  void onPostBackward(Unit& u, uint64_t it) {
    if (it != iteration || !iterationActive || u.backwardDone) return;
    onBackwardStart(it);
    postBackward(u);
  }

  void postBackward(Unit& u) {
    u.backwardDone = true;
    harvest(false);  // earlier units' reduce-scatters that are done free their buffers now
    NoGradGuard noGrad;
    std::vector<Tensor> grads;
    for (ShardParam& p : u.params) {
      grads.push_back(p.param.grad());
      p.param.setGrad(Tensor());
    }
    if (!requireSync) {
      if (!u.accumulated.defined()) u.accumulated = zeros({std::max<int64_t>(u.fullNumel, 1)}, u.dtype, u.device);
      for (size_t i = 0; i < u.params.size(); ++i) {
        if (!grads[i].defined()) continue;
        const ShardParam& p = u.params[i];
        u.accumulated.narrow(0, p.fullOffset, shapeNumel(p.shape)).add_(grads[i].reshape({-1}).to(u.dtype));
      }
    } else {
      launchReduceScatter(u, std::move(grads));
    }
    if (!u.isRoot) reshard(u);
  }

  void launchReduceScatter(Unit& u, std::vector<Tensor> grads) {
    const int64_t w = world();
    const DType reduceType = options.mixedPrecision.reduceDtype;
    NoGradGuard noGrad;
    const FlightContext flightContext("fsdp unit %zu %s reduce-scatter", u.index, u.name.c_str());
    // First the unit's slot: ranks that reduce different units find out in harvest.
    u.reduceSlots = zeros({kReduceSlots}, DType::Float32, u.device);
    u.reduceSlots.narrow(0, static_cast<int64_t>(u.index % kReduceSlots), 1).fill_(1.0);
    std::vector<WorkPtr> works{group->allreduce(u.reduceSlots)};
    // Each unit's own result buffer, made as its reduction starts: at the start of backward,
    // when the activations peak, no gradient shard exists yet.
    u.reduceOut = empty({std::max<int64_t>(u.shardNumel, 1)}, reduceType, u.device);
    const int64_t startNs = profiler::recording() ? profiler::nowNs() : 0;
    size_t bytes = 0;
    for (size_t i = 0; i < u.params.size(); ++i) {
      const ShardParam& p = u.params[i];
      if (p.shardRows == 0) continue;
      const int64_t numel = shapeNumel(p.shape);
      Tensor g = grads[i].defined() ? grads[i].reshape({-1}) : zeros({numel}, u.dtype, u.device);  // unused: zeros
      if (u.accumulated.defined()) g = add(u.accumulated.narrow(0, p.fullOffset, numel), g.to(u.dtype));
      if (g.dtype() != reduceType) g = g.to(reduceType);
      g = g.contiguous();
      // Divided before the sum, as DDP does: the sum over ranks is then the average. The
      // gradient is this wrapper's alone (taken from .grad), so in place.
      if (w > 1) mul_(g, 1.0 / static_cast<double>(w));
      if (!direct(p)) {
        Tensor padded = zeros({w * p.shardRows * p.rowNumel}, reduceType, u.device);
        padded.narrow(0, 0, numel).copy_(g);
        g = padded;
      }
      works.push_back(group->reduceScatterTensor(u.reduceOut.narrow(0, p.shardOffset, p.shardRows * p.rowNumel), g));
      bytes += g.nbytes();
      u.reduceInputs.push_back(std::move(g));
    }
    u.accumulated = Tensor();
    u.reduceWork = works.size() == 1 ? works[0] : allOf(str("sharded reduce-scatter of unit ", u.name), std::move(works));
    recordCollective(u.reduceWork, "reduce-scatter", u, startNs, bytes, 1);
    ++current.reduceScatters;
    current.reduceScatterBytes += bytes;
  }

  // Waits for (all) or collects (the completed) reduce-scatters: checks that every rank
  // reduced the same unit and gives the shards their gradients.
  void harvest(bool all) {
    for (auto& owned : units) {
      Unit& u = *owned;
      if (!u.reduceWork || (!all && !u.reduceWork->isCompleted())) continue;
      const auto start = Clock::now();
      try {
        u.reduceWork->wait();
      } catch (...) {
        u.reduceWork.reset();
        u.reduceInputs.clear();
        u.reduceSlots = u.reduceOut = Tensor();
        std::rethrow_exception(withPrefix(std::current_exception(), str("sharded unit '", u.name, "' reduce-scatter: ")));
      }
      current.backwardWaitMs += msSince(start);
      u.reduceInputs.clear();
      NoGradGuard noGrad;
      const std::vector<float> slots = u.reduceSlots.to(Device::cpu()).toVector<float>();
      const size_t mine = u.index % kReduceSlots;
      if (slots[mine] != static_cast<float>(world())) {
        std::string seen;
        for (size_t k = 0; k < slots.size(); ++k) {
          if (slots[k] == 0) continue;
          std::vector<std::string> names;
          for (size_t i = k; i < units.size(); i += kReduceSlots) names.push_back(str("'", units[i]->name, "'"));
          seen += str(seen.empty() ? "" : "; ", slots[k], " rank(s) reduced ", join(names, " or "));
        }
        throw DesyncError(str("[", who(), "] sharded unit '", u.name, "' reduce-scatter (iteration ", iteration,
                              "): the ranks reduced different units in one collective: ", seen,
                              ". Every rank must run the same units in the same order"));
      }
      Tensor g = u.reduceOut;
      if (g.dtype() != u.dtype) g = g.to(u.dtype);
      for (ShardParam& p : u.params) {
        Tensor view = g.narrow(0, p.shardOffset, p.shardRows * p.rowNumel).view(p.shardShape());
        Tensor existing = p.shard.grad();
        if (existing.defined()) {
          existing.add_(view);
        } else {
          p.shard.setGrad(view);
        }
      }
      u.reduceWork.reset();
      u.reduceSlots = u.reduceOut = Tensor();
    }
  }

  void finalize(uint64_t it) {
    if (it != iteration || !iterationActive) return;
    try {
      // Units whose backward did not end at their input (the root, units whose input needs no
      // gradient, units this forward did not run): the same order on every rank.
      std::vector<size_t> rest = backwardOrder();
      for (size_t i = units.size(); i-- > 0;) {
        if (std::find(rest.begin(), rest.end(), i) == rest.end()) rest.push_back(i);
      }
      for (size_t i : rest) {
        if (!units[i]->backwardDone) postBackward(*units[i]);
      }
      harvest(true);
      for (auto& u : units) reshard(*u);
    } catch (...) {
      abandonIteration();
      throw;
    }
    lastForwardOrder = forwardOrder;
    iterationActive = false;
    finishStats();
  }

  void finishStats() {
    last = current;
    totals.iteration = current.iteration;
    totals.gathers += current.gathers;
    totals.reduceScatters += current.reduceScatters;
    totals.gatherBytes += current.gatherBytes;
    totals.reduceScatterBytes += current.reduceScatterBytes;
    totals.forwardWaitMs += current.forwardWaitMs;
    totals.backwardWaitMs += current.backwardWaitMs;
    totals.peakGatheredUnits = std::max(totals.peakGatheredUnits, current.peakGatheredUnits);
  }

  void requireIdle(const char* what) const {
    if (iterationActive || summoned) {
      throw InvalidArgument(str("[", who(), "] FullyShardedDataParallel::", what,
                                " between iterations only (a forward's backward is pending, or full parameters are "
                                "gathered)"));
    }
  }

  std::vector<std::string> describeUnits() const {
    std::vector<std::string> lines;
    for (const auto& u : units) {
      for (const ShardParam& p : u->params) {
        lines.push_back(str("unit '", u->name, "' parameter ", p.name, ": ", toString(u->dtype), describeShape(p.shape)));
      }
      if (u->params.empty()) lines.push_back(str("unit '", u->name, "' (no parameters)"));
    }
    return lines;
  }
};

// ---- the wrapper ------------------------------------------------------------------------------------

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<nn::Module> module,
                                                   std::shared_ptr<ProcessGroup> group, FullyShardOptions options)
    : module_(std::move(module)), group_(std::move(group)), impl_(std::make_unique<Impl>(*this, std::move(options))) {
  Impl& m = *impl_;
  if (!module_) throw InvalidArgument("FullyShardedDataParallel: module is null");
  if (!group_) throw InvalidArgument("FullyShardedDataParallel: process group is null");
  if (!group_->isMember()) {
    throw InvalidArgument(str("FullyShardedDataParallel: this rank is not a member of process group ", group_->name()));
  }
  m.group = group_;
  const auto& o = m.options;
  if (o.maxGatheredUnits < 1 || o.prefetch < 0) {
    throw InvalidArgument(str("[", m.who(), "] FullyShardedDataParallel: maxGatheredUnits ", o.maxGatheredUnits,
                              " must be at least 1 and prefetch ", o.prefetch, " at least 0"));
  }
  for (DType d : {o.mixedPrecision.paramDtype, o.mixedPrecision.reduceDtype}) {
    if (!isFloatingPoint(d)) {
      throw InvalidArgument(str("[", m.who(), "] FullyShardedDataParallel: mixed-precision dtype ", toString(d),
                                " is not a floating-point type"));
    }
  }

  // Where each unit sits in the model: its path.
  std::map<const nn::Module*, std::string> paths;
  std::vector<std::pair<std::string, const nn::Module*>> pending{{"", module_.get()}};
  while (!pending.empty()) {
    auto [path, mod] = pending.back();
    pending.pop_back();
    paths.emplace(mod, path);
    for (const auto& [name, child] : mod->namedChildren()) pending.emplace_back(path.empty() ? name : path + "." + name, child.get());
  }
  for (const auto& unitModule : o.units) {
    auto it = unitModule ? paths.find(unitModule.get()) : paths.end();
    if (it == paths.end() || it->second.empty()) {
      throw InvalidArgument(str("[", m.who(), "] FullyShardedDataParallel: unit ",
                                unitModule ? unitModule->typeName() : std::string("(null)"),
                                " is not a submodule of the wrapped ", module_->typeName(),
                                " (units are submodules, such as its transformer blocks; the rest is the root unit)"));
    }
    for (const auto& u : m.units) {
      if (u->module == unitModule.get()) throw InvalidArgument(str("FullyShardedDataParallel: unit '", it->second, "' is listed twice"));
    }
    auto unit = std::make_unique<Unit>();
    unit->index = m.units.size();
    unit->name = it->second;
    unit->module = unitModule.get();
    m.units.push_back(std::move(unit));
  }
  auto rootUnit = std::make_unique<Unit>();
  rootUnit->index = m.units.size();
  rootUnit->name = "(root)";
  rootUnit->module = module_.get();
  rootUnit->isRoot = true;
  m.units.push_back(std::move(rootUnit));

  // Each parameter to the innermost unit whose path prefixes its name.
  const NamedTensors params = module_->namedParameters();
  std::map<const void*, std::string> owners;
  for (const auto& [name, t] : params) {
    size_t best = m.units.size() - 1;
    size_t bestLength = 0;
    for (size_t i = 0; i + 1 < m.units.size(); ++i) {
      const std::string& path = m.units[i]->name;
      if (name.starts_with(path + ".") && path.size() + 1 > bestLength) {
        best = i;
        bestLength = path.size() + 1;
      }
    }
    Unit& u = *m.units[best];
    if (auto [it, fresh] = owners.emplace(t.id(), u.name); !fresh && it->second != u.name) {
      throw InvalidArgument(str("[", m.who(), "] FullyShardedDataParallel: parameter ", name, " (", t.describe(),
                                ") is used by units '", it->second, "' and '", u.name,
                                "'; a tensor shared by two units must live in a unit that holds both (their parent)"));
    }
    if (!isFloatingPoint(t.dtype()) || !t.requiresGrad()) {
      throw InvalidArgument(str("[", m.who(), "] FullyShardedDataParallel: parameter ", name, " is ", t.describe(),
                                t.requiresGrad() ? "" : " without requiresGrad",
                                "; sharded parameters are floating-point tensors that require grad"));
    }
    if (!u.params.empty() && (t.dtype() != u.dtype || t.device() != u.device)) {
      throw InvalidArgument(str("[", m.who(), "] FullyShardedDataParallel: unit '", u.name, "' mixes ", toString(u.dtype),
                                " on ", u.device.str(), " and ", toString(t.dtype()), " on ", t.device().str(), " (",
                                name, "); a unit's parameters share one dtype and device"));
    }
    if (!m.paramOrder.empty()) {
      const ShardParam& first = m.units[m.paramOrder.front().first]->params[m.paramOrder.front().second];
      if (t.dtype() != first.param.dtype() || t.device() != first.param.device()) {
        throw InvalidArgument(str("[", m.who(), "] FullyShardedDataParallel: parameter ", name, " is ", t.describe(),
                                  " on ", t.device().str(), " but ", first.name, " is ", first.param.describe(), " on ",
                                  first.param.device().str(), "; the sharded parameters share one dtype and device"));
      }
    }
    u.dtype = t.dtype();
    u.device = t.device();
    ShardParam p;
    p.name = name;
    p.param = t;
    p.shape = t.sizes();
    u.params.push_back(std::move(p));
    m.paramOrder.emplace_back(best, u.params.size() - 1);
  }

  requireSameOnAllRanks(*group_, m.describeUnits(),
                        str("[", m.who(), "] FullyShardedDataParallel: the ranks' sharded models differ at"), "entry",
                        "Every rank must build the same model and wrap the same units (same parameters, shapes and "
                        "dtypes) before sharding it.");
  // Every rank starts from rank 0's values (a joiner's come with the state it receives; the
  // members, rebinding, run the same check and no broadcast).
  if (!o.joining) {
    std::vector<Tensor> state;
    for (const auto& [name, t] : params) state.push_back(t);
    for (const auto& [name, b] : module_->namedBuffers()) state.push_back(b);
    broadcastTensors(*group_, state, 0);
  }

  for (auto& u : m.units) m.layOut(*u);
  m.allocateShards(!o.joining);

  // Hooks: the units' forwards, the root's, and a late gradient's check.
  for (auto& owned : m.units) {
    Unit* u = owned.get();
    if (u->isRoot) continue;
    u->hookHandles.push_back(u->module->registerForwardPreHook(
        [&m, u](nn::Module&, const Tensor& x) { return m.onUnitPreForward(*u, x); }));
    u->hookHandles.push_back(u->module->registerForwardHook(
        [&m, u](nn::Module&, const Tensor&, const Tensor& out) { return m.onUnitPostForward(*u, out); }));
  }
  m.rootHook[0] = module_->registerForwardPreHook([&m](nn::Module&, const Tensor& x) { return m.onRootPreForward(x); });
  m.rootHook[1] = module_->registerForwardHook(
      [&m](nn::Module&, const Tensor&, const Tensor& out) { return m.onRootPostForward(out); });
  for (auto& owned : m.units) {
    Unit* u = owned.get();
    for (ShardParam& p : u->params) {
      const std::string name = p.name;
      p.lateGradHook = p.param.registerPostAccumulateGradHook([&m, u, name](Tensor&) {
        if (!m.iterationActive || !u->backwardDone) return;
        throw InvalidArgument(str("[", m.who(), "] sharded unit '", u->name, "': parameter ", name,
                                  " got its gradient after the unit's backward was over and its gradients were "
                                  "reduced (iteration ", m.iteration, "): it is used outside the unit's forward, or on "
                                  "a path that does not pass through the unit's input. Make it part of the unit that "
                                  "uses it (or of the root)"));
      });
    }
  }
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  Impl& m = *impl_;
  try {
    m.summoned = false;
    m.abandonIteration();
  } catch (const std::exception&) {  // a destructor reports nothing; the group's errors were reported
  }
  for (auto& u : m.units) {
    if (!u->isRoot) {
      for (int h : u->hookHandles) u->module->removeForwardHook(h);
    }
    for (ShardParam& p : u->params) p.param.removeHook(p.lateGradHook);
  }
  module_->removeForwardHook(m.rootHook[0]);
  module_->removeForwardHook(m.rootHook[1]);
}

Tensor FullyShardedDataParallel::operator()(const Tensor& input) { return (*module_)(input); }

std::vector<Tensor> FullyShardedDataParallel::forwardWith(const std::function<std::vector<Tensor>()>& body) {
  Impl& m = *impl_;
  if (m.summoned) return body();
  m.beginIteration();
  std::vector<Tensor> outputs;
  try {
    outputs = body();
  } catch (...) {
    m.inRootForward = false;
    throw;
  }
  m.afterRootForward(outputs);
  return outputs;
}

std::vector<Tensor> FullyShardedDataParallel::parameters() const {
  std::vector<Tensor> out;
  for (auto [u, p] : impl_->paramOrder) out.push_back(impl_->units[u]->params[p].shard);
  return out;
}

std::vector<optim::ParamGroup> FullyShardedDataParallel::paramGroups(const std::vector<optim::ParamGroup>& groups) const {
  std::map<const void*, Tensor> shardOf;
  for (auto [u, p] : impl_->paramOrder) {
    const ShardParam& sp = impl_->units[u]->params[p];
    shardOf[sp.param.id()] = sp.shard;
  }
  std::vector<optim::ParamGroup> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    optim::ParamGroup mapped{{}, groups[g].weightDecay};
    for (const Tensor& t : groups[g].params) {
      auto it = shardOf.find(t.id());
      if (it == shardOf.end()) {
        throw InvalidArgument(str("[", impl_->who(), "] FullyShardedDataParallel::paramGroups: group ", g, " holds ",
                                  t.describe(), ", which is no parameter of the wrapped model"));
      }
      mapped.params.push_back(it->second);
    }
    out.push_back(std::move(mapped));
  }
  return out;
}

ParameterMap FullyShardedDataParallel::parameterMap() const {
  ParameterMap map;
  for (auto [u, p] : impl_->paramOrder) {
    const ShardParam& sp = impl_->units[u]->params[p];
    map.add(sp.shard, {sp.name, Placement::Sharded, sp.shape, sp.globalOffset(impl_->rank()), sp.localRows * sp.rowNumel});
  }
  return map;
}

namespace {

class ShardedModelPart final : public StateProvider {
 public:
  explicit ShardedModelPart(FullyShardedDataParallel::Impl& impl) : impl_(impl) {}

  std::vector<StateTensor> collect() override {
    impl_.requireIdle("modelState().collect");
    std::vector<StateTensor> out;
    for (auto [u, p] : impl_.paramOrder) {
      const ShardParam& sp = impl_.units[u]->params[p];
      out.push_back({sp.name, Placement::Sharded, sp.shape, sp.globalOffset(impl_.rank()), sp.localView()});
    }
    for (const auto& [name, b] : impl_.owner.module().namedBuffers()) out.push_back({name, Placement::Replicated, b.sizes(), 0, b});
    return out;
  }

  void restore(const StateSource& source, const std::string& prefix, const RestoreContext&) override {
    impl_.requireIdle("modelState().restore");
    std::vector<std::string> expected;
    const auto full = [&](const std::string& name) { return prefix.empty() ? name : prefix + "." + name; };
    for (auto [u, p] : impl_.paramOrder) {
      const ShardParam& sp = impl_.units[u]->params[p];
      expected.push_back(full(sp.name));
      Tensor local = sp.localView();
      restoreTensor(source, expected.back(), sp.shape, sp.globalOffset(impl_.rank()), local);
    }
    for (const auto& [name, b] : impl_.owner.module().namedBuffers()) {
      expected.push_back(full(name));
      Tensor target = b;
      restoreTensor(source, expected.back(), b.sizes(), 0, target);
    }
    requireNoOthers(source, prefix, expected, "model");
  }

 private:
  FullyShardedDataParallel::Impl& impl_;
};

}  // namespace

std::shared_ptr<StateProvider> FullyShardedDataParallel::modelState() { return std::make_shared<ShardedModelPart>(*impl_); }

std::function<void(Tensor&, bool)> FullyShardedDataParallel::gradNormReducer() {
  std::shared_ptr<ProcessGroup> group = group_;
  return [group](Tensor& partial, bool max) {
    group->allreduce(partial, {.reduceOp = max ? ReduceOp::Max : ReduceOp::Sum})->wait();
  };
}

FullyShardedDataParallel::NoSyncGuard::NoSyncGuard(FullyShardedDataParallel* owner)
    : owner_(owner), previous_(owner->impl_->requireSync) {
  owner_->impl_->requireSync = false;
}

FullyShardedDataParallel::NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : owner_(other.owner_), previous_(other.previous_) {
  other.owner_ = nullptr;
}

FullyShardedDataParallel::NoSyncGuard::~NoSyncGuard() {
  if (owner_ != nullptr) owner_->impl_->requireSync = previous_;
}

FullyShardedDataParallel::NoSyncGuard FullyShardedDataParallel::noSync() { return NoSyncGuard(this); }

FullyShardedDataParallel::FullParametersGuard FullyShardedDataParallel::gatherFullParameters() {
  Impl& m = *impl_;
  m.requireIdle("gatherFullParameters");
  m.current = ShardedIterationStats{};  // reduceGradients reports this guard's gathers as its iteration's
  try {
    for (auto& u : m.units) m.launchGather(*u, kFull);
    for (auto& u : m.units) m.finishGather(*u, false);
  } catch (...) {
    // A member lost mid-gather: the units gathered so far and those still gathering (on a group
    // that is broken) go back to their shards, so that a rebind and the next gather start clean
    // instead of waiting on the old group's collectives again.
    for (auto& u : m.units) m.reshard(*u);
    throw;
  }
  m.summoned = true;
  return FullParametersGuard(this);
}

void FullyShardedDataParallel::reduceGradients() {
  Impl& m = *impl_;
  if (!m.summoned) {
    throw InvalidArgument(str("[", m.who(), "] FullyShardedDataParallel::reduceGradients outside a gatherFullParameters() "
                              "guard: inside one backward reduces nothing, outside it reduces by itself"));
  }
  NoGradGuard noGrad;
  try {
    for (auto& u : m.units) {
      std::vector<Tensor> grads;
      for (ShardParam& p : u->params) {
        grads.push_back(p.param.grad());
        p.param.setGrad(Tensor());
      }
      m.launchReduceScatter(*u, std::move(grads));
    }
    m.harvest(true);
  } catch (...) {
    for (auto& u : m.units) {
      u->reduceWork.reset();
      u->reduceInputs.clear();
      u->reduceSlots = u->reduceOut = Tensor();
    }
    throw;
  }
  ++m.iteration;
  m.current.iteration = m.iteration;
  m.finishStats();
  m.current = ShardedIterationStats{};
}

FullyShardedDataParallel::FullParametersGuard::FullParametersGuard(FullParametersGuard&& other) noexcept
    : owner_(other.owner_) {
  other.owner_ = nullptr;
}

FullyShardedDataParallel::FullParametersGuard::~FullParametersGuard() {
  if (owner_ == nullptr) return;
  Impl& m = *owner_->impl_;
  m.summoned = false;
  for (auto& u : m.units) m.reshard(*u);
}

void FullyShardedDataParallel::rebind(std::shared_ptr<ProcessGroup> group) {
  Impl& m = *impl_;
  // After a failed iteration (the elastic recovery's case: a member died mid-step) its
  // leftovers go first: the old group's collectives are waited for, every unit resharded.
  if (m.iterationFailed()) m.abandonIteration();
  m.requireIdle("rebind");
  if (!group || !group->isMember()) throw InvalidArgument("FullyShardedDataParallel::rebind: not a member of the new group");
  requireSameOnAllRanks(*group, m.describeUnits(),
                        str("[rank ", group->rank(), "/", group->size(), " pg=", group->name(),
                            "] FullyShardedDataParallel::rebind: the ranks' sharded models differ at"),
                        "entry", "Every rank of the new group must hold the same model and units.");
  group_ = group;
  m.group = std::move(group);
  for (auto& u : m.units) {
    m.layOut(*u);
    u->accumulated = Tensor();
  }
  m.allocateShards(false);
  m.lastForwardOrder.clear();
}

const ShardedIterationStats& FullyShardedDataParallel::lastIteration() const { return impl_->last; }
const ShardedIterationStats& FullyShardedDataParallel::totals() const { return impl_->totals; }

std::vector<std::string> FullyShardedDataParallel::unitNames() const {
  std::vector<std::string> out;
  for (const auto& u : impl_->units) out.push_back(u->name);
  return out;
}

}  // namespace dt
