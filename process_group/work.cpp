#include "process_group/work.h"

#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"

namespace dt {

Work::Work(std::string description) : description_(std::move(description)) {}

std::shared_ptr<Work> Work::completed(std::string description) {
  auto work = std::make_shared<Work>(std::move(description));
  work->markCompleted();
  return work;
}

std::shared_ptr<Work> Work::failed(std::string description, std::exception_ptr error) {
  auto work = std::make_shared<Work>(std::move(description));
  work->markFailed(std::move(error));
  return work;
}

bool Work::isCompleted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

bool Work::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && !error_;
}

std::exception_ptr Work::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

void Work::wait(std::optional<std::chrono::milliseconds> timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!completed_ && !timeout && waitHelper_) {
    auto helper = waitHelper_;
    lock.unlock();
    helper();
    lock.lock();
  }
  if (timeout) {
    if (!done_.wait_for(lock, *timeout, [&] { return completed_; })) {
      throw TimeoutError(str("Work::wait: ", description_, " still running after ", formatDuration(*timeout),
                             " (the operation itself continues; its own timeout ends it)"));
    }
  } else {
    done_.wait(lock, [&] { return completed_; });
  }
  if (error_) std::rethrow_exception(error_);
}

void Work::then(std::function<void(Work&)> callback) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!completed_) {
      callbacks_.push_back(std::move(callback));
      return;
    }
  }
  try {
    callback(*this);
  } catch (const std::exception& e) {
    logger("process_group")->error("Work::then callback of {} threw: {}", description_, e.what());
  }
}

void Work::markCompleted() { finish(nullptr); }

void Work::markFailed(std::exception_ptr error) {
  if (!error) error = std::make_exception_ptr(Error(str(description_, " failed without an error (internal error)")));
  finish(std::move(error));
}

void Work::finish(std::exception_ptr error) {
  std::vector<std::function<void(Work&)>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) {
      throw Error(str("Work ", description_, " completed twice (internal error, please report)"));
    }
    completed_ = true;
    error_ = std::move(error);
    callbacks.swap(callbacks_);
  }
  done_.notify_all();
  for (auto& cb : callbacks) {
    try {
      cb(*this);
    } catch (const std::exception& e) {
      logger("process_group")->error("Work::then callback of {} threw: {}", description_, e.what());
    }
  }
}

}  // namespace dt
