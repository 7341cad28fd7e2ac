#include "process_group/shm/shm_backend.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <thread>
#include <utility>

#include "collectives/coalesce.h"
#include "collectives/reduce_kernels.h"
#include "common/check.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "common/thread_name.h"
#include "process_group/collective_runner.h"
#include "process_group/cpu_tensors.h"
#include "process_group/shm/shm_segment.h"

namespace dt {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

uint64_t mix(uint64_t hash, uint64_t value) {
  hash ^= value + 0x9e3779b97f4a7c15ull + (hash << 6) + (hash >> 2);
  return hash;
}

uint64_t hashText(uint64_t hash, std::string_view text) {
  for (unsigned char c : text) hash = (hash ^ c) * 1099511628211ull;
  return hash;
}

// What every rank's collective must agree on (CollectiveFingerprint::agreesWith).
uint64_t agreementHash(const CollectiveFingerprint& fp) {
  uint64_t h = hashText(1469598103934665603ull, fp.op);
  h = mix(h, fp.seq);
  const bool sizesMayDiffer = fp.sizesMayDiffer();
  for (const auto& t : fp.tensors) {
    h = mix(h, static_cast<uint64_t>(t.dtype));
    if (sizesMayDiffer) break;
    h = mix(h, t.sizes.size());
    for (int64_t s : t.sizes) h = mix(h, static_cast<uint64_t>(s));
  }
  h = mix(h, fp.reduceOp ? static_cast<uint64_t>(*fp.reduceOp) + 1 : 0);
  h = mix(h, fp.root ? static_cast<uint64_t>(*fp.root) + 1 : 0);
  return h;
}

// [begin, end) of slice j when `count` elements are cut into `parts`.
std::pair<size_t, size_t> sliceOf(size_t count, int parts, int j) {
  const size_t p = static_cast<size_t>(parts);
  return {count * static_cast<size_t>(j) / p, count * static_cast<size_t>(j + 1) / p};
}

// One posted send or recv (p2p thread).
struct PostedTransfer {
  bool isSend = true;
  int peer = 0;
  uint32_t tag = 0;
  Tensor staging;                   // contiguous bytes sent / received
  std::vector<Tensor> copyBackTo;   // recv into strided/several tensors
  size_t done = 0;                  // bytes published (send) or copied (recv)
  bool active = false;              // recv: a message is being copied into it
  Clock::time_point deadline;
  WorkPtr work;
  std::string what;
};

// A message that arrived before a recv for its tag was posted.
struct Unexpected {
  int src = 0;
  uint32_t tag = 0;
  std::vector<uint8_t> bytes;
  size_t received = 0;
  std::shared_ptr<PostedTransfer> claimedBy;  // a recv posted while it was still arriving
};

}  // namespace

struct ShmBackend::Impl {
  int rank = 0;
  int size = 1;
  ShmBackendOptions options;
  Millis timeout{0};
  std::unique_ptr<shm::ShmSegment> seg;
  bool waitsLogged = false;  // shutdown() logs the wait counts once
  std::unique_ptr<CollectiveRunner> runner;

  // Collective state: touched only by the thread running a body (the
  // runner runs one at a time).
  uint64_t rounds = 0;     // exchanges so far: their parity picks the slot buffer
  uint64_t collectives = 0;
  bool verifyPending = false;
  uint64_t pendingHash = 0;
  const CollectiveFingerprint* pendingFingerprint = nullptr;
  Clock::time_point deadline;

  // p2p
  std::mutex p2pMutex;
  std::deque<std::shared_ptr<PostedTransfer>> sends;           // in post order (per peer order kept)
  std::list<std::shared_ptr<PostedTransfer>> recvs;            // posted, not yet matched
  std::vector<std::shared_ptr<PostedTransfer>> receiving;      // per src: the recv a message is copied into
  std::vector<std::shared_ptr<Unexpected>> arriving;  // per src: the unexpected message being copied
  std::list<std::shared_ptr<Unexpected>> unexpected;
  std::vector<uint64_t> messagesSent;                 // per dst
  bool p2pStopping = false;
  std::mutex p2pJoinMutex;  // shutdown() may run on several threads at once: one joins
  std::thread p2pThread;
  // Works to complete once p2pMutex is released (their callbacks may post more).
  std::vector<std::pair<WorkPtr, std::exception_ptr>> finished;

  std::string whoText;  // "rank 1/4 pg=default shm", made once: who() is on every op's path
  const std::string& who() const { return whoText; }
  CpuCallSite callSite(uint64_t seq) const { return CpuCallSite{who(), "shm", rank, size, seq}; }

  // ---- collective skeleton --------------------------------------------------------
  void begin(const CollectiveFingerprint& fp, Millis limit) {
    deadline = Clock::now() + limit;
    // After a phase that waited for one rank only (broadcast), the others may
    // still read this rank's buffers and compare its last collective's hash:
    // wait until every rank has caught up (free in lock step) before
    // overwriting either.
    seg->waitForAll(deadline);
    pendingHash = agreementHash(fp);
    pendingFingerprint = &fp;
    seg->control(rank).opHash[collectives & 1].store(pendingHash, std::memory_order_relaxed);
    verifyPending = true;
  }

