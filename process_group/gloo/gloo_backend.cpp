#include "process_group/gloo/gloo_backend.h"

#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <thread>
#include <pthread.h>
#include <sched.h>
#include <signal.h>

#include "collectives/coalesce.h"
#include "collectives/fingerprint.h"
#include "collectives/reduce_kernels.h"
#include "common/check.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"
#include "process_group/gloo/allreduce_algorithms.h"
#include "process_group/gloo/store_adapter.h"
#include "process_group/gloo/transfer_type.h"
#include "process_group/progress.h"
#include "store/prefix_store.h"

namespace dt {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// Gloo slot prefix for send/recv; Gloo's own collectives use 0x01-0x08.
constexpr uint8_t kP2PSlotPrefix = 0x10;

// Gloo prefixes its messages with "[file:line] "; users need the rest.
std::string glooMessage(const std::exception& e) {
  std::string text = e.what();
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find("] ");
    if (close != std::string::npos) text = text.substr(close + 2);
  }
  return text;
}

std::string rankList(const std::vector<int>& ranks) {
  if (ranks.size() == 1) return str("rank ", ranks[0]);
  if (ranks.size() == 2) return str("ranks ", ranks[0], " and ", ranks[1]);
  return str("ranks ", formatRanges(ranks));
}

const char* isAre(const std::vector<int>& ranks) { return ranks.size() == 1 ? "is" : "are"; }

// While alive, the calling thread runs under SCHED_BATCH, so that threads it
// starts inherit that policy. Gloo's TCP event-loop thread try_locks a pair's
// mutex and, when that fails, spins on level-triggered epoll; woken by a
// peer's data it used to preempt the very thread holding that mutex (wakeup
// preemption), then spin until the next scheduler tick: ~4 ms per collective
// whenever ranks share cores. SCHED_BATCH threads keep their CPU share but
// never preempt on wakeup. Only a SCHED_OTHER caller is switched, as one with
// a real-time policy might not be allowed to switch back.
class BatchPolicyForNewThreads {
 public:
  BatchPolicyForNewThreads(bool enabled, const Logger& log) : log_(log) {
    if (!enabled || pthread_getschedparam(pthread_self(), &policy_, &param_) != 0 || policy_ != SCHED_OTHER) return;
    const sched_param batch{};
    active_ = pthread_setschedparam(pthread_self(), SCHED_BATCH, &batch) == 0;
  }
  ~BatchPolicyForNewThreads() {
    if (active_ && pthread_setschedparam(pthread_self(), policy_, &param_) != 0) {
      log_->warn("could not restore this thread's scheduling policy after starting Gloo's event loop");
    }
  }
  BatchPolicyForNewThreads(const BatchPolicyForNewThreads&) = delete;
  BatchPolicyForNewThreads& operator=(const BatchPolicyForNewThreads&) = delete;

 private:
  const Logger& log_;
  int policy_ = SCHED_OTHER;
  sched_param param_{};
  bool active_ = false;
};

// Blocks SIGPIPE on this thread while alive. Gloo writes with writev(2); a
// write to a peer that has exited raises SIGPIPE, whose default action kills
// the whole process before Gloo can turn the EPIPE into an exception. Threads
// started meanwhile inherit the blocked mask. A SIGPIPE raised for this thread
// meanwhile is discarded, so that unblocking does not deliver it.
class SigpipeBlocked {
 public:
  SigpipeBlocked() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &previous_);
  }
  ~SigpipeBlocked() {
    if (sigismember(&previous_, SIGPIPE) == 1) return;
    sigset_t pending;
    if (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) {
      const timespec now{};
      sigtimedwait(&pipe_, nullptr, &now);
    }
    pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
  }
  SigpipeBlocked(const SigpipeBlocked&) = delete;
  SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;

 private:
  sigset_t pipe_;
  sigset_t previous_;
};

// One queued collective.
struct Task {
  uint64_t seq = 0;
  const char* op = "";
  CollectiveFingerprint fingerprint;
  Millis timeout{0};
  std::function<void(GlooBackend::Impl&, Millis)> run;  // does the transfer; throws on failure
  WorkPtr work;
};

// One posted send or recv, waited for on the p2p thread.
struct P2PTask {
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
  bool isSend = true;
  Clock::time_point deadline;
  Tensor staging;                 // keeps the transferred memory alive
  std::vector<Tensor> copyBackTo; // recv into strided/several tensors
  WorkPtr work;
  std::string what;               // "send to rank 1 (tag 3)"
};

}  // namespace

struct GlooBackend::Impl {
  StorePtr store;  // the group's scope
  int rank;
  int size;
  GlooBackendOptions options;
  Millis timeout;
  bool checkFingerprints;
  Logger log;
  std::shared_ptr<gloo::rendezvous::Context> context;
  std::unique_ptr<ProgressTracker> progress;
  GlooAllreduceAlgorithm allreduceAlgorithm = GlooAllreduceAlgorithm::Auto;
  std::vector<uint8_t> scratch;  // the worker thread's receive space for allreduce

  std::mutex mutex;  // guards everything below
  std::condition_variable wake;     // the collective worker
  std::condition_variable p2pWake;  // the p2p waiter (separate: a collective must not wake it)
  std::deque<Task> queue;
  std::deque<P2PTask> p2pQueue;
  bool stopping = false;
  bool running = false;  // the worker is inside a task (shutdown closes connections then)
  std::exception_ptr broken;
  uint64_t localSeq = 0;
  std::thread worker;
  std::thread p2pWorker;

