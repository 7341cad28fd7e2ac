// ProcessGroup: a set of ranks that run collectives together.
//
// Contract:
//  * Creating a group is collective: every rank of it calls create() (or
//    newGroup() on the parent) with the same name/ranks, and it returns once
//    all have connected (or throws TimeoutError after the group timeout).
//  * Every collective gets the next sequence number of the group (1, 2, ...),
//    assigned at issue; it appears in every error about that call. A call
//    rejected at issue (bad input) consumes no number and throws
//    InvalidArgument reading "[rank 0/2 pg=default gloo] reduce #1 (not
//    issued): root 2 is not a rank of the group (size 2)". send/recv are not
//    collectives and are not numbered.
//  * Every Work carries its result tensors (Work::result(), Work::future()):
//    the reduced/broadcast tensors, the gather/scatter outputs, a recv's
//    tensors; none for barriers and sends.
//  * isBroken()/brokenCause(): after a failed collective (timeout, lost
//    peer, desync, failed monitoredBarrier) the group is broken and every
//    later op fails at once with that cause. A Work::wait(timeout) that
//    merely expired leaves the group healthy.
//  * Routing: each call goes to the backend for its tensors' device. CUDA ->
//    nccl, created lazily by the first call on CUDA tensors (its
//    communicators by the first op on each device; see
//    nccl/nccl_backend.h). A build without NCCL or a machine without a CUDA
//    device throws NotSupportedError naming the device and the reason.
//    backend "nccl" also sends barrier() to NCCL; "gloo"/"shm" reject CUDA
//    tensors (InvalidArgument). CPU: at creation the
//    ranks exchange host ids (localHostId()); a group on one host uses shm
//    (shared memory), a group with one rank per host gloo, and a group with
//    several ranks on several hosts both (shm within a host, gloo across:
//    hierarchical allreduce). options.backend ("gloo", "shm") forces one
//    (shm across hosts is an InvalidArgument naming the hosts). Rank 0 logs
//    the choice once (info).
//  * Store keys live under "pg/<name>/<instance>/..." (instance counts
//    re-creations of the same name, so destroy() + create() in one process
//    works); a subgroup's under "<parent's scope>/sub<k>/".
//  * newGroup(ranks) must be called by every rank of the parent, in the same
//    order. Ranks outside `ranks` get a non-member handle: isMember() is false
//    and every op throws InvalidArgument saying so.
//  * The flight recorder (flight_recorder.h) records every send, recv and
//    batchIsendIrecv here, numbered per group (p2p_seq) apart from the
//    collectives, which CollectiveRunner records; a thenInline callback marks
//    the entry done or failed (on the completing thread, a moment after a
//    waiter is released: a dump in that moment still reads running).
//  * Thread safety: ops may be issued from several threads, but ranks must
//    agree on the order, so issue one group's collectives from one thread.
//    Different groups are independent. destroy() is idempotent; the
//    destructor calls it.
//  * Blocking: a collective's call into its backend may block (NCCL makes a
//    device's communicator at its first op, up to the timeout). The group
//    holds its issue lock across that call, so that sequence order is issue
//    order: a second thread issuing on the same group waits behind it. Sends
//    and recvs take no issue lock. abort(), brokenCause(), isBroken() and
//    lastSeq() never wait for the issue lock or for a call in progress (they
//    take a short lock that no backend call is made under): an abort from
//    another thread (an elastic job's watcher) reaches an op blocked in its
//    backend at once, and that op fails with the abort's cause. destroy()
//    takes no issue lock either: it shuts the backends down while the call is
//    in progress (Backend::shutdown, which for a healthy NCCL backend lets the
//    ops on the device finish first), and the call keeps its backend alive
//    until it returns.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "collectives/options.h"
#include "process_group/backend.h"
#include "process_group/flight_recorder.h"  // FlightContext, for the code that issues ops
#include "store/store.h"
#include "tensor/tensor.h"

