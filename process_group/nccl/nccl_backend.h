// NcclBackend: collectives on CUDA tensors through NCCL (only in builds with
// DT_HAVE_NCCL). No CUDA or NCCL header leaks from here.
//
// Contract (in addition to backend.h):
//  * Construction is cheap and not collective. A communicator is created
//    lazily for each CUDA device this rank first uses, by the first op on a
//    tensor of that device; every rank of the group must issue that op (it is
//    a collective anyway). Rendezvous: rank 0 makes the ncclUniqueId and puts
//    it in the group's store under "nccl/comm/<k>/id" (k counts this group's
//    communicators, so ranks on different device indices agree on k); every
//    rank marks "nccl/comm/<k>/joined/<rank>" as it starts, then initialises
//    without blocking (config.blocking = 0), polling until NCCL is done or
//    the group timeout passes. On timeout the communicator is aborted and the
//    op throws TimeoutError naming the ranks that never started to join.
//  * Ops: allreduce, reduce (sum, avg, min, max, product), broadcast,
//    allgather, reduceScatter, allToAll, send/recv, barrier, and the flat /
//    rooted forms (allgatherIntoTensor, reduceScatterTensor, allToAllSingle,
//    gather, scatter) on float32, float64, float16, bfloat16, int32, int64.
//    Tensors must be defined, contiguous CUDA tensors of one device (the one
//    the op's communicator serves); anything else, a bool tensor or a root
//    outside the group throws InvalidArgument at the call naming the tensor
//    and what is wrong. NCCL reads and writes the caller's memory, except
//    that reduceScatter's list of inputs is first copied into one buffer,
//    and allgather (one ncclAllGather) gathers into one buffer copied out to
//    the outputs afterwards unless they already lie back to back (both on
//    the NCCL stream). send/recv take tag 0 only (NCCL matches them in
//    order); batchIsendIrecv launches its whole batch as one NCCL group call.
//  * Enqueueing: on these nonblocking communicators NCCL finishes each op's
//    enqueue on a helper thread of its own; the call waits for it (yielding
//    first, then sleeping; bounded by the op's timeout, ended by an abort).
//    Meanwhile it holds the communicator's launch order only, not the lock of
//    its handle: an abort, the watchdog and shutdown get through. Why not
//    blocking communicators: nccl_backend.cpp, before finishEnqueue.
//  * Streams: each communicator has its own NCCL stream. An op is launched at
//    the call, on the calling thread: the NCCL stream first waits (on the
//    device) for the caller's current stream of that device, so the op sees
//    everything queued before the call; an event recorded after the op marks
//    its completion. The caching allocator is told that the NCCL stream uses
//    every tensor of the op (cuda::recordStream), so memory the caller frees
//    early is not handed out again before the op is done; the op also keeps
//    its tensors alive until its event has completed.
//  * Work: wait() makes the caller's current stream wait for the completion
//    event and returns without blocking the host (it rethrows when the op
//    already failed); wait(timeout) blocks the host. The watchdog completes
//    the Work (markCompleted) once its event has completed, so isCompleted(),
//    then() and future() behave as for the CPU backends, a poll interval
//    (<= 1 ms while ops are outstanding) after the GPU finished.
//  * Watchdog: collectives go through the shared CollectiveRunner, whose
//    worker watches them in issue order (the event, the op's deadline,
//    ncclCommGetAsyncError); send/recv are watched by a thread of this
//    backend. A deadline that passes or an asynchronous NCCL error aborts
//    every communicator of the group (ncclCommAbort), breaks the group and
//    fails the op with an error naming group, op, sequence number, NCCL's
//    error string and who is stuck (the progress keys, as for Gloo); the
//    outstanding ops fail with "the group is broken since <that error>".
//    An op's deadline runs from when the watchdog starts watching it (when
//    the ops ahead of it have completed), so nothing waits forever.
//  * DT_DEBUG=detail (checkFingerprints): the watchdog compares each
//    collective's fingerprint through the store before watching it, so a
//    desync becomes a DesyncError (and aborts the communicators) instead of
//    a hang. The op has already been launched by then.
//  * shutdown() on a healthy group (not broken, no abort begun) refuses new
//    ops, waits (bounded by the group timeout) until every launched op has
//    completed on the GPU and its Work is completed, then ncclCommFinalize
//    (which flushes what NCCL's proxy still sends), polls until each
//    communicator is quiescent and ncclCommDestroy: `allreduce(t)->wait();
//    destroy();` leaves t fully reduced and the peers unharmed. A broken
//    group, or a timeout or an NCCL error on that way, aborts the
//    communicators instead (ncclCommAbort, which never waits for a gone
//    peer); what is still outstanding then fails ("shut down" or "aborted").
//    A communicator still being created gives up at once. Idempotent; the
//    destructor calls it. The rules: nccl/comm_lifecycle.h.
//  * An abort (shutdown, a watchdog timeout, a failure of any op) fails every
//    op still watched, even one whose event completed: NCCL's kernels exit
//    early on an abort, so an event does not mean a result.
//  * Thread safety: as backend.h; launches on one communicator are
//    serialised (NCCL takes no call on it before the previous one finished
//    enqueueing), shutdown() and abort() may be called from any thread.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "process_group/backend.h"
#include "process_group/collective_runner.h"
#include "store/store.h"