  void end() { ++collectives; }

  // One exchange: this rank's data is in place; wait for everyone's.
  void exchange() {
    seg->arrive();
    seg->waitForAll(deadline);
    verify(-1);
  }

  // A phase in which only `source` publishes: the others wait for it alone,
  // and it does not wait at all (its next write waits for everyone).
  void exchangeFrom(int source) {
    seg->arrive();
    if (rank == source) {
      verifyPending = false;  // a rank that waits for it compares
      return;
    }
    seg->waitFor(source, deadline);
    verify(source);
  }

  // The first exchange of a collective compares its fingerprint hash with
  // those of the ranks it waited for (all, or only `only`).
  void verify(int only) {
    if (verifyPending) {
      verifyPending = false;
      for (int r = 0; r < size; ++r) {
        if (only >= 0 && r != only) continue;
        if (seg->control(r).opHash[collectives & 1].load(std::memory_order_relaxed) != pendingHash) {
          // Somebody runs another collective: let the store say who called what.
          runner->checkFingerprint(*pendingFingerprint, std::chrono::duration_cast<Millis>(
                                                            std::max(Clock::duration(Millis(1000)), deadline - Clock::now())));
          throw DesyncError(str("[", who(), "] collective #", pendingFingerprint->seq,
                                ": the ranks' fingerprints differ in shared memory but agree in the store"));
        }
      }
    }
  }

  // Rounds of copy-in / copy-out ops (broadcast, allgather) are this small, so
  // that the receivers copy one round out while the root copies the next in.
  size_t pipelineBytes() const { return std::min(seg->slotBytes(), options.pipelineBytes); }

  uint8_t* mySlot() const { return seg->slot(rank, static_cast<int>(rounds & 1)); }
  uint8_t* slotOf(int r) const { return seg->slot(r, static_cast<int>(rounds & 1)); }

  // ---- algorithms (on contiguous buffers) --------------------------------------------
  // out = in[0] (op) in[1] (op) ... in ranks' order, one rounding per step.
  static void reduceInOrder(ReduceFn fn, size_t width, uint8_t* out, const std::vector<const uint8_t*>& in,
                            size_t count) {
    if (in.size() == 1) {
      if (out != in[0]) std::memcpy(out, in[0], count * width);
      return;
    }
    fn(out, in[0], in[1], count);
    for (size_t j = 2; j < in.size(); ++j) fn(out, out, in[j], count);
  }

  void allreduceBuffer(uint8_t* data, size_t count, DType dtype, ReduceOp op, bool toAll, int root) {
    const size_t width = itemSize(dtype);
    const ReduceFn fn = reduceFunction(dtype, op);
    const size_t bytes = count * width;
    const size_t perRound = std::min(seg->slotBytes(), options.allreduceRoundBytes) / width;
    if (size == 1) {
      if (op == ReduceOp::Avg && count > 0) divideBy(dtype, data, count, 1);
      return;
    }
    if (bytes <= options.smallBytes) {
      // One exchange: everyone publishes everything, the receivers reduce it all.
      if (bytes > 0) std::memcpy(mySlot(), data, bytes);
      exchange();
      if (toAll || rank == root) {
        std::vector<const uint8_t*> in;
        for (int r = 0; r < size; ++r) in.push_back(slotOf(r));
        if (count > 0) reduceInOrder(fn, width, data, in, count);
        if (op == ReduceOp::Avg && count > 0) divideBy(dtype, data, count, size);
      }
      ++rounds;
      return;
    }
    for (size_t offset = 0; offset < count; offset += perRound) {
      const size_t n = std::min(perRound, count - offset);
      uint8_t* chunk = data + offset * width;
      // Reduce-scatter: publish the slices the others reduce.
      for (int j = 0; j < size; ++j) {
        if (j == rank) continue;
        const auto [b, e] = sliceOf(n, size, j);
        std::memcpy(mySlot() + b * width, chunk + b * width, (e - b) * width);
      }
      exchange();
      // Reduce this rank's slice into its own buffer, in rank order.
      const auto [b, e] = sliceOf(n, size, rank);
      if (e > b) {
        std::vector<const uint8_t*> in;
        for (int r = 0; r < size; ++r) in.push_back(r == rank ? chunk + b * width : slotOf(r) + b * width);
        uint8_t* out = mySlot() + b * width;
        reduceInOrder(fn, width, out, in, e - b);
        if (op == ReduceOp::Avg) divideBy(dtype, out, e - b, size);
      }
      exchange();
      // Allgather: everyone's reduced slice back into the caller's buffer.
      if (toAll || rank == root) {
        for (int j = 0; j < size; ++j) {
          const auto [jb, je] = sliceOf(n, size, j);
          std::memcpy(chunk + jb * width, slotOf(j) + jb * width, (je - jb) * width);
        }
      }
      ++rounds;
    }
  }

