#include "process_group/gloo/gloo_backend.h"

#include <dlfcn.h>

#include <cstring>
#include <typeinfo>

#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/gather.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/scatter.h>
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
#include "common/thread_name.h"
#include "process_group/gloo/allreduce_algorithms.h"
#include "process_group/gloo/store_adapter.h"
#include "process_group/gloo/transfer_type.h"
#include "process_group/collective_runner.h"
#include "process_group/cpu_tensors.h"
#include "store/prefix_store.h"

namespace dt {

// The group's Gloo context, able to fail this rank's own pending transfers.
//
// Gloo fails every pending send and recv of every pair when one of its own
// waits times out (tcp::Context::signalException); that call is protected,
// and its header does not build from Debian's package (it includes
// gloo/common/memory.h, which the package does not ship). An abort needs
// it: closing this rank's connections ends the peers' waits, but not its own,
// since a closed socket reports nothing more. So dtrain calls the function
// Gloo exports, by its symbol, on a context whose dynamic type it checked,
// and falls back to closing only (waits on live peers then end at their
// timeout) when either is not as expected.
class AbortableContext final : public gloo::rendezvous::Context {
 public:
  using gloo::rendezvous::Context::Context;
  bool failPendingTransfers(const std::string& why) {
    using Signal = void (*)(void* self, const std::string& message);
    static const Signal signal = [] {
      Signal fn = nullptr;
      void* symbol = ::dlsym(RTLD_DEFAULT,
                             "_ZN4gloo9transport3tcp7Context15signalExceptionERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");
      static_assert(sizeof fn == sizeof symbol);
      std::memcpy(&fn, &symbol, sizeof fn);
      return fn;
    }();
    gloo::transport::Context* transport = transportContext_.get();
    // tcp::Context's first base is transport::Context: the same address.
    if (signal == nullptr || transport == nullptr ||
        std::strcmp(typeid(*transport).name(), "N4gloo9transport3tcp7ContextE") != 0) {
      return false;
    }
    signal(transport, why);
    return true;
  }
};

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

// One posted send or recv, waited for on the p2p thread.
struct P2PTask {
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
  bool isSend = true;
  Clock::time_point deadline;
  Tensor staging;                 // keeps the transferred memory alive
  std::vector<Tensor> copyBackTo; // recv into strided/several tensors
  WorkPtr work;
  std::string what;               // "send to rank 1 (tag 3)"
  int peer = -1;
};

}  // namespace

struct GlooBackend::Impl {
  StorePtr store;  // the group's scope
  int rank;
  int size;
  GlooBackendOptions options;
  Millis timeout;
  Logger log;
  std::shared_ptr<AbortableContext> context;
  GlooAllreduceAlgorithm allreduceAlgorithm = GlooAllreduceAlgorithm::Auto;
  std::vector<uint8_t> scratch;  // the worker thread's receive space for allreduce
  std::unique_ptr<CollectiveRunner> runner;

  std::mutex p2pMutex;              // guards the p2p queue
  std::condition_variable p2pWake;  // the p2p waiter
  std::deque<P2PTask> p2pQueue;
  bool p2pStopping = false;
  std::mutex p2pJoinMutex;  // shutdown() may run on several threads at once: one joins
  std::thread p2pWorker;

