// Work: the handle every asynchronous call returns.
//
// Contract:
//  * A backend completes a Work exactly once, with success or with an
//    exception (an error is a value until wait() rethrows it). Completing it
//    again is an internal error.
//  * wait() blocks until completion and rethrows the backend's exception;
//    wait(timeout) additionally throws dt::TimeoutError if the work is still
//    running after `timeout` (the work itself keeps running).
//  * then(cb) runs cb(work) exactly once: on the completing thread, or at once
//    on the caller's thread when already complete. Callbacks run in
//    registration order, outside the Work's lock; an exception from a callback
//    is logged and swallowed (it must not take the backend's worker down).
//  * Every method is thread-safe. Held by std::shared_ptr (WorkPtr).
//  * A backend may give a Work a wait helper: wait() without a timeout calls
//    it (on the waiting thread, once, before blocking), so that an op nobody
//    has started yet can run on the thread that waits for it instead of
//    paying a worker thread's wake-up. The helper must leave the op's
//    completion to the usual path and return whether it did anything.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace dt {

class Work : public std::enable_shared_from_this<Work> {
 public:
  // description names the op for messages, e.g. "allreduce #3 (pg=default, gloo)".
  explicit Work(std::string description);
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
  const std::string& description() const { return description_; }

  // Backend side. Throws dt::Error when already completed.
  void markCompleted();
  void markFailed(std::exception_ptr error);
  // Backend side, before the Work is handed out.
  void setWaitHelper(std::function<bool()> helper) { waitHelper_ = std::move(helper); }

 private:
  void finish(std::exception_ptr error);

  const std::string description_;
  mutable std::mutex mutex_;
  std::condition_variable done_;
  bool completed_ = false;
  std::exception_ptr error_;
  std::vector<std::function<void(Work&)>> callbacks_;
  std::function<bool()> waitHelper_;
};

using WorkPtr = std::shared_ptr<Work>;

}  // namespace dt
