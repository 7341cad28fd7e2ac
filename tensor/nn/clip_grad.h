// Gradient clipping by the global norm over all parameters (PyTorch's clip_grad_norm_).
//
// Contract:
//  * clipGradNorm computes the norm of all the parameters' gradients taken as one vector
//    (2-norm, or the largest |g| for normType = infinity), accumulating in float64, and when
//    it exceeds maxNorm multiplies every gradient in place by maxNorm / (norm + 1e-6). It
//    returns the norm before clipping. Parameters without a gradient are skipped.
//  * Under DDP the gradients are already averaged and identical on every rank when backward
//    returns, so every rank computes the same norm locally and clips the same way: call it
//    after backward and before the optimizer step, with no reduction.
//  * Sharded parameters (each rank holds a different piece of every tensor): pass
//    `reducePartial`, which receives this rank's partial statistic (a float64 0-dim tensor:
//    the sum of squares, or the max |g| when max is true) and must replace it in place by the
//    total over the shard group (an allreduce with sum, or max). tensor/ knows no process
//    group; the caller supplies the collective. Every rank of the group must call it.
//  * Two levels (tensor parallelism, parallel/clip_grad.h): parameters for which `isSplit`
//    says true hold different blocks on the ranks of another group, while the others are
//    whole and equal there. The split ones' partial statistic alone goes through
//    `reduceSplitPartial` (every rank of that group calls it, even with no split parameter),
//    then the whole ones' is added once, and that sum goes through `reducePartial` if set.
//  * A non-finite norm: with errorIfNonfinite it throws InvalidArgument naming the first
//    parameter whose gradient is not finite, and changes nothing; otherwise the gradients
//    are scaled by a NaN factor, as PyTorch does.
//  * Gradients on a GPU: the statistics are computed and added up on the device and read once
//    per device (one host wait for the norm, not one per parameter); the partials passed to
//    reducePartial / reduceSplitPartial are CPU tensors, as with CPU gradients.
//  * Not differentiable (runs under NoGradGuard); bumps the versions of the gradients it scales.
#pragma once

#include <functional>
#include <limits>
#include <vector>

#include "tensor/tensor.h"

namespace dt::nn {

struct ClipGradNormOptions {
  double normType = 2.0;  // 2.0 or std::numeric_limits<double>::infinity()
  bool errorIfNonfinite = false;
  std::function<void(Tensor& partial, bool max)> reducePartial;
  std::function<bool(size_t parameterIndex)> isSplit;  // index into `parameters`
  std::function<void(Tensor& partial, bool max)> reduceSplitPartial;
};

double clipGradNorm(const std::vector<Tensor>& parameters, double maxNorm, const ClipGradNormOptions& options = {});

}  // namespace dt::nn