  // The root publishes, the others wait for the root alone: the root never
  // waits for a receiver except before reusing a buffer.
  void broadcastBuffer(uint8_t* data, size_t bytes, int root) {
    const size_t perRound = pipelineBytes();
    size_t offset = 0;
    do {
      const size_t n = std::min(perRound, bytes - offset);
      if (rank == root) {
        if (offset > 0) seg->waitForAll(deadline);
        if (n > 0) std::memcpy(mySlot(), data + offset, n);
      }
      exchangeFrom(root);
      if (rank != root && n > 0) std::memcpy(data + offset, slotOf(root), n);
      ++rounds;
      offset += n;
    } while (offset < bytes);
  }

  // ---- p2p (the p2p thread) ----------------------------------------------------------
  void startP2P() {
    // Called with p2pMutex held.
    if (p2pThread.joinable() || p2pStopping) return;
    receiving.assign(static_cast<size_t>(size), nullptr);
    arriving.assign(static_cast<size_t>(size), nullptr);
    messagesSent.assign(static_cast<size_t>(size), 0);
    p2pThread = std::thread([this] {
      setThreadName("dt-shm-p2p");
      p2pLoop();
    });
  }

  void completeRecv(PostedTransfer& op) {
    if (!op.copyBackTo.empty()) unflattenInto(op.staging, op.copyBackTo);
    finished.emplace_back(op.work, nullptr);
  }

  // Completes the finished Works; call without p2pMutex.
  void flushFinished() {
    std::vector<std::pair<WorkPtr, std::exception_ptr>> done;
    {
      std::lock_guard<std::mutex> lock(p2pMutex);
      done.swap(finished);
    }
    for (auto& [work, error] : done) {
      if (work->isCompleted()) continue;
      if (error) {
        Work::markFailed(work, error);
      } else {
        Work::markCompleted(work);
      }
    }
  }

  std::exception_ptr p2pError(const PostedTransfer& op, const std::string& why, bool timedOut) const {
    if (timedOut) {
      return std::make_exception_ptr(TimeoutError(str("[", who(), "] ", op.what, " timed out: ", why,
                                                      ". Did the peer post the matching call?")));
    }
    return std::make_exception_ptr(BackendError(str("[", who(), "] ", op.what, " failed: ", why)));
  }

  // Every send or recv not completed yet. p2pMutex held.
  std::vector<std::shared_ptr<PostedTransfer>> pendingP2P() const {
    std::vector<std::shared_ptr<PostedTransfer>> all(sends.begin(), sends.end());
    all.insert(all.end(), recvs.begin(), recvs.end());
    for (auto& r : receiving) {
      if (r) all.push_back(r);
    }
    for (auto& u : unexpected) {  // messages still arriving are listed here too
      if (u->claimedBy) all.push_back(u->claimedBy);
    }
    return all;
  }

  // Fails every pending p2p op (the group is broken). p2pMutex held.
  void failAllP2P(const std::exception_ptr& cause) {
    const auto all = pendingP2P();
    sends.clear();
    recvs.clear();
    std::fill(receiving.begin(), receiving.end(), nullptr);
    for (auto& op : all) finished.emplace_back(op->work, cause);
  }

