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
// across replicas when backward returns, so this is all (no dp reduction). ZeRO and the fully
// sharded wrapper bring their own reducer (gradNormReducer) over flat buckets that mix split
// and replicated parameters; under tensor parallelism they are not supported yet, and
// train::Loop refuses that combination.
//
// Contract: collective over `tensorParallel` (every rank of it calls it once per step, after
// backward and before the optimizer step); otherwise nn::clipGradNorm's contract (options as
// there: normType, errorIfNonfinite; `options.reducePartial`, if set, then reduces the total
// over an outer group). InvalidArgument when a parameter of `model` is not in
// parameterShardsOf(model), or when options already carry an isSplit / reduceSplitPartial.
#pragma once

#include "parallel/parallelize.h"
#include "tensor/nn/clip_grad.h"

namespace dt {

// Returns the norm before clipping; scales every gradient of `model` in place when it exceeds
// maxNorm.
double clipTensorParallelGradNorm(const nn::Module& model, double maxNorm, const ProcessGroupPtr& tensorParallel,
                                  nn::ClipGradNormOptions options = {});

}  // namespace dt
