// Index checks that a CUDA op leaves on the device and raises later (plain C++, every build).
//
// Why: crossEntropy's targets and embedding's indices must lie in range, and a kernel cannot
// throw. Reading a flag back in the op made every training step wait for the device twice
// (issue 43, item 7). On CUDA the op now queues its check kernel and returns; the result (the
// first bad position and its value) lands in host memory when the stream gets there, and is
// raised by the first of:
//  * the next copy between the host and that device (item(), toVector(), .to(Device::cpu()),
//    the next batch's upload: the host waits for the device there anyway), raising the same
//    InvalidArgument the CPU gives, plus the position, the device and where it was raised;
//  * the next optimizer step (SGD / AdamW step() over parameters on that device), which waits
//    for the device's pending checks before it changes any parameter: a bad batch never
//    reaches the weights, and the error comes at the latest at the end of its own step;
//  * the next check queued on the same device, once the failed one has finished; and when
//    more than kMaxPendingChecks are pending there, that check waits for them (a loop that
//    neither reads nor steps still stops within that many checks).
// Until then the ops stay safe: a bad target gives a loss of 0 and is not counted, a bad
// embedding index gathers a zero row and adds no gradient, so nothing reads out of bounds.
// The CPU checks stay immediate (the op throws).
//
// Contract:
//  * DeferredChecks keeps, per device, the checks in launch order. add() registers one;
//    poll(device, wait) looks at that device's checks (waiting for all of them when wait),
//    drops every finished one, and throws the first failed one's error (launch order)
//    after dropping them; a check still in flight stays. Devices are independent.
//  * A failed check is raised once, by whichever thread of the process polls its device
//    first (another thread's copy from that device, a checkpoint writer's say, may be the
//    one that throws).
//  * Thread-safe; the waits run without the lock held.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensor/device.h"

namespace dt::detail {

// What the device writes: the first position whose value is out of range (-1: none) and that value.
struct IndexCheckResult {
  int64_t position = -1;
  int64_t value = 0;
};

// The errors, shared by the CPU (immediate) and CUDA (deferred) paths so both say the same.
// `position` < 0 leaves the position out (the CPU embedding message, as before).
std::string crossEntropyTargetError(int64_t target, int64_t position, int64_t classes, int64_t ignoreIndex);
std::string embeddingIndexError(int64_t value, int64_t position, const std::string& weight, int64_t rows);
// The deferred message: the op's error, then where it was found and why only now.
std::string deferredCheckError(const std::string& error, Device device, const char* raisedAt);

constexpr size_t kMaxPendingChecks = 64;

class DeferredChecks {
 public:
  struct Check {
    Device device = Device::cpu();
    // Whether the device has written `result` (wait: block until it has). Called without the lock.
    std::function<bool(bool wait)> finished;
    // Valid once finished() returned true.
    std::function<IndexCheckResult()> result;
    // The op's error for a failed result (deferredCheckError adds the rest).
    std::function<std::string(const IndexCheckResult&)> error;
  };

  // Registers a queued check; first polls the device (without waiting) so a finished failure
  // is raised early, and waits for the device's checks when more than kMaxPendingChecks remain.
  void add(Check check);
  // Throws InvalidArgument for the first failed finished check of `device`; `raisedAt` names
  // the point for the message ("a read of a value from cuda:0", "the optimizer step").
  void poll(Device device, bool wait, const char* raisedAt);
  // Checks of `device` not yet dropped.
  size_t pending(Device device) const;
  size_t pendingTotal() const { return total_.load(std::memory_order_relaxed); }

 private:
  mutable std::mutex mutex_;
  std::vector<std::shared_ptr<Check>> checks_;  // every device, in launch order
  std::atomic<size_t> total_{0};
};

// The process's registry (never destroyed: its checks may hold CUDA events at exit).
DeferredChecks& deferredChecks();

// poll() on the process's registry, skipping the lock when nothing is pending (the common case:
// every host read calls it).
void raiseDeferredChecks(Device device, bool wait, const char* raisedAt);

}  // namespace dt::detail
