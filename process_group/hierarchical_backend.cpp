#include "process_group/hierarchical_backend.h"

#include <algorithm>

#include "collectives/reduce_kernels.h"
#include "common/check.h"
#include "common/errors.h"
#include "common/strings.h"
#include "process_group/cpu_tensors.h"
#include "store/prefix_store.h"

namespace dt {

HierarchicalBackend::HierarchicalBackend(StorePtr store, int rank, int size, const std::vector<int>& hostOf,
                                         GlooBackendOptions gloo, ShmBackendOptions shm)
    : rank_(rank), size_(size) {
  DT_CHECK_EQ(static_cast<int>(hostOf.size()), size, "HierarchicalBackend: one host index per rank");
  const int host = hostOf[rank];
  std::vector<int> localRanks, leaderRanks;
  for (int r = 0; r < size; ++r) {
    if (hostOf[r] == host) localRanks.push_back(r);
    if (std::find(hostOf.begin(), hostOf.begin() + r, hostOf[r]) == hostOf.begin() + r) leaderRanks.push_back(r);
  }
  const int localRank = static_cast<int>(std::find(localRanks.begin(), localRanks.end(), rank) - localRanks.begin());
  leader_ = localRank == 0;

  ShmBackendOptions local = shm;
  local.groupName = str(shm.groupName, ".host", host);
  local.globalRanks.clear();
  for (int r : localRanks) local.globalRanks.push_back(shm.globalRanks.empty() ? r : shm.globalRanks[r]);
  local.watchdogStore = nullptr;
  local_ = std::make_shared<ShmBackend>(std::make_shared<PrefixStore>(str("host", host), store), localRank,
                                        static_cast<int>(localRanks.size()), local);
  if (leader_) {
    GlooBackendOptions leaders = gloo;
    leaders.groupName = str(gloo.groupName, ".leaders");
    leaders.globalRanks.clear();
    for (int r : leaderRanks) leaders.globalRanks.push_back(gloo.globalRanks.empty() ? r : gloo.globalRanks[r]);
    leaders.watchdogStore = nullptr;
    leaders_ = std::make_shared<GlooBackend>(std::make_shared<PrefixStore>("leaders", store), host,
                                             static_cast<int>(leaderRanks.size()), leaders);
  }
  whole_ = std::make_shared<GlooBackend>(store, rank, size, gloo);

  runner_ = std::make_unique<CollectiveRunner>(std::make_shared<PrefixStore>("hier", store), rank, size,
                                               gloo.runnerOptions("shm+gloo"),
                                               [this] {
                                                 local_->shutdown();
                                                 if (leaders_) leaders_->shutdown();
                                               });
}

HierarchicalBackend::~HierarchicalBackend() { shutdown(); }

WorkPtr HierarchicalBackend::allreduce(const std::vector<Tensor>& tensors, const AllreduceOptions& options) {
  CollectiveFingerprint fp = checkAllreduce(
      CpuCallSite{runner_->who(), "shm+gloo", rank_, size_, options.seq}, tensors, options);
  const ReduceOp op = options.reduceOp;
  return runner_->enqueue(options.seq, "allreduce", std::move(fp), options.timeout,
                          [this, tensors = tensors, op](std::chrono::milliseconds limit, const CollectiveFingerprint&) {
                            Staged staged = stage(tensors);
                            // Sums within and across hosts; the leaders divide once for Avg.
                            const ReduceOp sum = op == ReduceOp::Avg ? ReduceOp::Sum : op;
                            for (auto& b : staged.buffers) {
                              local_->reduce({b}, {.reduceOp = sum, .root = 0, .timeout = limit})->wait();
                              if (leader_) {
                                leaders_->allreduce({b}, {.reduceOp = sum, .timeout = limit})->wait();
                                if (op == ReduceOp::Avg) divideBy(b.dtype(), b.dataPtr(), static_cast<size_t>(b.numel()), size_);
                              }
                              local_->broadcast({b}, {.root = 0, .timeout = limit})->wait();
                            }
                            staged.copyBack();
                          });
}

WorkPtr HierarchicalBackend::broadcast(const std::vector<Tensor>& tensors, const BroadcastOptions& options) {
  return whole_->broadcast(tensors, options);
}
WorkPtr HierarchicalBackend::allgather(const std::vector<Tensor>& outputs, const Tensor& input,
                                       const AllgatherOptions& options) {
  return whole_->allgather(outputs, input, options);
}
WorkPtr HierarchicalBackend::reduceScatter(const Tensor& output, const std::vector<Tensor>& inputs,
                                           const ReduceScatterOptions& options) {
  return whole_->reduceScatter(output, inputs, options);
}
WorkPtr HierarchicalBackend::reduce(const std::vector<Tensor>& tensors, const ReduceOptions& options) {
  return whole_->reduce(tensors, options);
}
WorkPtr HierarchicalBackend::barrier(const BarrierOptions& options) { return whole_->barrier(options); }
WorkPtr HierarchicalBackend::send(const std::vector<Tensor>& tensors, int dstRank, const SendOptions& options) {
  return whole_->send(tensors, dstRank, options);
}
WorkPtr HierarchicalBackend::recv(const std::vector<Tensor>& tensors, int srcRank, const RecvOptions& options) {
  return whole_->recv(tensors, srcRank, options);
}
WorkPtr HierarchicalBackend::allToAll(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                                      const AllToAllOptions& options) {
  return whole_->allToAll(outputs, inputs, options);
}
WorkPtr HierarchicalBackend::gather(const std::vector<Tensor>& outputs, const Tensor& input, const GatherOptions& options) {
  return whole_->gather(outputs, input, options);
}
WorkPtr HierarchicalBackend::scatter(const Tensor& output, const std::vector<Tensor>& inputs,
                                     const ScatterOptions& options) {
  return whole_->scatter(output, inputs, options);
}
WorkPtr HierarchicalBackend::allgatherIntoTensor(const Tensor& output, const Tensor& input,
                                                 const AllgatherOptions& options) {
  return whole_->allgatherIntoTensor(output, input, options);
}
WorkPtr HierarchicalBackend::reduceScatterTensor(const Tensor& output, const Tensor& input,
                                                 const ReduceScatterOptions& options) {
  return whole_->reduceScatterTensor(output, input, options);
}
WorkPtr HierarchicalBackend::allToAllSingle(const Tensor& output, const Tensor& input,
                                            const std::vector<int64_t>& outputSplits,
                                            const std::vector<int64_t>& inputSplits, const AllToAllOptions& options) {
  return whole_->allToAllSingle(output, input, outputSplits, inputSplits, options);
}
WorkPtr HierarchicalBackend::monitoredBarrier(const BarrierOptions& options) { return whole_->monitoredBarrier(options); }

std::exception_ptr HierarchicalBackend::brokenCause() const {
  if (auto cause = runner_->brokenCause()) return cause;
  return whole_->brokenCause();
}

void HierarchicalBackend::abort(std::exception_ptr cause) {
  runner_->fail(cause);
  for (Backend* part : {local_.get(), leaders_.get(), whole_.get()}) {
    if (part != nullptr) part->abort(cause);
  }
}

void HierarchicalBackend::shutdown() {
  if (runner_) runner_->shutdown();
  if (local_) local_->shutdown();
  if (leaders_) leaders_->shutdown();
  if (whole_) whole_->shutdown();
}

}  // namespace dt
