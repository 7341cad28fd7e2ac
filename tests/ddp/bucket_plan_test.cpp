// planBuckets: caps, the smaller first bucket, dtype/device split, order.
#include <gtest/gtest.h>

#include "common/errors.h"
#include "ddp/bucket_plan.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using Plan = std::vector<std::vector<size_t>>;

std::vector<BucketParam> floats(std::vector<size_t> bytes) {
  std::vector<BucketParam> out;
  for (size_t b : bytes) out.push_back({b, DType::Float32, Device::cpu()});
  return out;
}

TEST(BucketPlan, ReverseOrderWithASmallerFirstBucketAndNoSplitParameter) {
  // Parameters 0..5; gradients arrive 5, 4, ..., 0.
  const auto params = floats({400, 40, 400, 40, 400, 40});
  const Plan plan = planBuckets(params, reverseOrder(6), {.firstBucketCapBytes = 100, .bucketCapBytes = 500});
  // First bucket closes once it holds >= 100 bytes (40 + 400: the parameter is not split);
  // later ones at >= 500.
  EXPECT_EQ(plan, (Plan{{5, 4}, {3, 2, 1, 0}}));
}

TEST(BucketPlan, ZeroCapGivesOneBucketPerParameterAndHugeCapOneBucket) {
  const auto params = floats({4, 8, 12});
  EXPECT_EQ(planBuckets(params, reverseOrder(3), {0, 0}), (Plan{{2}, {1}, {0}}));
  EXPECT_EQ(planBuckets(params, reverseOrder(3), {size_t{1} << 30, size_t{1} << 30}), (Plan{{2, 1, 0}}));
}

TEST(BucketPlan, DtypesAndDevicesNeverShareABucketAndBucketsFollowTheOrder) {
  std::vector<BucketParam> params = {
      {100, DType::Float32, Device::cpu()}, {100, DType::Float16, Device::cpu()},
      {100, DType::Float32, Device::cpu()}, {100, DType::Float16, Device::cpu()},
      {100, DType::Float32, Device::cuda(0)},
  };
  const Plan plan = planBuckets(params, {1, 0, 2, 3, 4}, {1000, 1000});
  // Sorted by the position of their first parameter in the order.
  EXPECT_EQ(plan, (Plan{{1, 3}, {0, 2}, {4}}));
}

TEST(BucketPlan, AnObservedOrderIsFollowed) {
  const auto params = floats({10, 10, 10, 10});
  EXPECT_EQ(planBuckets(params, {2, 0, 3, 1}, {15, 15}), (Plan{{2, 0}, {3, 1}}));
}

TEST(BucketPlan, OrderThatIsNotAPermutationIsRejected) {
  const auto params = floats({10, 10, 10});
  testing::expectThrowsWith<InvalidArgument>([&] { planBuckets(params, {0, 1}, {}); }, {"lists 2", "there are 3"});
  testing::expectThrowsWith<InvalidArgument>([&] { planBuckets(params, {0, 1, 1}, {}); },
                                             {"not a permutation", "entry 2 is 1"});
  testing::expectThrowsWith<InvalidArgument>([&] { planBuckets(params, {0, 1, 7}, {}); }, {"entry 2 is 7"});
}

}  // namespace
}  // namespace dt
