// Fully sharded data parallel: every rank holds 1/W of each parameter, of its gradient and of
// its optimizer state, and gathers whole parameters only while a unit of the model runs
// (PyTorch's FSDP2 / fully_shard, DeepSpeed ZeRO-3).
//
//   std::vector<std::shared_ptr<dt::nn::Module>> blocks;
//   for (auto& [name, block] : model->h->namedChildren()) blocks.push_back(block);
//   dt::FullyShardedDataParallel fsdp(model, group, {.units = blocks});   // collective
//   dt::optim::AdamW adamw(fsdp.paramGroups(dt::optim::decayGroups(*model, 0.1)), {.lr = 1e-3});
//   for (...) {
//     adamw.zeroGrad();
//     dt::nn::Gpt::loss(fsdp(tokens), targets).backward();  // returns with sharded, averaged gradients
//     dt::nn::clipGradNorm(fsdp.parameters(), 1.0, {.reducePartial = fsdp.gradNormReducer()});
//     adamw.step();                                           // on this rank's shards only
//   }
//
// Sharding:
//  * Units: each module of options.units (a transformer block, say) is one unit; the root's
//    parameters that no unit holds form the root unit. A parameter belongs to the innermost
//    unit that contains it; one tensor in two units is an InvalidArgument naming both.
//  * Each parameter is cut along dim 0 into W shards of ceil(rows / W) rows, the last ones
//    padded with zero rows (a tensor of fewer rows than ranks leaves some ranks only padding);
//    0-dim parameters count as one row. Rank r's shard of every parameter of a unit lives in
//    one flat float buffer of the parameter's dtype; parameters() returns one leaf tensor per
//    model parameter, [ceil(rows / W), ...], a view of that buffer: what the optimizer
//    updates, what clipGradNorm reads, whose .grad holds this rank's rows of the averaged
//    gradient after backward (padding rows are zero and stay zero).
//  * Between uses the model's own parameter tensors hold this rank's rows (unpadded, shape
//    [rows of this rank, ...], sharing memory with the shard): the full tensors exist only
//    while their unit is gathered.
//
// One iteration (forward, then one backward over its outputs), every rank in the same order:
//  * Before a unit's forward its shards are gathered into the unit's parameter storage (in the
//    compute dtype): a small allgather carrying the unit's number and the phase, then one
//    allgatherIntoTensor per parameter, straight from the shard into the whole tensor (a
//    parameter whose rows W does not divide goes through a padded buffer). After the forward
//    the storage is freed again when reshardAfterForward (default), else kept until the
//    unit's backward is over (ZeRO-2-like: all units stay gathered between forward and
//    backward). The root unit stays gathered from its forward to the end of backward.
//  * In backward the unit is gathered again as soon as the gradient reaches its output; once
//    its backward is over (the gradient reaches its input, or the pass ends) each of its
//    gradients is divided by W (in the reduce dtype) and reduce-scattered straight into the
//    shard's gradient (asynchronously, overlapped with the rest of backward, after a small
//    allreduce that checks every rank reduces the same unit); its parameters' storage is
//    freed, and each whole gradient once its reduce-scatter is done. backward() returns once
//    every reduce-scatter has completed and the shards' .grad are set (added to a defined
//    .grad, as autograd accumulates).
//  * Prefetch: with prefetch = k, the next k units (in the previous iteration's forward
//    order, and in backward in the reverse of this forward's order) have their allgather
//    started ahead, so communication overlaps compute; at most maxGatheredUnits units
//    (the root not counted) are gathered or in flight at once, so memory is bounded. With
//    reshardAfterForward off the bound applies to backward only.
//  * Mixed precision: parameters are gathered and computed in paramDtype (bfloat16, float16
//    or float32) while shards, gradient shards and optimizer state stay in the parameters'
//    dtype; gradients are reduced in reduceDtype (float32 by default). castForwardInputs casts
//    floating-point inputs of the root's forward to paramDtype; outputDtype (optional) casts
//    the root's floating-point output.
//  * Unused parameters: a parameter of a unit that gets no gradient contributes zeros; a
//    gradient that arrives after its unit's reduce-scatter was launched (a parameter used on a
//    path that does not pass through the unit's input) throws InvalidArgument naming it.
//  * noSync(): backwards inside the scope keep each unit's gradient unsharded and accumulating
//    (one full gradient per unit, in float32) and reduce nothing; the first backward after
//    the scope reduce-scatters the total (what DDP's noSync does, with its memory cost).
//  * Activation checkpointing (autograd::checkpoint, inside a unit's forward or around a
//    unit's call): the recomputation runs while the unit is gathered for its backward, so it
//    gathers nothing more.
//  * Evaluation: a forward under NoGradGuard still gathers (a collective: every rank runs it)
//    and frees each unit after its forward. gatherFullParameters() gathers every unit at
//    once (a collective) and keeps them until the guard ends, so that one rank may then run
//    the plain model alone (sampling, a fingerprint, a full state dict).
//  * Whole parameters across many backwards (a pipeline's micro-batches, train/loop.h): inside
//    a gatherFullParameters() guard the gradients accumulate whole, and reduceGradients()
//    reduce-scatters them once: one gather and one reduce-scatter per unit per step.
//
// Diagnostics:
//  * Construction is collective: every rank checks that all ranks wrap the same units with
//    the same parameters (names, shapes, dtypes); a difference throws InvalidArgument on
//    every rank naming the first differing unit or parameter and the ranks. Rank 0's values
//    are then broadcast so every rank starts equal (not when joining: see the option).
//  * Every gather starts with the unit's number and the phase, every reduce-scatter with the
//    unit's number: ranks that run units in different orders get a DesyncError naming the
//    unit each rank ran, instead of mixing two units' data (or hanging). A rank that never arrives is
//    named by the group's timeout, thrown from forward or backward with the unit named.
//  * While a profiler records, every gather and reduce-scatter is an event of category
//    "sharded" from launch to done, on a track of its own per unit and kind.
//  * lastIteration()/totals(): gathers, reduce-scatters, their bytes, the time the forward
//    and backward threads waited for them, and the most units gathered at once.
//
// Membership changes: rebind(group) recomputes the shards for another process group (a
// shrink or regrow) and allocates them; their values must then be restored, from the newest
// checkpoint (CheckpointDir::load) or from the members' old shards (redistributeState, with
// state collected before rebind). See docs/sharded.md.
//
// Not thread-safe: one thread drives forward and backward. Construction and destruction
// install and remove the hooks on the model; destroying the wrapper leaves the model's
// parameters holding this rank's rows.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/state.h"
#include "process_group/process_group.h"
#include "tensor/nn/module.h"
#include "tensor/optim/optim.h"