  // Moves what can move now; returns whether anything did. p2pMutex held.
  bool p2pStep() {
    bool moved = false;
    const size_t chunkBytes = seg->chunkBytes();
    // Sends, the oldest first per destination.
    std::vector<bool> blocked(static_cast<size_t>(size), false);
    for (auto it = sends.begin(); it != sends.end();) {
      PostedTransfer& op = **it;
      if (blocked[op.peer]) {
        ++it;
        continue;
      }
      auto& ch = seg->channel(rank, op.peer);
      const size_t total = op.staging.nbytes();
      while (op.done < total) {
        const uint32_t published = ch.published.load(std::memory_order_acquire);
        if (published - ch.consumed.load(std::memory_order_acquire) >= 2) break;  // both chunks in use
        const size_t n = std::min(chunkBytes, total - op.done);
        auto& meta = ch.chunks[published & 1];
        meta.message = messagesSent[op.peer];
        meta.total = total;
        meta.offset = op.done;
        meta.length = n;
        meta.tag = op.tag;
        std::memcpy(seg->channelChunk(rank, op.peer, static_cast<int>(published & 1)),
                    static_cast<const uint8_t*>(op.staging.dataPtr()) + op.done, n);
        ch.published.store(published + 1, std::memory_order_release);
        seg->ring(op.peer);
        op.done += n;
        moved = true;
      }
      if (op.done == total) {
        ++messagesSent[op.peer];
        finished.emplace_back(op.work, nullptr);  // the data is in the channel
        it = sends.erase(it);
      } else {
        blocked[op.peer] = true;  // later messages to this peer wait their turn
        ++it;
      }
    }
    // Receives, from every peer's channel to this rank.
    for (int src = 0; src < size; ++src) {
      if (src == rank) continue;
      auto& ch = seg->channel(src, rank);
      while (true) {
        const uint32_t consumed = ch.consumed.load(std::memory_order_relaxed);
        if (ch.published.load(std::memory_order_acquire) == consumed) break;
        const auto& meta = ch.chunks[consumed & 1];
        const uint8_t* data = seg->channelChunk(src, rank, static_cast<int>(consumed & 1));
        if (meta.offset == 0 && !receiving[src] && !arriving[src]) {
          // A new message: the first recv posted for its tag, else hold it.
          auto match = std::find_if(recvs.begin(), recvs.end(),
                                    [&](const auto& r) { return r->peer == src && r->tag == meta.tag; });
          if (match != recvs.end()) {
            receiving[src] = *match;
            recvs.erase(match);
          } else {
            auto held = std::make_shared<Unexpected>();
            held->src = src;
            held->tag = meta.tag;
            held->bytes.resize(meta.total);
            arriving[src] = held;
            unexpected.push_back(held);
          }
        }
        if (receiving[src]) {
          PostedTransfer& op = *receiving[src];
          if (meta.total != op.staging.nbytes()) {
            auto cause = p2pError(op, str("the message from rank ", src, " with tag ", meta.tag, " has ", meta.total,
                                          " bytes but the recv expects ", op.staging.nbytes()), false);
            runner->fail(cause);
            failAllP2P(cause);
            return true;
          }
          std::memcpy(static_cast<uint8_t*>(op.staging.dataPtr()) + meta.offset, data, meta.length);
          op.done = meta.offset + meta.length;
        } else {
          Unexpected& held = *arriving[src];
          std::memcpy(held.bytes.data() + meta.offset, data, meta.length);
          held.received = meta.offset + meta.length;
        }
        const bool last = meta.offset + meta.length == meta.total;
        ch.consumed.store(consumed + 1, std::memory_order_release);
        seg->ring(src);
        moved = true;
        if (!last) continue;
        if (receiving[src]) {
          auto op = std::move(receiving[src]);
          completeRecv(*op);
        } else {
          auto held = std::move(arriving[src]);
          if (held->claimedBy) {
            deliverHeld(*held, *held->claimedBy);
            unexpected.remove(held);
          }
        }
      }
    }
    return moved;
  }

  void deliverHeld(const Unexpected& held, PostedTransfer& op) {
    if (held.bytes.size() != op.staging.nbytes()) {
      finished.emplace_back(op.work, p2pError(op, str("the message from rank ", held.src, " with tag ", held.tag,
                                                      " has ", held.bytes.size(), " bytes but the recv expects ",
                                                      op.staging.nbytes()),
                                              false));
      return;
    }
    std::memcpy(op.staging.dataPtr(), held.bytes.data(), held.bytes.size());
    completeRecv(op);
  }

  // Deadlines and peers' health for the pending ops. p2pMutex held.
  void p2pCheck() {
    if (std::exception_ptr broken = runner->brokenCause()) {  // aborted, or a collective failed
      if (!pendingP2P().empty()) failAllP2P(broken);
      return;
    }
    const auto now = Clock::now();
    for (auto& op : pendingP2P()) {
      std::exception_ptr cause;
      if (now >= op->deadline) {
        cause = p2pError(*op, "the deadline passed", true);
      } else {
        try {
          seg->checkPeer(op->peer);
        } catch (const std::exception& e) {
          cause = p2pError(*op, e.what(), false);
        }
      }
      if (cause) {
        runner->fail(cause);
        failAllP2P(cause);
        return;
      }
    }
  }

  void p2pLoop() {
    auto nextCheck = Clock::now();
    while (true) {
      const uint32_t seen = seg->doorbell();
      bool moved = false;
      {
        std::lock_guard<std::mutex> lock(p2pMutex);
        if (p2pStopping) {
          failAllP2P(std::make_exception_ptr(BackendError(str("[", who(), "] the group was shut down"))));
          break;
        }
        moved = p2pStep();
        if (Clock::now() >= nextCheck) {
          p2pCheck();
          nextCheck = Clock::now() + Millis(20);
        }
      }
      flushFinished();
      if (!moved) seg->waitDoorbell(seen, Clock::now() + Millis(20));
    }
    flushFinished();
  }

