// ElasticGroup: the membership of an elastic job and its current process
// group, rebuilt in place when a member dies, so that training goes on
// without a restart (docs/elastic.md).
//
//   auto elastic = dt::elastic::ElasticGroup::fromEnvironment();   // under dtrun --elastic
//   DistributedDataParallel ddp(model, elastic->group());
//   while (step < total) {
//     try {
//       ... forward, backward, the step's commit allreduce on elastic->group() ...
//       optimizer.step(); ++step;
//     } catch (const dt::Error&) {
//       const auto& m = elastic->recover(std::current_exception(), step);
//       if (m.resumeStep > step) { optimizer.step(); ++step; }    // the others committed it
//       ddp.rebind(elastic->group());  // and re-split the data for m.size() ranks
//     }
//   }
//
// Model:
//  * Members are the processes the launcher started, numbered by their launch
//    rank (member ids never change). An epoch is a set of members; its group
//    ranks them densely in id order. Epoch 0 is every member. Each epoch's
//    group keeps its keys under "elastic/e<epoch>/" in the job's store.
//  * The launcher posts a death as soon as it sees a worker exit, or when a
//    worker's heartbeat (beaten by this class's thread every
//    heartbeatInterval) is older than its liveness timeout, and then kills it
//    (store/membership.h). This class's thread waits for deaths: when a
//    member of the current epoch dies, it aborts the group with a
//    MemberLostError naming the member and how it ended ("rank 2 (member 2)
//    exited: signal SIGKILL"), so that any op in flight fails at once.
//  * recover(cause, stepsApplied) is collective over the survivors. Each
//    reports how many optimizer steps it applied; the lowest-numbered
//    surviving member decides (the members: those that reported and are not
//    dead; the resume step: the most any of them applied) and publishes the
//    decision with a compare-and-set, so there is exactly one per epoch. When
//    that member dies while deciding, the next one decides. Everyone then
//    makes the next epoch's group. A member that applied one step fewer than
//    the resume step must apply it: every member that took part in the commit
//    allreduce of that step holds its reduced gradients, since it only joins
//    the commit after its backward completed.
//  * recover() rethrows `cause` when no member died (a failure of another
//    kind: a desync, a timeout without a death), throws MembershipError when
//    fewer than minSize members are left (naming who is left and who died
//    why), or when this process was left out (it was declared dead).
//  * Not thread-safe: one training thread calls group() and recover(); the
//    watcher thread only aborts. The destructor stops the watcher and
//    destroys the group.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "process_group/process_group.h"
#include "store/store.h"

namespace dt::elastic {

struct ElasticOptions {
  // Fewer members than this stop the job (recover() throws). 0: DT_MIN_NPROC, else 1.
  int minSize = 0;
  std::chrono::milliseconds heartbeatInterval{200};
  // How long recover() waits for the other survivors to report.
  std::chrono::milliseconds agreementTimeout = std::chrono::seconds(60);
  // The options of every epoch's group (name, backend, timeout; failureReportWindow is
  // kept short: the launcher says who died).
  ProcessGroupOptions group;
};

struct Membership {
  uint64_t epoch = 0;
  std::vector<int> members;  // member ids in rank order
  int rank = -1;             // this process's rank in the epoch
  // recover(): the step every member continues from.
  int64_t resumeStep = 0;
  // recover(): the members lost since the previous epoch, and how ("rank 2 (member 2) exited: signal SIGKILL").
  std::vector<std::string> lost;
  int size() const { return static_cast<int>(members.size()); }
};

class ElasticGroup {
 public:
  // From dtrun --elastic's environment (initProcessGroup's variables; member id = RANK).
  static std::unique_ptr<ElasticGroup> fromEnvironment(ElasticOptions options = {});
  // Joins epoch 0 of `initialWorld` members over `store` (the job's store, shared by all).
  ElasticGroup(StorePtr store, int memberId, int initialWorld, ElasticOptions options = {});
  ~ElasticGroup();
  ElasticGroup(const ElasticGroup&) = delete;
  ElasticGroup& operator=(const ElasticGroup&) = delete;

  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  const Membership& membership() const { return membership_; }
  int memberId() const { return memberId_; }

  const Membership& recover(std::exception_ptr cause, int64_t stepsApplied);

 private:
  struct Watcher;
  std::shared_ptr<ProcessGroup> makeGroup(uint64_t epoch, int rank, int size);
  std::string who() const;

  StorePtr store_;
  int memberId_;
  ElasticOptions options_;
  Membership membership_;
  std::shared_ptr<ProcessGroup> group_;
  std::unique_ptr<Watcher> watcher_;
};

}  // namespace dt::elastic
