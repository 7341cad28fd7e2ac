#include "ddp/zero.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <utility>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/autograd.h"
#include "tensor/profiler.h"

namespace dt {
namespace {

using Clock = std::chrono::steady_clock;
// Profiler tracks of ZeRO's parameter gathers: beside DDP's bucket tracks.
constexpr uint64_t kZeroTrackBase = (uint64_t{1} << 32) + (uint64_t{1} << 24);

}  // namespace

namespace zero_detail {

struct Part {
  std::string name;
  Tensor param;          // the model's parameter
  Tensor piece;          // the optimizer's leaf: param's elements [offset, offset + count), flat
  size_t bucket = 0;
  int64_t start = 0;     // the parameter's first element in its bucket
  int64_t numel = 0;
  int64_t offset = 0;    // of the piece in the parameter
  int64_t count = 0;
  uint32_t version = 0;  // the piece's version when the parameter was last whole everywhere
};

struct Bucket {
  std::vector<size_t> parts;  // in bucket order
  int64_t numel = 0, chunk = 0, tail = 0;
  Tensor buffer;              // DDP's gradient bucket (seen at its first reduction)
  bool released = false;
  WorkPtr reduceWork;
  Tensor shardGrad;           // this rank's run of the averaged gradient
  bool gatherPending = false;  // this round still has to gather the bucket
  WorkPtr gatherWork;
  Tensor gatherIn, gatherOut;
  int64_t gatherStartNs = 0;

  int64_t lo(int rank) const { return rank * chunk; }
  int64_t hi(int rank, int world) const { return rank == world - 1 ? numel : (rank + 1) * chunk; }
};

}  // namespace zero_detail

using zero_detail::Bucket;
using zero_detail::Part;

struct ZeroRedundancy::Impl {
  DistributedDataParallel& ddp;
  ZeroOptions options;
  std::vector<Part> parts;  // module().namedParameters() order
  std::vector<Bucket> buckets;
  std::vector<std::pair<nn::Module*, int>> moduleHooks;
  int ddpHooks[2] = {-1, -1};
  std::shared_ptr<char> alive = std::make_shared<char>(0);
  bool callbackQueued = false;
  bool eagerRelease = false;
  ZeroStats stats;

  Impl(DistributedDataParallel& d, ZeroOptions o) : ddp(d), options(o) {}

  ProcessGroup& group() { return ddp.processGroup(); }
  int rank() { return group().rank(); }
  int world() { return group().size(); }
  std::string who() { return str("rank ", rank(), "/", world(), " pg=", group().name()); }

  // Runs and pieces from DDP's current buckets; the leaves keep their identity.
  void layOut() {
    std::map<std::string, size_t> byName;
    for (size_t i = 0; i < parts.size(); ++i) byName[parts[i].name] = i;
    const int w = world(), r = rank();
    const auto infos = ddp.buckets();
    buckets.assign(infos.size(), Bucket{});
    for (size_t b = 0; b < infos.size(); ++b) {
      Bucket& bucket = buckets[b];
      int64_t at = 0;
      for (const std::string& name : infos[b].parameters) {
        auto it = byName.find(name);
        if (it == byName.end()) {
          throw InvalidArgument(str("[", who(), "] ZeroRedundancy: DDP bucket ", b, " holds '", name,
                                    "', which is no trained parameter of the model"));
        }
        Part& p = parts[it->second];
        p.bucket = b;
        p.start = at;
        at += p.numel;
        bucket.parts.push_back(it->second);
      }
      bucket.numel = at;
      bucket.chunk = at / w;
      bucket.tail = at - bucket.chunk * w;
      for (size_t i : bucket.parts) {
        Part& p = parts[i];
        const int64_t begin = std::max(p.start, bucket.lo(r)), end = std::min(p.start + p.numel, bucket.hi(r, w));
        p.offset = end > begin ? begin - p.start : 0;
        p.count = std::max<int64_t>(0, end - begin);
        Tensor view = p.param.detach().view({-1}).narrow(0, p.offset, p.count);
        if (!p.piece.defined()) {
          p.piece = view.detach();
          p.piece.setRequiresGrad(true);
        } else {
          TensorImpl& impl = *p.piece.unsafeImpl();
          const TensorImpl& from = *view.unsafeImpl();
          impl.storage = from.storage;
          impl.sizes = from.sizes;
          impl.strides = from.strides;
          impl.offset = from.offset;
          impl.refreshGeometry();
          p.piece.setGrad(Tensor());
        }
        p.version = p.piece.version();
      }
    }
  }

