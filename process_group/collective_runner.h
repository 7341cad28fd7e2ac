// CollectiveRunner: the machinery every backend shares around its transport.
// It owns the queue of collectives and the worker thread that runs them in
// issue order, the sequence numbers, the broken-group state, this rank's
// progress (ProgressTracker), failure reports, and the diagnosis that turns a
// transport failure into one error naming who is stuck or gone. A backend
// adds its transport and algorithms: it validates input at the call, then
// enqueues a body that moves the bytes.
//
// Contract:
//  * enqueue() numbers the op (the seq it is given, or its own counter
//    1, 2, ...), returns a Work at once, and runs body(timeout) in issue
//    order, one op at a time, on the worker thread or on a thread that waits.
//    Who runs an op is decided without timers on the op's own path:
//      - An op of up to 1 MiB is left to its caller: enqueue wakes nobody,
//        and a wait() (without a timeout) on it while it is next in line runs
//        it on the waiting thread. A small issue-then-wait op therefore costs
//        no thread wake-up at all (each costs ~5 us and may preempt a rank
//        that is mid-exchange on the same core).
//      - It goes to the worker as soon as its caller shows that it is not
//        going to run it: the caller issues another op behind it, waits for
//        it while another op runs, or uses the Work in any other way
//        (then(), isCompleted(), future(), wait(timeout): Work's start
//        hints, work.h); or else at the worker's second tick (ticks are
//        10 ms apart while ops keep coming; an idle worker sleeps until
//        woken). A caller that waits late or never still has its op started
//        within 20 ms, and ranks waiting on two groups in opposite orders do
//        not block each other.
//      - Larger ops wake the worker at once: they are what callers overlap
//        with compute.
//    stats() counts which thread ran how many ops. The worker is idle again
//    before it completes an op's Work (so that the caller it wakes runs its
//    next op itself): an op its caller runs at once may therefore complete a
//    few microseconds before the worker has completed the op ahead of it;
//    the bodies themselves never overlap and run in issue order.
//  * A body reports failure by throwing. TransportTimeout and PeerLost (below)
//    are the transport's words for "the deadline passed" and "a peer is gone";
//    the runner turns them into TimeoutError / BackendError naming the op, the
//    sequence number, which ranks never started it, which are waiting in it,
//    and which stopped responding (from the ranks' progress keys and failure
//    reports in the store). DesyncError and dt errors pass through with the
//    op's context. Any failure publishes this rank's failure report, aborts
//    the transport (so peers fail promptly instead of at their timeout) and
//    breaks the group: every later op fails at once with the original cause.
//    A TimeoutError that breaks the group says so (unlike Work::wait's own
//    timeout, which leaves the op running and the group healthy).
//  * With fingerprint checks (DT_DEBUG=detail) every rank publishes the op's
//    fingerprint to the store before running it and compares the others';
//    a mismatch is a DesyncError on every rank naming what each called.
//  * While a profiler records (tensor/profiler.h), each op that runs is an
//    event of category "collective" on the thread that ran it, from start to
//    end, with its sequence number, bytes and time queued since issue.
//  * Every op enqueued here is in the flight recorder (flight_recorder.h):
//    recorded at issue (queued, or aborted when the group is already broken),
//    running when its body starts, then done, failed, or aborted (it failed
//    because the group was broken by another cause). The first failure that
//    breaks the group writes this process's flight record (reason timeout,
//    desync, member_loss, error for a failed op, abort for fail() from
//    outside), after the transport is aborted so that peers are not held up.
//  * Thread-safe. The abort callback may be called from any thread, also
//    while a body runs, and must be idempotent. shutdown() fails queued work
//    with "the group was shut down", aborts a body in flight, joins the worker
//    and stops the progress thread; idempotent; the destructor calls it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collectives/fingerprint.h"
#include "collectives/options.h"
#include "common/logging.h"
#include "common/small_function.h"
#include "process_group/progress.h"
#include "process_group/work.h"
#include "store/store.h"