namespace dt {

// What ProcessGroupOptions::cpuBackendFactory gets: the group a backend is
// made for, as the built-in backends get it.
struct BackendContext {
  StorePtr store;  // the group's scope of the store (keys under it are the group's own)
  int rank = 0;
  int size = 1;
  std::string groupName;
  int instance = 0;  // which creation of the root group's name (flight recorder)
  std::chrono::milliseconds timeout{0};
  std::vector<int> globalRanks;  // the group's ranks in the parent's numbering
};

struct ProcessGroupOptions {
  std::string name = "default";
  // Default op and set-up timeout; nullopt: DT_PG_TIMEOUT (10 min).
  std::optional<std::chrono::milliseconds> timeout;
  // "" routes by device and host; "gloo" or "shm" forces the CPU backend (and
  // rejects CUDA tensors); "nccl" routes as "" does and also puts barrier()
  // on NCCL (DT_HAVE_NCCL builds only).
  std::string backend;
  // This rank's host identity for routing; "" -> localHostId(). Ranks with
  // the same id share memory (threads of one test may pretend otherwise).
  std::string hostId;
  // Address Gloo's TCP transport binds/advertises; "" -> 127.0.0.1.
  std::string glooHostname;
  // nullopt: DT_DEBUG=detail.
  std::optional<bool> checkFingerprints;
  // Launcher hang watchdog (see docs/process_group.md): "<seq> <op>" of the
  // last completed collective goes to watchdogStore[watchdogKey].
  StorePtr watchdogStore;
  std::string watchdogKey;
  std::chrono::milliseconds progressInterval = std::chrono::seconds(1);
  // How long a rank that lost a peer waits for the others' failure reports
  // before it names the silent ones (an elastic job, which learns who died
  // from its launcher, keeps it short).
  std::chrono::milliseconds failureReportWindow = std::chrono::milliseconds(2500);
  // This rank's GPU (a CUDA device), for NCCL ops that bring no tensor to tell it: a barrier
  // that is the group's first NCCL op. Unset: NcclBackend::barrier's rule (the last op's device,
  // a non-zero current device, cuda:(LOCAL_RANK mod the device count), else a one-line refusal).
  // Subgroups inherit it.
  std::optional<Device> device;
  // Makes the backend for CPU tensors instead of the built-in choice (shm,
  // gloo or both by host layout): a transport of one's own, or a double of one
  // in a test. Called once per group by create() / newGroup() on every member
  // (newGroup passes the parent's on unless the subgroup's options name a
  // backend or a factory of their own); it may block (a collective set-up
  // over context.store) and throw, and create() then throws its error. The
  // backend keeps backend.h's contract; its rank() and size() must be the
  // group's. Not with backend "gloo" or "shm" (InvalidArgument); with "nccl",
  // barrier() still goes to NCCL.
  std::function<BackendPtr(const BackendContext& context)> cpuBackendFactory;
};

class ProcessGroup {
 public:
  static std::shared_ptr<ProcessGroup> create(StorePtr store, int rank, int size, ProcessGroupOptions options = {});
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // Rank and size in this group (-1 and the member count for a non-member).
  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return options_.name; }
  bool isMember() const { return rank_ >= 0; }
  // Ranks of this group in the parent's (for the default group: global) numbering.
  const std::vector<int>& parentRanks() const { return parentRanks_; }
  // The sequence number of the last collective issued.
  uint64_t lastSeq() const;
  std::chrono::milliseconds timeout() const { return timeout_; }

  WorkPtr allreduce(const std::vector<Tensor>& tensors, AllreduceOptions options = {});
  WorkPtr allreduce(const Tensor& tensor, AllreduceOptions options = {});
  WorkPtr broadcast(const std::vector<Tensor>& tensors, BroadcastOptions options = {});
  WorkPtr broadcast(const Tensor& tensor, BroadcastOptions options = {});
  WorkPtr allgather(const std::vector<Tensor>& outputs, const Tensor& input, AllgatherOptions options = {});
  WorkPtr reduceScatter(const Tensor& output, const std::vector<Tensor>& inputs, ReduceScatterOptions options = {});
  WorkPtr reduce(const std::vector<Tensor>& tensors, ReduceOptions options = {});
  WorkPtr reduce(const Tensor& tensor, ReduceOptions options = {});
  WorkPtr barrier(BarrierOptions options = {});
  WorkPtr send(const std::vector<Tensor>& tensors, int dstRank, SendOptions options = {});
  WorkPtr recv(const std::vector<Tensor>& tensors, int srcRank, RecvOptions options = {});
  WorkPtr allToAll(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                   AllToAllOptions options = {});
  // See backend.h for the shapes of these.
  WorkPtr gather(const std::vector<Tensor>& outputs, const Tensor& input, GatherOptions options = {});
  WorkPtr scatter(const Tensor& output, const std::vector<Tensor>& inputs, ScatterOptions options = {});
  WorkPtr allgatherIntoTensor(const Tensor& output, const Tensor& input, AllgatherOptions options = {});
  WorkPtr reduceScatterTensor(const Tensor& output, const Tensor& input, ReduceScatterOptions options = {});
  WorkPtr allToAllSingle(const Tensor& output, const Tensor& input, const std::vector<int64_t>& outputSplits = {},
                         const std::vector<int64_t>& inputSplits = {}, AllToAllOptions options = {});
  WorkPtr monitoredBarrier(BarrierOptions options = {});
  WorkPtr batchIsendIrecv(const std::vector<P2POp>& ops);

