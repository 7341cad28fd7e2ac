#include "process_group/nccl/comm_lifecycle.h"

#include <algorithm>
#include <thread>

namespace dt::nccl {

Micros Backoff::next(const BackoffPolicy& policy, Micros elapsed, Micros slept) {
  if (elapsed < policy.spin) return Micros(0);
  if (slept.count() == 0) return std::min(policy.firstSleep, policy.maxSleep);
  return std::min(slept * 2, policy.maxSleep);
}

void Backoff::pause() {
  const Micros wait = next(policy_, std::chrono::duration_cast<Micros>(Clock::now() - start_), slept_);
  if (wait.count() == 0) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(wait);
  slept_ = wait;
}

CallOutcome awaitCall(const std::function<CallState()>& state, const std::function<bool()>& aborting,
                      Clock::time_point deadline, BackoffPolicy policy) {
  Backoff backoff(policy);
  while (true) {
    if (aborting()) return CallOutcome::Aborted;
    switch (state()) {
      case CallState::Done: return CallOutcome::Done;
      case CallState::Failed: return CallOutcome::Failed;
      case CallState::InProgress: break;
    }
    if (Clock::now() >= deadline) return CallOutcome::TimedOut;
    backoff.pause();
  }
}

OpState pollOp(OpProbe& probe) {
  const bool completed = probe.eventCompleted();
  if (probe.aborted()) return OpState::Aborted;
  probe.throwIfAsyncError();
  return completed ? OpState::Completed : OpState::Running;
}

}  // namespace dt::nccl