  WorkPtr post(bool isSend, const std::vector<Tensor>& tensors, int peer, uint32_t tag, const OpTimeout& opTimeout) {
    const char* op = isSend ? "send" : "recv";
    checkPointToPoint(CpuCallSite{who(), "shm", rank, size}, op, tensors, peer);
    auto p = std::make_shared<PostedTransfer>();
    p->isSend = isSend;
    p->peer = peer;
    p->tag = tag;
    p->what = str(op, isSend ? " to rank " : " from rank ", runner->rankName(peer), " (tag ", tag, ", ", tensors.size(),
                  " tensor(s), ", totalNumel(tensors), " elements)");
    const std::string description = str(p->what, " (", who(), ")");
    if (WorkPtr rejected = runner->rejectIfUnusable(p->what, description)) return rejected;
    p->deadline = Clock::now() + opTimeout.value_or(timeout);
    if (tensors.size() == 1 && tensors[0].isContiguous()) {
      p->staging = isSend ? tensors[0].clone() : tensors[0];
    } else {
      p->staging = flattenTensors(tensors);
      if (!isSend) p->copyBackTo = tensors;
    }
    p->work = std::make_shared<Work>(description);
    if (p->staging.nbytes() == 0) {
      Work::markCompleted(p->work);
      return p->work;
    }
    WorkPtr work = p->work;
    {
      std::lock_guard<std::mutex> lock(p2pMutex);
      enqueueP2P(std::move(p), isSend, peer, tag);
    }
    flushFinished();
    return work;
  }

  void enqueueP2P(std::shared_ptr<PostedTransfer> p, bool isSend, int peer, uint32_t tag) {
    startP2P();
    if (isSend) {
      sends.push_back(std::move(p));
    } else {
      // A message with this tag may already be here.
      auto held = std::find_if(unexpected.begin(), unexpected.end(), [&](const auto& u) {
        return u->src == peer && u->tag == tag && !u->claimedBy;
      });
      if (held == unexpected.end()) {
        recvs.push_back(std::move(p));
      } else if (arriving[peer] == *held) {
        (*held)->claimedBy = std::move(p);  // still arriving: delivered when complete
      } else {
        deliverHeld(**held, *p);
        unexpected.erase(held);
      }
    }
    seg->ring(rank);
  }

  void stopP2P() {
    {
      std::lock_guard<std::mutex> lock(p2pMutex);
      p2pStopping = true;
    }
    if (seg) seg->ring(rank);
    std::lock_guard<std::mutex> join(p2pJoinMutex);
    if (p2pThread.joinable()) p2pThread.join();
  }
};

// ---- construction ---------------------------------------------------------------------------

ShmBackend::ShmBackend(StorePtr store, int rank, int size, ShmBackendOptions options)
    : impl_(std::make_unique<Impl>()) {
  DT_REQUIRE(store != nullptr, "ShmBackend: store is null");
  DT_REQUIRE(size >= 1, "ShmBackend: group size must be >= 1, got ", size);
  DT_REQUIRE(rank >= 0 && rank < size, "ShmBackend: rank ", rank, " is outside the group of size ", size);
  auto& d = *impl_;
  d.rank = rank;
  d.size = size;
  d.options = std::move(options);
  d.whoText = str("rank ", rank, "/", size, " pg=", d.options.groupName, " shm");
  d.timeout = d.options.resolvedTimeout();
  DT_REQUIRE(d.options.slotBytes >= 4096, "ShmBackend: slotBytes must be at least 4096, got ", d.options.slotBytes);
  d.options.smallBytes = std::min(d.options.smallBytes, d.options.slotBytes);

  shm::SegmentOptions so;
  so.name = d.options.groupName;
  so.rank = rank;
  so.size = size;
  so.slotBytes = d.options.slotBytes;
  so.timeout = d.timeout;
  so.heartbeatInterval = std::min(d.options.progressInterval, Millis(100));
  so.heartbeatTimeout = d.options.heartbeatTimeout;
  d.seg = std::make_unique<shm::ShmSegment>(store, so);

  d.runner = std::make_unique<CollectiveRunner>(std::move(store), rank, size, d.options.runnerOptions("shm"),
                                                [impl = impl_.get()] { impl->seg->abort(impl->rank); });
}

ShmBackend::~ShmBackend() { shutdown(); }

int ShmBackend::rank() const { return impl_->rank; }
int ShmBackend::size() const { return impl_->size; }

std::exception_ptr ShmBackend::brokenCause() const { return impl_->runner->brokenCause(); }

void ShmBackend::abort(std::exception_ptr cause) { impl_->runner->fail(cause); }

void ShmBackend::shutdown() {
  auto& d = *impl_;
  if (!d.runner) return;
  d.stopP2P();
  d.runner->shutdown();
  if (d.seg && !std::exchange(d.waitsLogged, true) && d.runner->log()->should_log(spdlog::level::debug)) {
    // How this rank's waits ended, and which thread ran its ops: what to read when small
    // collectives are slower than they should be (a small op the worker ran cost a wake-up).
    const shm::ShmSegment::WaitStats w = d.seg->waitStats();
    const CollectiveRunner::Stats ran = d.runner->stats();
    d.runner->log()->debug(
        "shm waits: {} spun ({} for a peer it had woken), {} slept ({} for a peer it had woken), {} for a core mate "
        "({} of them spun on a core of their own after moving, {} slept as their yields did not get the mate to run), "
        "{} stepped aside; ops run by their callers {}, by the worker {}",
        w.spun, w.spunForWaking, w.slept, w.sleptForWoken, w.forCoreMate, w.spunOnOwnCore, w.sleptForCoreMate,
        w.steppedAside,
        ran.ranByCaller, ran.ranByWorker);
  }
}

