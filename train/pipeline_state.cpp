#include "train/pipeline_state.h"

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "parallel/checkpoint.h"
#include "parallel/parallelize.h"

namespace dt::train {
namespace {

std::string joinName(const std::string& prefix, const std::string& name) { return prefix.empty() ? name : prefix + "." + name; }

// The stages' tensors by unsplit name, each once (V's rank 0 holds the tied weight in two chunks).
std::vector<std::pair<std::string, Tensor>> stageTensors(const pipeline::GptStages& stages) {
  std::vector<std::pair<std::string, Tensor>> out;
  std::set<std::string> seen;
  for (const auto& chunk : stages.chunks) {
    for (auto& [name, t] : chunk->stateDict()) {
      if (seen.insert(name).second) out.emplace_back(name, t);
    }
  }
  return out;
}

bool isLastStagesCopy(const pipeline::GptStages& stages, const Tensor& t) {
  return stages.tiedCopy.defined() && stages.tiedIsLast && t.dataPtr() == stages.tiedCopy.dataPtr();
}

// Where a stage's tensor sits in the checkpoint, and whether this rank writes it (see the header).
class Placer {
 public:
  Placer(const pipeline::GptStages& stages, const nn::Module& model, int replica, int tpRank, StageShards shards)
      : stages_(stages), replica_(replica), tpRank_(tpRank), sharded_(std::move(shards)) {
    for (ParameterShard& shard : parameterShardsOf(model)) {
      std::string name = shard.name;
      shards_.emplace(std::move(name), std::move(shard));
    }
  }

  // The tensor that holds `t`'s elements on this rank: its shard when sharded, else itself.
  Tensor holder(const Tensor& t) const {
    auto it = sharded_.find(t.id());
    return it == sharded_.end() ? t : it->second.shard;
  }

  // What of `t` this rank holds, as a flat run (a shard's padding rows left out), or t itself.
  Tensor held(const Tensor& t) const {
    auto it = sharded_.find(t.id());
    if (it == sharded_.end()) return t;
    const StageShard& s = it->second;
    const int64_t count = s.layout.count < 0 ? s.shard.numel() : s.layout.count;
    return s.shard.reshape({-1}).narrow(0, 0, count);
  }

  ParameterLayout of(const std::string& name, const Tensor& t) const {
    const bool copy = isLastStagesCopy(stages_, t);
    if (auto it = sharded_.find(t.id()); it != sharded_.end()) {
      // Each dp rank its own rows, named as the unsplit model names them.
      ParameterLayout layout = it->second.layout;
      layout.name = name;
      layout.savedByAnotherRank = copy;
      return layout;
    }
    auto it = shards_.find(name);
    if (it != shards_.end() && it->second.dim >= 0) {
      return tensorParallelLayout(it->second, t.sizes(), replica_ != 0 || copy);
    }
    // Whole on this rank: a piece that covers it, from one rank of all that hold it.
    ParameterLayout layout{name, Placement::Sharded, t.sizes()};
    layout.savedByAnotherRank = replica_ != 0 || tpRank_ != 0 || copy;
    return layout;
  }

 private:
  const pipeline::GptStages& stages_;
  int replica_, tpRank_;
  std::map<std::string, ParameterShard> shards_;
  StageShards sharded_;
};

class PipelineModelPart final : public StateProvider {
 public:
  PipelineModelPart(const pipeline::GptStages& stages, const nn::Module& model, int replica, int tpRank, StageShards shards)
      : stages_(stages), placer_(stages, model, replica, tpRank, std::move(shards)) {}

  std::vector<StateTensor> collect() override {
    std::vector<StateTensor> out;
    for (auto& [name, t] : stageTensors(stages_)) {
      const ParameterLayout l = placer_.of(name, t);
      if (!l.savedByAnotherRank) out.push_back({name, l.placement, l.shape, l.offset, placer_.held(t), l.stride, l.repeats});
    }
    return out;
  }

  void restore(const StateSource& source, const std::string& prefix, const RestoreContext&) override {
    for (auto& [name, t] : stageTensors(stages_)) {
      const ParameterLayout l = placer_.of(name, t);
      Tensor target = placer_.held(t);
      restoreRuns(source, joinName(prefix, name), l.shape, l.offset, l.stride, l.repeats, target);
    }
  }

 private:
  const pipeline::GptStages& stages_;
  Placer placer_;
};

// A source that shows only the optimizer state of the parameters in `keep` under `prefix`, so
// that the checkpoint module's optimizer part, which refuses state for parameters it does not
// update, restores a stage from a checkpoint of the whole model.
class StageSource final : public StateSource {
 public:
  StageSource(const StateSource& source, std::string prefix, std::set<std::string> keep)
      : source_(source), head_(prefix.empty() ? "" : prefix + "."), keep_(std::move(keep)) {}

