#include "parallel/checkpoint.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "common/strings.h"

namespace dt {
namespace {

std::map<std::string, ParameterShard> shardsByName(const nn::Module& model) {
  std::map<std::string, ParameterShard> out;
  for (ParameterShard& shard : parameterShardsOf(model)) {
    std::string name = shard.name;
    out.emplace(std::move(name), std::move(shard));
  }
  return out;
}

class TensorParallelModelPart final : public StateProvider {
 public:
  TensorParallelModelPart(nn::Module& model, int replica) : model_(model), replica_(replica) {}

  std::vector<StateTensor> collect() override {
    const auto shards = shardsByName(model_);
    std::vector<StateTensor> out;
    for (const auto& [name, t] : model_.stateDict()) {
      const ParameterLayout layout = layoutOf(shards, name, t);
      if (layout.savedByAnotherRank) continue;
      out.push_back({name, layout.placement, layout.shape, layout.offset, t, layout.stride, layout.repeats});
    }
    return out;
  }

  void restore(const StateSource& source, const std::string& prefix, const RestoreContext&) override {
    const auto shards = shardsByName(model_);
    std::vector<std::string> expected;
    for (auto& [name, t] : model_.stateDict()) {
      expected.push_back(prefix.empty() ? name : prefix + "." + name);
      const ParameterLayout layout = layoutOf(shards, name, t);
      Tensor target = t;
      restoreRuns(source, expected.back(), layout.shape, layout.offset, layout.stride, layout.repeats, target);
    }
    requireNoOthers(source, prefix, expected, "model");
  }

 private:
  ParameterLayout layoutOf(const std::map<std::string, ParameterShard>& shards, const std::string& name,
                           const Tensor& t) const {
    auto it = shards.find(name);
    if (it == shards.end()) return {name, Placement::Replicated, t.sizes()};  // a buffer
    return tensorParallelLayout(it->second, t.sizes(), replica_ != 0);
  }

  nn::Module& model_;
  int replica_;
};

}  // namespace

ParameterLayout tensorParallelLayout(const ParameterShard& shard, const Shape& localShape, bool savedByAnotherRank) {
  ParameterLayout layout{shard.name, Placement::Replicated, shard.globalShape};
  if (shard.dim < 0) return layout;
  const auto rank = static_cast<int64_t>(shard.globalShape.size());
  if (shard.dim >= rank || localShape.size() != shard.globalShape.size() || shard.parts < 1 ||
      shard.globalShape[static_cast<size_t>(shard.dim)] % shard.parts != 0 ||
      localShape[static_cast<size_t>(shard.dim)] % shard.parts != 0) {
    throw InvalidArgument(str("tensorParallelLayout: parameter \"", shard.name, "\" is ", describeShape(localShape),
                              " here, a shard of dim ", shard.dim, " in ", shard.parts, " parts of ",
                              describeShape(shard.globalShape), ", which does not fit"));
  }
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < shard.dim; ++d) outer *= shard.globalShape[static_cast<size_t>(d)];
  for (int64_t d = shard.dim + 1; d < rank; ++d) inner *= shard.globalShape[static_cast<size_t>(d)];
  const int64_t part = shard.globalShape[static_cast<size_t>(shard.dim)] / shard.parts;
  const int64_t held = localShape[static_cast<size_t>(shard.dim)] / shard.parts;
  layout.placement = Placement::Sharded;
  layout.offset = shard.offset * inner;
  layout.savedByAnotherRank = savedByAnotherRank;
  if (held == part) return layout;  // the dimension is whole here (TP = 1): one run, all of it
  layout.stride = part * inner;
  layout.repeats = outer * shard.parts;
  if (layout.repeats == 1) layout.stride = 0;  // one run: a dim-0 block of one part
  return layout;
}

std::shared_ptr<StateProvider> tensorParallelModelState(nn::Module& model, int replica) {
  return std::make_shared<TensorParallelModelPart>(model, replica);
}

ParameterMap tensorParallelParameterMap(const nn::Module& model, int replica) {
  const auto shards = shardsByName(model);
  ParameterMap map;
  for (const auto& [name, parameter] : model.namedParameters()) {
    auto it = shards.find(name);
    if (it == shards.end()) {
      throw InvalidArgument(str("tensorParallelParameterMap: parameter \"", name, "\" has no entry in parameterShardsOf"));
    }
    map.add(parameter, tensorParallelLayout(it->second, parameter.sizes(), replica != 0));
  }
  return map;
}

OuterPlacementOf tensorParallelPlacement(const nn::Module& model, int tpSize, int tpRank, int replica, bool optimizerNames) {
  if (tpSize < 1 || tpRank < 0 || tpRank >= tpSize) {
    throw InvalidArgument(str("tensorParallelPlacement: tp rank ", tpRank, " of ", tpSize, " is impossible"));
  }
  std::map<std::string, OuterPlacement> byName;
  for (auto& [name, shard] : shardsByName(model)) {
    OuterPlacement placement;
    placement.writesReplicated = replica == 0;
    placement.writesShards = tpRank == 0;
    if (shard.dim >= 0) {
      placement.localShape = shard.globalShape;
      auto& size = placement.localShape[static_cast<size_t>(shard.dim)];
      if (size % tpSize != 0) {
        throw InvalidArgument(str("tensorParallelPlacement: parameter \"", name, "\" ", describeShape(shard.globalShape),
                                  " does not split dim ", shard.dim, " over ", tpSize, " ranks"));
      }
      size /= tpSize;
      placement.layout = tensorParallelLayout(shard, placement.localShape, replica != 0);
    } else {
      placement.layout = {name, Placement::Replicated, shard.globalShape};
    }
    byName.emplace(name, std::move(placement));
  }
  return [byName = std::move(byName), optimizerNames](const std::string& name) -> std::optional<OuterPlacement> {
    std::string parameter = name;
    if (optimizerNames) {
      const auto dot = name.rfind('.');
      if (dot == std::string::npos) return std::nullopt;
      parameter = name.substr(0, dot);
    }
    auto it = byName.find(parameter);
    if (it == byName.end()) return std::nullopt;
    return it->second;
  };
}

}  // namespace dt
