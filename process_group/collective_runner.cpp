#include "process_group/collective_runner.h"

#include <time.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "common/check.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "common/thread_name.h"
#include "process_group/flight_recorder.h"
#include "tensor/profiler.h"

namespace dt {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// An op up to this size is left to its caller to run (see the header): the
// thread wake-ups it saves (~5 us each, and each may preempt a rank that is
// mid-exchange on the same core) are a large part of its time. Larger ops
// start on the worker at once: they are what callers overlap with compute.
constexpr size_t kCallerRunBytes = size_t{1} << 20;
// While ops keep coming (and for a while after), the idle worker wakes on its
// own every tick instead of being woken for each op. An op left to a caller
// that has not taken it by the worker's second tick goes to the worker: a
// caller that waits late, or never, and gives no other sign (Work's start
// hints) still has its op started within 10-20 ms. Ticks are rare because a
// wake-up is what makes the kernel stack two ranks on one core.
constexpr auto kTick = std::chrono::milliseconds(10);
constexpr auto kTickWindow = std::chrono::seconds(1);

// CLOCK_MONOTONIC (steady_clock's) at its last tick: a third of the cost.
Clock::time_point coarseNow() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return Clock::time_point(std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec));
}

size_t bytesOf(const CollectiveFingerprint& fp) {
  size_t bytes = 0;
  for (const auto& t : fp.tensors) {
    size_t n = itemSize(t.dtype);
    for (int64_t s : t.sizes) n *= static_cast<size_t>(s);
    bytes += n;
  }
  return bytes;
}

std::string rankList(const std::vector<int>& ranks) {
  if (ranks.size() == 1) return str("rank ", ranks[0]);
  if (ranks.size() == 2) return str("ranks ", ranks[0], " and ", ranks[1]);
  return str("ranks ", formatRanges(ranks));
}

const char* isAre(const std::vector<int>& ranks) { return ranks.size() == 1 ? "is" : "are"; }

bool isTimeout(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const TimeoutError&) {
    return true;
  } catch (...) {
    return false;
  }
}

std::string fingerprintKey(uint64_t seq, int r) { return str("dt_fp/", seq, "/", r); }
std::string failureKey(int r) { return str("dt_failed/", r); }

}  // namespace

std::chrono::milliseconds BackendCommonOptions::resolvedTimeout() const {
  return timeout.value_or(env::getDuration("DT_PG_TIMEOUT"));
}

CollectiveRunnerOptions BackendCommonOptions::runnerOptions(std::string backendName) const {
  CollectiveRunnerOptions r;
  r.backendName = std::move(backendName);
  r.groupName = groupName;
  r.instance = instance;
  r.timeout = resolvedTimeout();
  r.checkFingerprints = checkFingerprints.value_or(env::getString("DT_DEBUG") == "detail");
  r.globalRanks = globalRanks;
  r.watchdogStore = watchdogStore;
  r.watchdogKey = watchdogKey;
  r.progressInterval = progressInterval;
  r.failureReportWindow = failureReportWindow;
  return r;
}

struct CollectiveRunner::PeerReport {
  std::vector<int> silent;             // no failure report, no heartbeat
  std::vector<int> failed;             // reported a failure of their own
  std::map<int, std::string> reasons;  // what they reported
  std::string error;                   // could not ask
};