  std::string who() const {
    return str("rank ", rank, "/", size, " pg=", options.groupName, " gloo");
  }
  std::string rankName(int r) const {
    if (!options.globalRanks.empty() && options.globalRanks[r] != r) {
      return str(r, " (global ", options.globalRanks[r], ")");
    }
    return std::to_string(r);
  }

  // ---- set-up --------------------------------------------------------------
  void connect() {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    std::shared_ptr<gloo::transport::Device> device;
    const bool batchLoop = options.batchEventLoop ? *options.batchEventLoop : env::getBool("DT_GLOO_BATCH_LOOP");
    try {
      // Gloo's event-loop thread is born here and inherits this thread's policy.
      BatchPolicyForNewThreads batch(batchLoop, log);
      device = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      throw BackendError(str("[", who(), "] cannot create Gloo's TCP device on ", quoteBytes(options.hostname),
                             ": ", glooMessage(e),
                             ". Set the interface address with GlooBackendOptions.hostname / DT_GLOO_HOSTNAME"));
    }
    context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(timeout);
    GlooStoreAdapter adapter(std::make_shared<PrefixStore>("gloo", store), timeout);
    try {
      context->connectFullMesh(adapter, device);
    } catch (const dt::Error&) {
      std::rethrow_exception(withPrefix(std::current_exception(), str("[", who(), "] connecting the group failed: ")));
    } catch (const std::exception& e) {
      throw BackendError(str("[", who(), "] connecting the group's full mesh failed: ", glooMessage(e),
                             " (timeout ", formatDuration(timeout), ")"));
    }
  }


  // ---- issue -----------------------------------------------------------------
  WorkPtr enqueue(uint64_t requestedSeq, const char* op, CollectiveFingerprint fingerprint,
                  const OpTimeout& opTimeout, std::function<void(Impl&, Millis)> run) {
    std::lock_guard<std::mutex> lock(mutex);
    const uint64_t seq = requestedSeq != 0 ? requestedSeq : ++localSeq;
    fingerprint.seq = seq;
    fingerprint.op = op;
    const std::string description = str(op, " #", seq, " (", who(), ")");
    if (broken) {
      return Work::failed(description, withPrefix(broken, str("[", who(), "] ", op, " #", seq,
                                                              " not started: the group is broken since ")));
    }
    if (stopping) {
      return Work::failed(description, std::make_exception_ptr(BackendError(
                                           str("[", who(), "] ", op, " #", seq, ": the group was shut down"))));
    }
    Task task;
    task.seq = seq;
    task.op = op;
    task.fingerprint = std::move(fingerprint);
    task.timeout = opTimeout.value_or(timeout);
    task.run = std::move(run);
    task.work = std::make_shared<Work>(description);
    WorkPtr work = task.work;
    queue.push_back(std::move(task));
    wake.notify_one();
    return work;
  }

  // ---- worker ------------------------------------------------------------------
  // Runs one dequeued task and completes its Work. Called with `mutex` held
  // and `running` set; returns with `mutex` held.
  void runTask(Task& task, std::unique_lock<std::mutex>& lock) {
    if (broken || stopping) {
      auto cause = broken ? withPrefix(broken, str("[", who(), "] ", task.op, " #", task.seq,
                                                   " not started: the group is broken since "))
                          : std::make_exception_ptr(BackendError(
                                str("[", who(), "] ", task.op, " #", task.seq, ": the group was shut down")));
      lock.unlock();
      task.work->markFailed(cause);
      lock.lock();
      return;
    }
    lock.unlock();
    std::exception_ptr failure;
    progress->started(task.seq, task.op);
    try {
      if (checkFingerprints) verifyFingerprint(task);
      task.run(*this, task.timeout);
      progress->completed(task.seq, task.op);
    } catch (...) {
      failure = explainFailure(std::current_exception(), task.op, task.seq, task.fingerprint.describe(),
                               task.timeout);
    }
    settle(*task.work, failure, lock);
  }

  // Completes a task's Work; the first failure becomes the group's cause and
  // closes the connections, so that a timed-out posted buffer can no longer be
  // written by the transport. Called with `mutex` released; returns holding it.
  void settle(Work& work, std::exception_ptr failure, std::unique_lock<std::mutex>& lock) {
    lock.lock();
    if (failure && !broken) broken = failure;
    lock.unlock();
    if (failure) {
      closeConnections();
      work.markFailed(failure);
    } else {
      work.markCompleted();
    }
    lock.lock();
  }

  void workerLoop() {
    std::unique_lock<std::mutex> lock(mutex);
    while (true) {
      wake.wait(lock, [&] { return !running && (stopping || !queue.empty()); });
      if (queue.empty()) return;  // stopping and drained
      Task task = std::move(queue.front());
      queue.pop_front();
      running = true;
      runTask(task, lock);
      running = false;
    }
  }

