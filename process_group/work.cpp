#include "process_group/work.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <ctime>
#include <deque>
#include <set>
#include <thread>

#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"
#include "common/thread_name.h"

namespace dt {
namespace {

// The threads then() callbacks run on. Grows when no thread is idle, so that
// a callback blocked on another Work's callbacks never waits for itself;
// idle threads exit, so an idle process keeps none.
class CallbackPool {
 public:
  // Leaked on purpose: callbacks may still run while static objects are
  // destroyed at exit. A forked child gets a pool of its own (the parent's
  // threads do not exist there and its mutex may be held).
  static CallbackPool& instance() {
    static std::atomic<CallbackPool*> pool{nullptr};
    static std::mutex creating;
    CallbackPool* current = pool.load(std::memory_order_acquire);
    if (current != nullptr && current->pid_ == ::getpid()) return *current;
    std::lock_guard<std::mutex> lock(creating);
    current = pool.load(std::memory_order_acquire);
    if (current == nullptr || current->pid_ != ::getpid()) {
      current = new CallbackPool();
      pool.store(current, std::memory_order_release);
    }
    return *current;
  }

  void post(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(task));
    if (idle_ >= static_cast<int>(queue_.size()) || threads_ >= kMaxThreads) {
      wake_.notify_one();
      return;
    }
    ++threads_;
    std::thread([this] {
      setThreadName("dt-pg-callback");
      loop();
    }).detach();
  }

 private:
  static constexpr auto kIdleExit = std::chrono::seconds(5);
  // Beyond this, tasks wait for a thread (only callbacks that block for long
  // get here).
  static constexpr int kMaxThreads = 64;

  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      ++idle_;
      const bool got = wake_.wait_for(lock, kIdleExit, [&] { return !queue_.empty(); });
      --idle_;
      if (!got) {
        --threads_;
        return;
      }
      auto task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }

  const pid_t pid_ = ::getpid();
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  int idle_ = 0;
  int threads_ = 0;
};

void runCallbacks(Work& work, std::vector<std::function<void(Work&)>>& callbacks) {
  for (auto& cb : callbacks) {
    try {
      cb(work);
    } catch (const std::exception& e) {
      logger("process_group")->error("Work callback of {} threw: {}", work.description(), e.what());
    }
  }
}

}  // namespace

Work::Work(std::string description) : description_(std::move(description)) {}

Work::Work(const char* op, uint64_t seq, const std::string* who) : op_(op), seq_(seq), who_(who) {}

const std::string* Work::internName(const std::string& name) {
  // Never freed: Works may be described after their group is gone, and a
  // process creates few groups (a few dozen bytes each).
  static std::mutex mutex;
  static auto* names = new std::set<std::string>();
  std::lock_guard<std::mutex> lock(mutex);
  return &*names->insert(name).first;
}

const std::string& Work::description() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return describeLocked();
}

const std::string& Work::describeLocked() const {
  if (description_.empty() && op_ != nullptr) {
    description_ = op_;
    description_ += " #";
    description_ += std::to_string(seq_);
    description_ += " (";
    description_ += who_ ? *who_ : std::string();
    description_ += ')';
  }
  return description_;
}

std::shared_ptr<Work> Work::completed(std::string description) {
  auto work = std::make_shared<Work>(std::move(description));
  markCompleted(work);
  return work;
}

std::shared_ptr<Work> Work::failed(std::string description, std::exception_ptr error) {
  auto work = std::make_shared<Work>(std::move(description));
  markFailed(work, std::move(error));
  return work;
}

// completed_ is read without the lock where that saves one on the op's path:
// error_ is written before completed_ is set and never after, and the start
// and device helpers are set before the Work is handed out. Sequentially
// consistent: it pairs with listening_ (see finish()).
bool Work::done() const { return completed_.load(std::memory_order_seq_cst) != 0; }

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "completed_ is a futex word");

bool Work::sleepUntilDone(std::optional<std::chrono::steady_clock::time_point> deadline) {
  // Dekker with finish(): this thread counts itself a sleeper before it looks at completed_, and
  // finish() sets completed_ before it counts the sleepers; the futex wait itself returns at
  // once if completed_ is no longer 0.
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  bool finished = true;
  while (!done()) {
    timespec relative{};
    if (deadline) {
      const auto left = *deadline - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) {
        finished = false;
        break;
      }
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      relative.tv_sec = static_cast<time_t>(ns / 1000000000);
      relative.tv_nsec = static_cast<long>(ns % 1000000000);
    }
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&completed_), FUTEX_WAIT_PRIVATE, 0u,
              deadline ? &relative : nullptr, nullptr, 0);
  }
  sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  return finished;
}

void Work::wakeSleepers() {
  if (sleepers_.load(std::memory_order_seq_cst) == 0) return;
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&completed_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

void Work::listen() { listening_.store(true, std::memory_order_seq_cst); }

void Work::hintStartSoon() const {
  if (!startHelper_ || done() || startHinted_.exchange(true)) return;
  startHelper_(Start::Soon);
}

bool Work::isCompleted() const {
  if (done()) return true;
  hintStartSoon();
  return false;
}

bool Work::isSuccess() const { return done() && !error_; }

std::exception_ptr Work::exception() const {
  hintStartSoon();
  return done() ? error_ : nullptr;
}

void Work::setDeviceWait(std::function<void()> deviceWait) {
  std::lock_guard<std::mutex> lock(mutex_);
  deviceWait_ = std::move(deviceWait);
}

bool Work::hasDeviceWait() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<bool>(deviceWait_);
}