CollectiveRunner::CollectiveRunner(StorePtr store, int rank, int size, CollectiveRunnerOptions options,
                                   std::function<void()> abortTransport)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      options_(std::move(options)),
      timeout_(options_.timeout),
      log_(makeLogger("process_group", str("rank ", rank, "/", size, " pg=", options_.groupName))),
      abort_(std::move(abortTransport)) {
  who_ = str("rank ", rank_, "/", size_, " pg=", options_.groupName, " ", options_.backendName);
  internedWho_ = Work::internName(who_);
  internedGroup_ = Work::internName(options_.groupName);
  if (flight::enabled()) flight::installSignalHandler();
  DT_CHECK(store_ != nullptr, "CollectiveRunner: store is null");
  if (!options_.globalRanks.empty()) {
    DT_CHECK_EQ(static_cast<int>(options_.globalRanks.size()), size_, "CollectiveRunner: globalRanks must list every rank");
  }
  progress_ = std::make_unique<ProgressTracker>(store_->clone(), rank_, options_.progressInterval,
                                                options_.watchdogStore, options_.watchdogKey);
  worker_ = std::thread([this] {
    setThreadName("dt-pg-worker");
    workerLoop();
  });
}

CollectiveRunner::~CollectiveRunner() { shutdown(); }

std::string CollectiveRunner::rankName(int r) const {
  if (!options_.globalRanks.empty() && options_.globalRanks[r] != r) return str(r, " (global ", options_.globalRanks[r], ")");
  return std::to_string(r);
}

// ---- issue ---------------------------------------------------------------------------------------

std::exception_ptr CollectiveRunner::notStarted(const char* op, uint64_t seq) const {
  if (broken_) return withPrefix(broken_, str("[", who(), "] ", op, " #", seq, " not started: the group is broken since "));
  return std::make_exception_ptr(BackendError(str("[", who(), "] ", op, " #", seq, ": the group was shut down")));
}

WorkPtr CollectiveRunner::enqueue(uint64_t requestedSeq, const char* op, CollectiveFingerprint fingerprint,
                                  const OpTimeout& timeout, Body body) {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t seq = requestedSeq != 0 ? requestedSeq : ++localSeq_;
  fingerprint.seq = seq;
  fingerprint.op = op;
  if (broken_ || stopping_) {
    flight::recordCollective(internedGroup_, options_.instance, rank_, size_, seq, op, fingerprint, bytesOf(fingerprint),
                             flight::State::Aborted, flight::clockNs(0));
    auto work = std::make_shared<Work>(op, seq, internedWho_);
    Work::markFailed(work, notStarted(op, seq));
    return work;
  }
  // Ops still queued ahead of this one were not waited for by their caller,
  // who has moved on to issue this one: they are the worker's now.
  bool wakeWorker = false;
  for (Task& earlier : queue_) {
    if (earlier.leftToCaller) {
      earlier.leftToCaller = false;
      wakeWorker = true;
    }
  }
  WorkPtr work = std::make_shared<Work>(op, seq, internedWho_);
  const Work* raw = work.get();
  work->setStartHelper([this, raw](Work::Start how) { return start(raw, how); });
  // Built in place (nothing below throws): a Task is a few hundred bytes, and each move of it
  // shows in a small op's time.
  Task& task = queue_.emplace_back();
  task.seq = seq;
  task.op = op;
  task.fingerprint = std::move(fingerprint);
  task.timeout = timeout.value_or(timeout_);
  task.body = std::move(body);
  task.work = work;
  // The tick window needs no precision; the profiler's queued time does.
  const auto now = coarseNow();
  task.enqueuedAt = profiler::recording() ? Clock::now() : now;
  task.bytes = bytesOf(task.fingerprint);
  task.leftToCaller = task.bytes <= kCallerRunBytes;
  task.flightId = flight::recordCollective(
      internedGroup_, options_.instance, rank_, size_, seq, op, task.fingerprint, task.bytes, flight::State::Queued,
      task.leftToCaller ? std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count()
                        : flight::clockNs(task.bytes));
  wakeWorker = wakeWorker || !task.leftToCaller || !workerTicking_;
  tickUntil_ = now + kTickWindow;
  if (wakeWorker) wake_.notify_one();
  return work;
}