// ---- collectives ----------------------------------------------------------------------------

namespace {

// Queues `run` as collective `op` with this backend's skeleton around it.
template <typename Run>
WorkPtr collective(ShmBackend::Impl& d, uint64_t seq, const char* op, CollectiveFingerprint fp, const OpTimeout& timeout,
                   Run run) {
  return d.runner->enqueue(
      seq, op, std::move(fp), timeout,
      [&d, run = std::move(run)](Millis limit, const CollectiveFingerprint& numbered) mutable {
        if (d.size == 1) {  // nothing to exchange, nobody to compare with
          run(d);
          d.end();
          return;
        }
        d.seg->enterCollective();
        struct Leave {
          shm::ShmSegment& seg;
          ~Leave() { seg.leaveCollective(); }
        } leave{*d.seg};
        d.begin(numbered, limit);
        try {
          run(d);
        } catch (...) {
          d.end();
          throw;
        }
        d.end();
      });
}


}  // namespace

WorkPtr ShmBackend::allreduce(const std::vector<Tensor>& tensors, const AllreduceOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkAllreduce(d.callSite(options.seq), tensors, options);
  const ReduceOp op = options.reduceOp;
  return collective(d, options.seq, "allreduce", std::move(fp), options.timeout,
                    // `tensors = tensors`: a member that is not const (a plain capture of the const&
                    // parameter is), so the list moves into the queued body and from it.
                    [tensors = tensors, op](Impl& impl) mutable {  // runs once: it may give its list away
                      Staged staged = stage(std::move(tensors));
                      for (auto& b : staged.buffers) {
                        impl.allreduceBuffer(static_cast<uint8_t*>(b.dataPtr()), static_cast<size_t>(b.numel()),
                                             b.dtype(), op, true, 0);
                      }
                      staged.copyBack();
                    });
}

WorkPtr ShmBackend::reduce(const std::vector<Tensor>& tensors, const ReduceOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkReduce(d.callSite(options.seq), tensors, options);
  const ReduceOp op = options.reduceOp;
  const int root = options.root;
  return collective(d, options.seq, "reduce", std::move(fp), options.timeout,
                    [tensors = tensors, op, root](Impl& impl) {
                      // Non-root ranks reduce from a copy so that their tensors stay unchanged.
                      Staged staged = impl.rank == root ? stage(tensors) : stageCopy(tensors);
                      for (auto& b : staged.buffers) {
                        impl.allreduceBuffer(static_cast<uint8_t*>(b.dataPtr()), static_cast<size_t>(b.numel()),
                                             b.dtype(), op, false, root);
                      }
                      if (impl.rank == root) staged.copyBack();
                    });
}

WorkPtr ShmBackend::broadcast(const std::vector<Tensor>& tensors, const BroadcastOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkBroadcast(d.callSite(options.seq), tensors, options);
  const int root = options.root;
  return collective(d, options.seq, "broadcast", std::move(fp), options.timeout,
                    [tensors = tensors, root](Impl& impl) mutable {  // runs once: it may give its list away
                      Staged staged = stage(std::move(tensors));
                      for (auto& b : staged.buffers) {
                        impl.broadcastBuffer(static_cast<uint8_t*>(b.dataPtr()), b.nbytes(), root);
                      }
                      if (impl.rank != root) staged.copyBack();
                    });
}

