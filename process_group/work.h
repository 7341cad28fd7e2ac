// Work: the handle every asynchronous call returns.
//
// Contract:
//  * A backend completes a Work exactly once, with success or with an
//    exception (an error is a value until wait() rethrows it). Completing it
//    again is an internal error.
//  * wait() blocks until completion and rethrows the backend's exception;
//    wait(timeout) additionally throws dt::TimeoutError if the work is still
//    running after `timeout`. That error says the op continues and the group
//    is not broken by it (unlike a TimeoutError the op itself fails with,
//    which breaks the group): wait again, or check ProcessGroup::isBroken().
//  * then(cb) runs cb(work) exactly once after completion, on dtrain's
//    callback threads, never on the backend's worker: a slow callback cannot
//    hold back the group's later collectives. Callbacks of one Work run in
//    registration order, one after another; a callback registered on a Work
//    that is already complete runs at once on the caller's thread (after
//    the earlier ones, on their thread, if those still run). An
//    exception from a callback is logged and swallowed.
//    thenInline(cb) runs cb on the thread that completes the Work (usually
//    the backend's worker), before the then() callbacks are handed over: for
//    bookkeeping of a few microseconds only, since the worker starts the
//    group's next collective after it returns.
//  * result(): the tensors that hold the op's result once it succeeded (for
//    ProcessGroup calls: allreduce's tensors, allgather's outputs, a recv's
//    tensors, ...; empty for barrier and send). future() is a shared_future
//    of the same tensors that rethrows the op's error (c10d's get_future).
//    Both are set before the Work is handed out; their contents are only
//    meaningful after success.
//  * The callback threads: a small pool shared by the process, grown when
//    every thread is busy (so a callback that waits on another Work's
//    callbacks does not deadlock), idle threads exit after a few seconds.
//  * Every method is thread-safe. Held by std::shared_ptr (WorkPtr).
//  * A backend may give a Work a start helper, for an op it leaves to its
//    caller (CollectiveRunner does, see collective_runner.h). wait() without
//    a timeout calls helper(Start::OnThisThread) on the waiting thread, once,
//    before blocking, so that an op nobody has started yet runs there instead
//    of paying a worker thread's wake-up. The first then(), thenInline(),
//    isCompleted(), exception(), future() or wait(timeout) call on a Work not
//    yet completed calls helper(Start::Soon): the caller does not mean to
//    run it itself, so the backend should start it elsewhere now. The helper
//    must leave the op's completion to the usual path and return whether it
//    ran the op.
//  * Device work (NCCL) may carry a device wait instead: wait() without a
//    timeout then does not block the host. If the Work already failed it
//    rethrows; if it is still running it calls the device wait, which makes
//    the caller's current CUDA stream wait for the op's completion event, and
//    returns at once (an error found later surfaces at the next wait(), op or
//    isCompleted()/exception() check). wait(timeout) still blocks the host
//    until completion or timeout, and the backend still completes the Work
//    on the host (markCompleted once the op's event has completed), so
//    isCompleted(), then(), future() and result() read as for any Work.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace dt {

class Work {
 public:
  // description names the op for messages, e.g. "allreduce #3 (rank 0/2 pg=default gloo)".
  explicit Work(std::string description);
  // The same text, made only when something asks for it (errors, logs): a
  // collective's Work is on every op's path. `op` must be a string literal;
  // `who` must live as long as the process (see internName()).
  Work(const char* op, uint64_t seq, const std::string* who);
  // A copy of `name` that lives as long as the process, one per distinct text:
  // what a backend hands its Works as `who`. Works outlive their group, and
  // sharing the name through a shared_ptr would cost two atomic operations per op.
  static const std::string* internName(const std::string& name);
  virtual ~Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  static std::shared_ptr<Work> completed(std::string description);
  static std::shared_ptr<Work> failed(std::string description, std::exception_ptr error);

  bool isCompleted() const;
  // True once completed without an exception.
  bool isSuccess() const;
  // The failure, or nullptr (also while still running).
  std::exception_ptr exception() const;
  void wait(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  void then(std::function<void(Work&)> callback);
  void thenInline(std::function<void(Work&)> callback);
  std::vector<Tensor> result() const;
  std::shared_future<std::vector<Tensor>> future();
  const std::string& description() const;

  // Backend side: completes `work`. Throws dt::Error when already completed.
  // The caller hands over its WorkPtr because then() callbacks run on another
  // thread and keep the Work alive through it (a Work that found its own
  // owner, enable_shared_from_this, would pay four atomic operations on every
  // op).
  static void markCompleted(const std::shared_ptr<Work>& work);
  static void markFailed(const std::shared_ptr<Work>& work, std::exception_ptr error);
  // Backend side, before the Work is handed out: see "start helper" above.
  enum class Start { OnThisThread, Soon };
  void setStartHelper(std::function<bool(Start)> helper) { startHelper_ = std::move(helper); }
  // Backend side, before the Work is handed out: see "device wait" above.
  void setDeviceWait(std::function<void()> deviceWait);
  // Whether wait() without a timeout only orders the caller's stream; code
  // that must see the op finished on the host uses wait(timeout) then.
  bool hasDeviceWait() const;
  void setResult(std::vector<Tensor> tensors);  // before the Work is handed out, like the helpers

 private:
  void finish(std::exception_ptr error, const std::shared_ptr<Work>& self);
  // Runs `batch`, then whatever then() queued meanwhile, until none is left.
  void drainCallbacks(std::vector<std::function<void(Work&)>> batch);

  mutable std::string description_;  // made once from the parts below if empty (under mutex_)
  const char* op_ = nullptr;
  uint64_t seq_ = 0;
  const std::string* who_ = nullptr;
  mutable std::mutex mutex_;
  // 0 running, 1 completed; read without mutex_ (done()), see finish(). A blocking wait()
  // sleeps on it as a futex: a condition variable costs its construction and destruction on
  // every op, and most ops (run by their caller) never block on it.
  std::atomic<uint32_t> completed_{0};
  std::atomic<uint32_t> sleepers_{0};  // threads in (or entering) a futex wait on completed_
  // Blocks until done() or `deadline`; false at the deadline.
  bool sleepUntilDone(std::optional<std::chrono::steady_clock::time_point> deadline);
  void wakeSleepers();
  // Set (under mutex_) before anyone registers a callback or a future: finish() takes the
  // lock only then.
  std::atomic<bool> listening_{false};
  void listen();
  std::exception_ptr error_;
  std::vector<std::function<void(Work&)>> inlineCallbacks_;
  std::vector<std::function<void(Work&)>> callbacks_;
  bool callbacksDraining_ = false;  // then() callbacks still running after completion
  // The first hint that another thread should start the op (see above).
  void hintStartSoon() const;

  std::function<bool(Start)> startHelper_;
  bool done() const;
  const std::string& describeLocked() const;
  mutable std::atomic<bool> startHinted_{false};
  std::function<void()> deviceWait_;
  std::vector<Tensor> result_;
  std::optional<std::promise<std::vector<Tensor>>> promise_;  // made by the first future()
  bool promiseSettled_ = false;                                // under mutex_
  void settlePromiseLocked();
  std::shared_future<std::vector<Tensor>> future_;
};

using WorkPtr = std::shared_ptr<Work>;

// One Work that completes when all of `works` have: with the first failure
// (in list order) or with success. Its result is left to the caller.
WorkPtr allOf(std::string description, std::vector<WorkPtr> works);

}  // namespace dt