  // The error that broke the group, or nullptr while it is healthy.
  std::exception_ptr brokenCause() const;
  bool isBroken() const { return brokenCause() != nullptr; }

  // A subgroup of `ranks` (ranks of this group, any order, no duplicates;
  // group ranks follow ascending order). Collective over this group.
  std::shared_ptr<ProcessGroup> newGroup(std::vector<int> ranks, ProcessGroupOptions options = {});

  // The backend that serves `device` (NotSupportedError if none can); valid
  // until destroy(). The first call for a CUDA device makes the NCCL backend.
  Backend& backendFor(const Device& device);
  // Breaks the group with `cause`: every op in flight or queued on any of its
  // backends fails at once with it, and so does every later op (Backend::abort).
  // The subgroups newGroup made from it (still alive) break too: a member lost to the
  // group is lost to them, and a rank waiting in one (a mesh's dp or tp group) must not
  // wait out the timeout for a peer that left through the parent.
  // An NCCL backend made after the abort (by a later first CUDA op) is born
  // aborted with the same cause.
  // Any thread; idempotent; does not wait for an op in progress (see
  // "Blocking" above). destroy() still releases the group.
  void abort(std::exception_ptr cause);
  // Shuts the backends down; later calls fail with "destroyed". Any thread.
  void destroy();

 private:
  ProcessGroup() = default;
  void requireMember(const char* op) const;
  [[noreturn]] void throwDestroyed(const char* op) const;
  // The backend for `device`, held by the caller for as long as it calls it:
  // destroy() on another thread releases the group's reference meanwhile.
  BackendPtr backendPtr(const char* op, const Device& device);
  BackendPtr ncclBackend(const char* op, const Device& device);
  std::string who() const;
  template <typename Fn>
  WorkPtr recordedP2P(const char* op, const std::vector<Tensor>& tensors, int peer, Fn&& post);
  template <typename Fn>
  WorkPtr numbered(const char* op, const Device& device, uint64_t& seqField, std::vector<Tensor> result, Fn&& call);

  StorePtr store_;  // this group's scope
  int rank_ = -1;
  int size_ = 0;
  ProcessGroupOptions options_;
  std::chrono::milliseconds timeout_{0};
  std::vector<int> parentRanks_;
  int instance_ = 0;  // which creation of the root group's name (flight recorder)
  std::atomic<uint64_t> p2pSeq_{0};  // the flight recorder's numbering of send/recv
  // Held across a collective's backend call, which may block (see "Blocking"
  // above): the number a call gets is the order it reaches its backend in.
  std::mutex issueMutex_;
  // Held while the NCCL backend is made (its runner clones the store and
  // writes to it): one is made, and mutex_ stays free meanwhile.
  std::mutex ncclCreateMutex_;
  // Guards the state below. Never held across a backend call or store I/O,
  // so that abort(), brokenCause() and destroy() never wait for an op.
  mutable std::mutex mutex_;
  BackendPtr cpuBackend_;
  BackendPtr ncclBackend_;  // made by the first CUDA call
  std::exception_ptr abortCause_;  // the first abort(), for an NCCL backend made later
  int subgroups_ = 0;
  std::vector<std::weak_ptr<ProcessGroup>> children_;  // newGroup's member handles, for abort()
  bool destroyed_ = false;
  // Written under issueMutex_ only (atomic: lastSeq() reads it without it).
  std::atomic<uint64_t> seq_{0};
};

using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

// This process's host identity for routing: DT_HOST_ID when set, else the
// kernel's boot id and the network namespace, so that ranks in different
// network namespaces (or containers) never assume shared memory.
std::string localHostId();

}  // namespace dt