namespace {

using Impl = ShmBackend::Impl;

// Everyone publishes its input round by round; every rank (or only
// `onlyTo`, for gather) copies all of them out.
void allgatherRounds(Impl& impl, const std::vector<Tensor>& outputs, const Tensor& input, int onlyTo = -1) {
  const Tensor in = input.contiguous();
  const size_t bytes = in.nbytes();
  const bool receives = onlyTo < 0 || impl.rank == onlyTo;
  std::vector<Tensor> outs;
  for (const auto& o : outputs) outs.push_back(o.isContiguous() ? o : emptyLike(o));
  const size_t perRound = impl.pipelineBytes();
  size_t offset = 0;
  do {
    const size_t n = std::min(perRound, bytes - offset);
    if (n > 0) std::memcpy(impl.mySlot(), static_cast<const uint8_t*>(in.dataPtr()) + offset, n);
    impl.exchange();
    for (int r = 0; r < impl.size && n > 0 && receives; ++r) {
      std::memcpy(static_cast<uint8_t*>(outs[r].dataPtr()) + offset, impl.slotOf(r), n);
    }
    ++impl.rounds;
    offset += n;
  } while (offset < bytes);
  copyBackInto(outputs, outs);
}

// The root publishes every rank's block round by round; each copies its own.
void scatterRounds(Impl& impl, const Tensor& output, const std::vector<Tensor>& inputs, int root) {
  const size_t bytes = output.nbytes();
  std::vector<Tensor> ins;
  for (const auto& t : inputs) ins.push_back(t.contiguous());
  Tensor out = output.isContiguous() ? output : emptyLike(output);
  const size_t region = (impl.seg->slotBytes() / static_cast<size_t>(impl.size)) / 64 * 64;
  size_t offset = 0;
  do {
    const size_t n = std::min(region, bytes - offset);
    if (impl.rank == root) {
      if (offset > 0) impl.seg->waitForAll(impl.deadline);  // before reusing a buffer the others may still read
      for (int k = 0; k < impl.size && n > 0; ++k) {
        std::memcpy(impl.mySlot() + static_cast<size_t>(k) * region,
                    static_cast<const uint8_t*>(ins[k].dataPtr()) + offset, n);
      }
    }
    impl.exchangeFrom(root);
    if (n > 0) {
      std::memcpy(static_cast<uint8_t*>(out.dataPtr()) + offset,
                  impl.slotOf(root) + static_cast<size_t>(impl.rank) * region, n);
    }
    ++impl.rounds;
    offset += n;
  } while (offset < bytes);
  copyBackInto({output}, {out});
}

void reduceScatterRounds(Impl& impl, const Tensor& output, const std::vector<Tensor>& inputs, ReduceOp op) {
  const ReduceFn fn = reduceFunction(output.dtype(), op);
  const size_t width = itemSize(output.dtype());
  const size_t count = static_cast<size_t>(output.numel());
  std::vector<Tensor> ins;
  for (const auto& t : inputs) ins.push_back(t.contiguous());
  Tensor out = output.isContiguous() ? output : emptyLike(output);
  // Per round every rank publishes m elements of each of its inputs.
  const size_t m = std::max<size_t>(1, impl.seg->slotBytes() / (width * impl.size));
  size_t offset = 0;
  do {
    const size_t n = std::min(m, count - offset);
    for (int k = 0; k < impl.size && n > 0; ++k) {
      std::memcpy(impl.mySlot() + static_cast<size_t>(k) * n * width,
                  static_cast<const uint8_t*>(ins[k].dataPtr()) + offset * width, n * width);
    }
    impl.exchange();
    if (n > 0) {
      std::vector<const uint8_t*> parts;
      for (int j = 0; j < impl.size; ++j) parts.push_back(impl.slotOf(j) + static_cast<size_t>(impl.rank) * n * width);
      uint8_t* dst = static_cast<uint8_t*>(out.dataPtr()) + offset * width;
      Impl::reduceInOrder(fn, width, dst, parts, n);
      if (op == ReduceOp::Avg) divideBy(output.dtype(), dst, n, impl.size);
    }
    ++impl.rounds;
    offset += n;
  } while (offset < count);
  copyBackInto({output}, {out});
}

void allToAllRounds(Impl& impl, const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs) {
  const int w = impl.size;
  std::vector<Tensor> ins, outs;
  for (const auto& t : inputs) ins.push_back(t.contiguous());
  for (const auto& t : outputs) outs.push_back(t.isContiguous() ? t : emptyLike(t));
  // First exchange: every rank's send sizes, so all agree on the rounds.
  auto* sizes = reinterpret_cast<uint64_t*>(impl.mySlot());
  for (int k = 0; k < w; ++k) sizes[k] = ins[k].nbytes();
  impl.exchange();
  uint64_t largest = 0;
  for (int j = 0; j < w; ++j) {
    const auto* theirs = reinterpret_cast<const uint64_t*>(impl.slotOf(j));
    for (int k = 0; k < w; ++k) largest = std::max(largest, theirs[k]);
    if (theirs[impl.rank] != outs[j].nbytes()) {
      throw InvalidArgument(str("rank ", j, " sends ", theirs[impl.rank], " bytes to this rank but output ", j,
                                " holds ", outs[j].nbytes()));
    }
  }
  ++impl.rounds;
  const size_t region = (impl.seg->slotBytes() / static_cast<size_t>(w)) / 64 * 64;
  for (uint64_t offset = 0; offset < largest; offset += region) {
    for (int k = 0; k < w; ++k) {
      const size_t have = ins[k].nbytes();
      if (offset >= have) continue;
      std::memcpy(impl.mySlot() + static_cast<size_t>(k) * region, static_cast<const uint8_t*>(ins[k].dataPtr()) + offset,
                  std::min<size_t>(region, have - offset));
    }
    impl.exchange();
    for (int j = 0; j < w; ++j) {
      const size_t want = outs[j].nbytes();
      if (offset >= want) continue;
      std::memcpy(static_cast<uint8_t*>(outs[j].dataPtr()) + offset,
                  impl.slotOf(j) + static_cast<size_t>(impl.rank) * region, std::min<size_t>(region, want - offset));
    }
    ++impl.rounds;
  }
  copyBackInto(outputs, outs);
}

}  // namespace

