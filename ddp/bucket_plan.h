// Bucket plan: which parameters' gradients travel together in one allreduce.
//
// Contract (pure functions, thread-safe, no communication):
//  * planBuckets walks the parameters in `order` (gradient-ready order: the
//    reverse of registration order at first, the observed order after the
//    first iteration) and fills one open bucket per (dtype, device). A
//    parameter is never split: it joins the open bucket of its kind, and the
//    bucket is closed once it holds at least its cap (firstBucketCapBytes for
//    the first bucket of each kind, bucketCapBytes after that), so a bucket
//    may exceed its cap by its last parameter. Buckets come back sorted by the
//    position in `order` of their first parameter, so they become full in
//    that order and launch without waiting for each other.
//  * Every rank must compute the plan from the same inputs (DDP checks that
//    the models match and broadcasts rank 0's observed order).
//  * InvalidArgument when `order` is not a permutation of the parameters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tensor/device.h"
#include "tensor/dtype.h"

namespace dt {

struct BucketParam {
  size_t bytes = 0;
  DType dtype = DType::Float32;
  Device device = Device::cpu();
};

struct BucketCaps {
  size_t firstBucketCapBytes = size_t{1} << 20;
  size_t bucketCapBytes = size_t{25} << 20;
};

// Buckets as lists of parameter indices, each list in `order`'s sequence.
std::vector<std::vector<size_t>> planBuckets(const std::vector<BucketParam>& params, const std::vector<size_t>& order,
                                             const BucketCaps& caps);

// Reverse registration order: what the first iteration assumes.
std::vector<size_t> reverseOrder(size_t count);

}  // namespace dt
