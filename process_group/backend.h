// Backend: one communication library (Gloo, NCCL) bound to one group of ranks.
//
// Contract:
//  * Every op returns a Work at once; ops execute in issue order on the
//    backend's own thread(s), so every rank runs the collectives of a group
//    in the same order. Tensors passed in must stay alive and untouched until
//    the Work completes (the backend keeps handles, not copies, except where
//    it must make a contiguous copy of a strided tensor; it copies results
//    back before completing the Work).
//  * An op the backend lacks throws NotSupportedError naming the backend and
//    the op (the default implementations below). Input errors (wrong dtype,
//    device, shape, rank) throw InvalidArgument at the call, before anything is
//    queued.
//  * Errors during an op fail its Work with TimeoutError / BackendError /
//    DesyncError naming group, op, sequence number and peer ranks. After such
//    a failure the backend is broken: later calls return Works failed with
//    the original cause, at once.
//  * Thread safety: ops may be issued from any thread; concurrent issue from
//    several threads is serialised in an unspecified order, so issue
//    collectives from one thread (or order them yourself) as every rank must
//    issue them in the same order.
//  * Shapes: allreduce/broadcast/reduce take a list of tensors, each reduced
//    elementwise with the same tensor on the other ranks. allgather takes one
//    input and `size()` outputs of its shape; reduceScatter one output and
//    `size()` inputs of its shape; allToAll `size()` inputs and `size()`
//    outputs (input j goes to rank j, output i comes from rank i; sizes may
//    differ per peer but must match pairwise). gather: every rank's input of
//    one shape; the root passes `size()` outputs of it, the others none.
//    scatter: the mirror image. The *IntoTensor / *Tensor / *Single forms
//    take one buffer of `size()` equal blocks, block r for rank r, cut from
//    its elements in row-major order (a [size * n, ...] or [size, n, ...]
//    tensor is cut along dim 0; any strides); allToAllSingle cuts input and output along dim 0 by the
//    split sizes (row counts per rank; empty: equal), which must match
//    pairwise across ranks.
//  * monitoredBarrier: a barrier coordinated by rank 0 through the store, not
//    the transport, so that it can name the ranks that did not arrive within
//    the timeout: the Work fails on every rank with a TimeoutError naming
//    them (and the group is broken, as after any failed collective).
//  * batchIsendIrecv posts every send and recv of the batch in order before
//    any is waited for (so a batch that both sends to and receives from the
//    same peers cannot deadlock) and returns one Work that completes when
//    all have. Bad input anywhere in the batch throws before anything is
//    posted.
#pragma once

#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "collectives/options.h"
#include "process_group/work.h"
#include "tensor/tensor.h"

namespace dt {

// One send or recv of a batch (batchIsendIrecv).
struct P2POp {
  bool isSend = true;
  std::vector<Tensor> tensors;
  int peer = 0;
  uint32_t tag = 0;
  OpTimeout timeout;

  static P2POp send(std::vector<Tensor> tensors, int peer, uint32_t tag = 0) {
    return {true, std::move(tensors), peer, tag, std::nullopt};
  }
  static P2POp recv(std::vector<Tensor> tensors, int peer, uint32_t tag = 0) {
    return {false, std::move(tensors), peer, tag, std::nullopt};
  }
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "gloo", "nccl".
  virtual std::string name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  virtual WorkPtr allreduce(const std::vector<Tensor>& tensors, const AllreduceOptions& options = {});
  virtual WorkPtr broadcast(const std::vector<Tensor>& tensors, const BroadcastOptions& options = {});
  virtual WorkPtr allgather(const std::vector<Tensor>& outputs, const Tensor& input,
                            const AllgatherOptions& options = {});
  virtual WorkPtr reduceScatter(const Tensor& output, const std::vector<Tensor>& inputs,
                                const ReduceScatterOptions& options = {});
  virtual WorkPtr reduce(const std::vector<Tensor>& tensors, const ReduceOptions& options = {});
  virtual WorkPtr barrier(const BarrierOptions& options = {});
  virtual WorkPtr send(const std::vector<Tensor>& tensors, int dstRank, const SendOptions& options = {});
  virtual WorkPtr recv(const std::vector<Tensor>& tensors, int srcRank, const RecvOptions& options = {});
  virtual WorkPtr allToAll(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                           const AllToAllOptions& options = {});
  virtual WorkPtr gather(const std::vector<Tensor>& outputs, const Tensor& input, const GatherOptions& options = {});
  virtual WorkPtr scatter(const Tensor& output, const std::vector<Tensor>& inputs, const ScatterOptions& options = {});
  virtual WorkPtr allgatherIntoTensor(const Tensor& output, const Tensor& input, const AllgatherOptions& options = {});
  virtual WorkPtr reduceScatterTensor(const Tensor& output, const Tensor& input,
                                      const ReduceScatterOptions& options = {});
  virtual WorkPtr allToAllSingle(const Tensor& output, const Tensor& input, const std::vector<int64_t>& outputSplits,
                                 const std::vector<int64_t>& inputSplits, const AllToAllOptions& options = {});
  virtual WorkPtr monitoredBarrier(const BarrierOptions& options = {});
  // The default posts the batch's ops one by one (after checkBatch); a
  // backend whose transport can launch them together (NCCL's group calls)
  // overrides it.
  virtual WorkPtr batchIsendIrecv(const std::vector<P2POp>& ops);

  // The error that broke the backend, or nullptr while healthy.
  virtual std::exception_ptr brokenCause() const { return nullptr; }
  // Breaks the backend with `cause` (the first cause wins) and aborts its
  // transfers: every op in flight or queued fails at once with it (in its
  // own words, with the op's context), and so does every later op. For a
  // caller that knows a peer is gone before the transport does (an elastic
  // job told that a member died). Any thread; idempotent.
  virtual void abort(std::exception_ptr cause) = 0;
  // Stops the worker(s), failing queued work with an error saying the group
  // was shut down, and closes connections. Idempotent; the destructor calls it.
  virtual void shutdown() {}

 protected:
  // batchIsendIrecv's checks of the whole batch (peers, non-empty, one dtype
  // and device per op); throws InvalidArgument before anything is posted.
  void checkBatch(const std::vector<P2POp>& ops) const;
  [[noreturn]] void throwNotSupported(const std::string& op) const;
};

using BackendPtr = std::shared_ptr<Backend>;

}  // namespace dt