  void p2pLoop() {
    std::unique_lock<std::mutex> lock(mutex);
    while (true) {
      p2pWake.wait(lock, [&] { return stopping || !p2pQueue.empty(); });
      if (p2pQueue.empty()) return;
      P2PTask task = std::move(p2pQueue.front());
      p2pQueue.pop_front();
      lock.unlock();
      std::exception_ptr failure;
      try {
        const auto left = std::max(Millis(1), std::chrono::duration_cast<Millis>(task.deadline - Clock::now()));
        const bool ok = task.isSend ? task.buffer->waitSend(left) : task.buffer->waitRecv(left);
        if (!ok) throw BackendError("aborted");
        if (!task.isSend && !task.copyBackTo.empty()) unflattenInto(task.staging, task.copyBackTo);
      } catch (...) {
        failure = p2pFailure(task.what, std::current_exception());
      }
      settle(*task.work, failure, lock);
    }
  }

  // What a failed send/recv ("send to rank 1 (tag 3, ...)") reports.
  std::exception_ptr p2pFailure(const std::string& what, std::exception_ptr error) const {
    try {
      std::rethrow_exception(error);
    } catch (const gloo::IoException& e) {
      const std::string message = glooMessage(e);
      if (message.find("Timed out") != std::string::npos) {
        return std::make_exception_ptr(TimeoutError(
            str("[", who(), "] ", what, " timed out: ", message, ". Did the peer post the matching call?")));
      }
      return std::make_exception_ptr(
          BackendError(str("[", who(), "] ", what, " failed: ", message, " (peer exited or unreachable?)")));
    } catch (const std::exception& e) {
      return std::make_exception_ptr(BackendError(str("[", who(), "] ", what, " failed: ", glooMessage(e))));
    }
  }

  void closeConnections() {
    try {
      if (context) context->closeConnections();
    } catch (const std::exception& e) {
      log->debug("closing connections: {}", e.what());
    }
  }

  // ---- fingerprints (DT_DEBUG=detail) --------------------------------------------
  static std::string fingerprintKey(uint64_t seq, int r) { return str("dt_fp/", seq, "/", r); }