// One op runs at a time (running_, under mutex_), so its runner is the only
// writer of the counts then: a plain store after a load, not a locked
// read-modify-write.
void CollectiveRunner::countRun(std::atomic<uint64_t>& count) {
  count.store(count.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

bool CollectiveRunner::start(const Work* work, Work::Start how) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (queue_.empty()) return false;  // the worker took it
  if (how == Work::Start::Soon || running_ || stopping_ || queue_.front().work.get() != work) {
    // Its caller will not run it (or cannot now): the worker runs it when its
    // turn comes, without waiting for a tick.
    for (Task& task : queue_) {
      if (task.work.get() == work && task.leftToCaller) {
        task.leftToCaller = false;
        wake_.notify_one();
      }
    }
    return false;
  }
  Task task = std::move(queue_.front());
  queue_.pop_front();
  running_ = true;
  // Under the lock: an abort on another thread (fail()) may set broken_ at any time.
  const std::exception_ptr refused = broken_ ? notStarted(task.op, task.seq) : nullptr;
  lock.unlock();
  countRun(ranByCaller_);
  if (refused) flight::finished(task.flightId, flight::State::Aborted, flight::clockNs(task.bytes));
  const std::exception_ptr failure = refused ? refused : runTask(task);
  lock.lock();
  running_ = false;
  if (!queue_.empty() || stopping_) wake_.notify_all();
  lock.unlock();
  complete(task, failure);
  return true;
}

WorkPtr CollectiveRunner::rejectIfUnusable(const std::string& what, const std::string& description) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (broken_) {
    return Work::failed(description, withPrefix(broken_, str("[", who(), "] ", what, " not started: the group is broken since ")));
  }
  if (stopping_) {
    return Work::failed(description, std::make_exception_ptr(BackendError(str("[", who(), "] ", what,
                                                                              ": the group was shut down"))));
  }
  return nullptr;
}

void CollectiveRunner::breakGroup(const std::exception_ptr& failure, const char* dumpReason) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!broken_) {
      broken_ = failure;
      first = true;
    }
  }
  wake_.notify_all();  // queued ops fail now, also those left to their callers
  abortTransport();
  // After the abort: peers learn of the failure now, not after this rank's dump.
  if (first) flight::dumpOnFailure(failure, dumpReason);
}

std::exception_ptr CollectiveRunner::brokenCause() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return broken_;
}

bool CollectiveRunner::stopping() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stopping_;
}

void CollectiveRunner::abortTransport() {
  try {
    if (abort_) abort_();
  } catch (const std::exception& e) {
    log_->debug("aborting the transport: {}", e.what());
  }
}

void CollectiveRunner::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ && !worker_.joinable()) return;
    stopping_ = true;
    // A body in flight would otherwise block until its timeout.
    if (running_) abortTransport();
  }
  wake_.notify_all();
  {
    std::lock_guard<std::mutex> join(joinMutex_);
    if (worker_.joinable()) worker_.join();
  }
  progress_->stop();
}

// ---- worker ----------------------------------------------------------------------------------------

void CollectiveRunner::workerLoop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    if (stopping_ && queue_.empty() && !running_) return;
    if (!running_ && !queue_.empty() && (stopping_ || broken_ || !queue_.front().leftToCaller)) {
      workerTicking_ = false;
      Task task = std::move(queue_.front());
      queue_.pop_front();
      if (broken_ || stopping_) {
        auto cause = notStarted(task.op, task.seq);
        lock.unlock();
        flight::finished(task.flightId, flight::State::Aborted, flight::clockNs(task.bytes));
        Work::markFailed(task.work, cause);
        lock.lock();
        continue;
      }
      running_ = true;
      lock.unlock();
      countRun(ranByWorker_);
      const std::exception_ptr failure = runTask(task);
      lock.lock();
      running_ = false;
      lock.unlock();
      // Only now: the caller this wakes may issue its next op at once, and finding running_
      // still set it would hand that op to this thread too, and so on for every op after it.
      complete(task, failure);
      lock.lock();
      continue;
    }
    const bool opsWaitForCallers = std::any_of(queue_.begin(), queue_.end(), [](const Task& t) { return t.leftToCaller; });
    workerTicking_ = !stopping_ && (opsWaitForCallers || Clock::now() < tickUntil_);
    if (!workerTicking_) {
      wake_.wait(lock);
      continue;
    }
    if (wake_.wait_for(lock, kTick) == std::cv_status::timeout) {
      // Second chance: an op its caller left alone for a whole tick is the worker's.
      for (Task& task : queue_) {
        if (!task.leftToCaller) continue;
        if (task.seenByTick) task.leftToCaller = false;
        task.seenByTick = true;
      }
    }
  }
}