  std::string whoText;  // "rank 1/4 pg=default gloo", made once: who() is on every op's path
  const std::string& who() const { return whoText; }
  CpuCallSite callSite(uint64_t seq) const { return CpuCallSite{who(), "gloo", rank, size, seq}; }

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
    context = std::make_shared<AbortableContext>(rank, size);
    context->setTimeout(timeout);
    auto glooScope = std::make_shared<PrefixStore>("gloo", store);
    GlooStoreAdapter adapter(glooScope, timeout);
    try {
      context->connectFullMesh(adapter, device);
      // A rank's side of a pair is connected before its peer's side knows it:
      // a rank that returned and closed the group at once (create, then
      // destroy) would fail the peer's connect with "closed by peer". Nobody
      // leaves until every rank holds all its pairs.
      storeBarrier(*glooScope, "connected", rank, size, timeout);
    } catch (const dt::Error&) {
      std::rethrow_exception(withPrefix(std::current_exception(), str("[", who(), "] connecting the group failed: ")));
    } catch (const std::exception& e) {
      throw BackendError(str("[", who(), "] connecting the group's full mesh failed: ", glooMessage(e),
                             " (timeout ", formatDuration(timeout), ")"));
    }
  }

  // Queues a collective on the runner; Gloo's exceptions become the runner's
  // words for a timeout or a lost peer.
  WorkPtr enqueue(uint64_t seq, const char* op, CollectiveFingerprint fingerprint, const OpTimeout& opTimeout,
                  std::function<void(Impl&, Millis)> run) {
    return runner->enqueue(seq, op, std::move(fingerprint), opTimeout, [this, run = std::move(run)](Millis limit, const CollectiveFingerprint&) {
      try {
        run(*this, limit);
      } catch (const gloo::IoException& e) {
        const std::string message = glooMessage(e);
        if (message.find("Timed out") != std::string::npos) throw TransportTimeout(message);
        throw PeerLost(message);
      } catch (const dt::Error&) {
        throw;
      } catch (const std::exception& e) {
        throw BackendError(glooMessage(e));
      }
    });
  }

  void p2pLoop() {
    std::unique_lock<std::mutex> lock(p2pMutex);
    while (true) {
      p2pWake.wait(lock, [&] { return p2pStopping || !p2pQueue.empty(); });
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
        // After an abort the connections were closed on purpose: its cause is the reason.
        failure = runner->brokenCause() ? withPrefix(runner->brokenCause(), str("[", who(), "] ", task.what, " failed: "))
                                        : p2pFailure(task.what, task.peer, std::current_exception());
      }
      if (failure) {
        // The first failure breaks the group and closes the connections, so
        // that a timed-out posted buffer can no longer be written.
        runner->fail(failure);
        Work::markFailed(task.work, failure);
      } else {
        Work::markCompleted(task.work);
      }
      lock.lock();
    }
  }

  // What a failed send/recv ("send to rank 1 (tag 3, ...)") reports. A connection the peer
  // closed may be a live peer that failed first and closed its connections (its report, which
  // it published before closing, names the cause) or a dead one.
  std::exception_ptr p2pFailure(const std::string& what, int peer, std::exception_ptr error) const {
    try {
      std::rethrow_exception(error);
    } catch (const gloo::IoException& e) {
      const std::string message = glooMessage(e);
      if (message.find("Timed out") != std::string::npos) {
        return std::make_exception_ptr(TimeoutError(
            str("[", who(), "] ", what, " timed out: ", message, ". Did the peer post the matching call?")));
      }
      const std::string peerSaid = runner->noteP2PFailure(str(what, " failed: ", message), peer);
      return std::make_exception_ptr(BackendError(str("[", who(), "] ", what, " failed: ", message,
                                                      peerSaid.empty() ? " (peer exited or unreachable?)" : "; " + peerSaid)));
    } catch (const std::exception& e) {
      return std::make_exception_ptr(BackendError(str("[", who(), "] ", what, " failed: ", glooMessage(e))));
    }
  }

  void closeConnections() {
    try {
      if (context) {
        // Closing ends the peers' waits; this rank's own need their transfers failed.
        if (!context->failPendingTransfers("dtrain aborted the group's transfers")) {
          log->debug("cannot fail Gloo's pending transfers (symbol or context type not as expected); "
                     "waits on live peers end at their timeout");
        }
        context->closeConnections();
      }
    } catch (const std::exception& e) {
      log->debug("closing connections: {}", e.what());
    }
  }

  // ---- transfers (run on the worker thread) ----------------------------------------------
  uint32_t tagFor(uint64_t seq) const { return static_cast<uint32_t>(seq & 0xffffffffu); }

  uint32_t currentTag() const { return tagFor(runner->progress().lastStarted()); }

  // out holds size blocks of `bytes`; this rank's is already in place.
  void allgatherInPlace(uint8_t* out, size_t bytes, Millis timeout) {
    if (bytes == 0 || size == 1) return;
    gloo::AllgatherOptions opts(context);
    opts.setInput(out + bytes * rank, bytes);
    opts.setOutput(out, bytes * size);
    opts.setTag(currentTag());
    opts.setTimeout(timeout);
    gloo::allgather(opts);
  }

  // Block j of `send` (size blocks of `output`'s bytes) goes to rank j, which
  // reduces the blocks it receives into `output`. All-to-all moves the bytes
  // of a ring reduce-scatter, then each rank reduces locally.
  void reduceScatterBlocks(const uint8_t* send, const Tensor& output, ReduceOp op, Millis timeout) {
    const size_t bytes = output.nbytes();
    const size_t count = static_cast<size_t>(output.numel());
    if (bytes == 0) return;
    std::vector<uint8_t> recvBuf(bytes * size);
    if (size > 1) {
      gloo::AlltoallOptions opts(context);
      opts.setInput(const_cast<uint8_t*>(send), recvBuf.size());
      opts.setOutput(recvBuf.data(), recvBuf.size());
      opts.setTag(currentTag());
      opts.setTimeout(timeout);
      gloo::alltoall(opts);
    } else {
      std::memcpy(recvBuf.data(), send, bytes);
    }
    const ReduceFn fn = reduceFunction(output.dtype(), op);
    for (int r = 1; r < size; ++r) fn(recvBuf.data(), recvBuf.data(), recvBuf.data() + bytes * r, count);
    if (op == ReduceOp::Avg) divideBy(output.dtype(), recvBuf.data(), count, size);
    Tensor out = output;
    copyFromBytes(recvBuf.data(), out);
  }

  // send/recv: byte counts per rank, blocks back to back.
  void allToAllBytes(uint8_t* send, std::vector<int64_t> sendCounts, uint8_t* recv, std::vector<int64_t> recvCounts,
                     Millis timeout) {
    if (size == 1) {
      if (sendCounts[0] != recvCounts[0]) {
        throw InvalidArgument(str("allToAll on one rank: the input holds ", sendCounts[0], " bytes, the output ",
                                  recvCounts[0]));
      }
      if (sendCounts[0] > 0) std::memcpy(recv, send, static_cast<size_t>(sendCounts[0]));
      return;
    }
    // Gloo wants valid pointers even for empty buffers.
    uint8_t dummy[1];
    gloo::AlltoallvOptions opts(context);
    opts.setInput(send != nullptr ? send : dummy, std::move(sendCounts));
    opts.setOutput(recv != nullptr ? recv : dummy, std::move(recvCounts));
    opts.setTag(currentTag());
    opts.setTimeout(timeout);
    gloo::alltoallv(opts);
  }

  void allreduceBuffer(void* data, size_t count, DType dtype, ReduceOp op, Millis opTimeout, uint32_t tag) {
    if (count == 0) return;
    const size_t width = itemSize(dtype);
    const auto algorithm = chooseAllreduceAlgorithm(allreduceAlgorithm, count * width, size);
    runAllreduce(algorithm, {context, data, count, width, reduceFunction(dtype, op), opTimeout, tag, scratch});
    if (op == ReduceOp::Avg) divideBy(dtype, data, count, size);
  }
};


