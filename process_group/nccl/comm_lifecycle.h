// The NCCL backend's decisions, apart from NCCL and CUDA: when a watched op
// counts as done, how a nonblocking NCCL call is waited for (and which lock
// a launch holds meanwhile), which device an op without tensors (a barrier)
// runs on, how each device's communicator is created once while an abort
// can still get through, and how shutdown chooses between finalizing and
// aborting.
// NcclBackend implements the small interfaces below with its NCCL and CUDA
// calls; tests implement them with fakes, so the rules are checked in every
// build, with or without a GPU. No CUDA or NCCL header here.
//
// Contract:
//  * Blocking: pollOp and chooseDevice never block; awaitCall, awaitEnqueue
//    and closeCommunicators poll (with a Backoff) until their deadline at
//    most (awaitEnqueue takes the handle's lock for each look only, never
//    across a pause); CommRegistry::getOrCreate
//    blocks while another thread creates the same key (which is bounded by
//    that creation's own deadline) and returns at once on an abort.
//  * Thread safety: the free functions keep no state and call their
//    arguments on the calling thread only; CommRegistry is thread-safe.
//  * Ownership: CommRegistry shares its communicators (shared_ptr); it never
//    ends one itself (beginAbort hands them to the caller, a late one goes
//    to the creator's abandon()).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/errors.h"

namespace dt::nccl {

using Clock = std::chrono::steady_clock;
using Micros = std::chrono::microseconds;

// ---- waiting between polls -----------------------------------------------------------------------

// How a poll loop waits between looks: it yields while less than `spin` has
// passed since it began, then sleeps, starting at `firstSleep` and doubling
// up to `maxSleep`.
struct BackoffPolicy {
  Micros spin{0};
  Micros firstSleep{50};
  Micros maxSleep{10000};
};

class Backoff {
 public:
  explicit Backoff(BackoffPolicy policy) : policy_(policy), start_(Clock::now()) {}
  // Waits once (a yield or a sleep, as next() says).
  void pause();
  // The wait after `elapsed` in the loop when `slept` was the last sleep (0
  // if none yet): 0 means a yield. Pure, for tests.
  static Micros next(const BackoffPolicy& policy, Micros elapsed, Micros slept);

