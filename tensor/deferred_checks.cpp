#include "tensor/deferred_checks.h"

#include <algorithm>

#include "common/errors.h"
#include "common/strings.h"

namespace dt::detail {

std::string crossEntropyTargetError(int64_t target, int64_t position, int64_t classes, int64_t ignoreIndex) {
  return str("crossEntropy: target ", target, " at position ", position, " is out of range for ", classes,
             " classes (ignoreIndex is ", ignoreIndex, ")");
}

std::string embeddingIndexError(int64_t value, int64_t position, const std::string& weight, int64_t rows) {
  if (position < 0)
    return str("embedding: index ", value, " out of range for weight ", weight, " (", rows, " rows)");
  return str("embedding: index ", value, " at position ", position, " out of range for weight ", weight, " (",
             rows, " rows)");
}

std::string deferredCheckError(const std::string& error, Device device, const char* raisedAt) {
  return str(error, "; found on ", device.str(),
             " by the op's check, which CUDA runs without waiting, and raised at ", raisedAt,
             " (fix the batch that op was given; the error is late, the op is the one named)");
}

void DeferredChecks::add(Check check) {
  const Device device = check.device;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    checks_.push_back(std::make_shared<Check>(std::move(check)));
    total_.fetch_add(1, std::memory_order_relaxed);
  }
  // Registered first: a throw below leaves the new check pending (its buffers stay alive
  // until the device has written them), not lost.
  poll(device, false, "a later check on the same device");
  if (pending(device) > kMaxPendingChecks)
    poll(device, true, "a later check on the same device (too many pending)");
}

void DeferredChecks::poll(Device device, bool wait, const char* raisedAt) {
  std::vector<std::shared_ptr<Check>> mine;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& c : checks_) {
      if (c->device == device) mine.push_back(c);
    }
  }
  if (mine.empty()) return;
  // Waiting or querying the device happens without the lock: another thread may add meanwhile.
  std::vector<std::shared_ptr<Check>> done;
  for (const auto& c : mine) {
    if (c->finished(wait)) done.push_back(c);
  }
  if (done.empty()) return;
  // Only the thread that removes a check reports it, so a failure is raised once.
  std::vector<std::shared_ptr<Check>> claimed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& c : done) {
      auto it = std::find(checks_.begin(), checks_.end(), c);
      if (it == checks_.end()) continue;
      checks_.erase(it);
      total_.fetch_sub(1, std::memory_order_relaxed);
      claimed.push_back(c);
    }
  }
  for (const auto& c : claimed) {  // launch order: `mine` kept it
    const IndexCheckResult r = c->result();
    if (r.position >= 0) throw InvalidArgument(deferredCheckError(c->error(r), device, raisedAt));
  }
}

size_t DeferredChecks::pending(Device device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<size_t>(
      std::count_if(checks_.begin(), checks_.end(), [&](const auto& c) { return c->device == device; }));
}

DeferredChecks& deferredChecks() {
  static DeferredChecks* checks = new DeferredChecks();
  return *checks;
}

void raiseDeferredChecks(Device device, bool wait, const char* raisedAt) {
  DeferredChecks& checks = deferredChecks();
  if (checks.pendingTotal() == 0) return;
  checks.poll(device, wait, raisedAt);
}

}  // namespace dt::detail