  bool stepped() const {
    for (const Part& p : parts) {
      if (p.piece.version() != p.version) return true;
    }
    return false;
  }

  // ---- the gradients ----------------------------------------------------------------------

  WorkPtr reduce(ProcessGroup& g, GradBucket& grad) {
    if (grad.index >= buckets.size() || buckets[grad.index].parts.size() != grad.parameters.size() ||
        !std::equal(grad.parameters.begin(), grad.parameters.end(), buckets[grad.index].parts.begin(),
                    [&](const Tensor& t, size_t i) { return t.isSameAs(parts[i].param); })) {
      // DDP planned its buckets again (once, after its first iteration).
      if (stepped()) {
        throw InvalidArgument(str("[", who(), "] ZeroRedundancy: DDP changed its buckets after the optimizer's first "
                                  "step, so the parameter parts each rank's optimizer state belongs to moved; run one "
                                  "iteration before the first step (DDP rebuilds its buckets after it), or plan DDP's "
                                  "buckets from a saved order"));
      }
      layOut();
    }
    Bucket& bucket = buckets[grad.index];
    bucket.buffer = grad.buffer;
    if (eagerRelease) harvest(false);
    const int w = world();
    NoGradGuard noGrad;
    bucket.shardGrad = zeros({bucket.hi(rank(), w) - bucket.lo(rank())}, grad.buffer.options());
    std::vector<WorkPtr> works;
    if (bucket.chunk > 0) {
      works.push_back(g.reduceScatterTensor(bucket.shardGrad.narrow(0, 0, bucket.chunk),
                                            grad.buffer.narrow(0, 0, bucket.chunk * w)));
    }
    if (bucket.tail > 0) works.push_back(g.allreduce(grad.buffer.narrow(0, bucket.chunk * w, bucket.tail)));
    bucket.reduceWork = works.size() == 1 ? works[0] : allOf(str("ZeRO reduce of bucket ", grad.index), works);
    if (!callbackQueued) {
      callbackQueued = true;
      std::weak_ptr<char> token = alive;
      queueCallback(
          [this, token] {
            if (!token.expired()) afterBackward();
          },
          CallbackPass::Outermost);
    }
    return bucket.reduceWork;
  }

  // Gives the pieces their gradients from every finished (or, with all, every) reduction.
  void harvest(bool all) {
    const int w = world(), r = rank();
    NoGradGuard noGrad;
    for (size_t b = 0; b < buckets.size(); ++b) {
      Bucket& bucket = buckets[b];
      if (!bucket.reduceWork || (!all && !bucket.reduceWork->isCompleted())) continue;
      bucket.reduceWork->wait();  // a failure was DDP's to report: it waited first
      bucket.reduceWork.reset();
      if (r == w - 1 && bucket.tail > 0) {
        bucket.shardGrad.narrow(0, bucket.chunk, bucket.tail).copy_(bucket.buffer.narrow(0, bucket.chunk * w, bucket.tail));
      }
      for (size_t i : bucket.parts) {
        Part& p = parts[i];
        Tensor existing = p.piece.grad();
        if (p.count == 0) {
          // No elements here; an empty gradient keeps the optimizer's step count in line.
          if (!existing.defined()) p.piece.setGrad(zeros({0}, bucket.shardGrad.options()));
          continue;
        }
        const Tensor g = bucket.shardGrad.narrow(0, p.start + p.offset - bucket.lo(r), p.count);
        if (existing.defined()) {
          existing.add_(g);
        } else {
          p.piece.setGrad(g);
        }
      }
      bucket.shardGrad = Tensor();
      if (options.stage == 2 && bucket.buffer.defined() && !bucket.released) {
        Storage storage = bucket.buffer.storage();
        storage.resizeBytes(0);
        bucket.released = true;
        ++stats.releasedBuckets;
      }
    }
  }

  bool bucketsChanged() {
    const auto infos = ddp.buckets();
    if (infos.size() != buckets.size()) return true;
    for (size_t b = 0; b < infos.size(); ++b) {
      if (infos[b].parameters.size() != buckets[b].parts.size()) return true;
      for (size_t k = 0; k < infos[b].parameters.size(); ++k) {
        if (infos[b].parameters[k] != parts[buckets[b].parts[k]].name) return true;
      }
    }
    return false;
  }