 private:
  BackoffPolicy policy_;
  Clock::time_point start_;
  Micros slept_{0};
};

// The backend's polls. Enqueueing an op on a nonblocking communicator starts
// a helper thread in NCCL (every ncclGroupEnd, NCCL 2.28's group.cc) that
// usually ends within tens of microseconds: yield for 200 us before the first
// sleep, since a sleep of a few microseconds costs ~50 us of timer slack.
// Initialisation (milliseconds to seconds) and shutdown only sleep.
inline constexpr BackoffPolicy kEnqueuePolling{Micros(200), Micros(50), Micros(1000)};
inline constexpr BackoffPolicy kInitPolling{Micros(0), Micros(50), Micros(10000)};
inline constexpr BackoffPolicy kShutdownPolling{Micros(0), Micros(50), Micros(2000)};

// ---- a nonblocking NCCL call ---------------------------------------------------------------------

// What ncclCommGetAsyncError says about a call that returned ncclInProgress.
enum class CallState { Done, InProgress, Failed };
enum class CallOutcome { Done, Failed, Aborted, TimedOut };

// Polls `state` until the call leaves InProgress, an abort begins, or
// `deadline` passes. `aborting` is read before each poll and wins: a call on
// a communicator that is being aborted is given up at once instead of
// holding its caller (and whoever waits for it) until the deadline.
CallOutcome awaitCall(const std::function<CallState()>& state, const std::function<bool()>& aborting,
                      Clock::time_point deadline, BackoffPolicy policy);

// A launch's wait for NCCL to finish enqueueing its op (ncclGroupEnd
// returned ncclInProgress on a nonblocking communicator). `handle` is the
// communicator's lock: an abort takes it to call ncclCommAbort, which frees
// the communicator. Each look (`gone()`, then `state()`: ncclCommGetAsyncError)
// runs under it, and it is free between looks: an abort, the watchdog's
// async-error check of earlier ops and shutdown get through while the launch
// waits (the launch order stays with the caller's own lock, which it holds
// throughout). `gone()` says the communicator was aborted or destroyed: then
// state() is not called again (the handle may be freed) and the outcome is
// Aborted, as when `aborting()` (read without the lock) says an abort began.
CallOutcome awaitEnqueue(std::mutex& handle, const std::function<bool()>& gone, const std::function<CallState()>& state,
                         const std::function<bool()>& aborting, Clock::time_point deadline, BackoffPolicy policy);

// ---- the device of an op without tensors (a barrier) -----------------------------------------------

// What a rank knows about its GPU when an op brings no tensor to tell it.
struct DeviceHints {
  std::optional<int> bound;     // the backend's options (NcclBackendOptions::device)
  std::optional<int> lastUsed;  // the device of this backend's most recent op
  int current = 0;              // the calling thread's current device (cudaGetDevice)
  // The process holds the primary context of `current` (something used it).
  bool currentHasContext = false;
  std::optional<int> localRank;  // LOCAL_RANK (dtrun, torchrun) or SLURM_LOCALID
  int deviceCount = 0;           // visible CUDA devices
  int groupSize = 1;
};

struct DeviceChoice {
  std::optional<int> device;  // nullopt: none is known, refuse the op
  std::string why;            // how it was chosen, or why none could be
};

// The first rule that applies, in this order:
//  1. the bound device;
//  2. the device of the last op (the group's communicator is there already);
//  3. the thread's current device when it is not 0: a thread's device is
//     cuda:0 until something sets it, so any other one was chosen;
//  4. the launcher's contract (docs/gpu.md: rank r of a host uses
//     cuda:LOCAL_RANK), LOCAL_RANK mod the device count;
//  5. cuda:0 when the process already holds its context (it works there) or
//     the group has one rank (no other rank can claim the same GPU).
// Otherwise none: at world >= 2 every rank would take cuda:0 and NCCL would
// refuse the duplicate GPU (or hang), so the op is refused with a hint. A
// bound device that is not visible is refused too.
DeviceChoice chooseDevice(const DeviceHints& hints);

// ---- one op: completed, aborted or still running -----------------------------------------------

// What the watcher of one launched op can ask.
class OpProbe {
 public:
  virtual ~OpProbe() = default;
  // The op's completion event has completed (never blocks).
  virtual bool eventCompleted() = 0;
  // An abort of the op's communicator has begun (the backend's flag, set
  // before ncclCommAbort is called, or the communicator's own).
  virtual bool aborted() = 0;
  // Throws when NCCL reports an asynchronous error on the communicator.
  virtual void throwIfAsyncError() = 0;
};

enum class OpState { Running, Completed, Aborted };

// One look at an op. ncclCommAbort makes the kernels still running exit
// early, so the completion event of an op cut short completes as well: an
// event is read first, and counts only when no abort had begun by the time
// it was seen (the abort state is read after it and wins; read before, an
// abort in between would pass for a success). An asynchronous error wins
// over completion too (then nothing can be assumed about the op's result).
OpState pollOp(OpProbe& probe);

// ---- shutdown: finalize a healthy group, abort a broken one ----------------------------------------

// One communicator as shutdown sees it.
class CommCloser {
 public:
  virtual ~CommCloser() = default;
  // Every op launched on it has completed on the GPU (never blocks; throws
  // when NCCL reports an asynchronous error).
  virtual bool idle() = 0;
  // ncclCommFinalize: Done, InProgress (then poll state()) or Failed.
  virtual CallState finalize() = 0;
  virtual CallState state() = 0;  // ncclCommGetAsyncError
  virtual void destroy() = 0;     // ncclCommDestroy: local once finalized
  virtual void abort() = 0;       // ncclCommAbort
};

struct CloseResult {
  bool graceful = true;  // finalized and destroyed, every one
  std::string reason;    // why it aborted instead ("" when graceful)
};

// How shutdown ends the communicators. Aborting a healthy group is wrong:
// Work::wait() only orders the caller's stream, so `allreduce(t)->wait();
// destroy();` is legal with the op still running (an abort leaves t partial
// and the peers stuck until their watchdog), and even a finished kernel does
// not mean NCCL's proxy has sent its last chunk across the network (an abort
// drops it, ncclCommFinalize flushes it). So a healthy group (`healthy`:
// nothing broke it and no abort began) waits until every communicator is
// idle and `drained()` (the ops' Works are completed too), finalizes every
// communicator, waits for each to leave InProgress, then destroys them. It
// aborts every communicator not yet destroyed instead when the group is not
// healthy, or on the way when `deadline` passes, NCCL reports an error, or
// `aborting()` says an abort began elsewhere.
CloseResult closeCommunicators(const std::vector<CommCloser*>& comms, bool healthy,
                               const std::function<bool()>& drained, const std::function<bool()>& aborting,
                               Clock::time_point deadline, BackoffPolicy policy);

// ---- one communicator per device -----------------------------------------------------------------

// Creates each key's (device's) communicator once, on the first thread that
// needs it, without holding the registry's lock while it is being made
// (that is collective and may take the group's timeout): an abort from
// another thread gets through at once, and a creation in progress sees
// aborting() and gives up. A second thread asking for the same key meanwhile
// waits for the first one's result (and fails with its error).
template <typename Comm>
class CommRegistry {
 public:
  using CommPtr = std::shared_ptr<Comm>;
  // create(index) makes the communicator (polling aborting() while it waits);
  // `index` numbers this registry's communicators from 0 in the order their
  // creation began, which ranks agree on when they use devices in the same
  // order. When an abort began while create() ran, the new communicator is
  // handed to abandon() (which ends it) and getOrCreate throws BackendError.
  CommPtr getOrCreate(int key, const std::function<CommPtr(int index)>& create,
                      const std::function<void(Comm&)>& abandon);
  // From now on aborting() is true and getOrCreate throws; returns every
  // communicator made so far, for the caller to abort. Idempotent.
  std::vector<CommPtr> beginAbort();
  bool aborting() const { return aborting_.load(); }
  // The communicators made so far, in creation order.
  std::vector<CommPtr> made() const;

