// Checkpoints of a tensor-parallel model at one (TP, DP) shape, loadable at another: the model's
// parameters and the optimizer's state go into a TrainingState (checkpoint/state.h) under their
// global names and shapes, each rank's shard placed where it sits in the whole tensor, so the
// checkpoint module reshards them by name and shape as it does the fully sharded wrapper's.
//
//   dt::TrainingState state(world->rank(), world->size());
//   const int replica = mesh.coordinate("dp");
//   state.add("model", dt::tensorParallelModelState(*model, replica));
//   state.addOptimizer("optim", adam, dt::tensorParallelParameterMap(*model, replica));
//   checkpoints.save(state, *world);   ...   checkpoints.load(ref, state, world.get());
//
// Placement (ParameterShard -> StateTensor): a block of dim d of a [.., G_d, ..] tensor is not one
// run of the flattened tensor unless d = 0, and a fused projection's block (c_attn: parts = 3,
// this rank's q, k and v rows) is not even one run along dim 0. Both are strided shards: with
// inner = the product of the dimensions after d, outer = of those before, P = G_d / parts and
// L = the local size of d / parts, the shard is outer * parts runs of L * inner elements, run i
// at (offset * inner) + i * (P * inner), in the order the local tensor holds them. A split
// dimension held whole (TP = 1) is one run. Replicated parameters (the norms, biases of row
// layers, wpe) and buffers are saved once, by rank 0 of the group saving.
//
// Contract:
//  * `replica` is this rank's index among the ranks holding the same shards (its coordinate
//    along the data-parallel dimensions); only replica 0 lists them for saving, the others
//    restore them all the same. Every rank of a TP group must pass the same `replica` scheme.
//  * Loading at another shape: the model is built and parallelized at the new shape first (or
//    left plain: the plain model's parameters are whole, replicated), then restored; a plain
//    DDP model's checkpoint loads into a parallelized one the same way (its tensors are whole).
//    Global shapes must match (InvalidArgument from restore naming the tensor and both shapes).
//  * The optimizer's state tensors are placed like their parameters; its step counter is a
//    replicated scalar. Load the optimizer state only after the optimizer exists over the
//    model's parameters (as for any TrainingState).
//  * collect/restore do no communication; saving and loading are the checkpoint module's
//    collectives over the group given to them. The model is held by reference and must
//    outlive the state. Not thread-safe.
#pragma once

#include <memory>

#include "checkpoint/nested_state.h"
#include "checkpoint/state.h"
#include "parallel/parallelize.h"

namespace dt {

// Where `shard` (of a local tensor of `localShape`) sits in its global tensor, as a Sharded
// ParameterLayout (strided when it is not one run), or Replicated for dim -1.
ParameterLayout tensorParallelLayout(const ParameterShard& shard, const Shape& localShape, bool savedByAnotherRank);

// Every parameter and buffer of `model`, the tensor-parallel shards placed in their global
// tensors (see the placement above), the rest replicated.
std::shared_ptr<StateProvider> tensorParallelModelState(nn::Module& model, int replica);

// The ParameterMap for TrainingState::addOptimizer over `model`'s parameters, placed the same way.
ParameterMap tensorParallelParameterMap(const nn::Module& model, int replica);

// ZeRO or the fully sharded wrapper over a tensor-parallel `model` (checkpoint/nested_state.h):
// where the wrapper's tensors, each the whole of this rank's TP block as the wrapper sees it,
// sit in the global tensors. Names are `model`'s parameter paths, or with optimizerNames
// "<parameter>.<state>". `tpSize`/`tpRank`: this rank's TP group; `replica`: its coordinate
// along the data-parallel dimensions, whose 0 writes what the wrapper holds replicated (ZeRO's
// parameters); the TP-replicated parameters' shards are written by tp rank 0's wrapper.
// Read from the TP layers' own shapes, so it holds while the wrapper has resized the model's
// parameter tensors.
//
//   state.add("model", dt::nestedState(fsdp.modelState(), tensorParallelPlacement(*model, t, tpRank, dp, false)))
//        .add("optim", dt::nestedState(dt::optimizerState(adamw, fsdp.parameterMap()),
//                                      tensorParallelPlacement(*model, t, tpRank, dp, true)));
OuterPlacementOf tensorParallelPlacement(const nn::Module& model, int tpSize, int tpRank, int replica, bool optimizerNames);

}  // namespace dt
