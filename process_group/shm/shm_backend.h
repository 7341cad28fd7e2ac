// ShmBackend: collectives on CPU tensors through shared memory, for groups
// whose ranks all run on one host.
//
// Contract (in addition to backend.h):
//  * The constructor is collective: it maps the group's segment
//    (shm_segment.h) and returns once every rank has mapped it, or throws
//    TimeoutError after the group timeout. Nothing of the group stays in
//    /dev/shm once all ranks have mapped it.
//  * Every op of the Backend interface, with Gloo's dtypes (float32, float64,
//    float16, bfloat16, int32, int64; bool for sum/min/max/product) and
//    reduce ops (sum, avg, min, max, product), reduced by collectives/
//    reduce_kernels. Results are bitwise identical on every rank: each
//    element is reduced by one rank, over the ranks in order 0..size-1.
//  * Collectives run through the CollectiveRunner (issue order, sequence
//    numbers, Work semantics, failure reports; an op waited for right away
//    runs on the waiting thread, so a small op pays no thread wake-up).
//    Allreduce: up to smallBytes every rank reduces every input (one
//    exchange); above, reduce-scatter + allgather in rounds of slotBytes, every
//    rank reducing its own slice in parallel.
//  * Every collective compares a hash of its fingerprint with every other
//    rank's at its first exchange; a mismatch becomes a DesyncError naming
//    what each rank called (no DT_DEBUG needed).
//  * send/recv go through per-pair channels in the segment, on a p2p thread
//    started by the first of them; a send completes once its data is in the
//    channel, a recv once the data is in its tensors. Messages from one peer
//    arrive in send order; one whose tag nobody has posted yet is held
//    until a recv with that tag is posted.
//  * Failure: a peer whose process is gone, whose heartbeat stopped, or that
//    aborted the group fails the op at once (BackendError naming it); a
//    deadline passing fails it with TimeoutError saying who never started the
//    op. Either aborts the group's shared memory so every rank fails promptly.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "process_group/backend.h"
#include "process_group/collective_runner.h"
#include "store/store.h"

namespace dt {

struct ShmBackendOptions : BackendCommonOptions {
  // Bytes each rank exchanges per round (two buffers of it per rank).
  size_t slotBytes = size_t{1} << 20;
  size_t smallBytes = size_t{16} << 10;
  // Round size of broadcast and allgather (copy in, copy out: pipelined).
  size_t pipelineBytes = size_t{256} << 10;
  // Round size of allreduce's reduce-scatter + allgather.
  size_t allreduceRoundBytes = size_t{512} << 10;
  // A peer whose heartbeat has not moved for this long counts as gone.
  std::chrono::milliseconds heartbeatTimeout = std::chrono::seconds(5);
};

class ShmBackend final : public Backend {
 public:
  ShmBackend(StorePtr store, int rank, int size, ShmBackendOptions options = {});
  ~ShmBackend() override;

  std::string name() const override { return "shm"; }
  int rank() const override;
  int size() const override;

  WorkPtr allreduce(const std::vector<Tensor>& tensors, const AllreduceOptions& options = {}) override;
  WorkPtr broadcast(const std::vector<Tensor>& tensors, const BroadcastOptions& options = {}) override;
  WorkPtr allgather(const std::vector<Tensor>& outputs, const Tensor& input,
                    const AllgatherOptions& options = {}) override;
  WorkPtr reduceScatter(const Tensor& output, const std::vector<Tensor>& inputs,
                        const ReduceScatterOptions& options = {}) override;
  WorkPtr reduce(const std::vector<Tensor>& tensors, const ReduceOptions& options = {}) override;
  WorkPtr barrier(const BarrierOptions& options = {}) override;
  WorkPtr send(const std::vector<Tensor>& tensors, int dstRank, const SendOptions& options = {}) override;
  WorkPtr recv(const std::vector<Tensor>& tensors, int srcRank, const RecvOptions& options = {}) override;
  WorkPtr allToAll(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                   const AllToAllOptions& options = {}) override;
  WorkPtr gather(const std::vector<Tensor>& outputs, const Tensor& input, const GatherOptions& options = {}) override;
  WorkPtr scatter(const Tensor& output, const std::vector<Tensor>& inputs, const ScatterOptions& options = {}) override;
  WorkPtr allgatherIntoTensor(const Tensor& output, const Tensor& input, const AllgatherOptions& options = {}) override;
  WorkPtr reduceScatterTensor(const Tensor& output, const Tensor& input,
                              const ReduceScatterOptions& options = {}) override;
  WorkPtr allToAllSingle(const Tensor& output, const Tensor& input, const std::vector<int64_t>& outputSplits,
                         const std::vector<int64_t>& inputSplits, const AllToAllOptions& options = {}) override;
  WorkPtr monitoredBarrier(const BarrierOptions& options = {}) override;

  std::exception_ptr brokenCause() const override;
  void abort(std::exception_ptr cause) override;
  void shutdown() override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dt