  void verifyFingerprint(const Task& task) {
    store->set(fingerprintKey(task.seq, rank), task.fingerprint.serialize());
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) keys.push_back(fingerprintKey(task.seq, r));
    try {
      store->wait(keys, task.timeout);
    } catch (const TimeoutError&) {
      std::vector<int> missing;
      for (int r = 0; r < size; ++r) {
        if (!store->check({keys[r]})) missing.push_back(r);
      }
      throw TimeoutError(str("[", who(), "] ", task.op, " #", task.seq, " (",
                             task.fingerprint.describe(), ") timed out after ",
                             formatDuration(task.timeout), " comparing fingerprints (DT_DEBUG=detail): ",
                             rankList(missing), " never reached collective #", task.seq, ". ",
                             stuckSummary(task.seq)));
    }
    const auto values = store->multiGet(keys);
    std::map<std::string, std::vector<int>> others;  // description -> ranks
    for (int r = 0; r < size; ++r) {
      if (values[r] == values[rank]) continue;
      CollectiveFingerprint theirs;
      try {
        theirs = CollectiveFingerprint::parse(values[r]);
      } catch (const std::exception&) {
        theirs.op = "<unreadable fingerprint>";
      }
      others[theirs.describe() + (theirs.seq != task.seq ? str(" as #", theirs.seq) : std::string())].push_back(r);
    }
    // Keys of the previous collective are no longer read by anyone: every
    // rank has written this one, so each has finished comparing the last.
    if (task.seq > 1) store->deleteKey(fingerprintKey(task.seq - 1, rank));
    if (others.empty()) return;
    std::vector<std::string> parts;
    for (const auto& [description, ranks] : others) {
      parts.push_back(str(rankList(ranks), " called ", description));
    }
    throw DesyncError(str("[", who(), "] collective #", task.seq, " mismatch: this rank called ",
                          task.fingerprint.describe(), "; ", join(parts, "; "),
                          ". Every rank must issue the same collectives in the same order"));
  }

  // ---- failure diagnosis ------------------------------------------------------------
  // "rank 3 never started #41 (its last completed: #40); ranks 1 and 2 are waiting in #41"
  std::string stuckSummary(uint64_t seq) {
    std::vector<RankProgress> all;
    try {
      progress->publishNow();
      all = ProgressTracker::readAll(*store, size);
    } catch (const std::exception& e) {
      return str("(could not read the other ranks' progress: ", e.what(), ")");
    }
    std::map<uint64_t, std::vector<int>> neverStarted;  // last completed -> ranks
    std::vector<int> waiting, finished, unknown;
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      const auto& p = all[r];
      if (!p.present) unknown.push_back(r);
      else if (p.started < seq) neverStarted[p.completed].push_back(r);
      else if (p.completed < seq) waiting.push_back(r);
      else finished.push_back(r);
    }
    std::vector<std::string> parts;
    for (const auto& [last, ranks] : neverStarted) {
      parts.push_back(str(rankList(ranks), " never started #", seq, " (", ranks.size() == 1 ? "its" : "their",
                          " last completed: #", last, ")"));
    }
    if (!waiting.empty()) parts.push_back(str(rankList(waiting), " ", isAre(waiting), " waiting in #", seq));
    if (!finished.empty()) parts.push_back(str(rankList(finished), " completed #", seq));
    if (!unknown.empty()) parts.push_back(str(rankList(unknown), " published no progress"));
    if (parts.empty()) return "";
    return join(parts, "; ");
  }

  static std::string failureKey(int r) { return str("dt_failed/", r); }

  struct PeerReport {
    std::vector<int> silent;               // no failure report, no heartbeat
    std::vector<int> failed;               // reported a failure of their own
    std::map<int, std::string> reasons;    // what they reported
    std::string error;                     // could not ask
  };

  // Finds the peers that neither reported a failure of their own nor kept
  // their heartbeat going within the report window: those exited or hung.
  PeerReport collectPeerReports() {
    PeerReport report;
    try {
      const auto first = ProgressTracker::readAll(*store, size);
      const auto deadline = Clock::now() + options.failureReportWindow;
      std::set<int> pending;
      for (int r = 0; r < size; ++r) {
        if (r != rank) pending.insert(r);
      }
      while (!pending.empty()) {
        const auto now = ProgressTracker::readAll(*store, size);
        for (auto it = pending.begin(); it != pending.end();) {
          const int r = *it;
          if (store->check({failureKey(r)})) {
            report.failed.push_back(r);
            report.reasons[r] = store->get(failureKey(r));
            it = pending.erase(it);
          } else if (now[r].present && now[r].heartbeat != first[r].heartbeat) {
            it = pending.erase(it);  // alive, still working
          } else {
            ++it;
          }
        }
        if (pending.empty() || Clock::now() >= deadline) break;
        std::this_thread::sleep_for(Millis(50));
      }
      report.silent.assign(pending.begin(), pending.end());
    } catch (const std::exception& e) {
      report.error = str("(could not ask the other ranks: ", e.what(), ")");
    }
    std::sort(report.failed.begin(), report.failed.end());
    return report;
  }

  std::string describePeers(const PeerReport& report) {
    if (!report.error.empty()) return report.error;
    std::vector<std::string> parts;
    if (!report.silent.empty()) {
      parts.push_back(str(report.silent.size() == 1 ? "Rank " : "Ranks ", formatRanges(report.silent), " stopped responding (no failure report and no progress heartbeat for ",
                          formatDuration(options.failureReportWindow), ": exited, killed or hung)"));
    }
    if (!report.failed.empty()) {
      parts.push_back(str(rankList(report.failed), " failed too; rank ", report.failed.front(),
                          " reported: ", report.reasons.at(report.failed.front())));
    }
    return join(parts, "; ");
  }

  std::exception_ptr explainFailure(std::exception_ptr error, const char* op, uint64_t seq,
                                    const std::string& description, Millis opTimeout) {
    // "[rank 0/4 pg=default gloo] allreduce #41 (float32[1048576], sum)"
    const std::string args = description.size() > std::strlen(op) ? description.substr(std::strlen(op)) : "";
    const std::string head = str("[", who(), "] ", op, " #", seq, " ", args);
    try {
      std::rethrow_exception(error);
    } catch (const DesyncError&) {
      reportFailure(str(op, " #", seq, ": desync"));
      return error;
    } catch (const TimeoutError& e) {
      reportFailure(str(op, " #", seq, " timed out"));
      return error;
    } catch (const gloo::IoException& e) {
      const std::string message = glooMessage(e);
      if (message.find("Timed out") != std::string::npos) {
        const std::string stuck = stuckSummary(seq);
        reportFailure(str(op, " #", seq, " timed out after ", formatDuration(opTimeout)));
        closeConnections();
        return std::make_exception_ptr(TimeoutError(str(
            head, " timed out after ", formatDuration(opTimeout), " on rank ", rank, "/", size,
            stuck.empty() ? "" : "; ", stuck, ". (Gloo: ", message,
            ") Raise the timeout (DT_PG_TIMEOUT or the op's timeout) if the ranks are merely slow")));
      }
      reportFailure(str(op, " #", seq, " lost a connection: ", message));
      // Peers blocked on this rank fail now instead of at their timeout.
      closeConnections();
      const PeerReport report = collectPeerReports();
      // A peer that timed out closes its connections; what this rank sees
      // is then a lost connection, but the cause is the timeout.
      for (int r : report.failed) {
        const auto& reason = report.reasons.at(r);
        if (reason.find(" timed out") == std::string::npos) continue;
        const std::string stuck = stuckSummary(seq);
        return std::make_exception_ptr(TimeoutError(
            str(head, " timed out in the group (rank ", r, " reported: ", reason,
                ", and closed its connections)", stuck.empty() ? "" : "; ", stuck,
                ". Raise the timeout (DT_PG_TIMEOUT or the op's timeout) if the ranks are merely slow")));
      }
      const std::string peers = describePeers(report);
      return std::make_exception_ptr(BackendError(str(head, " failed: connection to a peer lost (Gloo: ", message,
                                                      ")", peers.empty() ? "" : ". ", peers)));
    } catch (const dt::Error& e) {
      reportFailure(str(op, " #", seq, ": ", e.what()));
      return withPrefix(error, head + " failed: ");
    } catch (const std::exception& e) {
      reportFailure(str(op, " #", seq, ": ", glooMessage(e)));
      return std::make_exception_ptr(BackendError(str(head, " failed: ", glooMessage(e))));
    }
  }

  void reportFailure(const std::string& reason) {
    try {
      store->set(failureKey(rank), str(reason, " (on rank ", rank, ")"));
    } catch (const std::exception& e) {
      log->warn("cannot publish failure report: {}", e.what());
    }
  }

  // ---- transfers (run on the worker thread) ----------------------------------------------
  uint32_t tagFor(uint64_t seq) const { return static_cast<uint32_t>(seq & 0xffffffffu); }

  void allreduceBuffer(void* data, size_t count, DType dtype, ReduceOp op, Millis opTimeout, uint32_t tag) {
    if (count == 0) return;
    const size_t width = itemSize(dtype);
    const auto algorithm = chooseAllreduceAlgorithm(allreduceAlgorithm, count * width, size);
    runAllreduce(algorithm, {context, data, count, width, reduceFunction(dtype, op), opTimeout, tag, scratch});
    if (op == ReduceOp::Avg) divideBy(dtype, data, count, size);
  }
};


