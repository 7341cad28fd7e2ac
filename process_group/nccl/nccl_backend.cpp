#include "process_group/nccl/nccl_backend.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "common/check.h"
#include "common/errors.h"
#include "common/strings.h"
#include "common/thread_name.h"
#include "process_group/cpu_tensors.h"
#include "process_group/nccl/comm_lifecycle.h"
#include "store/prefix_store.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/stream.h"

namespace dt {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// "ncclRemoteError: remote process exited or there was a network error (<NCCL's last message>)"
std::string ncclText(ncclResult_t result, ncclComm_t comm) {
  std::string text = str(ncclGetErrorString(result), " (ncclResult ", static_cast<int>(result), ")");
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += str(": ", last);
  return text;
}

std::optional<ncclDataType_t> ncclTypeOf(DType dtype) {
  switch (dtype) {
    case DType::Float32: return ncclFloat32;
    case DType::Float64: return ncclFloat64;
    case DType::Float16: return ncclFloat16;
    case DType::BFloat16: return ncclBfloat16;
    case DType::Int32: return ncclInt32;
    case DType::Int64: return ncclInt64;
    case DType::Bool: return std::nullopt;
  }
  return std::nullopt;
}

ncclRedOp_t ncclOpOf(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;  // NCCL divides after summing (integers truncate)
    case ReduceOp::Min: return ncclMin;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Product: return ncclProd;
  }
  return ncclSum;
}

cudaStream_t raw(const cuda::Stream& s) { return static_cast<cudaStream_t>(s.handle()); }

// What ncclCommGetAsyncError's answer means for a call that returned ncclInProgress.
nccl::CallState callState(ncclResult_t result) {
  if (result == ncclInProgress) return nccl::CallState::InProgress;
  return result == ncclSuccess ? nccl::CallState::Done : nccl::CallState::Failed;
}

// LOCAL_RANK (dtrun, torchrun), else SLURM_LOCALID (srun without a launcher;
// init.cpp's order); nullopt when neither is a non-negative integer.
std::optional<int> localRankFromEnvironment() {
  for (const char* name : {"LOCAL_RANK", "SLURM_LOCALID"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    char* end = nullptr;
    const long parsed = std::strtol(value, &end, 10);
    if (*end != '\0' || parsed < 0 || parsed > 1 << 20) return std::nullopt;
    return static_cast<int>(parsed);
  }
  return std::nullopt;
}

// How long one wait of a creation for the store may last before it looks at the abort flag.
constexpr std::chrono::milliseconds kAbortCheckInterval{100};

// The caching allocator hands a freed block out again on its own stream at
// once; the NCCL stream may still read or write it, so the block must also
// wait for the NCCL stream's work (recordStream). Views of one storage record
// it once each, which the allocator takes as often as it is told.
void recordNcclStream(const Tensor& t, const cuda::Stream& stream) {
  if (t.numel() == 0) return;
  cuda::recordStream(t.storage(), stream);
}

}  // namespace

// Queues work of ours on the NCCL stream after the op (false: a CUDA call failed).
using AfterEnqueue = std::function<bool(cudaStream_t)>;

// One NCCL communicator of the group, for one CUDA device of this rank.
struct NcclComm {
  Device device = Device::cuda(0);
  int index = 0;  // k: the group's k-th communicator
  ncclComm_t comm = nullptr;
  cuda::Stream stream;
  cuda::Event ready;  // reused: the caller's stream at the last launch (under launchMutex)
  // A launch's turn, held from ncclGroupStart until its completion event is
  // recorded, across the wait for NCCL's helper thread: NCCL takes no call
  // on a nonblocking communicator before the previous one left
  // ncclInProgress, and the stream may not be touched before then. Also held
  // by a graceful shutdown's finalize. Taken before `mutex`, never after it.
  std::mutex launchMutex;
  // The handle's lock: held for each NCCL call on the communicator (and each
  // look at it while a launch waits), never across a wait or a sleep, so
  // that an abort (ncclCommAbort frees the communicator) never races with a
  // use of it and still gets through at once. Every ncclCommGetAsyncError is
  // under it too: in NCCL 2.28 that call is not a pure read (once the helper
  // is done it joins it and unlinks its group job, init.cc).
  std::mutex mutex;
  // Set (under the mutex) before ncclCommAbort; read without it by watchers.
  std::atomic<bool> aborted{false};
  // Finalized and destroyed by a graceful shutdown (under the mutex): the
  // handle is gone, nothing may call NCCL on it any more.
  std::atomic<bool> destroyed{false};
  // The completion event of the last op launched here (under the mutex): ops
  // on one NCCL stream complete in order, so once it has, every one has.
  std::shared_ptr<cuda::Event> last;
};

// One op launched on a communicator's stream.
struct Launched {
  std::shared_ptr<NcclComm> comm;
  std::shared_ptr<cuda::Event> done;
  // Alive until the op completed: recordStream already protects freed memory,
  // and this keeps the Work's tensors meaningful for result() and callbacks
  // however the caller drops its handles.
  std::vector<Tensor> keep;
};

// A send or recv being watched by the p2p thread.
struct WatchedP2P {
  Launched op;
  WorkPtr work;
  Clock::time_point deadline;
  Millis timeout{0};
  std::string what;
};

struct NcclBackend::Impl {
  StorePtr store;  // the group's scope + "nccl/"
  int rank = 0;
  int size = 1;
  NcclBackendOptions options;
  Millis timeout{0};
  std::unique_ptr<CollectiveRunner> runner;
  // By device index. Its abort flag is the backend's: set (before any
  // ncclCommAbort) by abortAll, read by launches, watchers and creations.
  nccl::CommRegistry<NcclComm> comms;
  std::atomic<int> lastDevice{-1};  // of the most recent op (its communicator exists)
  // LOCAL_RANK (else SLURM_LOCALID), read at construction: the launcher's
  // contract says which GPU this rank uses (docs/gpu.md), for a barrier that
  // comes before any op told the backend its device.
  std::optional<int> localRank;

  bool aborting() const { return comms.aborting(); }
  // shutdown() began: no new op is launched.
  std::atomic<bool> closing{false};
  // The collectives' Works not yet completed, for shutdown to wait for.
  std::mutex outstandingMutex;
  std::vector<std::weak_ptr<Work>> outstanding;

  std::mutex p2pMutex;
  std::condition_variable p2pWake;
  std::list<WatchedP2P> p2p;
  bool p2pStopping = false;
  std::mutex p2pJoinMutex;  // shutdown() may run on several threads at once: one joins
  std::thread p2pThread;

  const std::string& who() const { return runner->who(); }
  CpuCallSite callSite(uint64_t seq) const { return CpuCallSite{who(), "nccl", rank, size, seq}; }

  // ---- input checks --------------------------------------------------------------------------------

