// ZeRO-1/2 on DDP's buckets: the optimizer state is split across the ranks (and, at stage 2,
// the gradients after backward), while every rank keeps the whole model for forward and
// backward (llm.c's ZeRO-1; PyTorch's ZeroRedundancyOptimizer shards the optimizer state the
// same way but still allreduces).
//
//   dt::DistributedDataParallel ddp(model, group);
//   dt::ZeroRedundancy zero(ddp, {.stage = 1});
//   dt::optim::AdamW adamw(zero.paramGroups(dt::optim::decayGroups(*model, 0.1)), {...});
//   for (...) {
//     adamw.zeroGrad();
//     loss(ddp(x)).backward();     // buckets reduce-scattered as they fill: each rank gets its part
//     dt::nn::clipGradNorm(zero.parameters(), 1.0, {.reducePartial = zero.gradNormReducer()});
//     adamw.step();                // this rank's part of every parameter
//     zero.gatherParameters();     // optional: start the allgathers now (else the next forward does)
//   }
//
// Contract:
//  * Each DDP bucket (N elements, in DDP's bucket order) is split into W runs: rank r holds
//    elements [r c, (r + 1) c) with c = floor(N / W), the last rank also the N - W c left over.
//    parameters() returns, per model parameter, one leaf tensor: the flat view of the
//    parameter's elements that fall into this rank's runs (possibly none), sharing the
//    parameter's memory. The optimizer updates only those; its state exists only for them.
//  * ZeRO installs DDP's communication hook: a full bucket is reduce-scattered (its left-over
//    elements allreduced) instead of allreduced, launched by DDP as the bucket fills, so
//    DDP's overlap, its errors (unused parameters, a rank that never arrives, ...) and its
//    statistics stay as they are. When backward returns each leaf's .grad holds the averaged
//    gradient of its elements (added to a defined .grad); the model parameters' own .grad are
//    dropped (they held only partly reduced sums).
//  * Stage 1 keeps DDP's gradient buckets; stage 2 frees each bucket's memory once its
//    reduce-scatter is done (from the end of backward to the end of the next forward only the
//    parts remain; during backward, finished buckets are freed while later ones fill, unless
//    gradients were accumulated with noSync, then at the end of the pass).
//  * After optimizer.step() the parameters are out of date outside this rank's runs:
//    gatherParameters() starts one allgather per bucket, and the next forward of the DDP
//    module (training or evaluation: a collective either way) starts them if they were not,
//    and waits for each bucket just before the first module that uses its parameters runs.
//    synchronize() waits for all of them (what a checkpoint, or code that reads the
//    parameters, calls first; modelState() does).
//  * DDP must not change its buckets after the optimizer's first step: its one rebuild happens
//    after the first iteration, so run one iteration before the first step (the training loop's
//    settleBuckets, train/loop.cpp) or plan the buckets from a saved order; a later change throws
//    InvalidArgument. Loading optimizer state does not count as a step: load it only after
//    the buckets are settled or planned.
//  * Not thread-safe, as DDP. Construction is local (no collective); it must happen on every
//    rank, between iterations. The ZeroRedundancy must outlive its use by DDP's hooks and be
//    destroyed before the DDP module (it reinstalls the default hook).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "checkpoint/state.h"
#include "ddp/ddp.h"
#include "tensor/optim/optim.h"

namespace dt {

struct ZeroOptions {
  int stage = 1;  // 1: optimizer state sharded; 2: gradients too, between backward and the next forward
};

struct ZeroStats {
  uint64_t steps = 0;        // parameter gathers done
  double gatherWaitMs = 0;   // forward (or synchronize) waiting for them, in total
  size_t gatherBytes = 0;    // received, in total
  size_t releasedBuckets = 0;  // stage 2: bucket buffers freed, in total
};

class ZeroRedundancy {
 public:
  ZeroRedundancy(DistributedDataParallel& ddp, ZeroOptions options = {});
  ~ZeroRedundancy();
  ZeroRedundancy(const ZeroRedundancy&) = delete;
  ZeroRedundancy& operator=(const ZeroRedundancy&) = delete;

  std::vector<Tensor> parameters() const;
  std::vector<optim::ParamGroup> paramGroups(const std::vector<optim::ParamGroup>& groups) const;
  ParameterMap parameterMap() const;
  std::function<void(Tensor&, bool)> gradNormReducer();
  // The model, replicated (synchronize() first), for the training state.
  std::shared_ptr<StateProvider> modelState();

  void gatherParameters();
  void synchronize();
  const ZeroStats& stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dt