// Runs one task's body (mutex not held) and returns its failure, explained; the
// first failure becomes the group's cause and aborts the transport, so that a
// timed-out transfer can no longer write into the caller's memory. The Work is
// completed by complete(), after running_ is cleared.
std::exception_ptr CollectiveRunner::runTask(Task& task) {
  std::exception_ptr failure;
  const int64_t profiledStartNs = profiler::recording() ? profiler::nowNs() : -1;
  progress_->started(task.seq, task.op);
  flight::started(task.flightId, flight::clockNs(task.bytes));
  bool abortedFromOutside = false;
  try {
    if (options_.checkFingerprints) checkFingerprint(task.fingerprint, task.timeout);
    task.body(task.timeout, task.fingerprint);
    progress_->completed(task.seq, task.op);
  } catch (...) {
    // Aborted from outside (Backend::abort) before or while the failure is
    // explained: the transport's error is only the abort's echo, so the
    // abort's cause is what the op says (and the peers are not asked).
    abortedFromOutside = brokenCause() != nullptr;
    if (!abortedFromOutside) failure = explainFailure(std::current_exception(), task);
    if (std::exception_ptr cause = brokenCause()) {
      const std::string description = task.fingerprint.describe();
      failure = withPrefix(cause, str("[", who(), "] ", task.op, " #", task.seq, " ",
                                      description.substr(std::min(description.size(), std::strlen(task.op))), " failed: "));
    }
  }
  if (profiledStartNs >= 0) [[unlikely]] recordProfile(task, profiledStartNs, failure != nullptr);
  flight::finished(task.flightId,
                   !failure ? flight::State::Done : abortedFromOutside ? flight::State::Aborted : flight::State::Failed,
                   flight::clockNs(task.bytes));
  if (failure) {
    if (isTimeout(failure)) {
      failure = withPrefix(failure, "", " [the group is broken now: later ops fail at once; ProcessGroup::isBroken()]");
    }
    breakGroup(failure, "error");
  }
  return failure;
}

void CollectiveRunner::complete(Task& task, const std::exception_ptr& failure) {
  if (failure) {
    Work::markFailed(task.work, failure);
  } else {
    Work::markCompleted(task.work);
  }
}

// The collective as a profiler event on the thread that ran it: issue (as the
// time it queued), start, end, bytes, sequence number and group.
void CollectiveRunner::recordProfile(const Task& task, int64_t startNs, bool failed) const {
  const int64_t endNs = profiler::nowNs();
  const int64_t issuedNs =
      std::chrono::duration_cast<std::chrono::nanoseconds>(task.enqueuedAt.time_since_epoch()).count();
  std::string args = str("\"seq\": ", task.seq, ", \"bytes\": ", bytesOf(task.fingerprint), ", \"queued_us\": ",
                         static_cast<double>(startNs - issuedNs) / 1e3, ", \"group\": \"", options_.groupName,
                         "\", \"backend\": \"", options_.backendName, "\"");
  if (failed) args += ", \"failed\": true";
  const int globalRank = options_.globalRanks.empty() ? rank_ : options_.globalRanks[rank_];
  profiler::recordEvent(task.op, EventCategory::Collective, startNs, endNs, std::move(args), globalRank);
}

// ---- fingerprints (DT_DEBUG=detail) -------------------------------------------------------------------