namespace {

void checkCpu(const Tensor& t, const char* op, const std::string& who) {
  DT_CHECK(t.defined(), "[", who, "] ", op, ": undefined tensor");
  if (!t.device().isCpu()) {
    throw InvalidArgument(str("[", who, "] ", op, ": the gloo backend takes CPU tensors, got ", t.describe(), " on ",
                              t.device().str(), "; use the nccl backend for CUDA tensors"));
  }
}

std::vector<TensorSignature> signatures(const std::vector<Tensor>& tensors) {
  std::vector<TensorSignature> out;
  for (const auto& t : tensors) out.push_back({t.dtype(), t.sizes()});
  return out;
}

// Tensors to operate on in place: a single contiguous tensor as is;
// otherwise one flat staging buffer per dtype, copied back afterwards.
struct Staged {
  std::vector<Tensor> buffers;
  std::vector<std::vector<Tensor>> members;  // empty: buffers[i] is the user's tensor
  void copyBack() {
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (!members[i].empty()) unflattenInto(buffers[i], members[i]);
    }
  }
};

Staged stage(const std::vector<Tensor>& tensors) {
  Staged staged;
  if (tensors.size() == 1 && tensors[0].isContiguous()) {
    staged.buffers.push_back(tensors[0]);
    staged.members.emplace_back();
    return staged;
  }
  std::map<DType, std::vector<Tensor>> byType;
  std::vector<DType> order;
  for (const auto& t : tensors) {
    if (!byType.count(t.dtype())) order.push_back(t.dtype());
    byType[t.dtype()].push_back(t);
  }
  for (DType d : order) {
    staged.buffers.push_back(flattenTensors(byType[d]));
    staged.members.push_back(byType[d]);
  }
  return staged;
}

}  // namespace

GlooBackend::GlooBackend(StorePtr store, int rank, int size, GlooBackendOptions options)
    : impl_(std::make_unique<Impl>()) {
  DT_CHECK(store != nullptr, "GlooBackend: store is null");
  DT_CHECK(size >= 1, "GlooBackend: group size must be >= 1, got ", size);
  DT_CHECK(rank >= 0 && rank < size, "GlooBackend: rank ", rank, " is outside the group of size ", size);
  auto& d = *impl_;
  d.store = std::move(store);
  d.rank = rank;
  d.size = size;
  d.options = std::move(options);
  d.timeout = d.options.timeout.value_or(env::getDuration("DT_PG_TIMEOUT"));
  d.checkFingerprints = d.options.checkFingerprints.value_or(env::getString("DT_DEBUG") == "detail");
  d.allreduceAlgorithm = d.options.allreduceAlgorithm
                             ? *d.options.allreduceAlgorithm
                             : parseGlooAllreduceAlgorithm(env::getString("DT_GLOO_ALLREDUCE"), "DT_GLOO_ALLREDUCE");
  d.log = makeLogger("process_group", str("rank ", rank, "/", size, " pg=", d.options.groupName));
  if (!d.options.globalRanks.empty()) {
    DT_CHECK_EQ(static_cast<int>(d.options.globalRanks.size()), size, "GlooBackend: globalRanks must list every rank");
  }
  // Gloo's event-loop thread (started in connect) and the two workers keep
  // SIGPIPE blocked for good: they are the threads that write to Gloo's sockets.
  SigpipeBlocked noSigpipe;
  d.connect();
  d.progress = std::make_unique<ProgressTracker>(d.store->clone(), rank, d.options.progressInterval,
                                                 d.options.watchdogStore, d.options.watchdogKey);
  d.worker = std::thread([this] { impl_->workerLoop(); });
  d.p2pWorker = std::thread([this] { impl_->p2pLoop(); });
}

GlooBackend::~GlooBackend() { shutdown(); }

int GlooBackend::rank() const { return impl_->rank; }
int GlooBackend::size() const { return impl_->size; }

std::exception_ptr GlooBackend::brokenCause() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->broken;
}

void GlooBackend::shutdown() {
  auto& d = *impl_;
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    if (d.stopping && !d.worker.joinable()) return;
    d.stopping = true;
    // An op still in flight at shutdown would otherwise block until its
    // timeout; closing the connections ends it now.
    if (d.running || !d.p2pQueue.empty()) d.closeConnections();
  }
  d.wake.notify_all();
  d.p2pWake.notify_all();
  if (d.worker.joinable()) d.worker.join();
  if (d.p2pWorker.joinable()) d.p2pWorker.join();
  if (d.progress) d.progress->stop();
}

// ---- ops -------------------------------------------------------------------------------------