  // A contiguous CUDA tensor of a dtype NCCL reduces, on `*device` (set by the first).
  void checkTensor(const CpuCallSite& at, const char* op, const Tensor& t, const std::string& what,
                   std::optional<Device>& device, std::optional<ReduceOp> reduceOp = std::nullopt) const {
    if (!t.defined()) rejectCall(at, op, str(what, " is an undefined tensor"));
    if (!t.device().isCuda()) {
      rejectCall(at, op, str("the nccl backend takes CUDA tensors, got ", what, " ", t.describe(), " on ",
                             t.device().str(), "; move it with .to(Device::cuda(i)) (ProcessGroup sends CPU tensors to "
                             "shm/gloo by itself)"));
    }
    if (!t.isContiguous()) {
      rejectCall(at, op, str(what, " ", t.describe(), " on ", t.device().str(),
                             " is not contiguous; NCCL works in place on contiguous memory: pass t.contiguous() and copy "
                             "the result back"));
    }
    if (!ncclTypeOf(t.dtype())) {
      rejectCall(at, op, str(what, " ", t.describe(), ": NCCL cannot ",
                             reduceOp ? str("reduce with ", toString(*reduceOp), " over") : std::string("move"), " dtype ",
                             toString(t.dtype()), "; use float32, float64, float16, bfloat16, int32 or int64"));
    }
    if (!device) {
      device = t.device();
    } else if (t.device() != *device) {
      rejectCall(at, op, str(what, " ", t.describe(), " is on ", t.device().str(), " but the op's first tensor is on ",
                             device->str(), "; one op runs on one device"));
    }
  }

  void checkList(const CpuCallSite& at, const char* op, const std::vector<Tensor>& list, const char* name,
                 std::optional<Device>& device, std::optional<ReduceOp> reduceOp = std::nullopt) const {
    for (size_t i = 0; i < list.size(); ++i) checkTensor(at, op, list[i], str(name, " ", i), device, reduceOp);
  }

  void checkRoot(const CpuCallSite& at, const char* op, int root) const {
    if (root < 0 || root >= size) rejectCall(at, op, str("root ", root, " is not a rank of the group (size ", size, ")"));
  }

  void checkCount(const CpuCallSite& at, const char* op, const std::vector<Tensor>& list, const char* name) const {
    if (static_cast<int>(list.size()) != size) {
      rejectCall(at, op, str("one ", name, " tensor per rank: got ", list.size(), " for a group of size ", size));
    }
  }

