#include "ddp/bucket_plan.h"

#include <algorithm>
#include <map>
#include <utility>

#include "common/errors.h"
#include "common/strings.h"

namespace dt {

std::vector<size_t> reverseOrder(size_t count) {
  std::vector<size_t> order(count);
  for (size_t i = 0; i < count; ++i) order[i] = count - 1 - i;
  return order;
}

std::vector<std::vector<size_t>> planBuckets(const std::vector<BucketParam>& params, const std::vector<size_t>& order,
                                             const BucketCaps& caps) {
  if (order.size() != params.size()) {
    throw InvalidArgument(str("planBuckets: the order lists ", order.size(), " parameters but there are ",
                              params.size()));
  }
  std::vector<size_t> position(params.size(), params.size());
  for (size_t i = 0; i < order.size(); ++i) {
    if (order[i] >= params.size() || position[order[i]] != params.size()) {
      throw InvalidArgument(str("planBuckets: the order is not a permutation of 0..", params.size() - 1,
                                " (entry ", i, " is ", order[i], ")"));
    }
    position[order[i]] = i;
  }

  struct Open {
    std::vector<size_t> members;
    size_t bytes = 0;
    size_t closed = 0;  // buckets of this kind already closed
  };
  // Keyed by (dtype, device); a map keeps the key order deterministic.
  std::map<std::pair<int, std::string>, Open> open;
  std::vector<std::vector<size_t>> buckets;
  for (size_t index : order) {
    const BucketParam& p = params[index];
    Open& bucket = open[{static_cast<int>(p.dtype), p.device.str()}];
    bucket.members.push_back(index);
    bucket.bytes += p.bytes;
    const size_t cap = bucket.closed == 0 ? caps.firstBucketCapBytes : caps.bucketCapBytes;
    if (bucket.bytes >= cap) {
      buckets.push_back(std::move(bucket.members));
      bucket.members.clear();
      bucket.bytes = 0;
      ++bucket.closed;
    }
  }
  for (auto& [kind, bucket] : open) {
    if (!bucket.members.empty()) buckets.push_back(std::move(bucket.members));
  }
  std::stable_sort(buckets.begin(), buckets.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });
  return buckets;
}

}  // namespace dt