WorkPtr GlooBackend::allreduce(const std::vector<Tensor>& tensors, const AllreduceOptions& options) {
  auto& d = *impl_;
  DT_CHECK(!tensors.empty(), "[", d.who(), "] allreduce: empty tensor list");
  for (const auto& t : tensors) checkCpu(t, "allreduce", d.who());
  reduceFunction(tensors[0].dtype(), options.reduceOp);  // rejects bool+avg now, not on the worker
  CollectiveFingerprint fp;
  fp.tensors = signatures(tensors);
  fp.reduceOp = options.reduceOp;
  const ReduceOp op = options.reduceOp;
  return d.enqueue(options.seq, "allreduce", fp, options.timeout, [tensors, op](Impl& impl, Millis timeout) {
    Staged staged = stage(tensors);
    const uint64_t tagBase = impl.progress->lastStarted();
    for (size_t i = 0; i < staged.buffers.size(); ++i) {
      auto& b = staged.buffers[i];
      impl.allreduceBuffer(b.dataPtr(), static_cast<size_t>(b.numel()), b.dtype(), op, timeout,
                           impl.tagFor(tagBase) ^ static_cast<uint32_t>(i << 24));
    }
    staged.copyBack();
  });
}

WorkPtr GlooBackend::broadcast(const std::vector<Tensor>& tensors, const BroadcastOptions& options) {
  auto& d = *impl_;
  DT_CHECK(!tensors.empty(), "[", d.who(), "] broadcast: empty tensor list");
  for (const auto& t : tensors) checkCpu(t, "broadcast", d.who());
  DT_CHECK(options.root >= 0 && options.root < d.size, "[", d.who(), "] broadcast: root ", options.root,
           " is not a rank of the group (size ", d.size, ")");
  CollectiveFingerprint fp;
  fp.tensors = signatures(tensors);
  fp.root = options.root;
  const int root = options.root;
  return d.enqueue(options.seq, "broadcast", fp, options.timeout, [tensors, root](Impl& impl, Millis timeout) {
    Staged staged = stage(tensors);
    const uint32_t tag = impl.tagFor(impl.progress->lastStarted());
    for (size_t i = 0; i < staged.buffers.size(); ++i) {
      auto& b = staged.buffers[i];
      if (b.numel() == 0 || impl.size == 1) continue;
      gloo::BroadcastOptions opts(impl.context);
      opts.setOutput(static_cast<uint8_t*>(b.dataPtr()), b.nbytes());
      opts.setRoot(root);
      opts.setTag(tag ^ static_cast<uint32_t>(i << 24));
      opts.setTimeout(timeout);
      gloo::broadcast(opts);
    }
    if (impl.rank != root) staged.copyBack();
  });
}

WorkPtr GlooBackend::allgather(const std::vector<Tensor>& outputs, const Tensor& input,
                               const AllgatherOptions& options) {
  auto& d = *impl_;
  checkCpu(input, "allgather", d.who());
  DT_CHECK_EQ(static_cast<int>(outputs.size()), d.size, "[", d.who(), "] allgather: one output tensor per rank");
  for (const auto& o : outputs) {
    checkCpu(o, "allgather", d.who());
    DT_CHECK(o.dtype() == input.dtype() && o.sizes() == input.sizes(), "[", d.who(), "] allgather: output ",
             o.describe(), " does not match input ", input.describe());
  }
  CollectiveFingerprint fp;
  fp.tensors = {{input.dtype(), input.sizes()}};
  return d.enqueue(options.seq, "allgather", fp, options.timeout, [outputs, input](Impl& impl, Millis timeout) {
    const size_t bytes = input.nbytes();
    if (bytes == 0) return;
    std::vector<uint8_t> gathered(bytes * impl.size);
    copyToBytes(input, gathered.data() + bytes * impl.rank);
    if (impl.size > 1) {
      gloo::AllgatherOptions opts(impl.context);
      opts.setInput(gathered.data() + bytes * impl.rank, bytes);
      opts.setOutput(gathered.data(), gathered.size());
      opts.setTag(impl.tagFor(impl.progress->lastStarted()));
      opts.setTimeout(timeout);
      gloo::allgather(opts);
    }
    for (int r = 0; r < impl.size; ++r) {
      Tensor out = outputs[r];
      copyFromBytes(gathered.data() + bytes * r, out);
    }
  });
}