namespace dt {

// Thrown by a transport when an op's deadline passed (message: the transport's words).
class TransportTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Thrown by a transport when a peer is gone; `ranks` are the ones it knows
// are gone (may be empty: the runner then asks the others).
class PeerLost : public std::runtime_error {
 public:
  PeerLost(const std::string& message, std::vector<int> ranks = {})
      : std::runtime_error(message), ranks(std::move(ranks)) {}
  std::vector<int> ranks;
};

struct CollectiveRunnerOptions {
  std::string backendName;  // "gloo", "shm": appears in every message
  std::string groupName = "default";
  // Which creation of the name this group is (ProcessGroup::create counts them on every rank
  // alike): the flight recorder tells a group made again apart from the one before.
  int instance = 0;
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  bool checkFingerprints = false;
  // Group rank -> global rank, only for messages ("rank 2 (global 5)").
  std::vector<int> globalRanks;
  StorePtr watchdogStore;
  std::string watchdogKey;
  std::chrono::milliseconds progressInterval = std::chrono::seconds(1);
  // How long a failed rank waits for its peers' failure reports before
  // naming the ones that did not answer.
  std::chrono::milliseconds failureReportWindow = std::chrono::milliseconds(2500);
};

// What every backend built on a CollectiveRunner takes (its own options
// derive from this).
struct BackendCommonOptions {
  std::string groupName = "default";
  int instance = 0;  // see CollectiveRunnerOptions
  // Default timeout of every op and of set-up. nullopt: DT_PG_TIMEOUT.
  std::optional<std::chrono::milliseconds> timeout;
  // nullopt: DT_DEBUG=detail.
  std::optional<bool> checkFingerprints;
  // Group rank -> global rank, only for messages ("rank 2 (global 5)").
  std::vector<int> globalRanks;
  // The launcher's hang watchdog: when set, the last completed collective is
  // written to watchdogStore[watchdogKey] as "<seq> <op>" (throttled).
  StorePtr watchdogStore;
  std::string watchdogKey;
  std::chrono::milliseconds progressInterval = std::chrono::seconds(1);
  // How long a failed rank waits for its peers' failure reports.
  std::chrono::milliseconds failureReportWindow = std::chrono::milliseconds(2500);

  // The resolved timeout (DT_PG_TIMEOUT when unset).
  std::chrono::milliseconds resolvedTimeout() const;
  // The runner's options, defaults resolved from the environment.
  CollectiveRunnerOptions runnerOptions(std::string backendName) const;
};

class CollectiveRunner {
 public:
  using Millis = std::chrono::milliseconds;
  // timeout: the op's; fingerprint: the op as numbered (seq filled in).
  // Kept in place up to 64 bytes (a backend's body and its captures): no allocation per op.
  using Body = SmallFunction<void(Millis timeout, const CollectiveFingerprint& fingerprint)>;

  // `store` is the group's scope; abortTransport ends transfers in flight.
  CollectiveRunner(StorePtr store, int rank, int size, CollectiveRunnerOptions options,
                   std::function<void()> abortTransport);
  ~CollectiveRunner();
  CollectiveRunner(const CollectiveRunner&) = delete;
  CollectiveRunner& operator=(const CollectiveRunner&) = delete;

  // `op` must be a string literal.
  WorkPtr enqueue(uint64_t requestedSeq, const char* op, CollectiveFingerprint fingerprint, const OpTimeout& timeout,
                  Body body);

  // Compares `fingerprint` with every rank's through the store (what
  // DT_DEBUG=detail does before each op); throws DesyncError naming what each
  // rank called when they differ. For a backend that detected a mismatch cheaply.
  void checkFingerprint(const CollectiveFingerprint& fingerprint, Millis timeout);

  // A barrier through the store, coordinated by rank 0, that names the ranks
  // that did not arrive within the timeout (Backend::monitoredBarrier).
  WorkPtr monitoredBarrier(uint64_t requestedSeq, const OpTimeout& timeout);

  // For work outside the queue (point to point): a failed Work when the group
  // is broken or shut down, else nullptr. `what` names the call.
  WorkPtr rejectIfUnusable(const std::string& what, const std::string& description);
  // Marks the group broken by `failure` (the first cause wins) and aborts the transport.
  void fail(const std::exception_ptr& failure) { breakGroup(failure, "abort"); }
  // A point-to-point transfer with `peer` failed on the transport: publishes this rank's
  // `reason` where the other ranks' failure reports look (call it before fail(), whose abort
  // is what the others see next), and returns what `peer` has published about its own failure
  // ("rank 1 reported: recv from rank 2 ... failed: ..."), which names the rank that failed
  // first when the peer only closed its connections on failing; "" when it has published
  // nothing. Never waits for the peer: a dead one never publishes.
  std::string noteP2PFailure(const std::string& reason, int peer);
  std::exception_ptr brokenCause() const;
  bool stopping() const;
  void shutdown();

