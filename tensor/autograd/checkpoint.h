// Activation checkpointing: run a segment of the forward pass without keeping its
// intermediate activations, and run it once more inside backward to get them back. Memory of
// the activations inside the segment for a second forward of it (PyTorch's re-entrant
// torch.utils.checkpoint).
//
//   Tensor y = dt::autograd::checkpoint([&](const Tensor& x) { return block(x); }, x);
//
// Contract:
//  * With grad mode off, or no input requiring grad, fn runs once as usual and nothing is
//    recorded. Otherwise fn runs under NoGradGuard (it records no graph and keeps nothing for
//    backward), and its outputs get one node, "CheckpointBackward", whose edges lead to the
//    inputs. The node keeps the inputs (with their versions: an input changed in place
//    before backward is the usual "modified by an inplace operation" error) and fn itself,
//    so whatever fn captures must live until backward has run.
//  * In backward the node runs fn again on detached copies of the inputs, with grad mode on,
//    and then a backward pass of its own (re-entrant, on the same thread) from the outputs
//    with the gradients that reached them. That pass accumulates the gradients of the
//    parameters fn used (their post-accumulate-grad hooks run there, which DDP and the
//    sharded wrapper rely on; CallbackPass::Outermost callbacks wait for the whole backward)
//    and gives the inputs' gradients, which the node returns. Undefined gradient outputs
//    count as zeros; outputs that do not require grad are left out of the inner pass.
//  * Randomness: the generators named in preserveGenerators are put back, for the
//    recomputation, where they were when the first run began, so dropout draws the same
//    masks; afterwards they are returned to where backward found them, so the rest of
//    training sees the stream it would have seen without checkpointing.
//  * fn must compute the same outputs (shapes, dtypes) when run again; a different count
//    or shape throws InvalidArgument from backward naming the checkpoint.
//  * Threads: as any autograd node (autograd.h).
#pragma once

#include <functional>
#include <vector>

#include "tensor/autograd/autograd.h"
#include "tensor/generator.h"

namespace dt::autograd {

struct CheckpointOptions {
  std::vector<Generator*> preserveGenerators;
};

using CheckpointFunction = std::function<TensorList(const TensorList& inputs)>;

TensorList checkpoint(CheckpointFunction fn, const TensorList& inputs, const CheckpointOptions& options = {});
Tensor checkpoint(std::function<Tensor(const Tensor&)> fn, const Tensor& input, const CheckpointOptions& options = {});

}  // namespace dt::autograd