 private:
  struct Entry {
    int index = 0;
    bool creating = true;
    CommPtr comm;
    std::exception_ptr failure;
  };
  [[noreturn]] static void throwAborted();
  std::vector<CommPtr> madeLocked() const;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<int, std::shared_ptr<Entry>> entries_;
  int created_ = 0;
  std::atomic<bool> aborting_{false};
};

template <typename Comm>
void CommRegistry<Comm>::throwAborted() {
  throw BackendError("the group's NCCL communicators were aborted (shut down or broken); no new one is created");
}

template <typename Comm>
typename CommRegistry<Comm>::CommPtr CommRegistry<Comm>::getOrCreate(int key,
                                                                     const std::function<CommPtr(int index)>& create,
                                                                     const std::function<void(Comm&)>& abandon) {
  std::shared_ptr<Entry> entry;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (auto it = entries_.find(key); it != entries_.end()) {
      std::shared_ptr<Entry> other = it->second;
      changed_.wait(lock, [&] { return !other->creating || aborting_.load(); });
      if (other->creating) throwAborted();  // the creator gives up too
      if (other->failure) std::rethrow_exception(other->failure);
      return other->comm;
    }
    if (aborting_.load()) throwAborted();
    entry = std::make_shared<Entry>();
    entry->index = created_++;
    entries_[key] = entry;
  }
  CommPtr comm;
  try {
    comm = create(entry->index);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    entry->failure = std::current_exception();
    entry->creating = false;
    changed_.notify_all();
    throw;
  }
  bool late = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Under the lock, as beginAbort() collects: either it saw this one made,
    // or this sees its flag and ends the communicator here.
    late = aborting_.load();
    entry->creating = false;
    if (late) {
      entry->failure = std::make_exception_ptr(BackendError(
          "the group's NCCL communicators were aborted (shut down or broken) while this one was being created"));
    } else {
      entry->comm = comm;
    }
    changed_.notify_all();
  }
  if (late) {
    abandon(*comm);
    std::rethrow_exception(entry->failure);
  }
  return comm;
}

template <typename Comm>
std::vector<typename CommRegistry<Comm>::CommPtr> CommRegistry<Comm>::beginAbort() {
  aborting_.store(true);
  std::lock_guard<std::mutex> lock(mutex_);
  changed_.notify_all();
  return madeLocked();
}

template <typename Comm>
std::vector<typename CommRegistry<Comm>::CommPtr> CommRegistry<Comm>::made() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return madeLocked();
}

template <typename Comm>
std::vector<typename CommRegistry<Comm>::CommPtr> CommRegistry<Comm>::madeLocked() const {
  std::map<int, CommPtr> byIndex;
  for (const auto& [key, entry] : entries_) {
    if (entry->comm) byIndex[entry->index] = entry->comm;
  }
  std::vector<CommPtr> out;
  for (auto& [index, comm] : byIndex) out.push_back(comm);
  return out;
}

}  // namespace dt::nccl