namespace dt {

struct MixedPrecisionPolicy {
  DType paramDtype = DType::Float32;   // gathered parameters and the compute
  DType reduceDtype = DType::Float32;  // gradients on the wire
  bool castForwardInputs = true;
  std::optional<DType> outputDtype;
};

struct FullyShardOptions {
  std::vector<std::shared_ptr<nn::Module>> units;
  bool reshardAfterForward = true;
  int prefetch = 1;          // units gathered ahead in forward and in backward (0: none)
  int maxGatheredUnits = 2;  // units (the root not counted) gathered or gathering at once, >= 1
  MixedPrecisionPolicy mixedPrecision;
  // A rank that joins a running job (the members call rebind on the same new group): the
  // construction skips the broadcast of rank 0's values, and the shards are zero until the
  // state is restored (redistributeState or a checkpoint).
  bool joining = false;
};

struct ShardedIterationStats {
  uint64_t iteration = 0;
  size_t gathers = 0;
  size_t reduceScatters = 0;
  size_t gatherBytes = 0;         // received by this rank
  size_t reduceScatterBytes = 0;  // sent by this rank
  double forwardWaitMs = 0;       // forward waiting for gathers
  double backwardWaitMs = 0;      // backward waiting for gathers and, at its end, for reduce-scatters
  size_t peakGatheredUnits = 0;   // the root not counted
};

class FullyShardedDataParallel {
 public:
  FullyShardedDataParallel(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> group,
                           FullyShardOptions options = {});
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // The model's call operator: its hooks do the gathering.
  Tensor operator()(const Tensor& input);
  Tensor forward(const Tensor& input) { return (*this)(input); }
  // For a root whose forward takes other arguments: body calls the root module's parts; the
  // root unit is gathered around it and backward is prepared from the returned tensors.
  std::vector<Tensor> forwardWith(const std::function<std::vector<Tensor>()>& body);

