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
