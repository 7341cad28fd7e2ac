// CUDA storage: runs on a GPU machine; elsewhere checks the error a user gets.
#include <gtest/gtest.h>

#include <vector>

#include "common/config.h"
#include "common/errors.h"
#include "tensor/storage.h"
#include "tests/testing/testing.h"

#if DT_HAVE_CUDA
#include "tensor/cuda/cuda.h"
#endif

namespace dt {
namespace {

#if DT_HAVE_CUDA
TEST(CudaStorage, WithoutDeviceAllocationNamesDeviceAndReason) {
  if (cuda::deviceCount() > 0) GTEST_SKIP() << "this machine has a CUDA device; see FillAndCopyBack";
  const std::string reason = cuda::unavailableReason();
  EXPECT_FALSE(reason.empty());
  testing::expectThrowsWith<NotSupportedError>([] { Storage(1024, Device::cuda(0)); }, {"cuda:0", reason});
}

TEST(CudaStorage, FillAndCopyBack) {
  if (cuda::deviceCount() == 0) GTEST_SKIP() << "needs a CUDA device: " << cuda::unavailableReason();
  constexpr size_t n = 1 << 20;
  Storage storage(n * sizeof(float), Device::cuda(0));
  ASSERT_TRUE(storage.defined());
  cuda::fillFloat32(storage.data(), Device::cuda(0), n, 2.5f);
  std::vector<float> host(n, 0.0f);
  cuda::copyBytes(host.data(), Device::cpu(), storage.data(), Device::cuda(0), n * sizeof(float));
  for (size_t i = 0; i < n; i += 4099) ASSERT_EQ(host[i], 2.5f) << "at " << i;
  EXPECT_EQ(host[n - 1], 2.5f);
  testing::expectThrowsWith<InvalidArgument>(
      [] { Storage(16, Device::cuda(cuda::deviceCount())); }, {"does not exist"});
}
#else
TEST(CudaStorage, CpuOnlyBuildRefusesCuda) {
  testing::expectThrowsWith<NotSupportedError>([] { Storage(16, Device::cuda(0)); }, {"cuda:0", "no GPU support"});
}
#endif

}  // namespace
}  // namespace dt
