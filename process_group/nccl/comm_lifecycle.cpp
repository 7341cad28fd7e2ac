#include "process_group/nccl/comm_lifecycle.h"

#include <algorithm>
#include <thread>

#include "common/strings.h"

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

CallOutcome awaitEnqueue(std::mutex& handle, const std::function<bool()>& gone, const std::function<CallState()>& state,
                         const std::function<bool()>& aborting, Clock::time_point deadline, BackoffPolicy policy) {
  bool wentAway = false;
  const CallOutcome outcome = awaitCall(
      [&] {
        std::lock_guard<std::mutex> lock(handle);
        if (gone()) {
          wentAway = true;
          return CallState::Failed;  // ends the loop; reported as Aborted below
        }
        return state();
      },
      aborting, deadline, policy);
  return wentAway ? CallOutcome::Aborted : outcome;
}

DeviceChoice chooseDevice(const DeviceHints& h) {
  if (h.bound) {
    if (*h.bound < 0 || (h.deviceCount > 0 && *h.bound >= h.deviceCount)) {
      return {std::nullopt, str("the backend is bound to cuda:", *h.bound, ", but this process sees ", h.deviceCount,
                                " CUDA device(s) (check CUDA_VISIBLE_DEVICES)")};
    }
    return {*h.bound, str("cuda:", *h.bound, ", the backend's bound device")};
  }
  if (h.lastUsed) return {*h.lastUsed, str("cuda:", *h.lastUsed, ", the device of the group's last op")};
  if (h.current != 0) return {h.current, str("cuda:", h.current, ", this thread's current device")};
  if (h.localRank && *h.localRank >= 0 && h.deviceCount > 0) {
    const int device = *h.localRank % h.deviceCount;
    return {device, str("cuda:", device, " from LOCAL_RANK ", *h.localRank, " (", h.deviceCount, " device(s))")};
  }
  if (h.currentHasContext) return {0, "cuda:0, where this process already works"};
  if (h.groupSize == 1) return {0, "cuda:0 (a group of one rank)"};
  return {std::nullopt,
          str("no CUDA device is known for this rank: no op of the group has run on one, this thread's current device "
              "is cuda:0 only by default (nothing made it current, the process holds no context there), and ",
              h.localRank ? str("LOCAL_RANK ", *h.localRank, " cannot pick one (", h.deviceCount, " device(s) visible)")
                          : std::string("LOCAL_RANK is unset"),
              "; every rank would take cuda:0, which NCCL refuses at world >= 2. Call "
              "dt::setCurrentDevice(dt::Device::cuda(localRank)) (or cuda::setCurrentDevice) before the first barrier, "
              "pass NcclBackendOptions::device, or run a CUDA collective first")};
}

CloseResult closeCommunicators(const std::vector<CommCloser*>& comms, bool healthy,
                               const std::function<bool()>& drained, const std::function<bool()>& aborting,
                               Clock::time_point deadline, BackoffPolicy policy) {
  std::vector<bool> closed(comms.size(), false);
  auto abortRest = [&](std::string why) {
    for (size_t i = 0; i < comms.size(); ++i) {
      if (!closed[i]) comms[i]->abort();
      closed[i] = true;
    }
    return CloseResult{false, std::move(why)};
  };
  if (!healthy) return abortRest("the group is broken");

  // 1. Wait for what is outstanding (the GPU's work, then the Works).
  Backoff backoff(policy);
  while (true) {
    if (aborting()) return abortRest("an abort began while shutdown waited for outstanding ops");
    bool idle = true;
    try {
      for (CommCloser* c : comms) idle = c->idle() && idle;
    } catch (const std::exception& e) {
      return abortRest(str("NCCL reported an error while shutdown waited for outstanding ops: ", e.what()));
    }
    if (idle && drained()) break;
    if (Clock::now() >= deadline) return abortRest("outstanding ops did not complete before shutdown's deadline");
    backoff.pause();
  }
  // 2. Finalize every one first, so that their flushes overlap.
  std::vector<CallState> states;
  for (CommCloser* c : comms) {
    states.push_back(c->finalize());
    if (states.back() == CallState::Failed) return abortRest("ncclCommFinalize failed");
  }
  // 3. Wait until each is quiescent.
  for (size_t i = 0; i < comms.size(); ++i) {
    if (states[i] != CallState::InProgress) continue;
    switch (awaitCall([&] { return comms[i]->state(); }, aborting, deadline, policy)) {
      case CallOutcome::Done: break;
      case CallOutcome::Failed: return abortRest("ncclCommFinalize reported an error");
      case CallOutcome::Aborted: return abortRest("an abort began while shutdown finalized");
      case CallOutcome::TimedOut: return abortRest("ncclCommFinalize did not complete before shutdown's deadline");
    }
  }
  // 4. Local from here on.
  for (size_t i = 0; i < comms.size(); ++i) {
    comms[i]->destroy();
    closed[i] = true;
  }
  return CloseResult{};
}

OpState pollOp(OpProbe& probe) {
  const bool completed = probe.eventCompleted();
  if (probe.aborted()) return OpState::Aborted;
  probe.throwIfAsyncError();
  return completed ? OpState::Completed : OpState::Running;
}

}  // namespace dt::nccl