void Work::wait(std::optional<std::chrono::milliseconds> timeout) {
  // A completed op's event (device work) has completed too: nothing to wait for.
  if (done()) {
    if (error_) std::rethrow_exception(error_);
    return;
  }
  if (!timeout && deviceWait_) {
    deviceWait_();
    return;
  }
  if (startHelper_) {
    if (timeout) {
      hintStartSoon();
    } else {
      startHelper_(Start::OnThisThread);
    }
    if (done()) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
  }
  std::optional<std::chrono::steady_clock::time_point> deadline;
  if (timeout) deadline = std::chrono::steady_clock::now() + *timeout;
  if (!sleepUntilDone(deadline)) {
    throw TimeoutError(str("Work::wait: ", description(), " still running after ", formatDuration(*timeout),
                           "; only this wait timed out: the op continues, the group is not broken by it, and "
                           "the op's own timeout ends it; wait again, or check ProcessGroup::isBroken()"));
  }
  if (error_) std::rethrow_exception(error_);
}

void Work::then(std::function<void(Work&)> callback) {
  hintStartSoon();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    listen();
    // While earlier callbacks still run on the pool, or wait for the completing thread to hand
    // them over (see finish()), a late one joins them, so that callbacks keep their
    // registration order.
    if (!done() || callbacksDraining_ || !callbacks_.empty()) {
      callbacks_.push_back(std::move(callback));
      return;
    }
  }
  std::vector<std::function<void(Work&)>> one{std::move(callback)};
  runCallbacks(*this, one);
}

void Work::thenInline(std::function<void(Work&)> callback) {
  hintStartSoon();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    listen();
    if (!done() || !inlineCallbacks_.empty()) {
      inlineCallbacks_.push_back(std::move(callback));
      return;
    }
  }
  std::vector<std::function<void(Work&)>> one{std::move(callback)};
  runCallbacks(*this, one);
}

void Work::drainCallbacks(std::vector<std::function<void(Work&)>> batch) {
  for (;;) {
    runCallbacks(*this, batch);
    std::lock_guard<std::mutex> lock(mutex_);
    if (callbacks_.empty()) {
      callbacksDraining_ = false;
      return;
    }
    batch.clear();
    batch.swap(callbacks_);
  }
}

void Work::setResult(std::vector<Tensor> tensors) {
  // No lock: before the Work is handed out nothing reads result_ (only
  // result(), future() and a completion with a future made read it).
  result_ = std::move(tensors);
}

std::vector<Tensor> Work::result() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return result_;
}

std::shared_future<std::vector<Tensor>> Work::future() {
  hintStartSoon();
  std::lock_guard<std::mutex> lock(mutex_);
  listen();
  if (!promise_) {
    promise_.emplace();
    future_ = promise_->get_future().share();
    if (done()) settlePromiseLocked();
  }
  return future_;
}

void Work::markCompleted(const std::shared_ptr<Work>& work) { work->finish(nullptr, work); }

void Work::markFailed(const std::shared_ptr<Work>& work, std::exception_ptr error) {
  if (!error) error = std::make_exception_ptr(Error(str(work->description(), " failed without an error (internal error)")));
  work->finish(std::move(error), work);
}

void Work::settlePromiseLocked() {
  if (!promise_ || promiseSettled_) return;
  promiseSettled_ = true;
  if (error_) {
    promise_->set_exception(error_);
  } else {
    promise_->set_value(result_);
  }
}

void Work::finish(std::exception_ptr error, const std::shared_ptr<Work>& self) {
  // Completing twice is a backend's bug: caught when the completions follow each other (two
  // racing ones are not told apart).
  if (done()) {
    std::lock_guard<std::mutex> lock(mutex_);
    throw Error(str("Work ", describeLocked(), " completed twice (internal error, please report)"));
  }
  // Without the lock while nobody has registered a callback or a future (an op its caller ran
  // inline and then waited for). Registrants set listening_ before they look at completed_, and
  // this thread sets completed_ before it looks at listening_ again (all sequentially
  // consistent): a registrant this thread does not see finds the Work complete; one that found it
  // running is seen here, and what it registered is handed over below (later registrants queue
  // behind what is waiting, so the order holds). Blocked waits are woken the same way
  // (sleepUntilDone()).
  bool published = false;
  if (!listening_.load(std::memory_order_seq_cst)) {
    error_ = std::move(error);
    completed_.store(1, std::memory_order_seq_cst);
    wakeSleepers();
    if (!listening_.load(std::memory_order_seq_cst)) return;
    published = true;
  }
  std::vector<std::function<void(Work&)>> inlineCallbacks;
  std::vector<std::function<void(Work&)>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!published) {
      error_ = std::move(error);
      completed_.store(1, std::memory_order_seq_cst);
    }
    settlePromiseLocked();
    inlineCallbacks.swap(inlineCallbacks_);
    callbacks.swap(callbacks_);
    callbacksDraining_ = !callbacks.empty();
  }
  if (!published) wakeSleepers();
  runCallbacks(*this, inlineCallbacks);
  if (callbacks.empty()) return;
  CallbackPool::instance().post([self, callbacks = std::move(callbacks)]() mutable {
    self->drainCallbacks(std::move(callbacks));
  });
}

WorkPtr allOf(std::string description, std::vector<WorkPtr> works) {
  auto all = std::make_shared<Work>(std::move(description));
  if (works.empty()) {
    Work::markCompleted(all);
    return all;
  }
  // The last to complete completes `all`, with the first failure in list order.
  auto remaining = std::make_shared<std::atomic<size_t>>(works.size());
  for (const auto& w : works) {
    w->thenInline([all, works, remaining](Work&) {
      if (remaining->fetch_sub(1) != 1) return;
      for (const auto& part : works) {
        if (std::exception_ptr error = part->exception()) {
          Work::markFailed(all, error);
          return;
        }
      }
      Work::markCompleted(all);
    });
  }
  return all;
}

}  // namespace dt