WorkPtr ShmBackend::allgather(const std::vector<Tensor>& outputs, const Tensor& input, const AllgatherOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkAllgather(d.callSite(options.seq), outputs, input);
  return collective(d, options.seq, "allgather", std::move(fp), options.timeout,
                    [outputs, input](Impl& impl) { allgatherRounds(impl, outputs, input); });
}

WorkPtr ShmBackend::allgatherIntoTensor(const Tensor& output, const Tensor& input, const AllgatherOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkAllgatherIntoTensor(d.callSite(options.seq), output, input);
  return collective(d, options.seq, "allgatherIntoTensor", std::move(fp), options.timeout, [output, input](Impl& impl) {
    Tensor flat = output.isContiguous() ? output : empty({output.numel()}, output.dtype());
    allgatherRounds(impl, blocksOf(flat, impl.size, input.sizes()), input);
    copyBackInto({output}, {flat.view(output.sizes())});
  });
}

WorkPtr ShmBackend::gather(const std::vector<Tensor>& outputs, const Tensor& input, const GatherOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkGather(d.callSite(options.seq), outputs, input, options);
  const int root = options.root;
  return collective(d, options.seq, "gather", std::move(fp), options.timeout,
                    [outputs, input, root](Impl& impl) { allgatherRounds(impl, outputs, input, root); });
}

WorkPtr ShmBackend::scatter(const Tensor& output, const std::vector<Tensor>& inputs, const ScatterOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkScatter(d.callSite(options.seq), output, inputs, options);
  const int root = options.root;
  return collective(d, options.seq, "scatter", std::move(fp), options.timeout,
                    [output, inputs, root](Impl& impl) { scatterRounds(impl, output, inputs, root); });
}

WorkPtr ShmBackend::reduceScatter(const Tensor& output, const std::vector<Tensor>& inputs,
                                  const ReduceScatterOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkReduceScatter(d.callSite(options.seq), output, inputs, options);
  const ReduceOp op = options.reduceOp;
  return collective(d, options.seq, "reduceScatter", std::move(fp), options.timeout,
                    [output, inputs, op](Impl& impl) { reduceScatterRounds(impl, output, inputs, op); });
}

WorkPtr ShmBackend::reduceScatterTensor(const Tensor& output, const Tensor& input, const ReduceScatterOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkReduceScatterTensor(d.callSite(options.seq), output, input, options);
  const ReduceOp op = options.reduceOp;
  return collective(d, options.seq, "reduceScatterTensor", std::move(fp), options.timeout, [output, input, op](Impl& impl) {
    reduceScatterRounds(impl, output, blocksOf(input.contiguous(), impl.size, output.sizes()), op);
  });
}

WorkPtr ShmBackend::barrier(const BarrierOptions& options) {
  auto& d = *impl_;
  return collective(d, options.seq, "barrier", CollectiveFingerprint{}, options.timeout,
                    [](Impl& impl) { impl.exchange(); });
}

WorkPtr ShmBackend::monitoredBarrier(const BarrierOptions& options) {
  // Through the store, not shared memory: a rank that never arrives must not
  // leave the others spinning on a segment it will never write.
  return impl_->runner->monitoredBarrier(options.seq, options.timeout);
}

WorkPtr ShmBackend::allToAll(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                             const AllToAllOptions& options) {
  auto& d = *impl_;
  CollectiveFingerprint fp = checkAllToAll(d.callSite(options.seq), outputs, inputs);
  return collective(d, options.seq, "allToAll", std::move(fp), options.timeout,
                    [outputs, inputs](Impl& impl) { allToAllRounds(impl, outputs, inputs); });
}

WorkPtr ShmBackend::allToAllSingle(const Tensor& output, const Tensor& input, const std::vector<int64_t>& outputSplits,
                                   const std::vector<int64_t>& inputSplits, const AllToAllOptions& options) {
  auto& d = *impl_;
  AllToAllSplits splits;
  CollectiveFingerprint fp = checkAllToAllSingle(d.callSite(options.seq), output, input, outputSplits, inputSplits, splits);
  return collective(d, options.seq, "allToAllSingle", std::move(fp), options.timeout, [output, input, splits](Impl& impl) {
    Tensor out = output.isContiguous() ? output : emptyLike(output);
    allToAllRounds(impl, rowsOf(out, splits.recvRows), rowsOf(input.contiguous(), splits.sendRows));
    copyBackInto({output}, {out});
  });
}

WorkPtr ShmBackend::send(const std::vector<Tensor>& tensors, int dstRank, const SendOptions& options) {
  return impl_->post(true, tensors, dstRank, options.tag, options.timeout);
}

WorkPtr ShmBackend::recv(const std::vector<Tensor>& tensors, int srcRank, const RecvOptions& options) {
  return impl_->post(false, tensors, srcRank, options.tag, options.timeout);
}

}  // namespace dt