namespace dt {

struct NcclBackendOptions : BackendCommonOptions {
  // How often a watched op polls its event and ncclCommGetAsyncError at
  // most (the first polls come sooner; see nccl_backend.cpp).
  std::chrono::microseconds pollInterval{1000};
  // This rank's GPU, for ops that bring no tensor to tell it (barrier).
  // Unset: see barrier() below.
  std::optional<Device> device;
};

class NcclBackend final : public Backend {
 public:
  // `store` is the group's scope (NcclBackend adds "nccl/" under it).
  NcclBackend(StorePtr store, int rank, int size, NcclBackendOptions options = {});
  ~NcclBackend() override;

  std::string name() const override { return "nccl"; }
  int rank() const override;
  int size() const override;

  WorkPtr allreduce(const std::vector<Tensor>& tensors, const AllreduceOptions& options = {}) override;
  WorkPtr broadcast(const std::vector<Tensor>& tensors, const BroadcastOptions& options = {}) override;
  WorkPtr allgather(const std::vector<Tensor>& outputs, const Tensor& input,
                    const AllgatherOptions& options = {}) override;
  WorkPtr reduceScatter(const Tensor& output, const std::vector<Tensor>& inputs,
                        const ReduceScatterOptions& options = {}) override;
  WorkPtr reduce(const std::vector<Tensor>& tensors, const ReduceOptions& options = {}) override;
  // An allreduce of one element; wait() blocks the host. Its device, by the
  // first rule that applies (nccl::chooseDevice, comm_lifecycle.h): the
  // options' device; the device of this backend's last op; the calling
  // thread's current device when it is not cuda:0; cuda:(LOCAL_RANK mod the
  // device count) (the launcher's contract, LOCAL_RANK read at construction,
  // else SLURM_LOCALID); cuda:0 when the process already holds its context or
  // the group has one rank. Otherwise (a PyTorch-style program that inits and
  // barriers without choosing a device, outside dtrun) it throws
  // InvalidArgument naming rank, group, op and seq, with the hint to call
  // dt::setCurrentDevice(Device::cuda(localRank)) first or pass the device:
  // every rank would take cuda:0, which NCCL refuses at world >= 2.
  WorkPtr barrier(const BarrierOptions& options = {}) override;
  WorkPtr send(const std::vector<Tensor>& tensors, int dstRank, const SendOptions& options = {}) override;
  WorkPtr recv(const std::vector<Tensor>& tensors, int srcRank, const RecvOptions& options = {}) override;
  // One NCCL group call for the whole batch, one Work.
  WorkPtr batchIsendIrecv(const std::vector<P2POp>& ops) override;
  WorkPtr allToAll(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                   const AllToAllOptions& options = {}) override;
  WorkPtr gather(const std::vector<Tensor>& outputs, const Tensor& input, const GatherOptions& options = {}) override;
  WorkPtr scatter(const Tensor& output, const std::vector<Tensor>& inputs, const ScatterOptions& options = {}) override;
  WorkPtr allgatherIntoTensor(const Tensor& output, const Tensor& input, const AllgatherOptions& options = {}) override;
  WorkPtr reduceScatterTensor(const Tensor& output, const Tensor& input,
                              const ReduceScatterOptions& options = {}) override;
  WorkPtr allToAllSingle(const Tensor& output, const Tensor& input, const std::vector<int64_t>& outputSplits,
                         const std::vector<int64_t>& inputSplits, const AllToAllOptions& options = {}) override;
  // Through the store (CollectiveRunner::monitoredBarrier), after the
  // collectives issued before it have completed on the GPU.
  WorkPtr monitoredBarrier(const BarrierOptions& options = {}) override;

  std::exception_ptr brokenCause() const override;
  void abort(std::exception_ptr cause) override;
  void shutdown() override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dt