WorkPtr GlooBackend::reduceScatter(const Tensor& output, const std::vector<Tensor>& inputs,
                                   const ReduceScatterOptions& options) {
  auto& d = *impl_;
  checkCpu(output, "reduceScatter", d.who());
  DT_CHECK_EQ(static_cast<int>(inputs.size()), d.size, "[", d.who(), "] reduceScatter: one input tensor per rank");
  for (const auto& in : inputs) {
    checkCpu(in, "reduceScatter", d.who());
    DT_CHECK(in.dtype() == output.dtype() && in.sizes() == output.sizes(), "[", d.who(), "] reduceScatter: input ",
             in.describe(), " does not match output ", output.describe());
  }
  const ReduceFn fn = reduceFunction(output.dtype(), options.reduceOp);
  CollectiveFingerprint fp;
  fp.tensors = {{output.dtype(), output.sizes()}};
  fp.reduceOp = options.reduceOp;
  const ReduceOp op = options.reduceOp;
  return d.enqueue(options.seq, "reduceScatter", fp, options.timeout,
                   [output, inputs, op, fn](Impl& impl, Millis timeout) {
                     const size_t bytes = output.nbytes();
                     const size_t count = static_cast<size_t>(output.numel());
                     if (bytes == 0) return;
                     // All-to-all moves chunk j to rank j (bandwidth of a ring
                     // reduce-scatter); then each rank reduces its chunks locally.
                     std::vector<uint8_t> sendBuf(bytes * impl.size), recvBuf(bytes * impl.size);
                     for (int r = 0; r < impl.size; ++r) copyToBytes(inputs[r], sendBuf.data() + bytes * r);
                     if (impl.size > 1) {
                       gloo::AlltoallOptions opts(impl.context);
                       opts.setInput(sendBuf.data(), sendBuf.size());
                       opts.setOutput(recvBuf.data(), recvBuf.size());
                       opts.setTag(impl.tagFor(impl.progress->lastStarted()));
                       opts.setTimeout(timeout);
                       gloo::alltoall(opts);
                     } else {
                       recvBuf = sendBuf;
                     }
                     for (int r = 1; r < impl.size; ++r) {
                       fn(recvBuf.data(), recvBuf.data(), recvBuf.data() + bytes * r, count);
                     }
                     if (op == ReduceOp::Avg) divideBy(output.dtype(), recvBuf.data(), count, impl.size);
                     Tensor out = output;
                     copyFromBytes(recvBuf.data(), out);
                   });
}

WorkPtr GlooBackend::reduce(const std::vector<Tensor>& tensors, const ReduceOptions& options) {
  auto& d = *impl_;
  DT_CHECK(!tensors.empty(), "[", d.who(), "] reduce: empty tensor list");
  for (const auto& t : tensors) checkCpu(t, "reduce", d.who());
  DT_CHECK(options.root >= 0 && options.root < d.size, "[", d.who(), "] reduce: root ", options.root,
           " is not a rank of the group (size ", d.size, ")");
  reduceFunction(tensors[0].dtype(), options.reduceOp);
  CollectiveFingerprint fp;
  fp.tensors = signatures(tensors);
  fp.reduceOp = options.reduceOp;
  fp.root = options.root;
  const ReduceOp op = options.reduceOp;
  const int root = options.root;
  return d.enqueue(options.seq, "reduce", fp, options.timeout, [tensors, op, root](Impl& impl, Millis timeout) {
    // Non-root ranks reduce from a copy so that their tensors stay unchanged.
    Staged staged;
    if (impl.rank == root) {
      staged = stage(tensors);
    } else {
      std::map<DType, std::vector<Tensor>> byType;
      std::vector<DType> order;
      for (const auto& t : tensors) {
        if (!byType.count(t.dtype())) order.push_back(t.dtype());
        byType[t.dtype()].push_back(t);
      }
      for (DType dt : order) {
        staged.buffers.push_back(flattenTensors(byType[dt]));
        staged.members.emplace_back();
      }
    }
    const uint32_t tag = impl.tagFor(impl.progress->lastStarted());
    for (size_t i = 0; i < staged.buffers.size(); ++i) {
      auto& b = staged.buffers[i];
      const size_t count = static_cast<size_t>(b.numel());
      if (count == 0) continue;
      if (impl.size > 1) {
        const ReduceFn fn = reduceFunction(b.dtype(), op);
        withTransferType(itemSize(b.dtype()), [&](auto typeTag) {
          using T = decltype(typeTag);
          gloo::ReduceOptions opts(impl.context);
          opts.setOutput(static_cast<T*>(b.dataPtr()), count);
          opts.setRoot(root);
          opts.setReduceFunction(fn);
          opts.setTag(tag ^ static_cast<uint32_t>(i << 24));
          opts.setTimeout(timeout);
          gloo::reduce(opts);
        });
      }
      if (op == ReduceOp::Avg && impl.rank == root) divideBy(b.dtype(), b.dataPtr(), count, impl.size);
    }
    if (impl.rank == root) staged.copyBack();
  });
}

WorkPtr GlooBackend::barrier(const BarrierOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp;
  return d.enqueue(options.seq, "barrier", fp, options.timeout, [](Impl& impl, Millis timeout) {
    if (impl.size == 1) return;
    gloo::BarrierOptions opts(impl.context);
    opts.setTag(impl.tagFor(impl.progress->lastStarted()));
    opts.setTimeout(timeout);
    gloo::barrier(opts);
  });
}

