#include "parallel/clip_grad.h"

#include <map>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/strings.h"

namespace dt {

double clipTensorParallelGradNorm(const nn::Module& model, double maxNorm, const ProcessGroupPtr& tensorParallel,
                                  nn::ClipGradNormOptions options) {
  return clipTensorParallelGradNorm(model, model.parameters(), maxNorm, tensorParallel, std::move(options));
}

double clipTensorParallelGradNorm(const nn::Module& model, const std::vector<Tensor>& holders, double maxNorm,
                                  const ProcessGroupPtr& tensorParallel, nn::ClipGradNormOptions options) {
  if (!tensorParallel) throw InvalidArgument("clipTensorParallelGradNorm: the tensor-parallel group is null");
  if (options.isSplit || options.reduceSplitPartial) {
    throw InvalidArgument(str("clipTensorParallelGradNorm (rank ", tensorParallel->rank(), "/", tensorParallel->size(),
                              " group ", tensorParallel->name(),
                              "): options carry isSplit / reduceSplitPartial; this function sets them from the model"));
  }
  std::map<std::string, bool> splitByName;
  for (const ParameterShard& shard : parameterShardsOf(model)) splitByName[shard.name] = shard.dim >= 0;
  const NamedTensors named = model.namedParameters();
  if (holders.size() != named.size()) {
    throw InvalidArgument(str("clipTensorParallelGradNorm (rank ", tensorParallel->rank(), "/", tensorParallel->size(),
                              " group ", tensorParallel->name(), "): ", holders.size(), " gradient holders for the ",
                              named.size(), " parameters of the model; pass one per parameter, in namedParameters() "
                              "order (a sharded wrapper's parameters())"));
  }
  std::vector<bool> split;
  for (const auto& [name, parameter] : named) {
    auto it = splitByName.find(name);
    if (it == splitByName.end()) {
      throw InvalidArgument(str("clipTensorParallelGradNorm (rank ", tensorParallel->rank(), "/", tensorParallel->size(),
                                "): parameter \"", name, "\" has no entry in parameterShardsOf(model)"));
    }
    split.push_back(it->second);
  }
  options.isSplit = [&split](size_t index) { return split[index]; };
  options.reduceSplitPartial = [&tensorParallel](Tensor& partial, bool max) {
    tensorParallel->allreduce(partial, {.reduceOp = max ? ReduceOp::Max : ReduceOp::Sum})->wait();
  };
  return nn::clipGradNorm(holders, maxNorm, options);
}

}  // namespace dt