  // Which thread ran the ops so far (the scheduling paths of the contract).
  struct Stats {
    uint64_t ranByCaller = 0;
    uint64_t ranByWorker = 0;
  };
  Stats stats() const { return Stats{ranByCaller_.load(), ranByWorker_.load()}; }

  int rank() const { return rank_; }
  int size() const { return size_; }
  Millis timeout() const { return timeout_; }
  // "rank 1/4 pg=default gloo"
  const std::string& who() const { return who_; }
  // "2" or "2 (global 5)"
  std::string rankName(int rank) const;
  const Logger& log() const { return log_; }
  Store& store() { return *store_; }
  ProgressTracker& progress() { return *progress_; }

 private:
  struct Task {
    uint64_t seq = 0;
    const char* op = "";
    CollectiveFingerprint fingerprint;
    Millis timeout{0};
    Body body;
    WorkPtr work;
    std::chrono::steady_clock::time_point enqueuedAt;
    size_t bytes = 0;
    uint64_t flightId = 0;      // its flight recorder entry (0: none)
    bool leftToCaller = false;  // small: its caller may run it (see the contract)
    bool seenByTick = false;    // the worker's last tick found it left to its caller
  };
  // First in, first out, in one vector. The queue empties after almost every small op, and a
  // std::deque frees a node and allocates another every other op at that rhythm.
  class TaskQueue {
   public:
    bool empty() const { return head_ == tasks_.size(); }
    Task& front() { return tasks_[head_]; }
    Task& emplace_back() { return tasks_.emplace_back(); }
    void pop_front() {  // the front was moved out: only its husk is left
      if (++head_ == tasks_.size()) {
        tasks_.clear();
        head_ = 0;
      } else if (head_ >= 64 && 2 * head_ >= tasks_.size()) {  // never drains: drop the husks
        tasks_.erase(tasks_.begin(), tasks_.begin() + static_cast<std::ptrdiff_t>(head_));
        head_ = 0;
      }
    }
    std::vector<Task>::iterator begin() { return tasks_.begin() + static_cast<std::ptrdiff_t>(head_); }
    std::vector<Task>::iterator end() { return tasks_.end(); }

   private:
    std::vector<Task> tasks_;
    size_t head_ = 0;
  };

  void workerLoop();
  std::exception_ptr runTask(Task& task);
  static void complete(Task& task, const std::exception_ptr& failure);
  void recordProfile(const Task& task, int64_t startNs, bool failed) const;
  // The start helper: runs the op of `work` on this thread if it is next
  // (OnThisThread), or hands it to the worker (Soon).
  bool start(const Work* work, Work::Start how);
  std::exception_ptr notStarted(const char* op, uint64_t seq) const;
  static void countRun(std::atomic<uint64_t>& count);

  std::string stuckSummary(uint64_t seq);
  struct PeerReport;
  PeerReport collectPeerReports(const std::vector<int>& knownGone);
  std::string describePeers(const PeerReport& report) const;
  std::exception_ptr explainFailure(std::exception_ptr error, const Task& task);
  void reportFailure(const std::string& reason);
  void abortTransport();
  // fail(); `dumpReason` names the flight record's reason when the error's type does not.
  void breakGroup(const std::exception_ptr& failure, const char* dumpReason);

  StorePtr store_;
  const int rank_;
  const int size_;
  const CollectiveRunnerOptions options_;
  const Millis timeout_;
  Logger log_;
  std::string who_;
  const std::string* internedWho_;  // the same, for Works that outlive the runner
  const std::string* internedGroup_;  // the group's name, for the flight recorder
  std::function<void()> abort_;
  std::unique_ptr<ProgressTracker> progress_;

  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable wake_;
  TaskQueue queue_;
  bool stopping_ = false;
  bool running_ = false;  // a body runs (on the worker or inline)
  std::exception_ptr broken_;
  uint64_t localSeq_ = 0;
  uint64_t lastMonitoredBarrier_ = 0;  // touched only by the thread running a body
  bool workerTicking_ = false;  // the idle worker wakes by itself every tick
  std::atomic<uint64_t> ranByCaller_{0};
  std::atomic<uint64_t> ranByWorker_{0};
  std::chrono::steady_clock::time_point tickUntil_{};
  // shutdown() may run on several threads at once (a body's failure and an elastic watcher's
  // abort both stop a sub-backend): one joins, the others wait for that join.
  std::mutex joinMutex_;
  std::thread worker_;
};

}  // namespace dt
