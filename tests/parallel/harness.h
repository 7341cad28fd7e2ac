// Shared by the parallel tests (threads as ranks: withRanks of tests/fsdp/harness.h): gathering a
// tensor's blocks with plain allgathers (not the code under test), and the numeric bars.
#pragma once

#include <string>

#include "parallel/tensor_parallel.h"
#include "process_group/process_group.h"
#include "tensor/tensor.h"

namespace dt::testing {

// Every rank's `local` side by side along `dim` (ranks in group order).
Tensor gatherBlocks(ProcessGroup& group, const Tensor& local, int64_t dim);

// The whole parameter of which `local` is this rank's shard, assembled from every rank's (plain
// allgathers): blocks side by side along shard.dim, each of shard.parts parts in its place; a
// replicated parameter (dim -1) is `local` itself.
Tensor wholeParameter(ProcessGroup& group, const Tensor& local, const ParameterShard& shard);

// float64: max |actual - expected| <= 1e-12 max |expected|; float32: PyTorch's
// assert_close bar, |actual - expected| <= 1e-5 + 1.3e-6 |expected| elementwise.
void expectMatches(const Tensor& actual, const Tensor& expected, const std::string& what);

}  // namespace dt::testing