WorkPtr GlooBackend::allToAll(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                              const AllToAllOptions& options) {
  auto& d = *impl_;
  DT_CHECK_EQ(static_cast<int>(inputs.size()), d.size, "[", d.who(), "] allToAll: one input tensor per rank");
  DT_CHECK_EQ(static_cast<int>(outputs.size()), d.size, "[", d.who(), "] allToAll: one output tensor per rank");
  for (const auto& t : inputs) checkCpu(t, "allToAll", d.who());
  for (const auto& t : outputs) {
    checkCpu(t, "allToAll", d.who());
    DT_CHECK(t.dtype() == inputs[0].dtype(), "[", d.who(), "] allToAll: output ", t.describe(),
             " has another dtype than input ", inputs[0].describe());
  }
  for (const auto& t : inputs) {
    DT_CHECK(t.dtype() == inputs[0].dtype(), "[", d.who(), "] allToAll: inputs must share one dtype");
  }
  CollectiveFingerprint fp;
  fp.tensors = signatures(inputs);
  return d.enqueue(options.seq, "allToAll", fp, options.timeout, [outputs, inputs](Impl& impl, Millis timeout) {
    std::vector<int64_t> sendCounts, recvCounts;
    size_t sendTotal = 0, recvTotal = 0;
    for (int r = 0; r < impl.size; ++r) {
      sendCounts.push_back(static_cast<int64_t>(inputs[r].nbytes()));
      recvCounts.push_back(static_cast<int64_t>(outputs[r].nbytes()));
      sendTotal += inputs[r].nbytes();
      recvTotal += outputs[r].nbytes();
    }
    std::vector<uint8_t> sendBuf(std::max<size_t>(sendTotal, 1)), recvBuf(std::max<size_t>(recvTotal, 1));
    size_t offset = 0;
    for (int r = 0; r < impl.size; ++r) {
      copyToBytes(inputs[r], sendBuf.data() + offset);
      offset += inputs[r].nbytes();
    }
    if (impl.size > 1) {
      gloo::AlltoallvOptions opts(impl.context);
      opts.setInput(sendBuf.data(), sendCounts);
      opts.setOutput(recvBuf.data(), recvCounts);
      opts.setTag(impl.tagFor(impl.progress->lastStarted()));
      opts.setTimeout(timeout);
      gloo::alltoallv(opts);
    } else {
      DT_CHECK_EQ(sendTotal, recvTotal, "allToAll on one rank: output size vs input size");
      recvBuf = sendBuf;
    }
    offset = 0;
    for (int r = 0; r < impl.size; ++r) {
      Tensor out = outputs[r];
      copyFromBytes(recvBuf.data() + offset, out);
      offset += outputs[r].nbytes();
    }
  });
}

// ---- point to point ---------------------------------------------------------------------------

namespace {

WorkPtr postP2P(GlooBackend::Impl& d, bool isSend, const std::vector<Tensor>& tensors, int peer, uint32_t tag,
                const OpTimeout& timeout) {
  const char* op = isSend ? "send" : "recv";
  DT_CHECK(!tensors.empty(), "[", d.who(), "] ", op, ": empty tensor list");
  for (const auto& t : tensors) {
    checkCpu(t, op, d.who());
    DT_CHECK(t.dtype() == tensors[0].dtype(), "[", d.who(), "] ", op, ": tensors must share one dtype");
  }
  DT_CHECK(peer >= 0 && peer < d.size && peer != d.rank, "[", d.who(), "] ", op, ": peer rank ", peer,
           " must be another rank of the group (size ", d.size, ")");
  const std::string what =
      str(op, isSend ? " to rank " : " from rank ", d.rankName(peer), " (tag ", tag, ", ", signatures(tensors).size(),
          " tensor(s), ", totalNumel(tensors), " elements)");
  std::lock_guard<std::mutex> lock(d.mutex);
  const std::string description = str(what, " (", d.who(), ")");
  if (d.broken) {
    return Work::failed(description, withPrefix(d.broken, str("[", d.who(), "] ", what,
                                                              " not started: the group is broken since ")));
  }
  if (d.stopping) {
    return Work::failed(description, std::make_exception_ptr(BackendError(str("[", d.who(), "] ", what,
                                                                              ": the group was shut down"))));
  }
  P2PTask task;
  task.isSend = isSend;
  task.what = what;
  task.deadline = Clock::now() + timeout.value_or(d.timeout);
  if (tensors.size() == 1 && tensors[0].isContiguous()) {
    task.staging = tensors[0];
  } else {
    task.staging = flattenTensors(tensors);
    if (!isSend) task.copyBackTo = tensors;
  }
  task.work = std::make_shared<Work>(description);
  if (task.staging.nbytes() == 0) {
    task.work->markCompleted();
    return task.work;
  }
  // Posting happens here, on the caller's thread and in issue order, so
  // matching sends and recvs pair up even while earlier ones still wait.
  task.buffer = d.context->createUnboundBuffer(task.staging.dataPtr(), task.staging.nbytes());
  const uint64_t slot = gloo::Slot::build(kP2PSlotPrefix, tag);
  try {
    SigpipeBlocked noSigpipe;  // posting may write to the peer's socket on this thread
    if (isSend) {
      task.buffer->send(peer, slot);
    } else {
      task.buffer->recv(peer, slot);
    }
  } catch (...) {
    // The transport already knows the peer is gone: fail this Work and the group.
    auto failure = d.p2pFailure(what, std::current_exception());
    d.broken = failure;
    d.closeConnections();
    return Work::failed(description, failure);
  }
  WorkPtr work = task.work;
  d.p2pQueue.push_back(std::move(task));
  d.p2pWake.notify_one();
  return work;
}

}  // namespace

WorkPtr GlooBackend::send(const std::vector<Tensor>& tensors, int dstRank, const SendOptions& options) {
  return postP2P(*impl_, true, tensors, dstRank, options.tag, options.timeout);
}

WorkPtr GlooBackend::recv(const std::vector<Tensor>& tensors, int srcRank, const RecvOptions& options) {
  return postP2P(*impl_, false, tensors, srcRank, options.tag, options.timeout);
}

}  // namespace dt