  void checkLike(const CpuCallSite& at, const char* op, const std::vector<Tensor>& list, const Tensor& like,
                 const char* listName, const char* likeName) const {
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].dtype() != like.dtype() || list[i].sizes() != like.sizes()) {
        rejectCall(at, op, str(listName, " ", i, " ", list[i].describe(), " does not match ", likeName, " ",
                               like.describe()));
      }
    }
  }

  // ---- communicators -----------------------------------------------------------------------------

  std::vector<int> ranksThatJoined(const std::string& base, bool joined) const {
    std::vector<int> out;
    for (int r = 0; r < size; ++r) {
      bool present = false;
      try {
        present = store->check({str(base, "joined/", r)});
      } catch (const std::exception&) {
      }
      if (present == joined) out.push_back(r);
    }
    return out;
  }

  [[noreturn]] void throwInitTimeout(const std::string& head, const std::string& base, Millis limit,
                                     const std::string& stage) const {
    const std::vector<int> missing = ranksThatJoined(base, false);
    if (missing.empty()) {
      throw TimeoutError(str(head, " timed out after ", formatDuration(limit), " ", stage,
                             ": every rank started to join, but NCCL did not finish setting up its connections; "
                             "run with NCCL_DEBUG=INFO to see which transport hangs, or raise DT_PG_TIMEOUT"));
    }
    throw TimeoutError(str(head, " timed out after ", formatDuration(limit), " ", stage, ": ",
                           missing.size() == 1 ? "rank " : "ranks ", formatRanges(missing),
                           " never started to join (", formatRanges(ranksThatJoined(base, true)),
                           " did). Every rank must issue the group's first op on a CUDA device; are ",
                           missing.size() == 1 ? "it" : "they", " running, on the same store, and past the "
                           "previous ops?"));
  }

  // The communicator for `device`, created on first use (collective over the
  // group) by the thread that first needs it; see nccl::CommRegistry.
  std::shared_ptr<NcclComm> commFor(Device device) {
    return comms.getOrCreate(
        device.index, [&](int index) { return createComm(device, index); },
        [&](NcclComm& c) { abortOne(c); });
  }

  // Makes communicator #index on `device`. Every wait in it (rank 0's
  // ncclUniqueId in the store, NCCL's nonblocking initialisation) looks at
  // the abort flag between polls: an abort meanwhile ends it at once, and the
  // ncclCommAbort of a half-made communicator is done here, by its creator.
  std::shared_ptr<NcclComm> createComm(Device device, int index) {
    auto c = std::make_shared<NcclComm>();
    c->device = device;
    c->index = index;
    const std::string base = str("comm/", c->index, "/");
    const std::string head = str("[", who(), "] creating NCCL communicator #", c->index, " of the group on ", device.str());
    const auto deadline = Clock::now() + timeout;
    auto givenUp = [&] {
      return BackendError(str(head, " was given up: the group's communicators are being aborted (shut down, or "
                              "broken by another op)"));
    };
    // First, so that NCCL's calls below find this rank's GPU current.
    cuda::DeviceGuard guard(device);
    store->set(str(base, "joined/", rank), device.str());
    ncclUniqueId id{};
    if (rank == 0) {
      const ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) {
        throw BackendError(str(head, " failed: ncclGetUniqueId: ", ncclGetErrorString(r),
                               "; check NCCL_SOCKET_IFNAME / the network set-up (NCCL_DEBUG=INFO)"));
      }
      store->set(base + "id", Bytes(reinterpret_cast<const char*>(&id), sizeof(id)));
    } else {
      Bytes bytes;
      while (true) {
        if (aborting()) throw givenUp();
        const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
        if (left.count() <= 0) throwInitTimeout(head, base, timeout, "waiting for rank 0's ncclUniqueId");
        try {
          bytes = store->get(base + "id", std::min<Millis>(left, kAbortCheckInterval));
          break;
        } catch (const TimeoutError&) {
        }
      }
      if (bytes.size() != sizeof(id)) {
        throw BackendError(str(head, " failed: the ncclUniqueId in the store has ", bytes.size(), " bytes, expected ",
                               sizeof(id), "; do all ranks run the same NCCL version?"));
      }
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    c->stream = cuda::Stream::create(device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // so that a rank that never arrives ends in a timeout, not a hang
    ncclResult_t result = ncclCommInitRankConfig(&c->comm, size, id, rank, &config);
    nccl::CallOutcome outcome = result == ncclSuccess ? nccl::CallOutcome::Done : nccl::CallOutcome::Failed;
    if (result == ncclInProgress) {
      outcome = nccl::awaitCall(
          [&] {
            ncclCommGetAsyncError(c->comm, &result);
            return callState(result);
          },
          [&] { return aborting(); }, deadline, nccl::kInitPolling);
    }
    switch (outcome) {
      case nccl::CallOutcome::Done: break;
      case nccl::CallOutcome::Aborted:
        ncclCommAbort(c->comm);
        throw givenUp();
      case nccl::CallOutcome::TimedOut:
        ncclCommAbort(c->comm);
        throwInitTimeout(head, base, timeout, "in ncclCommInitRankConfig");
      case nccl::CallOutcome::Failed: {
        const std::string text = c->comm != nullptr ? ncclText(result, c->comm) : ncclGetErrorString(result);
        if (c->comm != nullptr) ncclCommAbort(c->comm);
        throw BackendError(str(head, " failed: ncclCommInitRankConfig: ", text,
                               "; NCCL_DEBUG=INFO shows why (note: NCCL rejects two ranks on one GPU)"));
      }
    }
    runner->log()->debug("NCCL communicator #{} ready on {}", c->index, device.str());
    return c;
  }

  // Aborts one communicator, once (the comm mutex waits for a launch on it).
  void abortOne(NcclComm& c) {
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.destroyed.load() || c.aborted.exchange(true)) return;
    cuda::DeviceGuard guard(c.device);
    if (const ncclResult_t r = ncclCommAbort(c.comm); r != ncclSuccess) {
      runner->log()->warn("ncclCommAbort on {}: {}", c.device.str(), ncclGetErrorString(r));
    }
  }

  // Aborts every communicator (the runner's abortTransport: a failure or
  // shutdown). Idempotent; never waits for a communicator being created (its
  // creator sees the flag and ends it).
  void abortAll() {
    for (const auto& c : comms.beginAbort()) abortOne(*c);
    p2pWake.notify_all();
  }

  // ---- launch ----------------------------------------------------------------------------------------

  // After a call on a nonblocking communicator returned ncclInProgress, NCCL
  // still enqueues in the background (a helper thread per ncclGroupEnd, NCCL
  // 2.28's group.cc); the stream must not be touched before it is done. The
  // helper usually ends within tens of microseconds, so the wait spins
  // (yields) first: a sleep of a few microseconds costs ~50 us of timer slack.
  // Returns NCCL's final result; throws on the deadline or an abort. Called
  // with c.launchMutex held and c.mutex not: it takes c.mutex for each look
  // only (nccl::awaitEnqueue), so an abort or the watchdog's check of earlier
  // ops on this communicator does not wait behind this op's enqueue.
  //
  // Why the communicators stay nonblocking for ops (issue 43, item 6), from
  // NCCL 2.28.9's source: a blocking communicator runs ncclGroupEnd's launch
  // on the caller's thread, and that launch connects lazily: the first
  // collective of each algorithm (NCCL_RUNTIME_CONNECT, on by default) and
  // the first send/recv with each peer exchange connection details with the
  // peers and wait for them (group.cc, groupLaunch). A peer that is late or
  // gone holds the caller there with no deadline of ours, and only NCCL's
  // abort flag ends the wait, which only ncclCommAbort sets; on a blocking
  // communicator ncclCommAbort does not wait for a call running on another
  // thread (ncclCommEnsureReady joins only a nonblocking group job), so it
  // would free the communicator under that call. Deriving a blocking
  // communicator after a timed nonblocking init (ncclCommSplit with
  // blocking = 1, itself nonblocking on a nonblocking parent) would bound
  // creation but not these first-op waits. A nonblocking communicator costs a
  // helper thread per op, host time only (the GPU work is queued either way):
  // a bare pthread create, poll and join took 80-140 us on the loaded 2-core
  // CI machine, so many small ops on a host-bound step would feel it. It
  // keeps every wait here, where the op's timeout bounds it and an abort ends
  // it (ncclCommAbort stops and joins the helper). The NCCL path itself is
  // not measured on a device yet.
  ncclResult_t finishEnqueue(NcclComm& c, ncclResult_t result, Clock::time_point deadline, const std::string& what,
                             Millis limit) {
    if (result != ncclInProgress) return result;
    const nccl::CallOutcome outcome = nccl::awaitEnqueue(
        c.mutex, [&] { return c.aborted.load() || c.destroyed.load(); },
        [&] {
          ncclCommGetAsyncError(c.comm, &result);
          return callState(result);
        },
        [&] { return aborting(); }, deadline, nccl::kEnqueuePolling);
    if (outcome == nccl::CallOutcome::TimedOut) {
      throw TransportTimeout(str(what, ": NCCL did not finish enqueueing the op within ", formatDuration(limit)));
    }
    if (outcome == nccl::CallOutcome::Aborted) {
      throw BackendError(str(what, ": the group's communicators were aborted while NCCL enqueued the op"));
    }
    return result;
  }

  // Launches issue(comm, stream) on the communicator of `device` after the
  // caller's current stream, and records the completion event. Throws
  // BackendError when NCCL refuses (the caller breaks the group).
  template <typename Issue>
  Launched launch(const std::string& what, Device device, std::vector<Tensor> keep, Millis limit, Issue&& issue,
                  const AfterEnqueue& after = {}) {
    Launched l;
    l.comm = commFor(device);
    lastDevice.store(device.index);
    l.done = std::make_shared<cuda::Event>();
    NcclComm& c = *l.comm;
    cuda::DeviceGuard guard(device);
    // Before anything is queued, so that a refusal leaves nothing in flight.
    for (const auto& t : keep) recordNcclStream(t, c.stream);
    auto refuseGone = [&] {
      return BackendError(str("[", who(), "] ", what, ": the communicator on ", device.str(), " was ",
                              c.aborted ? "aborted" : "shut down"));
    };
    std::lock_guard<std::mutex> turn(c.launchMutex);
    ncclResult_t result = ncclSuccess;
    {
      std::lock_guard<std::mutex> lock(c.mutex);
      if (c.aborted || c.destroyed) throw refuseGone();
      c.ready.record(cuda::currentStream(device));
      c.ready.block(c.stream);
      result = ncclGroupStart();
      if (result == ncclSuccess) {
        result = issue(c.comm, raw(c.stream));
        const ncclResult_t ended = ncclGroupEnd();
        if (result == ncclSuccess || result == ncclInProgress) result = ended;
      }
    }
    // The handle's lock is free while NCCL's helper enqueues (see finishEnqueue).
    result = finishEnqueue(c, result, Clock::now() + limit, what, limit);
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.aborted || c.destroyed) throw refuseGone();
    if (result != ncclSuccess) throw BackendError(str(what, ": NCCL refused the op: ", ncclText(result, c.comm)));
    // Work of ours behind NCCL's on its stream (allgather's copies out):
    // only now, once NCCL has finished enqueueing, may the stream be used.
    if (after && !after(raw(c.stream))) {
      throw BackendError(str(what, ": queueing the copies after the NCCL op on ", device.str(), " failed: ",
                             cudaGetErrorString(cudaGetLastError())));
    }
    l.done->record(c.stream);
    c.last = l.done;
    l.keep = std::move(keep);
    return l;
  }

  // ---- watching (runner worker / p2p thread) -------------------------------------------------------

  // Throws when NCCL reports an asynchronous error on the communicator.
  void checkAsync(NcclComm& c) {
    ncclResult_t result = ncclSuccess;
    std::string text;
    {
      std::lock_guard<std::mutex> lock(c.mutex);
      if (c.aborted || c.destroyed) return;
      if (ncclCommGetAsyncError(c.comm, &result) != ncclSuccess || result == ncclSuccess || result == ncclInProgress) {
        return;
      }
      text = ncclText(result, c.comm);
    }
    if (result == ncclRemoteError) {
      throw PeerLost(str("ncclCommGetAsyncError on ", c.device.str(), ": ", text));
    }
    throw BackendError(str("NCCL reported an asynchronous error on ", c.device.str(), ": ", text));
  }

  // A watcher's view of one launched op, for nccl::pollOp (comm_lifecycle.h):
  // an abort, from whichever thread, fails the op even when its event fired.
  struct LaunchedProbe final : nccl::OpProbe {
    LaunchedProbe(Impl& impl, const Launched& op) : impl(impl), op(op) {}
    bool eventCompleted() override { return op.done->query(); }
    bool aborted() override { return impl.aborting() || op.comm->aborted.load(); }
    void throwIfAsyncError() override { impl.checkAsync(*op.comm); }
    Impl& impl;
    const Launched& op;
  };

  // Blocks until the op's event completed. Throws TransportTimeout after
  // `limit`, PeerLost / BackendError on an NCCL error or an abort.
  void watch(const Launched& l, Millis limit) {
    const auto deadline = Clock::now() + limit;
    // The event's device, for CUDA's calls on this thread (the runner's worker,
    // or a caller running the op inline). The guard leaves a worker that had no
    // device on this one, so the worker's later calls make no context on cuda:0.
    cuda::DeviceGuard guard(l.comm->device);
    LaunchedProbe probe(*this, l);
    auto pause = std::chrono::microseconds(10);
    while (true) {
      const nccl::OpState state = nccl::pollOp(probe);
      if (state == nccl::OpState::Completed) return;
      if (state == nccl::OpState::Aborted) {
        throw BackendError(str("the NCCL communicators of the group were aborted while the op ran on ",
                               l.comm->device.str(), " (group shut down or broken by another op); an abort ends "
                               "NCCL's kernels early, so its result is not trusted even where its event completed"));
      }
      if (Clock::now() >= deadline) {
        throw TransportTimeout(str("its completion event on ", l.comm->device.str(),
                                   " did not complete and NCCL reports no error (ncclCommGetAsyncError: ncclSuccess); "
                                   "the communicators are aborted"));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, options.pollInterval);
    }
  }

  // ---- collectives -----------------------------------------------------------------------------

  template <typename Issue>
  WorkPtr collective(const char* op, uint64_t seq, CollectiveFingerprint fp, const OpTimeout& opTimeout, Device device,
                     std::vector<Tensor> keep, bool deviceWait, Issue&& issue, const AfterEnqueue& after = {}) {
    // A broken or stopped group launches nothing; the runner fails the Work.
    if (runner->brokenCause() || runner->stopping()) {
      return runner->enqueue(seq, op, std::move(fp), opTimeout, [](Millis, const CollectiveFingerprint&) {});
    }
    if (closing.load()) return refuseClosing(str(op, seq != 0 ? str(" #", seq) : std::string()));
    const Millis limit = opTimeout.value_or(timeout);
    std::optional<Launched> launched;
    try {
      launched = launch(str(op, seq != 0 ? str(" #", seq) : std::string()), device, std::move(keep), limit,
                        std::forward<Issue>(issue), after);
    } catch (const TimeoutError&) {
      // Creating the communicator timed out: the group cannot run this op, nor any later one.
      runner->fail(std::current_exception());
      throw;
    } catch (const std::exception& e) {
      // NCCL refused the op, or the communicator could not be made: break the
      // group now (no lock held here), so that no later op is launched on it;
      // the runner then fails this op's Work with the cause.
      runner->fail(std::make_exception_ptr(
          BackendError(str("[", who(), "] ", op, seq != 0 ? str(" #", seq) : std::string(), " failed to launch: ",
                           e.what()))));
    }
    auto self = this;
    WorkPtr work = runner->enqueue(seq, op, std::move(fp), opTimeout,
                                   [self, launched](Millis timeLimit, const CollectiveFingerprint&) {
                                     if (launched) self->watch(*launched, timeLimit);
                                   });
    if (launched && deviceWait) {
      work->setDeviceWait([done = launched->done, device] { done->block(cuda::currentStream(device)); });
    }
    if (launched) track(work);
    return work;
  }

  WorkPtr refuseClosing(const std::string& what) {
    const std::string description = str(what, " (", who(), ")");
    return Work::failed(description, std::make_exception_ptr(BackendError(
                                         str("[", who(), "] ", what, ": the group is being shut down; not launched"))));
  }

  void track(const WorkPtr& work) {
    std::lock_guard<std::mutex> lock(outstandingMutex);
    std::erase_if(outstanding, [](const std::weak_ptr<Work>& w) {
      const WorkPtr p = w.lock();
      return !p || p->isCompleted();
    });
    outstanding.push_back(work);
  }

  // Nothing launched is still waiting for its watcher: every tracked Work and
  // every send/recv is completed (or failed).
  bool drained() {
    {
      std::lock_guard<std::mutex> lock(outstandingMutex);
      for (const auto& w : outstanding) {
        if (const WorkPtr p = w.lock(); p && !p->isCompleted()) return false;
      }
    }
    std::lock_guard<std::mutex> lock(p2pMutex);
    return p2p.empty();
  }

  // ---- shutdown ----------------------------------------------------------------------------------

  // One communicator for nccl::closeCommunicators (comm_lifecycle.h).
  struct CommClose final : nccl::CommCloser {
    CommClose(Impl& impl, std::shared_ptr<NcclComm> comm) : impl(impl), c(std::move(comm)) {}
    bool idle() override {
      std::shared_ptr<cuda::Event> last;
      {
        std::lock_guard<std::mutex> lock(c->mutex);
        last = c->last;
      }
      if (!last || last->query()) return true;
      impl.checkAsync(*c);
      return false;
    }
    nccl::CallState finalize() override {
      // After a launch still enqueueing (NCCL takes no call before it is done).
      std::lock_guard<std::mutex> turn(c->launchMutex);
      std::lock_guard<std::mutex> lock(c->mutex);
      if (c->aborted) return nccl::CallState::Failed;
      cuda::DeviceGuard guard(c->device);
      return report("ncclCommFinalize", ncclCommFinalize(c->comm));
    }
    nccl::CallState state() override {
      std::lock_guard<std::mutex> lock(c->mutex);
      if (c->aborted) return nccl::CallState::Failed;
      ncclResult_t result = ncclSuccess;
      if (ncclCommGetAsyncError(c->comm, &result) != ncclSuccess) return nccl::CallState::Failed;
      return report("ncclCommFinalize (async)", result);
    }
    void destroy() override {
      std::lock_guard<std::mutex> lock(c->mutex);
      if (c->aborted) return;
      cuda::DeviceGuard guard(c->device);
      if (const ncclResult_t r = ncclCommDestroy(c->comm); r != ncclSuccess) {
        impl.runner->log()->warn("ncclCommDestroy on {}: {}", c->device.str(), ncclGetErrorString(r));
      }
      c->destroyed = true;
    }
    void abort() override { impl.abortOne(*c); }

    nccl::CallState report(const char* what, ncclResult_t result) {
      const nccl::CallState state = callState(result);
      if (state == nccl::CallState::Failed) {
        impl.runner->log()->warn("{} on {}: {}", what, c->device.str(), ncclText(result, c->comm));
      }
      return state;
    }
    Impl& impl;
    std::shared_ptr<NcclComm> c;
  };

  // Finalizes the communicators of a healthy group (after what is in flight
  // has completed) or aborts them; see nccl::closeCommunicators.
  void closeCommunicators() {
    const bool healthy = !runner->brokenCause() && !aborting();
    std::vector<std::unique_ptr<CommClose>> closers;
    std::vector<nccl::CommCloser*> all;
    for (auto& c : comms.made()) {
      closers.push_back(std::make_unique<CommClose>(*this, c));
      all.push_back(closers.back().get());
    }
    const nccl::CloseResult result = nccl::closeCommunicators(
        all, healthy, [this] { return drained(); }, [this] { return aborting() || runner->brokenCause() != nullptr; },
        Clock::now() + timeout, nccl::kShutdownPolling);
    if (!result.graceful && healthy) {
      runner->log()->warn("[{}] shutdown aborted the NCCL communicators instead of finalizing them: {}", who(),
                          result.reason);
    }
  }

  // ---- point to point ------------------------------------------------------------------------------

  // Sends and recvs, launched together in one NCCL group (so a batch that
  // both sends to and receives from a peer cannot deadlock), completing one
  // Work. `op` names the call in errors: "send", "recv", "batchIsendIrecv".
  WorkPtr post(const char* op, const std::vector<P2POp>& ops) {
    const CpuCallSite at = callSite(0);
    std::optional<Device> device;
    std::vector<Tensor> all;
    int64_t elements = 0;
    Millis limit{0};  // the longest of the ops' own limits (each defaults to the group's)
    for (const P2POp& p : ops) {
      if (p.tensors.empty()) rejectCall(at, op, "empty tensor list");
      checkList(at, op, p.tensors, "tensor", device);
      if (p.peer < 0 || p.peer >= size || p.peer == rank) {
        rejectCall(at, op, str("peer rank ", p.peer, " must be another rank of the group (size ", size, ")"));
      }
      if (p.tag != 0) {
        rejectCall(at, op, str("tag ", p.tag, ": NCCL has no tags (sends and recvs between two ranks match in issue "
                               "order); pass tag 0"));
      }
      for (const auto& t : p.tensors) elements += t.numel();
      all.insert(all.end(), p.tensors.begin(), p.tensors.end());
      limit = std::max(limit, p.timeout.value_or(timeout));
    }
    const std::string what =
        ops.size() == 1 ? str(op, ops[0].isSend ? " to rank " : " from rank ", runner->rankName(ops[0].peer), " (",
                              ops[0].tensors.size(), " tensor(s), ", elements, " elements)")
                        : str(op, " of ", ops.size(), " sends and recvs (", elements, " elements)");
    const std::string description = str(what, " (", who(), ")");
    if (WorkPtr rejected = runner->rejectIfUnusable(what, description)) return rejected;
    if (closing.load()) return refuseClosing(what);
    Launched l;
    try {
      l = launch(what, *device, all, limit, [&](ncclComm_t comm, cudaStream_t stream) {
        for (const P2POp& p : ops) {
          for (const auto& t : p.tensors) {
            const ncclDataType_t type = *ncclTypeOf(t.dtype());
            const size_t count = static_cast<size_t>(t.numel());
            void* data = const_cast<Tensor&>(t).dataPtr();
            const ncclResult_t r = p.isSend ? ncclSend(data, count, type, p.peer, comm, stream)
                                            : ncclRecv(data, count, type, p.peer, comm, stream);
            if (r != ncclSuccess && r != ncclInProgress) return r;
          }
        }
        return ncclSuccess;
      });
    } catch (const TimeoutError&) {
      runner->fail(std::current_exception());
      throw;
    } catch (const std::exception& e) {
      auto cause = std::make_exception_ptr(BackendError(str("[", who(), "] ", what, " failed: ", e.what())));
      runner->fail(cause);
      return Work::failed(description, cause);
    }
    auto work = std::make_shared<Work>(description);
    work->setDeviceWait([done = l.done, dev = *device] { done->block(cuda::currentStream(dev)); });
    {
      std::lock_guard<std::mutex> lock(p2pMutex);
      if (!p2pThread.joinable() && !p2pStopping) {
        p2pThread = std::thread([this, dev = *device] {
          setThreadName("dt-nccl-p2p");
          // Its device once, first: every CUDA call of this thread then finds a
          // context of this rank's GPU instead of making one on cuda:0.
          try {
            cuda::setCurrentDevice(dev.index);
          } catch (const std::exception& e) {
            runner->log()->warn("p2p watcher cannot make {} current: {}", dev.str(), e.what());
          }
          p2pLoop();
        });
      }
      p2p.push_back(WatchedP2P{std::move(l), work, Clock::now() + limit, limit, what});
    }
    p2pWake.notify_all();
    return work;
  }

  // Watches the posted sends and recvs: completes them as their events
  // complete; a deadline, an NCCL error or an abort fails them all.
  void p2pLoop() {
    auto pause = std::chrono::microseconds(10);
    std::unique_lock<std::mutex> lock(p2pMutex);
    while (true) {
      if (p2p.empty() && !p2pStopping) {
        p2pWake.wait(lock, [&] { return !p2p.empty() || p2pStopping; });
        pause = std::chrono::microseconds(10);
      }
      if (p2pStopping && p2p.empty()) return;
      std::vector<WorkPtr> completed;
      std::exception_ptr failure;
      bool sawAbort = false;
      for (auto it = p2p.begin(); it != p2p.end() && !failure && !sawAbort;) {
        try {
          LaunchedProbe probe(*this, it->op);
          const nccl::OpState state = nccl::pollOp(probe);
          if (state == nccl::OpState::Completed) {
            completed.push_back(it->work);
            it = p2p.erase(it);
            continue;
          }
          if (state == nccl::OpState::Aborted) {
            sawAbort = true;  // this one and every other outstanding one fail below
            break;
          }
        } catch (const std::exception& e) {
          failure = std::make_exception_ptr(BackendError(str("[", who(), "] ", it->what, " failed: ", e.what())));
          break;
        }
        if (Clock::now() >= it->deadline) {
          failure = std::make_exception_ptr(TimeoutError(str(
              "[", who(), "] ", it->what, " timed out after ", formatDuration(it->timeout),
              ": NCCL never completed it; did the peer post the matching ", it->work->description().rfind("send", 0) == 0
                                                                                 ? "recv"
                                                                                 : "send",
              ", and does every rank order its sends, recvs and collectives alike? [the group is broken now]")));
        }
        ++it;
      }
      if (!failure && (sawAbort || aborting() || p2pStopping)) {
        std::exception_ptr cause = runner->brokenCause();
        failure = cause ? withPrefix(cause, str("[", who(), "] aborted: the group is broken since "))
                        : std::make_exception_ptr(BackendError(str("[", who(), "] the group was shut down")));
      }
      std::vector<std::pair<WorkPtr, std::exception_ptr>> failed;
      if (failure) {
        for (auto& w : p2p) failed.emplace_back(w.work, failure);
        p2p.clear();
      }
      lock.unlock();
      for (auto& w : completed) Work::markCompleted(w);
      if (failure) {
        runner->fail(failure);  // aborts the communicators (no-op when already aborted)
        for (auto& [w, e] : failed) Work::markFailed(w, e);
      }
      if (completed.empty()) {
        std::this_thread::sleep_for(pause);
        pause = std::min<std::chrono::microseconds>(pause * 2, options.pollInterval);
      } else {
        pause = std::chrono::microseconds(10);
      }
      lock.lock();
    }
  }

  void stopP2P() {
    {
      std::lock_guard<std::mutex> lock(p2pMutex);
      p2pStopping = true;
    }
    p2pWake.notify_all();
    std::lock_guard<std::mutex> join(p2pJoinMutex);
    if (p2pThread.joinable()) p2pThread.join();
  }

  // The device of a barrier (no tensor says it): see nccl::chooseDevice.
  Device deviceForBarrier(const CpuCallSite& at) const {
    nccl::DeviceHints hints;
    if (options.device) {
      if (!options.device->isCuda()) {
        rejectCall(at, "barrier", str("NcclBackendOptions::device is ", options.device->str(),
                                      "; the nccl backend needs a CUDA device (Device::cuda(i))"));
      }
      hints.bound = options.device->index;
    }
    if (const int last = lastDevice.load(); last >= 0) hints.lastUsed = last;
    hints.current = cuda::currentDevice();
    hints.currentHasContext = cuda::primaryContextActive(hints.current);
    hints.localRank = localRank;
    hints.deviceCount = cuda::deviceCount();
    hints.groupSize = size;
    const nccl::DeviceChoice choice = nccl::chooseDevice(hints);
    if (!choice.device) rejectCall(at, "barrier", choice.why);
    runner->log()->debug("barrier on {}", choice.why);
    return Device::cuda(*choice.device);
  }
};

