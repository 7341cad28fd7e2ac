#include "process_group/progress.h"

#include "common/env.h"
#include "common/logging.h"
#include "common/strings.h"
#include "common/thread_name.h"
#include "process_group/flight_recorder.h"

namespace dt {

ProgressTracker::ProgressTracker(StorePtr groupStore, int rank, std::chrono::milliseconds interval,
                                 StorePtr watchdogStore, std::string watchdogKey)
    : store_(std::move(groupStore)),
      rank_(rank),
      interval_(interval),
      watchdogStore_(std::move(watchdogStore)),
      watchdogKey_(std::move(watchdogKey)) {
  writeGroupKey();  // present from the start: "never started anything" is information too
  thread_ = std::thread([this] {
    setThreadName("dt-pg-progress");
    loop();
  });
}

ProgressTracker::~ProgressTracker() { stop(); }

std::string ProgressTracker::progressKey(int rank) { return str("dt_progress/", rank); }

void ProgressTracker::started(uint64_t seq, const char*) noexcept {
  started_.store(seq, std::memory_order_relaxed);
}

void ProgressTracker::completed(uint64_t seq, const char* op) noexcept {
  completedOp_.store(op, std::memory_order_relaxed);
  completed_.store(seq, std::memory_order_release);
}

void ProgressTracker::writeGroupKey() {
  std::lock_guard<std::mutex> lock(writeMutex_);
  ++heartbeat_;
  try {
    store_->set(progressKey(rank_), str(lastStarted(), " ", lastCompleted(), " ", heartbeat_));
    loggedError_ = false;
  } catch (const std::exception& e) {
    if (!loggedError_) logger("process_group")->warn("rank {}: cannot publish progress: {}", rank_, e.what());
    loggedError_ = true;
  }
}

void ProgressTracker::publishNow() { writeGroupKey(); }

void ProgressTracker::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait_for(lock, interval_, [&] { return stopping_; });
    const bool last = stopping_;
    lock.unlock();
    // Not on the way out: the group is going away, and the store's host may already have.
    if (!last) writeGroupKey();
    if (!last) flight::pollSignal();
    if (watchdogStore_) {
      const uint64_t done = completed_.load(std::memory_order_acquire);
      if (done != watchdogWritten_) {
        try {
          watchdogStore_->set(watchdogKey_, str(done, " ", completedOp_.load(std::memory_order_relaxed)));
          watchdogWritten_ = done;
        } catch (const std::exception& e) {
          logger("process_group")->warn("rank {}: cannot write {}: {}", rank_, watchdogKey_, e.what());
        }
      }
    }
    lock.lock();
    if (last) return;
  }
}

void ProgressTracker::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  wake_.notify_all();
  std::lock_guard<std::mutex> join(joinMutex_);
  if (thread_.joinable()) thread_.join();
}

std::vector<RankProgress> ProgressTracker::readAll(Store& groupStore, int worldSize) {
  std::vector<RankProgress> out(worldSize);
  for (int r = 0; r < worldSize; ++r) {
    try {
      if (!groupStore.check({progressKey(r)})) continue;
      const auto fields = split(groupStore.get(progressKey(r)), ' ');
      if (fields.size() < 3) continue;
      out[r].started = static_cast<uint64_t>(env::parseInt(fields[0], "progress"));
      out[r].completed = static_cast<uint64_t>(env::parseInt(fields[1], "progress"));
      out[r].heartbeat = static_cast<uint64_t>(env::parseInt(fields[2], "progress"));
      out[r].present = true;
    } catch (const std::exception&) {
      // A rank whose key cannot be read is reported as unknown.
    }
  }
  return out;
}

}  // namespace dt