  // DDP planned its buckets again at the end of its first iteration (every rank alike): the
  // parts move to the new runs, and this iteration's gradients with them (one allgather of
  // the gradient, once).
  void followRebuild() {
    const int w = world(), r = rank();
    NoGradGuard noGrad;
    std::vector<Tensor> whole(parts.size());
    for (size_t b = 0; b < buckets.size(); ++b) {
      Bucket& bucket = buckets[b];
      if (bucket.parts.empty()) continue;
      const int64_t block = bucket.chunk + bucket.tail;
      const Tensor& first = parts[bucket.parts.front()].param;
      Tensor in = zeros({block}, first.options());
      bool any = false;
      for (size_t i : bucket.parts) {
        const Part& p = parts[i];
        const Tensor g = p.piece.grad();
        if (g.defined()) any = true;
        if (p.count > 0 && g.defined()) in.narrow(0, p.start + p.offset - bucket.lo(r), p.count).copy_(g);
      }
      Tensor out = empty({block * w}, first.options());
      group().allgatherIntoTensor(out, in)->wait();
      if (!any) continue;
      for (size_t i : bucket.parts) {
        const Part& p = parts[i];
        whole[i] = zeros({p.numel}, first.options());
        for (int q = 0; q < w; ++q) {
          const int64_t begin = std::max(p.start, bucket.lo(q)), end = std::min(p.start + p.numel, bucket.hi(q, w));
          if (end > begin) whole[i].narrow(0, begin - p.start, end - begin).copy_(out.narrow(0, q * block + begin - bucket.lo(q), end - begin));
        }
      }
    }
    layOut();
    for (size_t i = 0; i < parts.size(); ++i) {
      if (whole[i].defined()) parts[i].piece.setGrad(whole[i].narrow(0, parts[i].offset, parts[i].count).clone());
    }
  }

  void afterBackward() {
    callbackQueued = false;
    harvest(true);
    if (bucketsChanged()) followRebuild();
    // The parameters' own gradients held partial sums only; the parts hold the result.
    for (Part& p : parts) p.param.setGrad(Tensor());
  }

  void regainBuffers() {
    for (Bucket& bucket : buckets) {
      if (!bucket.released) continue;
      Storage storage = bucket.buffer.storage();
      storage.resizeBytes(static_cast<size_t>(bucket.numel) * bucket.buffer.itemsize());
      bucket.released = false;
    }
  }

  // ---- the parameters ---------------------------------------------------------------------

  // At most this many bucket gathers are on the wire at once: each holds a bucket-sized result
  // until its parameters are copied out, so all at once would be one more copy of the model.
  static constexpr int kGathersInFlight = 2;

  // A round of gathers starts when the optimizer (or a restore) changed this rank's parts since
  // the parameters were last whole everywhere, and then gathers every bucket: deciding per
  // bucket could differ between ranks (a rank whose pieces of a bucket are empty).
  void startRound() {
    for (const Bucket& bucket : buckets) {
      if (bucket.gatherPending) return;  // one is under way
    }
    if (!stepped()) return;
    for (Bucket& bucket : buckets) bucket.gatherPending = !bucket.parts.empty();
    ++stats.steps;
  }

  void launchGather(size_t b) {
    Bucket& bucket = buckets[b];
    if (bucket.gatherWork || !bucket.gatherPending) return;
    const int w = world(), r = rank();
    NoGradGuard noGrad;
    const Tensor& first = parts[bucket.parts.front()].param;
    const int64_t block = bucket.chunk + bucket.tail;
    bucket.gatherIn = zeros({block}, first.options());
    for (size_t i : bucket.parts) {
      const Part& p = parts[i];
      if (p.count > 0) bucket.gatherIn.narrow(0, p.start + p.offset - bucket.lo(r), p.count).copy_(p.piece);
    }
    bucket.gatherOut = empty({block * w}, first.options());
    const int64_t startNs = profiler::recording() ? profiler::nowNs() : 0;
    bucket.gatherWork = group().allgatherIntoTensor(bucket.gatherOut, bucket.gatherIn);
    const bool profiling = profiler::recording();
    const std::string args = str("\"bucket\": ", b, ", \"bytes\": ", bucket.gatherOut.nbytes());
    bucket.gatherWork->thenInline([profiling, startNs, r, b, args](Work& work) {
      if (!profiling || !profiler::recording()) return;
      profiler::recordEvent("zero gather", EventCategory::Ddp, startNs, profiler::nowNs(),
                            work.isSuccess() ? args : args + ", \"failed\": true", r, kZeroTrackBase + b,
                            str("zero gather ", b));
    });
    stats.gatherBytes += bucket.gatherOut.nbytes();
  }