  nn::Module& module() { return *module_; }
  const std::shared_ptr<nn::Module>& modulePtr() const { return module_; }
  ProcessGroup& processGroup() { return *group_; }

  // This rank's shards, one per model parameter, in namedParameters() order.
  std::vector<Tensor> parameters() const;
  // `groups` (of the model's parameters, e.g. optim::decayGroups) with each parameter
  // replaced by its shard; InvalidArgument for a tensor that is no parameter of the model.
  std::vector<optim::ParamGroup> paramGroups(const std::vector<optim::ParamGroup>& groups) const;
  // The shards as the training state places them (checkpoint/state.h).
  ParameterMap parameterMap() const;
  // The model's part of the training state: the shards (unpadded) and the buffers.
  std::shared_ptr<StateProvider> modelState();
  // clipGradNorm's reducePartial: the sum (or max) over the group.
  std::function<void(Tensor&, bool)> gradNormReducer();

  class NoSyncGuard {
   public:
    ~NoSyncGuard();
    NoSyncGuard(NoSyncGuard&& other) noexcept;
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;

   private:
    friend class FullyShardedDataParallel;
    explicit NoSyncGuard(FullyShardedDataParallel* owner);
    FullyShardedDataParallel* owner_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard noSync();

  class FullParametersGuard {
   public:
    ~FullParametersGuard();
    FullParametersGuard(FullParametersGuard&& other) noexcept;
    FullParametersGuard(const FullParametersGuard&) = delete;
    FullParametersGuard& operator=(const FullParametersGuard&) = delete;
    FullParametersGuard& operator=(FullParametersGuard&&) = delete;

   private:
    friend class FullyShardedDataParallel;
    explicit FullParametersGuard(FullyShardedDataParallel* owner) : owner_(owner) {}
    FullyShardedDataParallel* owner_;
  };
  // A collective: every unit gathered until the guard ends (no collective then); meanwhile
  // the model's parameters are whole (in paramDtype) and its forward gathers nothing. When a
  // gather fails (a member lost) it throws with every unit sharded again, ready for rebind.
  [[nodiscard]] FullParametersGuard gatherFullParameters();

  // Inside a gatherFullParameters() guard, backward reduces nothing: autograd accumulates into
  // the model's whole parameters' .grad, over as many backwards as the caller runs (a pipeline's
  // micro-batches, which call the stages' modules directly, not the wrapper). This reduce-scatters
  // those sums, each divided by the group's size, into the shards' .grad (added to a defined one,
  // as backward does), drops the whole gradients, and ends the iteration for the statistics:
  // lastIteration() counts the guard's gathers (one per unit, however many backwards ran) and
  // these reduce-scatters. A parameter without a gradient contributes zeros. Collective; inside
  // the guard only (InvalidArgument otherwise).
  void reduceGradients();

  // A collective over `group` (see the header comment). Between iterations only, or after an
  // iteration whose forward or backward threw (a member lost mid-step): that iteration is
  // abandoned first (the old group's collectives waited for, gradients not reduced dropped).
  void rebind(std::shared_ptr<ProcessGroup> group);

  const ShardedIterationStats& lastIteration() const;
  const ShardedIterationStats& totals() const;
  // Unit names ("h.0", ..., and "(root)" last) in unit order.
  std::vector<std::string> unitNames() const;

  struct Impl;

 private:
  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dt
