#include "tests/parallel/harness.h"

#include <gtest/gtest.h>

#include "tensor/ops.h"

namespace dt::testing {

Tensor gatherBlocks(ProcessGroup& group, const Tensor& local, int64_t dim) {
  std::vector<Tensor> blocks;
  for (int r = 0; r < group.size(); ++r) blocks.push_back(emptyLike(local));
  group.allgather(blocks, local.detach().contiguous())->wait();
  return cat(blocks, dim);
}

Tensor wholeParameter(ProcessGroup& group, const Tensor& local, const ParameterShard& shard) {
  if (shard.dim < 0) return local.detach();
  const Tensor blocks = gatherBlocks(group, local, shard.dim);
  if (shard.parts == 1) return blocks;
  // Rank r's block is [part 0 of r, part 1 of r, ...]; the whole is [part 0 of every rank, ...].
  const int64_t part = local.size(shard.dim) / shard.parts;
  std::vector<Tensor> ordered;
  for (int64_t p = 0; p < shard.parts; ++p) {
    for (int r = 0; r < group.size(); ++r) ordered.push_back(blocks.narrow(shard.dim, (r * shard.parts + p) * part, part));
  }
  return cat(ordered, shard.dim);
}

void expectMatches(const Tensor& actual, const Tensor& expected, const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what << ": undefined";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  ASSERT_EQ(actual.dtype(), expected.dtype()) << what;
  if (expected.dtype() == DType::Float64) {
    const double difference = max(abs(actual.detach() - expected.detach())).item<double>();
    const double scale = max(abs(expected.detach())).item<double>();
    EXPECT_LE(difference, 1e-12 * scale) << what << ": max difference " << difference << ", max |expected| " << scale;
  } else {
    EXPECT_TRUE(allclose(actual.detach(), expected.detach(), 1.3e-6, 1e-5))
        << what << ": max difference " << max(abs(actual.detach() - expected.detach())).item<double>();
  }
}

}  // namespace dt::testing
