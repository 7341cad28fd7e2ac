#include "tests/fsdp/harness.h"

#include <cmath>
#include <cstring>

#include "common/strings.h"
#include "store/hash_store.h"
#include "tensor/nn/clip_grad.h"
#include "tensor/optim/schedule.h"
#include "tests/testing/testing.h"

namespace dt::testing {

using namespace std::chrono_literals;

nn::GptConfig smallGpt(int64_t layers) {
  return {.vocabSize = 61, .contextLength = 8, .layers = layers, .heads = 2, .width = 16};
}

const char* wrapperName(Wrapper wrapper) {
  switch (wrapper) {
    case Wrapper::Ddp: return "ddp";
    case Wrapper::Zero1: return "zero1";
    case Wrapper::Zero2: return "zero2";
    case Wrapper::Sharded: return "sharded";
  }
  return "?";
}

namespace {

constexpr int64_t kTotalSteps = 20;

// Step s's global batch: rows of T + 1 tokens.
Tensor globalBatch(const RunSpec& spec, int64_t step) {
  Generator g(1000 + static_cast<uint64_t>(step));
  return randint(0, spec.model.vocabSize, {spec.globalBatch, spec.model.contextLength + 1}, g);
}

}  // namespace

TrainingRank::TrainingRank(const RunSpec& spec, std::shared_ptr<ProcessGroup> group) : spec_(spec), group_(std::move(group)) {
  model_ = std::make_shared<nn::Gpt>(spec_.model, init_);
  const auto groups = optim::decayGroups(*model_, 0.1);
  const optim::AdamWOptions adamw{.lr = 3e-3, .beta2 = 0.95};
  if (spec_.wrapper == Wrapper::Sharded) {
    FullyShardOptions options = spec_.sharded;
    options.units.clear();
    for (const auto& [name, block] : model_->h->namedChildren()) options.units.push_back(block);
    fsdp_ = std::make_unique<FullyShardedDataParallel>(model_, group_, options);
    optimizer_ = std::make_unique<optim::AdamW>(fsdp_->paramGroups(groups), adamw);
    return;
  }
  ddp_ = std::make_shared<DistributedDataParallel>(model_, group_, spec_.ddp);
  if (spec_.wrapper != Wrapper::Ddp) {
    zero_ = std::make_unique<ZeroRedundancy>(*ddp_, ZeroOptions{.stage = spec_.wrapper == Wrapper::Zero1 ? 1 : 2});
    optimizer_ = std::make_unique<optim::AdamW>(zero_->paramGroups(groups), adamw);
  } else {
    optimizer_ = std::make_unique<optim::AdamW>(groups, adamw);
  }
  // DDP plans its buckets once more after its first iteration: one thrown away, as
  // examples/gpt does, so that every real step (and ZeRO's parts) use the final layout.
  if (!spec_.settle) return;
  const int64_t rows = spec_.globalBatch / group_->size();
  const Tensor tokens = zeros({rows, spec_.model.contextLength}, DType::Int64);
  model_->eval();
  nn::Gpt::loss((*ddp_)(tokens), tokens).backward();
  model_->train();
  optimizer_->zeroGrad();
}

TrainingRank::~TrainingRank() {
  zero_.reset();
  fsdp_.reset();
}

double TrainingRank::train(int64_t from, int64_t to) {
  const optim::WarmupCosineSchedule schedule(3e-3, 2, kTotalSteps, 3e-4);
  const int world = group_->size(), rank = group_->rank();
  const int64_t perRank = spec_.globalBatch / world, micro = perRank / spec_.microBatches, T = spec_.model.contextLength;
  double lastLoss = 0;
  for (int64_t step = from; step < to; ++step) {
    optimizer_->setLr(schedule.at(step));
    optimizer_->zeroGrad();
    const Tensor all = globalBatch(spec_, step);
    std::vector<int64_t> mine;
    for (int64_t i = rank; i < spec_.globalBatch; i += world) mine.push_back(i);
    const Tensor rows = indexSelect(all, 0, fromVector<int64_t>(mine));
    double stepLoss = 0;
    const bool whole = fsdp_ && spec_.wholeAcrossMicroBatches;
    std::optional<FullyShardedDataParallel::FullParametersGuard> gathered;
    if (whole) gathered.emplace(fsdp_->gatherFullParameters());
    for (int m = 0; m < spec_.microBatches; ++m) {
      const Tensor part = rows.narrow(0, m * micro, micro);
      const Tensor inputs = part.narrow(1, 0, T).contiguous(), targets = part.narrow(1, 1, T).contiguous();
      std::optional<DistributedDataParallel::NoSyncGuard> ddpNoSync;
      std::optional<FullyShardedDataParallel::NoSyncGuard> shardedNoSync;
      if (m + 1 < spec_.microBatches && !whole) {
        if (fsdp_) shardedNoSync.emplace(fsdp_->noSync());
        else ddpNoSync.emplace(ddp_->noSync());
      }
      const Tensor logits = whole ? (*model_)(inputs) : fsdp_ ? (*fsdp_)(inputs) : (*ddp_)(inputs);
      const Tensor loss = nn::Gpt::loss(logits.to(DType::Float32), targets);
      stepLoss += loss.item<double>() / spec_.microBatches;
      mul(loss, 1.0 / spec_.microBatches).backward();
    }
    if (whole) {
      fsdp_->reduceGradients();
      gathered.reset();
    }
    if (fsdp_) {
      nn::clipGradNorm(fsdp_->parameters(), 1.0, {.reducePartial = fsdp_->gradNormReducer()});
    } else if (zero_) {
      nn::clipGradNorm(zero_->parameters(), 1.0, {.reducePartial = zero_->gradNormReducer()});
    } else {
      nn::clipGradNorm(model_->parameters(), 1.0);
    }
    optimizer_->step();
    Tensor l = fromVector<double>({stepLoss});
    group_->allreduce(l)->wait();
    lastLoss = l.item<double>() / world;
  }
  return lastLoss;
}

std::vector<Tensor> TrainingRank::fullParameters() {
  std::vector<Tensor> out;
  if (!fsdp_) {
    if (zero_) zero_->synchronize();
    for (const Tensor& p : model_->parameters()) out.push_back(p.detach().clone());
    return out;
  }
  // The float32 shards, gathered: exact, whatever the compute dtype.
  return gatherShards(*group_, fsdp_->parameters(), fsdp_->parameterMap(), [](const Tensor& s) { return s; });
}

std::vector<Tensor> gatherShards(ProcessGroup& group, const std::vector<Tensor>& shards, const ParameterMap& map,
                                 const std::function<Tensor(const Tensor&)>& pick) {
  std::vector<Tensor> out;
  for (size_t i = 0; i < shards.size(); ++i) {
    const Tensor local = pick(shards[i]).detach().contiguous();
    std::vector<Tensor> all;
    for (int r = 0; r < group.size(); ++r) all.push_back(empty(local.sizes(), local.dtype()));
    group.allgather(all, local)->wait();
    const Shape& shape = map.of(shards[i], i).shape;
    out.push_back(cat(all, 0).reshape({-1}).narrow(0, 0, shapeNumel(shape)).reshape(shape).clone());
  }
  return out;
}

TrainingState TrainingRank::state() {
  TrainingState state(group_->rank(), group_->size());
  if (fsdp_) {
    state.add("model", fsdp_->modelState()).addOptimizer("optim", *optimizer_, fsdp_->parameterMap());
  } else if (zero_) {
    state.add("model", zero_->modelState()).addOptimizer("optim", *optimizer_, zero_->parameterMap());
  } else {
    state.addModule("model", *model_).addOptimizer("optim", *optimizer_, ParameterMap::replicated(*model_));
  }
  return state;
}

void TrainingRank::rebind(std::shared_ptr<ProcessGroup> group) {
  group_ = group;
  fsdp_->rebind(std::move(group));
}

void withRanksAndStore(int world,
                       const std::function<void(int, const std::shared_ptr<ProcessGroup>&, const StorePtr&)>& fn,
                       const std::string& backend) {
  auto store = std::make_shared<HashStore>();
  runRanks(
      world,
      [&](int rank) {
        ProcessGroupOptions o;
        o.timeout = 30s;
        o.backend = backend;
        auto group = ProcessGroup::create(store, rank, world, o);
        fn(rank, group, store);
        group->destroy();
      },
      120s);
}

void withRanks(int world, const std::function<void(int, const std::shared_ptr<ProcessGroup>&)>& fn) {
  withRanksAndStore(world, [&](int rank, const std::shared_ptr<ProcessGroup>& group, const StorePtr&) { fn(rank, group); });
}

double relativeDifference(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, max(abs(sub(a[i].to(DType::Float64), b[i].to(DType::Float64)))).item<double>());
    scale = std::max(scale, max(abs(a[i].to(DType::Float64))).item<double>());
  }
  return diff / scale;
}

bool bitwiseEqual(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const Tensor x = a[i].contiguous(), y = b[i].contiguous();
    if (x.sizes() != y.sizes() || x.dtype() != y.dtype() || std::memcmp(x.dataPtr(), y.dataPtr(), x.nbytes()) != 0) {
      return false;
    }
  }
  return true;
}

std::vector<Tensor> trainedParameters(const RunSpec& spec, int world, int64_t steps) {
  std::vector<Tensor> out;
  withRanks(world, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    TrainingRank job(spec, group);
    job.train(0, steps);
    auto params = job.fullParameters();
    if (rank == 0) out = std::move(params);
  });
  return out;
}

}  // namespace dt::testing