// ---- construction ------------------------------------------------------------------------------------

NcclBackend::NcclBackend(StorePtr store, int rank, int size, NcclBackendOptions options)
    : impl_(std::make_unique<Impl>()) {
  DT_REQUIRE(store != nullptr, "NcclBackend: store is null");
  DT_REQUIRE(size >= 1, "NcclBackend: group size must be >= 1, got ", size);
  DT_REQUIRE(rank >= 0 && rank < size, "NcclBackend: rank ", rank, " is outside the group of size ", size);
  auto& d = *impl_;
  d.rank = rank;
  d.size = size;
  d.options = std::move(options);
  d.timeout = d.options.resolvedTimeout();
  d.localRank = localRankFromEnvironment();
  // Under "nccl/" so that its progress keys do not collide with the CPU
  // backend's of the same group (each has its own ProgressTracker).
  d.store = std::make_shared<PrefixStore>("nccl", std::move(store));
  d.runner = std::make_unique<CollectiveRunner>(d.store, rank, size, d.options.runnerOptions("nccl"),
                                                [impl = impl_.get()] { impl->abortAll(); });
}

NcclBackend::~NcclBackend() { shutdown(); }

int NcclBackend::rank() const { return impl_->rank; }
int NcclBackend::size() const { return impl_->size; }

