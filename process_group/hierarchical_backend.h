// HierarchicalBackend: CPU collectives for a group whose ranks sit on
// several hosts, some of them with more than one rank.
//
// Contract (in addition to backend.h):
//  * allreduce: shared memory within each host (reduce to the host's first
//    rank, its leader), Gloo among the leaders, shared memory again to
//    broadcast the result on each host. Results are bitwise identical on every
//    rank (they come from the leaders' allreduce). Runs through its own
//    CollectiveRunner (issue order, the group's sequence numbers); an error of
//    a step fails the op with that step's error as the cause.
//  * Every other op goes to a Gloo backend over the whole group.
//  * The constructor is collective over the group (it creates the host's shm
//    group, the leaders' Gloo group and the whole group's Gloo group) and
//    takes the group's store scope; hostOf[r] is rank r's host index
//    (0..hosts-1, the order in which hosts first appear among the ranks).
#pragma once

#include <memory>
#include <vector>

#include "process_group/backend.h"
#include "process_group/collective_runner.h"
#include "process_group/gloo/gloo_backend.h"
#include "process_group/shm/shm_backend.h"
#include "store/store.h"

namespace dt {

class HierarchicalBackend final : public Backend {
 public:
  HierarchicalBackend(StorePtr store, int rank, int size, const std::vector<int>& hostOf, GlooBackendOptions gloo,
                      ShmBackendOptions shm);
  ~HierarchicalBackend() override;

  std::string name() const override { return "shm+gloo"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

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

 private:
  int rank_;
  int size_;
  bool leader_ = false;
  std::shared_ptr<Backend> local_;    // shm among this host's ranks
  std::shared_ptr<Backend> leaders_;  // gloo among the hosts' leaders (leaders only)
  std::shared_ptr<Backend> whole_;    // gloo over the whole group
  std::unique_ptr<CollectiveRunner> runner_;
};

}  // namespace dt