void CollectiveRunner::checkFingerprint(const CollectiveFingerprint& fingerprint, Millis timeout) {
  const uint64_t seq = fingerprint.seq;
  store_->set(fingerprintKey(seq, rank_), fingerprint.serialize());
  std::vector<std::string> keys;
  for (int r = 0; r < size_; ++r) keys.push_back(fingerprintKey(seq, r));
  try {
    store_->wait(keys, timeout);
  } catch (const TimeoutError&) {
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r) {
      if (!store_->check({keys[r]})) missing.push_back(r);
    }
    throw TimeoutError(str("[", who(), "] ", fingerprint.op, " #", seq, " (", fingerprint.describe(),
                           ") timed out after ", formatDuration(timeout), " comparing fingerprints: ",
                           rankList(missing), " never reached collective #", seq, ". ", stuckSummary(seq)));
  }
  const auto values = store_->multiGet(keys);
  std::map<std::string, std::vector<int>> others;  // description -> ranks
  for (int r = 0; r < size_; ++r) {
    if (values[r] == values[rank_]) continue;
    CollectiveFingerprint theirs;
    try {
      theirs = CollectiveFingerprint::parse(values[r]);
    } catch (const std::exception&) {
      theirs.op = "<unreadable fingerprint>";
    }
    if (fingerprint.agreesWith(theirs)) continue;
    others[theirs.describe() + (theirs.seq != seq ? str(" as #", theirs.seq) : std::string())].push_back(r);
  }
  // Keys of the previous collective are no longer read by anyone: every
  // rank has written this one, so each has finished comparing the last.
  if (seq > 1) store_->deleteKey(fingerprintKey(seq - 1, rank_));
  if (others.empty()) return;
  std::vector<std::string> parts;
  for (const auto& [description, ranks] : others) parts.push_back(str(rankList(ranks), " called ", description));
  throw DesyncError(str("[", who(), "] collective #", seq, " mismatch: this rank called ",
                        fingerprint.describe(), "; ", join(parts, "; "),
                        ". Every rank must issue the same collectives in the same order"));
}

// ---- monitored barrier ---------------------------------------------------------------------------

WorkPtr CollectiveRunner::monitoredBarrier(uint64_t requestedSeq, const OpTimeout& timeout) {
  return enqueue(requestedSeq, "monitoredBarrier", CollectiveFingerprint{}, timeout,
                 [this](Millis limit, const CollectiveFingerprint& fp) {
    const std::string base = str("dt_mbarrier/", fp.seq);
    auto arrivedKey = [&](int r) { return str(base, "/arrived/", r); };
    const std::string verdictKey = base + "/verdict";
    const std::string head = str("[", who(), "] monitoredBarrier #", fp.seq);
    store_->set(arrivedKey(rank_), "1");
    if (rank_ == 0) {
      std::vector<std::string> keys;
      for (int r = 0; r < size_; ++r) keys.push_back(arrivedKey(r));
      std::vector<int> missing;
      try {
        store_->wait(keys, limit);
      } catch (const TimeoutError&) {
        for (int r = 0; r < size_; ++r) {
          if (!store_->check({keys[r]})) missing.push_back(r);
        }
      }
      const std::string verdict =
          missing.empty() ? "" : str(rankList(missing), " did not arrive within ", formatDuration(limit));
      store_->set(verdictKey, missing.empty() ? "ok" : verdict);
      for (int r = 0; r < size_; ++r) store_->deleteKey(keys[r]);
      // Every rank arrived here, so all have read the previous verdict.
      if (lastMonitoredBarrier_ != 0 && missing.empty()) {
        store_->deleteKey(str("dt_mbarrier/", lastMonitoredBarrier_, "/verdict"));
      }
      lastMonitoredBarrier_ = fp.seq;
      if (!missing.empty()) {
        throw TimeoutError(str(head, ": ", verdict, " (", size_ - static_cast<int>(missing.size()), " of ", size_,
                               " did). ", stuckSummary(fp.seq)));
      }
      return;
    }
    std::optional<Bytes> verdict;
    try {
      verdict = store_->get(verdictKey, limit);
    } catch (const TimeoutError&) {
      // Rank 0 decides `limit` after it arrives; it may have come later than this rank.
      if (!store_->check({arrivedKey(0)}) && !store_->check({verdictKey})) {
        throw TimeoutError(str(head, ": rank 0, which coordinates it, did not arrive within ", formatDuration(limit),
                               ". ", stuckSummary(fp.seq)));
      }
      verdict = store_->get(verdictKey, limit);
    }
    if (*verdict != "ok") throw TimeoutError(str(head, ": rank 0 reports that ", *verdict));
  });
}