std::exception_ptr NcclBackend::brokenCause() const { return impl_->runner->brokenCause(); }

void NcclBackend::abort(std::exception_ptr cause) { impl_->runner->fail(cause); }

void NcclBackend::shutdown() {
  auto& d = *impl_;
  if (!d.runner) return;
  // A healthy group finishes what is in flight and finalizes; a broken one
  // aborts (ops still on the GPU end before their Works fail and drop the
  // tensors they write into; aborting never waits for a peer that is gone).
  if (!d.closing.exchange(true)) d.closeCommunicators();
  // Then the flag for everything else: a communicator still being created
  // gives up, the destroyed ones are skipped.
  d.abortAll();
  d.stopP2P();
  d.runner->shutdown();
}

// ---- ops ------------------------------------------------------------------------------------------

namespace {

size_t countOf(const Tensor& t) { return static_cast<size_t>(t.numel()); }
void* dataOf(const Tensor& t) { return const_cast<Tensor&>(t).dataPtr(); }

CollectiveFingerprint fingerprintOf(const std::vector<Tensor>& tensors, std::optional<ReduceOp> op = std::nullopt,
                                    std::optional<int> root = std::nullopt) {
  CollectiveFingerprint fp;
  fp.tensors = signatures(tensors);
  fp.reduceOp = op;
  fp.root = root;
  return fp;
}

}  // namespace

