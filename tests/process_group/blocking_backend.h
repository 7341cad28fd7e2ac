// BlockingBackend: a CPU backend (for ProcessGroupOptions::cpuBackendFactory)
// whose allreduce and barrier block inside the call, as NCCL's first op does
// while it makes its communicator, until the backend is aborted or shut down;
// the call then returns a Work failed with the abort's cause (or "shut down").
// Later calls fail at once the same way. Its state lives in a Gate the test
// keeps, so that the test holds no reference to the backend itself (the group's
// keep-alive of a backend in use is then what keeps it alive).
//
// BlockingGate::setHoldAborts(true) makes abort() itself block (after it
// recorded the cause and released the ops) until set back: a transport whose
// abort is slow. opsOutlastShutdown keeps ops blocked after shutdown(), and
// release() lets every op and held abort go (a test's way out).
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/strings.h"
#include "process_group/backend.h"
#include "process_group/process_group.h"

namespace dt::testing {

struct BlockingGate {
  std::mutex mutex;
  std::condition_variable changed;
  int inside = 0;        // calls blocked in the backend now
  int calls = 0;         // calls that entered the backend
  int abortsEntered = 0;
  int alive = 0;         // backends not yet destroyed
  bool shutDown = false;
  bool holdAborts = false;
  bool opsOutlastShutdown = false;  // set before the first op
  bool released = false;
  std::exception_ptr cause;

  // Waits up to `within` for `done` (under the mutex); false on the deadline.
  template <typename Pred>
  bool waitFor(std::chrono::milliseconds within, Pred done) {
    std::unique_lock<std::mutex> lock(mutex);
    return changed.wait_for(lock, within, [&] { return done(*this); });
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      released = true;
    }
    changed.notify_all();
  }
  void setHoldAborts(bool hold) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      holdAborts = hold;
    }
    changed.notify_all();
  }
};

class BlockingBackend final : public Backend {
 public:
  BlockingBackend(std::shared_ptr<BlockingGate> gate, int rank, int size)
      : gate_(std::move(gate)), rank_(rank), size_(size) {
    std::lock_guard<std::mutex> lock(gate_->mutex);
    ++gate_->alive;
  }
  ~BlockingBackend() override {
    {
      std::lock_guard<std::mutex> lock(gate_->mutex);
      --gate_->alive;
    }
    gate_->changed.notify_all();
  }

  // A cpuBackendFactory that makes one of these on `gate`.
  static std::function<BackendPtr(const BackendContext&)> factory(std::shared_ptr<BlockingGate> gate) {
    return [gate](const BackendContext& c) { return std::make_shared<BlockingBackend>(gate, c.rank, c.size); };
  }

  std::string name() const override { return "blocking"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  WorkPtr allreduce(const std::vector<Tensor>&, const AllreduceOptions& options) override {
    return block("allreduce", options.seq);
  }
  WorkPtr barrier(const BarrierOptions& options) override { return block("barrier", options.seq); }

  std::exception_ptr brokenCause() const override {
    std::lock_guard<std::mutex> lock(gate_->mutex);
    return gate_->cause;
  }
  void abort(std::exception_ptr cause) override {
    std::unique_lock<std::mutex> lock(gate_->mutex);
    if (!gate_->cause) gate_->cause = cause;
    ++gate_->abortsEntered;
    gate_->changed.notify_all();
    gate_->changed.wait(lock, [&] { return !gate_->holdAborts || gate_->released; });
  }
  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(gate_->mutex);
      gate_->shutDown = true;
    }
    gate_->changed.notify_all();
  }

 private:
  WorkPtr block(const char* op, uint64_t seq) {
    std::unique_lock<std::mutex> lock(gate_->mutex);
    ++gate_->calls;
    ++gate_->inside;
    gate_->changed.notify_all();
    gate_->changed.wait(lock, [&] {
      return gate_->cause || gate_->released || (gate_->shutDown && !gate_->opsOutlastShutdown);
    });
    --gate_->inside;
    gate_->changed.notify_all();
    const std::string what = str(op, " #", seq, " (rank ", rank_, "/", size_, " blocking)");
    if (gate_->cause) return Work::failed(what, gate_->cause);
    return Work::failed(what, std::make_exception_ptr(BackendError(str(what, ": the backend was shut down"))));
  }

  std::shared_ptr<BlockingGate> gate_;
  int rank_;
  int size_;
};

}  // namespace dt::testing