  // Keeps kGathersInFlight bucket gathers going, in the order the forward needs them (the last
  // bucket holds the first parameters). The same on every rank: the same forward, the same calls.
  void launchGathers() {
    startRound();
    int inFlight = 0;
    for (const Bucket& bucket : buckets) inFlight += bucket.gatherWork ? 1 : 0;
    for (size_t b = buckets.size(); b-- > 0 && inFlight < kGathersInFlight;) {
      if (buckets[b].gatherWork || !buckets[b].gatherPending) continue;
      launchGather(b);
      ++inFlight;
    }
  }

  void finishGather(size_t b) {
    Bucket& bucket = buckets[b];
    if (!bucket.gatherWork) launchGather(b);  // needed before its turn (a forward of another order)
    if (!bucket.gatherWork) return;
    const auto start = Clock::now();
    try {
      bucket.gatherWork->wait();
    } catch (...) {
      bucket.gatherWork.reset();
      std::rethrow_exception(withPrefix(std::current_exception(), str("ZeRO parameter gather of bucket ", b, ": ")));
    }
    stats.gatherWaitMs += std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    const int w = world(), r = rank();
    const int64_t block = bucket.chunk + bucket.tail;
    NoGradGuard noGrad;
    for (size_t i : bucket.parts) {
      Part& p = parts[i];
      Tensor flat = p.param.detach().view({-1});
      for (int q = 0; q < w; ++q) {
        if (q == r) continue;
        const int64_t begin = std::max(p.start, bucket.lo(q)), end = std::min(p.start + p.numel, bucket.hi(q, w));
        if (end <= begin) continue;
        flat.narrow(0, begin - p.start, end - begin).copy_(bucket.gatherOut.narrow(0, q * block + begin - bucket.lo(q), end - begin));
      }
      p.param.bumpVersion();
      p.version = p.piece.version();
    }
    bucket.gatherWork.reset();
    bucket.gatherIn = bucket.gatherOut = Tensor();
    bucket.gatherPending = false;
    launchGathers();
  }

  void finishAll() {
    for (size_t b = buckets.size(); b-- > 0;) finishGather(b);
  }

