// Checkpoint parts of a pipeline-split GPT (train/loop.h under LoopOptions::pipeline): each rank
// lists its stages' tensors under the unsplit model's names (pipeline::GptStages::namedParameters),
// so a checkpoint written at one pipeline degree loads at any other, or without a pipeline (the
// plain model's replicated parts read the same names), and a plain model's checkpoint loads into
// the stages.
//
//   TrainingState state(world->rank(), world->size());
//   state.add("model", pipelineModelState(stages, replica));
//   state.add("optim", pipelineOptimizerState(stages, optimizer, model, replica, world->rank() == 0));
//
// Placement: a stage's tensor is a Sharded piece that covers the whole tensor (offset 0), written
// by the rank that holds it; of the dp replicas of a stage only replica 0 lists it, and the last
// stage's copy of the tied embedding (equal to the first stage's, see pipeline.h) is left to the
// first stage's rank. The optimizer's per-parameter state is placed like its parameter. Its step
// counters are replicated scalars, which the checkpoint module writes from rank 0 alone: rank 0
// (writesSharedScalars) lists each scalar state for every parameter of the whole model with its
// own value, which is right because every parameter of a GPT is stepped at every step.
//
// Contract:
//  * restore reads only the names this rank's stages hold: the source holds the other stages'
//    too, so unlike the plain model's part a name it does not know is no error. A name the stages
//    hold that the source lacks, or of another global shape, is InvalidArgument (restoreTensor's).
//  * `stages`, `optimizer` and `model` are held by reference and must outlive the providers; the
//    optimizer updates exactly the stages' parameters (Loop::checkOptimizer). No communication.
#pragma once

#include <memory>

#include "checkpoint/state.h"
#include "parallel/pipeline.h"
#include "tensor/nn/module.h"
#include "tensor/optim/optim.h"

namespace dt::train {

std::shared_ptr<StateProvider> pipelineModelState(const pipeline::GptStages& stages, int replica);

// `model`: the whole (unsplit) model, for the names of the parameters other ranks hold.
std::shared_ptr<StateProvider> pipelineOptimizerState(const pipeline::GptStages& stages, optim::Optimizer& optimizer,
                                                      const nn::Module& model, int replica, bool writesSharedScalars);

}  // namespace dt::train
