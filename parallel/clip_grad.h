// Gradient clipping of a tensor-parallel model: the global gradient norm of the whole (unsplit)
// model, as one process would compute it, from ranks that each hold blocks of it.
//
//   dt::parallelize(*model, mesh["tp"], dt::gptParallelPlan());
//   dt::DistributedDataParallel ddp(model, mesh["dp"]);
//   ... loss.backward();                               // gradients averaged over dp
//   dt::clipTensorParallelGradNorm(*model, 1.0, mesh["tp"]);
//   optimizer.step();
//
// Counting: a parameter that a tensor-parallel layer splits (parameterShardsOf: dim >= 0) adds
// the squares of its block on each rank, summed over the TP group, so each element counts once;
// a replicated parameter (the norms, a row-parallel bias, wpe, and with sequence parallelism
// the norms whose gradients the layers already summed) is whole and equal on every rank of the
// group and counts once. One all-reduce of one float64 value over the TP group (max for the
// infinity norm), whatever the model.
//
// Composition: under DDP over another mesh dimension the gradients are averaged and equal
// across replicas when backward returns, so this is all (no dp reduction). Under ZeRO-1/2 over
// dp each parameter's gradient is held by a leaf of this rank's elements (ZeroRedundancy::
// parameters(), one per parameter in the model's order): pass those as `holders` and the
// wrapper's gradNormReducer() as options.reducePartial. The split parameters' partial sum is
// all-reduced over tp first, the replicated ones' added once, and that sum over dp: every
// element of the whole model counts exactly once.
//
// Contract: collective over `tensorParallel` (every rank of it calls it once per step, after
// backward and before the optimizer step); otherwise nn::clipGradNorm's contract (options as
// there: normType, errorIfNonfinite; `options.reducePartial`, if set, then reduces the total
// over an outer group). InvalidArgument when a parameter of `model` is not in
// parameterShardsOf(model), or when options already carry an isSplit / reduceSplitPartial.
#pragma once

#include <vector>

#include "parallel/parallelize.h"
#include "tensor/nn/clip_grad.h"

namespace dt {

// Returns the norm before clipping; scales every gradient of `model` in place when it exceeds
// maxNorm.
double clipTensorParallelGradNorm(const nn::Module& model, double maxNorm, const ProcessGroupPtr& tensorParallel,
                                  nn::ClipGradNormOptions options = {});

// The same with the gradients held elsewhere: holders[i] holds the gradient of the i-th of
// model.namedParameters() (a sharded wrapper's per-parameter leaves). InvalidArgument when the
// counts differ.
double clipTensorParallelGradNorm(const nn::Module& model, const std::vector<Tensor>& holders, double maxNorm,
                                  const ProcessGroupPtr& tensorParallel, nn::ClipGradNormOptions options = {});

}  // namespace dt