// ---- failure diagnosis ------------------------------------------------------------------------------

// "rank 3 never started #41 (its last completed: #40); ranks 1 and 2 are waiting in #41"
std::string CollectiveRunner::stuckSummary(uint64_t seq) {
  std::vector<RankProgress> all;
  try {
    progress_->publishNow();
    all = ProgressTracker::readAll(*store_, size_);
  } catch (const std::exception& e) {
    return str("(could not read the other ranks' progress: ", e.what(), ")");
  }
  std::map<uint64_t, std::vector<int>> neverStarted;  // last completed -> ranks
  std::vector<int> waiting, finished, unknown;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
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
  return join(parts, "; ");
}

// Finds the peers that neither reported a failure of their own nor kept
// their heartbeat going within the report window: those exited or hung.
CollectiveRunner::PeerReport CollectiveRunner::collectPeerReports(const std::vector<int>& knownGone) {
  PeerReport report;
  try {
    const auto first = ProgressTracker::readAll(*store_, size_);
    const auto deadline = Clock::now() + options_.failureReportWindow;
    std::set<int> pending;
    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && std::find(knownGone.begin(), knownGone.end(), r) == knownGone.end()) pending.insert(r);
    }
    while (!pending.empty()) {
      const auto now = ProgressTracker::readAll(*store_, size_);
      for (auto it = pending.begin(); it != pending.end();) {
        const int r = *it;
        if (store_->check({failureKey(r)})) {
          report.failed.push_back(r);
          report.reasons[r] = store_->get(failureKey(r));
          it = pending.erase(it);
        } else if (now[r].present && now[r].heartbeat != first[r].heartbeat) {
          it = pending.erase(it);  // alive, still working
        } else {
          ++it;
        }
      }
      if (pending.empty() || Clock::now() >= deadline || brokenCause()) break;  // an abort says why
      std::this_thread::sleep_for(Millis(50));
    }
    report.silent.assign(pending.begin(), pending.end());
  } catch (const std::exception& e) {
    report.error = str("(could not ask the other ranks: ", e.what(), ")");
  }
  std::sort(report.failed.begin(), report.failed.end());
  return report;
}

std::string CollectiveRunner::describePeers(const PeerReport& report) const {
  if (!report.error.empty()) return report.error;
  std::vector<std::string> parts;
  if (!report.silent.empty()) {
    parts.push_back(str(report.silent.size() == 1 ? "Rank " : "Ranks ", formatRanges(report.silent),
                        " stopped responding (no failure report and no progress heartbeat for ",
                        formatDuration(options_.failureReportWindow), ": exited, killed or hung)"));
  }
  if (!report.failed.empty()) {
    parts.push_back(str(rankList(report.failed), " failed too; rank ", report.failed.front(),
                        " reported: ", report.reasons.at(report.failed.front())));
  }
  return join(parts, "; ");
}