  std::string describe() const override { return source_.describe(); }
  int64_t step() const override { return source_.step(); }
  int worldSize() const override { return source_.worldSize(); }
  const std::map<std::string, std::string>& metadata() const override { return source_.metadata(); }
  std::vector<StateTensorInfo> tensors() const override {
    std::vector<StateTensorInfo> out;
    for (StateTensorInfo& info : source_.tensors()) {
      if (shown(info.name)) out.push_back(std::move(info));
    }
    return out;
  }
  std::optional<StateTensorInfo> find(const std::string& name) const override {
    return shown(name) ? source_.find(name) : std::nullopt;
  }
  void read(const std::string& name, int64_t offset, Tensor& dst, int rank) const override {
    source_.read(name, offset, dst, rank);
  }
  Tensor adoptable(const std::string& name) const override { return source_.adoptable(name); }

 private:
  // "<prefix>.<parameter>.<state>": the state's name has no dot.
  bool shown(const std::string& name) const {
    if (!name.starts_with(head_)) return true;
    const std::string rest = name.substr(head_.size());
    const auto dot = rest.rfind('.');
    return dot != std::string::npos && keep_.count(rest.substr(0, dot)) != 0;
  }

  const StateSource& source_;
  std::string head_;
  std::set<std::string> keep_;
};

class PipelineOptimizerPart final : public StateProvider {
 public:
  PipelineOptimizerPart(const pipeline::GptStages& stages, optim::Optimizer& optimizer, const nn::Module& model,
                        int replica, int tpRank, bool writesSharedScalars, StageShards shards)
      : stages_(stages), optimizer_(optimizer), model_(model), placer_(stages, model, replica, tpRank, std::move(shards)),
        writesSharedScalars_(writesSharedScalars) {}

  std::vector<StateTensor> collect() override {
    TrainingState inner;
    inner.addOptimizer("", optimizer_, parameterMap());
    std::vector<StateTensor> out = inner.collect();
    if (!writesSharedScalars_) return out;
    // The scalars (AdamW's step) of the parameters other ranks hold, from this rank's own.
    std::set<std::string> mine;
    for (const auto& [name, t] : stages_.namedParameters()) mine.insert(name);
    std::map<std::string, StateTensor> scalars;  // by state name
    for (const StateTensor& t : out) {
      const auto dot = t.name.rfind('.');
      if (t.placement == Placement::Replicated && dot != std::string::npos) scalars.emplace(t.name.substr(dot + 1), t);
    }
    for (const auto& [name, parameter] : model_.namedParameters()) {
      if (mine.count(name)) continue;
      for (const auto& [state, t] : scalars) out.push_back({name + "." + state, Placement::Replicated, t.shape, 0, t.local});
    }
    return out;
  }

  void restore(const StateSource& source, const std::string& prefix, const RestoreContext& context) override {
    std::set<std::string> mine;
    for (const auto& [name, t] : stages_.namedParameters()) mine.insert(name);
    TrainingState inner(context.rank, context.worldSize);
    inner.addOptimizer(prefix, optimizer_, parameterMap());
    inner.restore(StageSource(source, prefix, std::move(mine)));
  }

 private:
  ParameterMap parameterMap() const {
    ParameterMap map;
    std::set<const void*> seen;
    for (const auto& [name, t] : stages_.namedParameters()) {
      if (seen.insert(t.dataPtr()).second) map.add(placer_.holder(t), placer_.of(name, t));
    }
    return map;
  }

  const pipeline::GptStages& stages_;
  optim::Optimizer& optimizer_;
  const nn::Module& model_;
  Placer placer_;
  bool writesSharedScalars_;
};

}  // namespace

std::shared_ptr<StateProvider> pipelineModelState(const pipeline::GptStages& stages, const nn::Module& model, int replica,
                                                  int tpRank, StageShards shards) {
  return std::make_shared<PipelineModelPart>(stages, model, replica, tpRank, std::move(shards));
}

std::shared_ptr<StateProvider> pipelineOptimizerState(const pipeline::GptStages& stages, optim::Optimizer& optimizer,
                                                      const nn::Module& model, int replica, int tpRank,
                                                      bool writesSharedScalars, StageShards shards) {
  return std::make_shared<PipelineOptimizerPart>(stages, optimizer, model, replica, tpRank, writesSharedScalars,
                                                 std::move(shards));
}

}  // namespace dt::train
