// ProgressTracker: what a rank has started and completed, published to the
// store from a background thread so that (a) a timed-out rank can say who is
// stuck where, (b) a failed rank can tell dead peers from live ones, and (c)
// the launcher's hang watchdog sees the last completed collective.
//
// Contract:
//  * started()/completed() are called on the collective hot path: they only
//    store atomics and never touch the store or a lock.
//  * A background thread wakes every `interval` (default 1 s) and writes
//      <groupStore>/dt_progress/<rank> = "<lastStarted> <lastCompleted> <heartbeat>"
//    (heartbeat increments every write, so readers can tell a live rank from
//    a dead one) and, when a watchdog key is configured and the completed
//    sequence number changed,
//      <watchdogStore>/<watchdogKey>  = "<seq> <op>"   e.g. "41 allreduce".
//    Writes are therefore throttled to one per interval per key, and the last
//    value is always written eventually (also on stop()).
//  * Store errors in the background thread are logged once and retried on
//    the next tick; they never reach the caller.
//  * Thread-safe. stop() joins the thread; the destructor calls it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "store/store.h"

namespace dt {

struct RankProgress {
  uint64_t started = 0;
  uint64_t completed = 0;
  uint64_t heartbeat = 0;
  bool present = false;  // the key existed
};

class ProgressTracker {
 public:
  ProgressTracker(StorePtr groupStore, int rank, std::chrono::milliseconds interval = std::chrono::seconds(1),
                  StorePtr watchdogStore = nullptr, std::string watchdogKey = {});
  ~ProgressTracker();
  ProgressTracker(const ProgressTracker&) = delete;
  ProgressTracker& operator=(const ProgressTracker&) = delete;

  // `op` must be a string literal (kept as a pointer).
  void started(uint64_t seq, const char* op) noexcept;
  void completed(uint64_t seq, const char* op) noexcept;
  uint64_t lastStarted() const noexcept { return started_.load(std::memory_order_relaxed); }
  uint64_t lastCompleted() const noexcept { return completed_.load(std::memory_order_relaxed); }

  // Writes this rank's progress now (used before a timeout diagnosis).
  void publishNow();
  // Reads every rank's progress key (never blocks on missing keys).
  static std::vector<RankProgress> readAll(Store& groupStore, int worldSize);
  static std::string progressKey(int rank);

  void stop();

 private:
  void loop();
  void writeGroupKey();

  StorePtr store_;
  const int rank_;
  const std::chrono::milliseconds interval_;
  StorePtr watchdogStore_;
  const std::string watchdogKey_;

  std::atomic<uint64_t> started_{0};
  std::atomic<uint64_t> completed_{0};
  std::atomic<const char*> completedOp_{""};
  uint64_t heartbeat_ = 0;         // loop thread / publishNow under writeMutex_
  uint64_t watchdogWritten_ = 0;   // loop thread only
  bool loggedError_ = false;
  std::mutex writeMutex_;

  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::mutex joinMutex_;  // stop() may run on several threads at once: one joins
  std::thread thread_;
};

}  // namespace dt
