// GlooBackend: collectives on CPU tensors over Gloo's TCP transport.
//
// Contract (in addition to backend.h):
//  * The constructor rendezvouses through `store` (already scoped to the
//    group; Gloo's keys go under "<that scope>/gloo/") and connects a full
//    mesh; it blocks until every rank of the group has arrived or the group
//    timeout passes (TimeoutError naming the missing ranks' keys).
//  * Collectives run on one worker thread per backend, in issue order; send
//    and recv are posted to the transport at issue time and waited for on a
//    second thread, so p2p exchanges cannot deadlock behind each other.
//    Several backends (groups) progress independently.
//  * Dtypes float32, float64, float16, bfloat16, int32, int64 (and bool for
//    sum/min/max/product); reduce ops sum, avg, min, max, product, reduced
//    with collectives/reduce_kernels (Gloo itself only moves bytes here).
//  * Allreduce picks its algorithm by size (allreduce_algorithms.h):
//    recursive doubling, halving-doubling, or Gloo's ring; DT_GLOO_ALLREDUCE
//    or options.allreduceAlgorithm forces one.
//  * Failure: a timeout fails the Work with TimeoutError saying which ranks
//    never started the collective and which are waiting in it (read from the
//    ranks' progress keys); a lost peer fails it with BackendError naming the
//    ranks that stopped responding. The backend then closes its connections
//    (so peers fail promptly instead of waiting for their timeout) and is
//    broken: every later call fails at once with the original cause.
//  * DT_DEBUG=detail (options.checkFingerprints): before every collective the
//    ranks exchange fingerprints through the store; a mismatch raises
//    DesyncError on every rank naming what each side called.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "process_group/backend.h"
#include "process_group/collective_runner.h"
#include "process_group/gloo/allreduce_algorithms.h"
#include "store/store.h"

namespace dt {

struct GlooBackendOptions : BackendCommonOptions {
  // Address the TCP transport binds and advertises to peers.
  std::string hostname = "127.0.0.1";
  // nullopt: DT_GLOO_ALLREDUCE. Every rank of a group must use the same.
  std::optional<GlooAllreduceAlgorithm> allreduceAlgorithm;
  // Run Gloo's event-loop thread under SCHED_BATCH (see gloo_backend.cpp).
  // nullopt: DT_GLOO_BATCH_LOOP.
  std::optional<bool> batchEventLoop;
};

class GlooBackend final : public Backend {
 public:
  GlooBackend(StorePtr store, int rank, int size, GlooBackendOptions options = {});
  ~GlooBackend() override;

  std::string name() const override { return "gloo"; }
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