WorkPtr NcclBackend::allreduce(const std::vector<Tensor>& tensors, const AllreduceOptions& options) {
  auto& d = *impl_;
  const auto at = d.callSite(options.seq);
  if (tensors.empty()) rejectCall(at, "allreduce", "empty tensor list");
  std::optional<Device> device;
  d.checkList(at, "allreduce", tensors, "tensor", device, options.reduceOp);
  const ncclRedOp_t op = ncclOpOf(options.reduceOp);
  return d.collective("allreduce", options.seq, fingerprintOf(tensors, options.reduceOp), options.timeout, *device,
                      tensors, true, [&](ncclComm_t comm, cudaStream_t stream) {
                        for (const auto& t : tensors) {
                          const ncclResult_t r = ncclAllReduce(dataOf(t), dataOf(t), countOf(t), *ncclTypeOf(t.dtype()),
                                                               op, comm, stream);
                          if (r != ncclSuccess && r != ncclInProgress) return r;
                        }
                        return ncclSuccess;
                      });
}

WorkPtr NcclBackend::reduce(const std::vector<Tensor>& tensors, const ReduceOptions& options) {
  auto& d = *impl_;
  const auto at = d.callSite(options.seq);
  if (tensors.empty()) rejectCall(at, "reduce", "empty tensor list");
  d.checkRoot(at, "reduce", options.root);
  std::optional<Device> device;
  d.checkList(at, "reduce", tensors, "tensor", device, options.reduceOp);
  const ncclRedOp_t op = ncclOpOf(options.reduceOp);
  const int root = options.root;
  // NCCL writes recvbuff on the root only ("ignored for other ranks"), so
  // every rank passes its tensor as both buffers and the others keep theirs.
  return d.collective("reduce", options.seq, fingerprintOf(tensors, options.reduceOp, root), options.timeout, *device,
                      tensors, true, [&](ncclComm_t comm, cudaStream_t stream) {
                        for (const auto& t : tensors) {
                          const ncclResult_t r =
                              ncclReduce(dataOf(t), dataOf(t), countOf(t), *ncclTypeOf(t.dtype()), op, root, comm, stream);
                          if (r != ncclSuccess && r != ncclInProgress) return r;
                        }
                        return ncclSuccess;
                      });
}

WorkPtr NcclBackend::broadcast(const std::vector<Tensor>& tensors, const BroadcastOptions& options) {
  auto& d = *impl_;
  const auto at = d.callSite(options.seq);
  if (tensors.empty()) rejectCall(at, "broadcast", "empty tensor list");
  d.checkRoot(at, "broadcast", options.root);
  std::optional<Device> device;
  d.checkList(at, "broadcast", tensors, "tensor", device);
  const int root = options.root;
  return d.collective("broadcast", options.seq, fingerprintOf(tensors, std::nullopt, root), options.timeout, *device,
                      tensors, true, [&](ncclComm_t comm, cudaStream_t stream) {
                        for (const auto& t : tensors) {
                          const ncclResult_t r = ncclBroadcast(dataOf(t), dataOf(t), countOf(t), *ncclTypeOf(t.dtype()),
                                                               root, comm, stream);
                          if (r != ncclSuccess && r != ncclInProgress) return r;
                        }
                        return ncclSuccess;
                      });
}