GlooBackend::GlooBackend(StorePtr store, int rank, int size, GlooBackendOptions options)
    : impl_(std::make_unique<Impl>()) {
  DT_REQUIRE(store != nullptr, "GlooBackend: store is null");
  DT_REQUIRE(size >= 1, "GlooBackend: group size must be >= 1, got ", size);
  DT_REQUIRE(rank >= 0 && rank < size, "GlooBackend: rank ", rank, " is outside the group of size ", size);
  auto& d = *impl_;
  d.store = std::move(store);
  d.rank = rank;
  d.size = size;
  d.options = std::move(options);
  d.whoText = str("rank ", rank, "/", size, " pg=", d.options.groupName, " gloo");
  d.timeout = d.options.resolvedTimeout();
  d.allreduceAlgorithm = d.options.allreduceAlgorithm
                             ? *d.options.allreduceAlgorithm
                             : parseGlooAllreduceAlgorithm(env::getString("DT_GLOO_ALLREDUCE"), "DT_GLOO_ALLREDUCE");
  d.log = makeLogger("process_group", str("rank ", rank, "/", size, " pg=", d.options.groupName));
  // Gloo's event-loop thread (started in connect) and the two workers keep
  // SIGPIPE blocked for good: they are the threads that write to Gloo's sockets.
  SigpipeBlocked noSigpipe;
  d.connect();
  d.runner = std::make_unique<CollectiveRunner>(d.store, rank, size, d.options.runnerOptions("gloo"), [impl = impl_.get()] {
    impl->closeConnections();
  });
  d.p2pWorker = std::thread([this] {
    setThreadName("dt-gloo-p2p");
    impl_->p2pLoop();
  });
}

