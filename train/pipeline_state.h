// Checkpoint parts of a pipeline-split GPT (train/loop.h under LoopOptions::pipeline): each rank
// lists its stages' tensors under the unsplit model's names (pipeline::GptStages::namedParameters),
// so a checkpoint written at one pipeline degree loads at any other, or without a pipeline (the
// plain model's replicated parts read the same names), and a plain model's checkpoint loads into
// the stages.
//
//   TrainingState state(world->rank(), world->size());
//   state.add("model", pipelineModelState(stages, model, replica, tpRank));
//   state.add("optim", pipelineOptimizerState(stages, optimizer, model, replica, tpRank, world->rank() == 0));
//
// Placement: a stage's tensor is a Sharded piece that covers the whole tensor (offset 0), written
// by the rank that holds it; of the dp replicas of a stage only replica 0 lists it, and the last
// stage's copy of the tied embedding (equal to the first stage's, see pipeline.h) is left to the
// first stage's rank. Under tensor parallelism (a model parallelized before the split) a split
// parameter is placed as parallel/checkpoint.h places it (tensorParallelLayout: this rank's
// block in the global tensor), and a replicated one (norms, some biases, wpe) is written by tp
// rank 0 alone. The optimizer's per-parameter state is placed like its parameter. Its step
// counters are replicated scalars, which the checkpoint module writes from rank 0 alone: rank 0
// (writesSharedScalars) lists each scalar state for every parameter of the whole model with its
// own value, which is right because every parameter of a GPT is stepped at every step.
// Sharded stages (StageShards): every dp rank writes and reads its own rows of each stage
// parameter, and its optimizer state, placed where FullyShardedDataParallel places them.
//
// Contract:
//  * restore reads only the names this rank's stages hold: the source holds the other stages'
//    too, so unlike the plain model's part a name it does not know is no error. A name the stages
//    hold that the source lacks, or of another global shape, is InvalidArgument (restoreTensor's).
//  * `stages`, `optimizer` and `model` are held by reference and must outlive the providers; the
//    optimizer updates exactly the stages' parameters (Loop::checkOptimizer). No communication.
#pragma once

#include <memory>
#include <unordered_map>

#include "checkpoint/state.h"
#include "parallel/pipeline.h"
#include "tensor/nn/module.h"
#include "tensor/optim/optim.h"

namespace dt::train {

// Sharded stages (the fully sharded wrapper over dp, train/loop.h's ZeRO and Full under a
// pipeline): a stage parameter's piece on this rank (the optimizer's leaf) and its place in the
// global tensor (FullyShardedDataParallel::parameterMap()), by the parameter's Tensor::id().
// Every dp rank writes its own piece (the tied weight's last-stage copy still left to the first
// stage); empty: the stages are whole on every dp replica.
struct StageShard {
  Tensor shard;
  ParameterLayout layout;
};
using StageShards = std::unordered_map<const void*, StageShard>;

// `model`: the whole (unsplit) model the stages were cut from, for the tensor-parallel shards
// (parameterShardsOf) and the names of the parameters other ranks hold. `replica`: this rank's
// coordinate along dp; `tpRank` along tp (0 without tensor parallelism).
std::shared_ptr<StateProvider> pipelineModelState(const pipeline::GptStages& stages, const nn::Module& model, int replica,
                                                  int tpRank, StageShards shards = {});

std::shared_ptr<StateProvider> pipelineOptimizerState(const pipeline::GptStages& stages, optim::Optimizer& optimizer,
                                                      const nn::Module& model, int replica, int tpRank,
                                                      bool writesSharedScalars, StageShards shards = {});

}  // namespace dt::train