WorkPtr NcclBackend::allgather(const std::vector<Tensor>& outputs, const Tensor& input, const AllgatherOptions& options) {
  auto& d = *impl_;
  const auto at = d.callSite(options.seq);
  std::optional<Device> device;
  d.checkTensor(at, "allgather", input, "the input", device);
  d.checkCount(at, "allgather", outputs, "output");
  d.checkList(at, "allgather", outputs, "output", device);
  d.checkLike(at, "allgather", outputs, input, "output", "input");
  std::vector<Tensor> keep = outputs;
  keep.push_back(input);
  // One ncclAllGather (on a ring every byte crosses each link once, in one
  // pipelined kernel) instead of one broadcast per rank. It needs one flat
  // output: outputs that already lie back to back (views of one buffer, in
  // order) are gathered into in place; otherwise into a staging buffer,
  // copied out on the NCCL stream once NCCL has enqueued the op.
  const size_t bytes = input.nbytes();
  bool backToBack = true;
  for (int r = 0; r < d.size; ++r) {
    if (static_cast<char*>(dataOf(outputs[r])) != static_cast<char*>(dataOf(outputs[0])) + r * bytes) {
      backToBack = false;
    }
  }
  Tensor flat = backToBack ? outputs[0] : empty({static_cast<int64_t>(d.size) * input.numel()}, input.dtype(), *device);
  if (!backToBack) keep.push_back(flat);
  AfterEnqueue copyOut;
  if (!backToBack && bytes > 0) {
    copyOut = [&](cudaStream_t stream) {
      for (int r = 0; r < d.size; ++r) {
        if (cudaMemcpyAsync(dataOf(outputs[r]), static_cast<const char*>(dataOf(flat)) + r * bytes, bytes,
                            cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
          return false;
        }
      }
      return true;
    };
  }
  return d.collective(
      "allgather", options.seq, fingerprintOf({input}), options.timeout, *device, std::move(keep), true,
      [&](ncclComm_t comm, cudaStream_t stream) {
        return ncclAllGather(dataOf(input), dataOf(flat), countOf(input), *ncclTypeOf(input.dtype()), comm, stream);
      },
      copyOut);
}

WorkPtr NcclBackend::allgatherIntoTensor(const Tensor& output, const Tensor& input, const AllgatherOptions& options) {
  auto& d = *impl_;
  const auto at = d.callSite(options.seq);
  std::optional<Device> device;
  d.checkTensor(at, "allgatherIntoTensor", input, "the input", device);
  d.checkTensor(at, "allgatherIntoTensor", output, "the output", device);
  if (output.dtype() != input.dtype() || output.numel() != input.numel() * d.size) {
    rejectCall(at, "allgatherIntoTensor", str("output ", output.describe(), " must hold ", d.size, " x ", input.numel(),
                                              " ", toString(input.dtype()), " elements (group size x input ",
                                              input.describe(), ")"));
  }
  return d.collective("allgatherIntoTensor", options.seq, fingerprintOf({input}), options.timeout, *device,
                      {output, input}, true, [&](ncclComm_t comm, cudaStream_t stream) {
                        return ncclAllGather(dataOf(input), dataOf(output), countOf(input), *ncclTypeOf(input.dtype()),
                                             comm, stream);
                      });
}

WorkPtr NcclBackend::reduceScatter(const Tensor& output, const std::vector<Tensor>& inputs,
                                   const ReduceScatterOptions& options) {
  auto& d = *impl_;
  const auto at = d.callSite(options.seq);
  std::optional<Device> device;
  d.checkTensor(at, "reduceScatter", output, "the output", device, options.reduceOp);
  d.checkCount(at, "reduceScatter", inputs, "input");
  d.checkList(at, "reduceScatter", inputs, "input", device);
  d.checkLike(at, "reduceScatter", inputs, output, "input", "output");
  const ncclRedOp_t op = ncclOpOf(options.reduceOp);
  // NCCL reduce-scatters one flat buffer: the inputs are copied into one on
  // the NCCL stream (after the caller's stream, so they are ready).
  Tensor flat = empty({static_cast<int64_t>(d.size) * output.numel()}, output.dtype(), output.device());
  std::vector<Tensor> keep = inputs;
  keep.push_back(output);
  keep.push_back(flat);
  const size_t bytes = output.nbytes();
  return d.collective("reduceScatter", options.seq, fingerprintOf({output}, options.reduceOp), options.timeout, *device,
                      std::move(keep), true, [&](ncclComm_t comm, cudaStream_t stream) {
                        for (int r = 0; r < d.size; ++r) {
                          if (bytes == 0) break;
                          if (cudaMemcpyAsync(static_cast<char*>(dataOf(flat)) + r * bytes, dataOf(inputs[r]), bytes,
                                              cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
                            return ncclUnhandledCudaError;
                          }
                        }
                        return ncclReduceScatter(dataOf(flat), dataOf(output), countOf(output),
                                                 *ncclTypeOf(output.dtype()), op, comm, stream);
                      });
}

WorkPtr NcclBackend::reduceScatterTensor(const Tensor& output, const Tensor& input, const ReduceScatterOptions& options) {
  auto& d = *impl_;
  const auto at = d.callSite(options.seq);
  std::optional<Device> device;
  d.checkTensor(at, "reduceScatterTensor", output, "the output", device, options.reduceOp);
  d.checkTensor(at, "reduceScatterTensor", input, "the input", device);
  if (output.dtype() != input.dtype() || input.numel() != output.numel() * d.size) {
    rejectCall(at, "reduceScatterTensor", str("input ", input.describe(), " must hold ", d.size, " x ", output.numel(),
                                              " ", toString(output.dtype()), " elements (group size x output ",
                                              output.describe(), ")"));
  }
  const ncclRedOp_t op = ncclOpOf(options.reduceOp);
  return d.collective("reduceScatterTensor", options.seq, fingerprintOf({output}, options.reduceOp), options.timeout,
                      *device, {output, input}, true, [&](ncclComm_t comm, cudaStream_t stream) {
                        return ncclReduceScatter(dataOf(input), dataOf(output), countOf(output),
                                                 *ncclTypeOf(output.dtype()), op, comm, stream);
                      });
}

WorkPtr NcclBackend::allToAll(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                              const AllToAllOptions& options) {
  auto& d = *impl_;
  const auto at = d.callSite(options.seq);
  std::optional<Device> device;
  d.checkCount(at, "allToAll", inputs, "input");
  d.checkCount(at, "allToAll", outputs, "output");
  d.checkList(at, "allToAll", inputs, "input", device);
  d.checkList(at, "allToAll", outputs, "output", device);
  for (const auto& t : inputs) {
    if (t.dtype() != inputs[0].dtype()) rejectCall(at, "allToAll", "inputs must share one dtype");
  }
  for (const auto& t : outputs) {
    if (t.dtype() != inputs[0].dtype()) {
      rejectCall(at, "allToAll", str("output ", t.describe(), " has another dtype than input ", inputs[0].describe()));
    }
  }
  std::vector<Tensor> keep = outputs;
  keep.insert(keep.end(), inputs.begin(), inputs.end());
  // Sizes per peer are the callers' to match (as on the CPU backends); NCCL
  // itself cannot tell a mismatch, which hangs until the op's timeout.
  return d.collective("allToAll", options.seq, fingerprintOf(inputs), options.timeout, *device, std::move(keep), true,
                      [&](ncclComm_t comm, cudaStream_t stream) {
                        const ncclDataType_t type = *ncclTypeOf(inputs[0].dtype());
                        for (int r = 0; r < d.size; ++r) {
                          ncclResult_t res = ncclSend(dataOf(inputs[r]), countOf(inputs[r]), type, r, comm, stream);
                          if (res != ncclSuccess && res != ncclInProgress) return res;
                          res = ncclRecv(dataOf(outputs[r]), countOf(outputs[r]), type, r, comm, stream);
                          if (res != ncclSuccess && res != ncclInProgress) return res;
                        }
                        return ncclSuccess;
                      });
}

WorkPtr NcclBackend::allToAllSingle(const Tensor& output, const Tensor& input, const std::vector<int64_t>& outputSplits,
                                    const std::vector<int64_t>& inputSplits, const AllToAllOptions& options) {
  auto& d = *impl_;
  const auto at = d.callSite(options.seq);
  std::optional<Device> device;
  d.checkTensor(at, "allToAllSingle", input, "the input", device);
  d.checkTensor(at, "allToAllSingle", output, "the output", device);
  if (input.dim() == 0 || output.dim() == 0) rejectCall(at, "allToAllSingle", "input and output need a dim 0 to split along");
  const Shape rowIn(input.sizes().begin() + 1, input.sizes().end());
  const Shape rowOut(output.sizes().begin() + 1, output.sizes().end());
  if (input.dtype() != output.dtype() || rowIn != rowOut) {
    rejectCall(at, "allToAllSingle", str("output ", output.describe(), " and input ", input.describe(),
                                         " need one dtype and the same sizes after dim 0"));
  }
  auto resolve = [&](const std::vector<int64_t>& splits, int64_t rows, const char* what) {
    if (splits.empty()) {
      if (rows % d.size != 0) {
        rejectCall(at, "allToAllSingle", str(what, " has ", rows, " rows along dim 0, which ", d.size,
                                             " ranks cannot share equally; pass split sizes"));
      }
      return std::vector<int64_t>(static_cast<size_t>(d.size), rows / d.size);
    }
    if (static_cast<int>(splits.size()) != d.size) {
      rejectCall(at, "allToAllSingle", str(what, " split sizes list ", splits.size(), " entries for a group of size ",
                                           d.size));
    }
    int64_t total = 0;
    for (int64_t s : splits) {
      if (s < 0) {
        rejectCall(at, "allToAllSingle", str(what, " split sizes [", join(splits, ", "), "] has a negative entry"));
      }
      total += s;
    }
    if (total != rows) {
      rejectCall(at, "allToAllSingle", str(what, " split sizes [", join(splits, ", "), "] add up to ", total,
                                           " rows, but the ", what, " has ", rows, " along dim 0"));
    }
    return splits;
  };
  const auto sendRows = resolve(inputSplits, input.size(0), "input");
  const auto recvRows = resolve(outputSplits, output.size(0), "output");
  const size_t rowElems = static_cast<size_t>(shapeNumel(rowIn));
  const size_t width = itemSize(input.dtype());
  return d.collective("allToAllSingle", options.seq, fingerprintOf({input}), options.timeout, *device, {output, input},
                      true, [&](ncclComm_t comm, cudaStream_t stream) {
                        const ncclDataType_t type = *ncclTypeOf(input.dtype());
                        size_t sendOffset = 0, recvOffset = 0;
                        for (int r = 0; r < d.size; ++r) {
                          const size_t sendCount = static_cast<size_t>(sendRows[r]) * rowElems;
                          const size_t recvCount = static_cast<size_t>(recvRows[r]) * rowElems;
                          ncclResult_t res = ncclSend(static_cast<const char*>(dataOf(input)) + sendOffset * width,
                                                      sendCount, type, r, comm, stream);
                          if (res != ncclSuccess && res != ncclInProgress) return res;
                          res = ncclRecv(static_cast<char*>(dataOf(output)) + recvOffset * width, recvCount, type, r,
                                         comm, stream);
                          if (res != ncclSuccess && res != ncclInProgress) return res;
                          sendOffset += sendCount;
                          recvOffset += recvCount;
                        }
                        return ncclSuccess;
                      });
}

WorkPtr NcclBackend::gather(const std::vector<Tensor>& outputs, const Tensor& input, const GatherOptions& options) {
  auto& d = *impl_;
  const auto at = d.callSite(options.seq);
  d.checkRoot(at, "gather", options.root);
  std::optional<Device> device;
  d.checkTensor(at, "gather", input, "the input", device);
  const int root = options.root;
  if (d.rank == root) {
    d.checkCount(at, "gather", outputs, "output");
    d.checkList(at, "gather", outputs, "output", device);
    d.checkLike(at, "gather", outputs, input, "output", "input");
  } else if (!outputs.empty()) {
    rejectCall(at, "gather", str("only the root (rank ", root, ") passes outputs; this rank passed ", outputs.size()));
  }
  std::vector<Tensor> keep = outputs;
  keep.push_back(input);
  return d.collective("gather", options.seq, fingerprintOf({input}, std::nullopt, root), options.timeout, *device,
                      std::move(keep), true, [&](ncclComm_t comm, cudaStream_t stream) {
                        const ncclDataType_t type = *ncclTypeOf(input.dtype());
                        if (d.rank != root) return ncclSend(dataOf(input), countOf(input), type, root, comm, stream);
                        for (int r = 0; r < d.size; ++r) {
                          if (r == root) {
                            if (input.nbytes() > 0 &&
                                cudaMemcpyAsync(dataOf(outputs[r]), dataOf(input), input.nbytes(),
                                                cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
                              return ncclUnhandledCudaError;
                            }
                            continue;
                          }
                          const ncclResult_t res = ncclRecv(dataOf(outputs[r]), countOf(input), type, r, comm, stream);
                          if (res != ncclSuccess && res != ncclInProgress) return res;
                        }
                        return ncclSuccess;
                      });
}

WorkPtr NcclBackend::scatter(const Tensor& output, const std::vector<Tensor>& inputs, const ScatterOptions& options) {
  auto& d = *impl_;
  const auto at = d.callSite(options.seq);
  d.checkRoot(at, "scatter", options.root);
  std::optional<Device> device;
  d.checkTensor(at, "scatter", output, "the output", device);
  const int root = options.root;
  if (d.rank == root) {
    d.checkCount(at, "scatter", inputs, "input");
    d.checkList(at, "scatter", inputs, "input", device);
    d.checkLike(at, "scatter", inputs, output, "input", "output");
  } else if (!inputs.empty()) {
    rejectCall(at, "scatter", str("only the root (rank ", root, ") passes inputs; this rank passed ", inputs.size()));
  }
  std::vector<Tensor> keep = inputs;
  keep.push_back(output);
  return d.collective("scatter", options.seq, fingerprintOf({output}, std::nullopt, root), options.timeout, *device,
                      std::move(keep), true, [&](ncclComm_t comm, cudaStream_t stream) {
                        const ncclDataType_t type = *ncclTypeOf(output.dtype());
                        if (d.rank != root) return ncclRecv(dataOf(output), countOf(output), type, root, comm, stream);
                        for (int r = 0; r < d.size; ++r) {
                          if (r == root) {
                            if (output.nbytes() > 0 &&
                                cudaMemcpyAsync(dataOf(output), dataOf(inputs[r]), output.nbytes(),
                                                cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
                              return ncclUnhandledCudaError;
                            }
                            continue;
                          }
                          const ncclResult_t res = ncclSend(dataOf(inputs[r]), countOf(output), type, r, comm, stream);
                          if (res != ncclSuccess && res != ncclInProgress) return res;
                        }
                        return ncclSuccess;
                      });
}

WorkPtr NcclBackend::barrier(const BarrierOptions& options) {
  auto& d = *impl_;
  const Device device = d.deviceForBarrier(d.callSite(options.seq));
  Tensor one = empty({1}, DType::Float32, device);
  // No device wait: a barrier's wait() holds the host until every rank arrived.
  return d.collective("barrier", options.seq, CollectiveFingerprint{}, options.timeout, device, {one}, false,
                      [&](ncclComm_t comm, cudaStream_t stream) {
                        return ncclAllReduce(dataOf(one), dataOf(one), 1, ncclFloat32, ncclSum, comm, stream);
                      });
}

WorkPtr NcclBackend::monitoredBarrier(const BarrierOptions& options) {
  return impl_->runner->monitoredBarrier(options.seq, options.timeout);
}

WorkPtr NcclBackend::send(const std::vector<Tensor>& tensors, int dstRank, const SendOptions& options) {
  return impl_->post("send", {P2POp{true, tensors, dstRank, options.tag, options.timeout}});
}

WorkPtr NcclBackend::recv(const std::vector<Tensor>& tensors, int srcRank, const RecvOptions& options) {
  return impl_->post("recv", {P2POp{false, tensors, srcRank, options.tag, options.timeout}});
}

WorkPtr NcclBackend::batchIsendIrecv(const std::vector<P2POp>& ops) {
  checkBatch(ops);
  return impl_->post("batchIsendIrecv", ops);
}

}  // namespace dt