GlooBackend::~GlooBackend() { shutdown(); }

int GlooBackend::rank() const { return impl_->rank; }
int GlooBackend::size() const { return impl_->size; }

std::exception_ptr GlooBackend::brokenCause() const { return impl_->runner->brokenCause(); }

void GlooBackend::abort(std::exception_ptr cause) { impl_->runner->fail(cause); }

void GlooBackend::shutdown() {
  auto& d = *impl_;
  {
    std::lock_guard<std::mutex> lock(d.p2pMutex);
    if (d.p2pStopping && !d.p2pWorker.joinable()) return;
    d.p2pStopping = true;
    // A send or recv still waiting would otherwise block until its timeout.
    if (!d.p2pQueue.empty()) d.closeConnections();
  }
  d.p2pWake.notify_all();
  d.runner->shutdown();
  std::lock_guard<std::mutex> join(d.p2pJoinMutex);
  if (d.p2pWorker.joinable()) d.p2pWorker.join();
}

// ---- ops -------------------------------------------------------------------------------------

WorkPtr GlooBackend::allreduce(const std::vector<Tensor>& tensors, const AllreduceOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkAllreduce(d.callSite(options.seq), tensors, options);
  const ReduceOp op = options.reduceOp;
  return d.enqueue(options.seq, "allreduce", fp, options.timeout, [tensors = tensors, op](Impl& impl, Millis timeout) {
    Staged staged = stage(tensors);
    const uint64_t tagBase = impl.runner->progress().lastStarted();
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
  CollectiveFingerprint fp = checkBroadcast(d.callSite(options.seq), tensors, options);
  const int root = options.root;
  return d.enqueue(options.seq, "broadcast", fp, options.timeout, [tensors = tensors, root](Impl& impl, Millis timeout) {
    Staged staged = stage(tensors);
    const uint32_t tag = impl.tagFor(impl.runner->progress().lastStarted());
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
  CollectiveFingerprint fp = checkAllgather(d.callSite(options.seq), outputs, input);
  return d.enqueue(options.seq, "allgather", fp, options.timeout, [outputs, input](Impl& impl, Millis timeout) {
    const size_t bytes = input.nbytes();
    if (bytes == 0) return;
    std::vector<uint8_t> gathered(bytes * impl.size);
    copyToBytes(input, gathered.data() + bytes * impl.rank);
    impl.allgatherInPlace(gathered.data(), bytes, timeout);
    for (int r = 0; r < impl.size; ++r) {
      Tensor out = outputs[r];
      copyFromBytes(gathered.data() + bytes * r, out);
    }
  });
}

WorkPtr GlooBackend::allgatherIntoTensor(const Tensor& output, const Tensor& input, const AllgatherOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkAllgatherIntoTensor(d.callSite(options.seq), output, input);
  return d.enqueue(options.seq, "allgatherIntoTensor", fp, options.timeout, [output, input](Impl& impl, Millis timeout) {
    const size_t bytes = input.nbytes();
    if (bytes == 0) return;
    // Gathered straight into the caller's buffer when it is contiguous.
    Tensor out = output.isContiguous() ? output : empty({output.numel()}, output.dtype());
    auto* data = static_cast<uint8_t*>(out.dataPtr());
    copyToBytes(input, data + bytes * impl.rank);
    impl.allgatherInPlace(data, bytes, timeout);
    if (!out.isSameAs(output)) {
      Tensor target = output;
      copyFromBytes(data, target);
    }
  });
}

WorkPtr GlooBackend::reduceScatter(const Tensor& output, const std::vector<Tensor>& inputs,
                                   const ReduceScatterOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkReduceScatter(d.callSite(options.seq), output, inputs, options);
  const ReduceOp op = options.reduceOp;
  return d.enqueue(options.seq, "reduceScatter", fp, options.timeout, [output, inputs, op](Impl& impl, Millis timeout) {
    const size_t bytes = output.nbytes();
    std::vector<uint8_t> sendBuf(bytes * impl.size);
    for (int r = 0; r < impl.size && bytes > 0; ++r) copyToBytes(inputs[r], sendBuf.data() + bytes * r);
    impl.reduceScatterBlocks(sendBuf.data(), output, op, timeout);
  });
}

WorkPtr GlooBackend::reduceScatterTensor(const Tensor& output, const Tensor& input, const ReduceScatterOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkReduceScatterTensor(d.callSite(options.seq), output, input, options);
  const ReduceOp op = options.reduceOp;
  return d.enqueue(options.seq, "reduceScatterTensor", fp, options.timeout, [output, input, op](Impl& impl, Millis timeout) {
    const Tensor in = input.contiguous();
    impl.reduceScatterBlocks(static_cast<const uint8_t*>(in.dataPtr()), output, op, timeout);
  });
}

WorkPtr GlooBackend::reduce(const std::vector<Tensor>& tensors, const ReduceOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkReduce(d.callSite(options.seq), tensors, options);
  const ReduceOp op = options.reduceOp;
  const int root = options.root;
  return d.enqueue(options.seq, "reduce", fp, options.timeout, [tensors = tensors, op, root](Impl& impl, Millis timeout) {
    // Non-root ranks reduce from a copy so that their tensors stay unchanged.
    Staged staged = impl.rank == root ? stage(tensors) : stageCopy(tensors);
    const uint32_t tag = impl.tagFor(impl.runner->progress().lastStarted());
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
    opts.setTag(impl.tagFor(impl.runner->progress().lastStarted()));
    opts.setTimeout(timeout);
    gloo::barrier(opts);
  });
}

WorkPtr GlooBackend::allToAll(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                              const AllToAllOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkAllToAll(d.callSite(options.seq), outputs, inputs);
  return d.enqueue(options.seq, "allToAll", fp, options.timeout, [outputs, inputs](Impl& impl, Millis timeout) {
    std::vector<int64_t> sendCounts, recvCounts;
    size_t sendTotal = 0, recvTotal = 0;
    for (int r = 0; r < impl.size; ++r) {
      sendCounts.push_back(static_cast<int64_t>(inputs[r].nbytes()));
      recvCounts.push_back(static_cast<int64_t>(outputs[r].nbytes()));
      sendTotal += inputs[r].nbytes();
      recvTotal += outputs[r].nbytes();
    }
    std::vector<uint8_t> sendBuf(sendTotal), recvBuf(recvTotal);
    size_t offset = 0;
    for (int r = 0; r < impl.size; ++r) {
      copyToBytes(inputs[r], sendBuf.data() + offset);
      offset += inputs[r].nbytes();
    }
    impl.allToAllBytes(sendBuf.data(), std::move(sendCounts), recvBuf.data(), std::move(recvCounts), timeout);
    offset = 0;
    for (int r = 0; r < impl.size; ++r) {
      Tensor out = outputs[r];
      copyFromBytes(recvBuf.data() + offset, out);
      offset += outputs[r].nbytes();
    }
  });
}

WorkPtr GlooBackend::allToAllSingle(const Tensor& output, const Tensor& input, const std::vector<int64_t>& outputSplits,
                                    const std::vector<int64_t>& inputSplits, const AllToAllOptions& options) {
  auto& d = *impl_;
  AllToAllSplits splits;
  CollectiveFingerprint fp = checkAllToAllSingle(d.callSite(options.seq), output, input, outputSplits, inputSplits, splits);
  return d.enqueue(options.seq, "allToAllSingle", fp, options.timeout,
                   [output, input, splits](Impl& impl, Millis timeout) {
    std::vector<int64_t> sendCounts, recvCounts;
    for (int r = 0; r < impl.size; ++r) {
      sendCounts.push_back(splits.sendRows[r] * static_cast<int64_t>(splits.rowBytes));
      recvCounts.push_back(splits.recvRows[r] * static_cast<int64_t>(splits.rowBytes));
    }
    // Straight from and into the caller's buffers when they are contiguous.
    Tensor in = input.contiguous();
    Tensor out = output.isContiguous() ? output : empty(output.sizes(), output.dtype());
    impl.allToAllBytes(static_cast<uint8_t*>(in.dataPtr()), std::move(sendCounts), static_cast<uint8_t*>(out.dataPtr()),
                       std::move(recvCounts), timeout);
    copyBackInto({output}, {out});
  });
}

WorkPtr GlooBackend::gather(const std::vector<Tensor>& outputs, const Tensor& input, const GatherOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkGather(d.callSite(options.seq), outputs, input, options);
  const int root = options.root;
  return d.enqueue(options.seq, "gather", fp, options.timeout, [outputs, input, root](Impl& impl, Millis timeout) {
    const size_t bytes = input.nbytes();
    if (bytes == 0) return;
    const Tensor in = input.contiguous();
    if (impl.size == 1) {
      Tensor out = outputs[0];
      copyFromBytes(in.dataPtr(), out);
      return;
    }
    std::vector<uint8_t> gathered(impl.rank == root ? bytes * impl.size : 0);
    gloo::GatherOptions opts(impl.context);
    opts.setInput(static_cast<uint8_t*>(const_cast<void*>(in.dataPtr())), bytes);
    if (impl.rank == root) opts.setOutput(gathered.data(), gathered.size());
    opts.setRoot(root);
    opts.setTag(impl.currentTag());
    opts.setTimeout(timeout);
    gloo::gather(opts);
    for (int r = 0; r < impl.size && impl.rank == root; ++r) {
      Tensor out = outputs[r];
      copyFromBytes(gathered.data() + bytes * r, out);
    }
  });
}

WorkPtr GlooBackend::scatter(const Tensor& output, const std::vector<Tensor>& inputs, const ScatterOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkScatter(d.callSite(options.seq), output, inputs, options);
  const int root = options.root;
  return d.enqueue(options.seq, "scatter", fp, options.timeout, [output, inputs, root](Impl& impl, Millis timeout) {
    const size_t bytes = output.nbytes();
    if (bytes == 0) return;
    std::vector<Tensor> ins;  // the root's, contiguous
    for (const auto& t : inputs) ins.push_back(t.contiguous());
    Tensor out = output.isContiguous() ? output : empty(output.sizes(), output.dtype());
    if (impl.size == 1) {
      out.copy_(ins[0]);
    } else {
      gloo::ScatterOptions opts(impl.context);
      if (impl.rank == root) {
        std::vector<uint8_t*> pointers;
        for (auto& t : ins) pointers.push_back(static_cast<uint8_t*>(t.dataPtr()));
        opts.setInputs(pointers, bytes);
      }
      opts.setOutput(static_cast<uint8_t*>(out.dataPtr()), bytes);
      opts.setRoot(root);
      opts.setTag(impl.currentTag());
      opts.setTimeout(timeout);
      gloo::scatter(opts);
    }
    copyBackInto({output}, {out});
  });
}

WorkPtr GlooBackend::monitoredBarrier(const BarrierOptions& options) {
  return impl_->runner->monitoredBarrier(options.seq, options.timeout);
}

// ---- point to point ---------------------------------------------------------------------------

namespace {

WorkPtr postP2P(GlooBackend::Impl& d, bool isSend, const std::vector<Tensor>& tensors, int peer, uint32_t tag,
                const OpTimeout& timeout) {
  const char* op = isSend ? "send" : "recv";
  checkPointToPoint(CpuCallSite{d.who(), "gloo", d.rank, d.size}, op, tensors, peer);
  const std::string what =
      str(op, isSend ? " to rank " : " from rank ", d.runner->rankName(peer), " (tag ", tag, ", ", signatures(tensors).size(),
          " tensor(s), ", totalNumel(tensors), " elements)");
  const std::string description = str(what, " (", d.who(), ")");
  if (WorkPtr rejected = d.runner->rejectIfUnusable(what, description)) return rejected;
  P2PTask task;
  task.isSend = isSend;
  task.what = what;
  task.peer = peer;
  task.deadline = Clock::now() + timeout.value_or(d.timeout);
  if (tensors.size() == 1 && tensors[0].isContiguous()) {
    task.staging = tensors[0];
  } else {
    task.staging = flattenTensors(tensors);
    if (!isSend) task.copyBackTo = tensors;
  }
  task.work = std::make_shared<Work>(description);
  if (task.staging.nbytes() == 0) {
    Work::markCompleted(task.work);
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
    auto failure = d.p2pFailure(what, peer, std::current_exception());
    d.runner->fail(failure);
    return Work::failed(description, failure);
  }
  WorkPtr work = task.work;
  std::lock_guard<std::mutex> lock(d.p2pMutex);
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