  void beforeForward() {
    launchGathers();
    // Not before DDP has settled its buckets (after its first iteration): that rebuild copies
    // the gradients out of the old buffers, so they must still hold them.
    eagerRelease = options.stage == 2 && ddp.bucketsRebuilt();
    for (const Part& p : parts) {
      if (p.param.grad().defined()) eagerRelease = false;  // noSync accumulation: DDP may restore some
    }
  }
};

ZeroRedundancy::ZeroRedundancy(DistributedDataParallel& ddp, ZeroOptions options)
    : impl_(std::make_unique<Impl>(ddp, options)) {
  Impl& m = *impl_;
  if (options.stage != 1 && options.stage != 2) {
    throw InvalidArgument(str("[", m.who(), "] ZeroRedundancy: stage ", options.stage, " is not 1 or 2 (stage 3 is "
                              "FullyShardedDataParallel, fsdp/fully_shard.h)"));
  }
  for (const auto& [name, t] : ddp.module().namedParameters()) {
    if (!t.requiresGrad()) continue;
    if (!t.isContiguous()) {
      throw InvalidArgument(str("[", m.who(), "] ZeroRedundancy: parameter ", name, " (", t.describe(), ") is not contiguous"));
    }
    Part p;
    p.name = name;
    p.param = t;
    p.numel = t.numel();
    m.parts.push_back(std::move(p));
  }
  m.layOut();
  std::weak_ptr<char> token = m.alive;
  ddp.registerCommHook([&m, token](ProcessGroup& g, GradBucket& bucket) {
    return token.expired() ? g.allreduce(bucket.buffer) : m.reduce(g, bucket);
  });
  // Before the DDP forward: the gathers; before each module: its buckets; after it: stage
  // 2's buffers back for the backward that follows.
  m.ddpHooks[0] = ddp.registerForwardPreHook([&m](nn::Module&, const Tensor&) {
    m.beforeForward();
    return Tensor();
  });
  m.ddpHooks[1] = ddp.registerForwardHook([&m](nn::Module&, const Tensor&, const Tensor&) {
    m.finishAll();
    if (gradModeEnabled()) m.regainBuffers();
    return Tensor();
  });
  std::map<const void*, size_t> partOf;
  for (size_t i = 0; i < m.parts.size(); ++i) partOf[m.parts[i].param.id()] = i;
  std::vector<nn::Module*> pending{&ddp.module()};
  while (!pending.empty()) {
    nn::Module* mod = pending.back();
    pending.pop_back();
    for (const auto& [name, child] : mod->namedChildren()) pending.push_back(child.get());
    std::vector<size_t> own;  // the module's own parameters, as parts (their buckets may be planned again)
    for (const auto& [name, t] : mod->namedParameters(false)) {
      if (auto it = partOf.find(t.id()); it != partOf.end()) own.push_back(it->second);
    }
    if (own.empty()) continue;
    const int handle = mod->registerForwardPreHook([&m, own](nn::Module&, const Tensor&) {
      m.launchGathers();  // a forward that did not come through DDP's (the model called directly)
      for (size_t i : own) m.finishGather(m.parts[i].bucket);
      return Tensor();
    });
    m.moduleHooks.emplace_back(mod, handle);
  }
}

ZeroRedundancy::~ZeroRedundancy() {
  Impl& m = *impl_;
  try {
    m.finishAll();
    m.regainBuffers();
  } catch (const std::exception&) {  // a destructor reports nothing: the failed gather was reported
  }
  for (auto& [mod, handle] : m.moduleHooks) mod->removeForwardHook(handle);
  m.ddp.removeForwardHook(m.ddpHooks[0]);
  m.ddp.removeForwardHook(m.ddpHooks[1]);
  try {
    m.ddp.registerCommHook(nullptr);
  } catch (const std::exception&) {  // mid-iteration: DDP keeps the hook, which falls back to allreduce
  }
}

std::vector<Tensor> ZeroRedundancy::parameters() const {
  std::vector<Tensor> out;
  for (const Part& p : impl_->parts) out.push_back(p.piece);
  return out;
}

std::vector<optim::ParamGroup> ZeroRedundancy::paramGroups(const std::vector<optim::ParamGroup>& groups) const {
  std::vector<optim::ParamGroup> out;
  for (size_t g = 0; g < groups.size(); ++g) {
    optim::ParamGroup mapped{{}, groups[g].weightDecay};
    for (const Tensor& t : groups[g].params) {
      auto it = std::find_if(impl_->parts.begin(), impl_->parts.end(), [&](const Part& p) { return p.param.isSameAs(t); });
      if (it == impl_->parts.end()) {
        throw InvalidArgument(str("[", impl_->who(), "] ZeroRedundancy::paramGroups: group ", g, " holds ", t.describe(),
                                  ", which is no trained parameter of the DDP model"));
      }
      mapped.params.push_back(it->piece);
    }
    out.push_back(std::move(mapped));
  }
  return out;
}

ParameterMap ZeroRedundancy::parameterMap() const {
  ParameterMap map;
  for (const Part& p : impl_->parts) map.add(p.piece, {p.name, Placement::Sharded, p.param.sizes(), p.offset, p.count});
  return map;
}

std::function<void(Tensor&, bool)> ZeroRedundancy::gradNormReducer() {
  Impl* m = impl_.get();
  return [m](Tensor& partial, bool max) {
    m->group().allreduce(partial, {.reduceOp = max ? ReduceOp::Max : ReduceOp::Sum})->wait();
  };
}

namespace {

class ZeroModelPart final : public StateProvider {
 public:
  ZeroModelPart(ZeroRedundancy& zero, nn::Module& module) : zero_(zero), inner_(moduleState(module)) {}
  std::vector<StateTensor> collect() override {
    zero_.gatherParameters();
    zero_.synchronize();
    return inner_->collect();
  }
  void restore(const StateSource& source, const std::string& prefix, const RestoreContext& context) override {
    zero_.synchronize();
    inner_->restore(source, prefix, context);
  }

 private:
  ZeroRedundancy& zero_;
  std::shared_ptr<StateProvider> inner_;
};

}  // namespace

std::shared_ptr<StateProvider> ZeroRedundancy::modelState() {
  return std::make_shared<ZeroModelPart>(*this, impl_->ddp.module());
}

void ZeroRedundancy::gatherParameters() { impl_->launchGathers(); }

void ZeroRedundancy::synchronize() {
  impl_->launchGathers();
  impl_->finishAll();
}

const ZeroStats& ZeroRedundancy::stats() const { return impl_->stats; }

}  // namespace dt