std::exception_ptr CollectiveRunner::explainFailure(std::exception_ptr error, const Task& task) {
  const char* op = task.op;
  const uint64_t seq = task.seq;
  // "[rank 0/4 pg=default gloo] allreduce #41 (float32[1048576], sum)"
  const std::string description = task.fingerprint.describe();
  const std::string args = description.size() > std::strlen(op) ? description.substr(std::strlen(op)) : "";
  const std::string head = str("[", who(), "] ", op, " #", seq, " ", args);
  const std::string raise = ". Raise the timeout (DT_PG_TIMEOUT or the op's timeout) if the ranks are merely slow";
  try {
    std::rethrow_exception(error);
  } catch (const DesyncError&) {
    reportFailure(str(op, " #", seq, ": desync"));
    return error;
  } catch (const TimeoutError&) {
    reportFailure(str(op, " #", seq, " timed out"));
    return error;
  } catch (const TransportTimeout& e) {
    const std::string stuck = stuckSummary(seq);
    reportFailure(str(op, " #", seq, " timed out after ", formatDuration(task.timeout)));
    abortTransport();
    return std::make_exception_ptr(TimeoutError(str(head, " timed out after ", formatDuration(task.timeout),
                                                    " on rank ", rank_, "/", size_, stuck.empty() ? "" : "; ", stuck,
                                                    ". (", options_.backendName, ": ", e.what(), ")", raise)));
  } catch (const PeerLost& e) {
    reportFailure(str(op, " #", seq, " lost a peer: ", e.what()));
    // Peers blocked on this rank fail now instead of at their timeout.
    abortTransport();
    const PeerReport report = collectPeerReports(e.ranks);
    // A peer that timed out aborts its transport; what this rank sees is
    // then a lost peer, but the cause is the timeout.
    for (int r : report.failed) {
      const auto& reason = report.reasons.at(r);
      if (reason.find(" timed out") == std::string::npos) continue;
      const std::string stuck = stuckSummary(seq);
      return std::make_exception_ptr(TimeoutError(str(head, " timed out in the group (rank ", r, " reported: ", reason,
                                                      ", and aborted its transfers)", stuck.empty() ? "" : "; ", stuck,
                                                      raise)));
    }
    std::vector<std::string> parts;
    if (!e.ranks.empty()) {
      std::vector<std::string> names;
      for (int r : e.ranks) names.push_back(rankName(r));
      parts.push_back(str(e.ranks.size() == 1 ? "Rank " : "Ranks ", join(names, ", "), e.ranks.size() == 1 ? " is" : " are",
                          " gone"));
    }
    if (const std::string peers = describePeers(report); !peers.empty()) parts.push_back(peers);
    return std::make_exception_ptr(BackendError(str(head, " failed: ", e.ranks.empty() ? "connection to a peer lost" : "a peer is gone",
                                                    " (", options_.backendName, ": ", e.what(), ")",
                                                    parts.empty() ? "" : ". ", join(parts, "; "))));
  } catch (const dt::Error& e) {
    reportFailure(str(op, " #", seq, ": ", e.what()));
    return withPrefix(error, head + " failed: ");
  } catch (const std::exception& e) {
    reportFailure(str(op, " #", seq, ": ", e.what()));
    return std::make_exception_ptr(BackendError(str(head, " failed: ", e.what())));
  }
}

std::string CollectiveRunner::noteP2PFailure(const std::string& reason, int peer) {
  reportFailure(reason);
  if (peer < 0 || peer >= size_ || peer == rank_) return "";
  try {
    if (store_->check({failureKey(peer)})) return str("rank ", peer, " reported: ", store_->get(failureKey(peer)));
  } catch (const std::exception& e) {
    log_->debug("cannot read rank {}'s failure report: {}", peer, e.what());
  }
  return "";
}

void CollectiveRunner::reportFailure(const std::string& reason) {
  try {
    store_->set(failureKey(rank_), str(reason, " (on rank ", rank_, ")"));
  } catch (const std::exception& e) {
    log_->warn("cannot publish failure report: {}", e.what());
  }
}

}  // namespace dt
