#include "elastic/internal/loss_aware_store.h"

#include <algorithm>

#include "common/errors.h"
#include "common/strings.h"
#include "store/membership.h"

namespace dt::elastic {
namespace {

using Clock = std::chrono::steady_clock;
// Short against any failure timeout, long against a store call.
constexpr std::chrono::milliseconds kSlice{50};

// The wait in one slice, for at most what is left of `timeout` (at least 1 ms).
Store::Duration sliceOf(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<Store::Duration>(deadline - Clock::now());
  return std::max(Store::Duration(1), std::min(left, Store::Duration(kSlice)));
}

}  // namespace

LossAwareStore::LossAwareStore(StorePtr store, StorePtr jobStore, std::vector<int> members)
    : store_(std::move(store)), deaths_(jobStore->clone()), members_(std::move(members)) {
  setTimeout(store_->timeout());
}

void LossAwareStore::throwIfLost() {
  std::lock_guard<std::mutex> lock(deathsMutex_);
  for (size_t rank = 0; rank < members_.size(); ++rank) {
    if (auto reason = membership::deathOf(*deaths_, members_[rank])) {
      const int member = members_[rank];
      throw MemberLostError(static_cast<int>(rank) == member ? str("rank ", rank, " ", *reason)
                                                             : str("rank ", rank, " (member ", member, ") ", *reason));
    }
  }
}

void LossAwareStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    try {
      store_->wait(keys, sliceOf(deadline));
      return;
    } catch (const TimeoutError& e) {
      if (Clock::now() >= deadline) throw TimeoutError(str(e.what(), " (the last slice of a wait of ", formatDuration(timeout), ")"));
    }
    throwIfLost();
  }
}

Bytes LossAwareStore::get(const std::string& key, Duration timeout) {
  wait({key}, timeout);
  return store_->get(key, timeout);
}

std::vector<Bytes> LossAwareStore::multiGet(const std::vector<std::string>& keys, Duration timeout) {
  wait(keys, timeout);
  return store_->multiGet(keys, timeout);
}

std::optional<Bytes> LossAwareStore::queuePop(const std::string& key, bool block, Duration timeout) {
  if (!block) return store_->queuePop(key, false, timeout);
  const auto deadline = Clock::now() + timeout;
  while (true) {
    try {
      return store_->queuePop(key, true, sliceOf(deadline));
    } catch (const TimeoutError& e) {
      if (Clock::now() >= deadline) throw TimeoutError(str(e.what(), " (the last slice of a wait of ", formatDuration(timeout), ")"));
    }
    throwIfLost();
  }
}

std::shared_ptr<Store> LossAwareStore::clone() {
  return std::make_shared<LossAwareStore>(store_->clone(), deaths_, members_);
}

}  // namespace dt::elastic
