// dtrain as a PyTorch process group (LibTorch C++; the Python module dtrain_torch wraps it).
//
// Contract:
//  * ProcessGroupDtrain is a c10d::ProcessGroup (torch 1.13) whose ops run on one
//    dt::ProcessGroup: CPU tensors through shared memory on one host, Gloo across hosts, both
//    for several ranks on several hosts (process_group.h's routing, DT_BACKEND forces one).
//    Tensors are not copied: each at::Tensor is wrapped in place (dt::fromBlob) and kept alive
//    by the op until it has completed, whether or not the caller keeps the Work.
//  * Ops: broadcast, allreduce, allreduce_coalesced, reduce, allgather, _allgather_base,
//    gather, scatter, reduce_scatter, _reduce_scatter_base, alltoall_base, alltoall, send,
//    recv, barrier, monitoredBarrier. Reduce ops SUM, AVG, PRODUCT, MIN, MAX over float32,
//    float64, float16, bfloat16, int32, int64, bool. Ops that only move data also take uint8,
//    int8 and int16 (moved as bytes; torch's object collectives send uint8). Anything else
//    (recvAnysource, allgather_coalesced, BAND/BOR/BXOR/PREMUL_SUM, complex dtypes, CUDA
//    tensors) throws c10::Error reading "ProcessGroup dtrain does not support <op> ...", as
//    torch's own backends do. Bad input dtrain finds (shapes, roots) throws dt::InvalidArgument
//    at the call.
//  * Work (c10d::Work): wait() blocks until the op completed and rethrows dtrain's error
//    (dt::TimeoutError, dt::BackendError, dt::DesyncError: who is stuck, who died, what each
//    rank called); wait(timeout) with a non-zero timeout throws dt::TimeoutError when the op is
//    still running then (the op continues). isCompleted(), isSuccess(), exception() never
//    block. getFuture() returns a c10::ivalue::Future of the op's output tensors (a
//    List[Tensor]; empty for barrier and send) that completes, or fails with dtrain's error,
//    on dtrain's callback threads (work.h), never on the group's worker. result() is the same
//    tensors.
//  * Blocking: an op call returns at once with its Work; create() blocks until every rank of
//    the group joined (up to the timeout) and throws dt::TimeoutError naming the missing ranks.
//  * Timeouts: the group's is CreateOptions::timeout (torch's init_process_group/new_group
//    timeout, 30 min unless given); an op's own where torch passes one (its options' timeout),
//    else the group's. A lost peer fails the ops at once, not at the timeout (shm: its pid is
//    watched; Gloo: its socket closes, and the report names it after a 750 ms failure-report
//    window, shorter than dtrain's default, with a 250 ms progress heartbeat to match).
//  * Thread safety: as dt::ProcessGroup: issue one group's collectives from one thread, in the
//    same order on every rank; Works and futures may be used from any thread.
//  * Ownership: the group owns its dt::ProcessGroup; destroying it (or the last reference)
//    shuts the dt group down, failing ops still queued with "destroyed".
//  * Stores: DtrainStore is a dt::Store seen as a c10d::Store, so torch.distributed's own
//    store calls (its store-based barrier, user code's store.set/get) go to dtrain's TcpStore
//    or EtcdStore. create() uses dtrain's store for the group when it is given one (a
//    DtrainStore, maybe inside torch's PrefixStore), else the launcher's store when dtrun set
//    DT_STORE_ADDR / DT_ETCD_ENDPOINTS, else a dtrain TcpStore that group rank 0 starts and
//    announces through the store torch gave it (a plain torchrun job).
//
// Versions: written and tested against torch 1.13 (Debian 12's libtorch-dev), where a
// third-party backend is a c10d::ProcessGroup. torch 2.x splits that into c10d::Backend (the
// ops, same signatures) under a dispatching c10d::ProcessGroup: TORCH_VERSION_MAJOR >= 2 picks
// c10d::Backend as the base below; that branch has not been compiled (no 2.x torch here).
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace dt {
class ProcessGroup;
class Store;
}  // namespace dt

namespace dt::torch_shim {

#if TORCH_VERSION_MAJOR >= 2
using TorchBackendBase = c10d::Backend;
#else
using TorchBackendBase = c10d::ProcessGroup;
#endif

// A dt::Store as a c10d::Store. Values are bytes both ways; add() counters are decimal ASCII on
// both sides, so torch's and dtrain's code can share keys. Errors are dtrain's
// (dt::TimeoutError naming the keys still missing, dt::NetworkError). Thread-safe as the
// dt::Store is. watchKey is not supported (c10::Error).
class DtrainStore : public c10d::Store {
 public:
  explicit DtrainStore(std::shared_ptr<dt::Store> store);
  ~DtrainStore() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  void setTimeout(const std::chrono::milliseconds& timeout) override;

  const std::shared_ptr<dt::Store>& store() const { return store_; }

 private:
  std::shared_ptr<dt::Store> store_;
};

// The launcher's store (dtrun's TcpStore at DT_STORE_ADDR, etcd at DT_ETCD_ENDPOINTS; else rank
// 0 hosts one at MASTER_ADDR:MASTER_PORT, torch's env://), as a DtrainStore: what the Python
// module's "dtrain://" init method returns. Blocks until connected (DT_STORE_CONNECT_TIMEOUT).
c10::intrusive_ptr<DtrainStore> connectLauncherStore(int rank, int worldSize, std::chrono::milliseconds timeout);

struct CreateOptions {
  // torch's name for the group ("0" for the default group, then "1", ...); keys of the group
  // live under "torch/<groupId>/" in dtrain's store.
  std::string groupId = "0";
  // The group's ranks in the default group's numbering; empty: this is the default group.
  std::vector<int64_t> globalRanks;
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
};

class ProcessGroupDtrain : public TorchBackendBase {
 public:
  // Collective over the group's ranks (see "Stores" above for which store it uses).
  static c10::intrusive_ptr<ProcessGroupDtrain> create(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                       int size, CreateOptions options = {});
  // Over a dt group the caller made (its rank and size become this group's).
  explicit ProcessGroupDtrain(std::shared_ptr<dt::ProcessGroup> group);
  ~ProcessGroupDtrain() override;

  const std::string getBackendName() const override { return "dtrain"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions(), bool waitAllRanks = false) override;
  // dtrain numbers a group's collectives from 1 by itself; torch's call to agree on a start is
  // a no-op, and the number read back is the last collective's.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override;

  dt::ProcessGroup& group() const { return *group_; }
  // The error that broke the group (a lost rank, a timeout, a desync), or nullptr.
  std::exception_ptr brokenCause() const;
  // Breaks the group with `reason`: every op in flight or queued fails with it. Any thread.
  void abort(const std::string& reason);

 private:
  std::shared_ptr<dt::ProcessGroup> group_;
};

}  // namespace dt::torch_shim
