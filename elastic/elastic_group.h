// ElasticGroup: the membership of an elastic job and its current process
// group, rebuilt in place when a member dies, so that training goes on
// without a restart (docs/elastic.md).
//
//   auto elastic = dt::elastic::ElasticGroup::fromEnvironment();   // under dtrun --elastic
//   DistributedDataParallel ddp(model, elastic->group());
//   if (elastic->joinedNow()) ... receive the training state (broadcastState, restoreHere) ...
//   while (step < total) {
//     try {
//       ... forward, backward, the step's commit allreduce on elastic->group(), which also
//           sums elastic->joinersWaiting() over the members ...
//       optimizer.step(); ++step;
//       if (joinersWaitingAnywhere) {
//         const auto& m = elastic->admit(step);
//         ... send the training state (broadcastState from rank 0) ...
//         ddp.rebind(elastic->group());  // and re-split the data for m.size() ranks
//       }
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
//  * Growing: a process started to replace a dead one (dtrun --elastic --max-restarts)
//    has a fresh member id (store/membership.h: newMemberId) and constructs its
//    ElasticGroup as a joiner (fromEnvironment does when DT_ELASTIC_JOIN=1): it
//    registers, beats, and blocks until the members admit it (up to joinTimeout;
//    TimeoutError names the epoch it waited for; JobFinishedError when the job finished
//    first: nothing is left to do; MembershipError, within a poll of 200 ms, when every
//    member of the newest epoch was posted dead: nobody is left to admit it, and it names
//    what ended them. fromEnvironment's joiner knows epoch 0's members, join()'s only
//    those of decided epochs). The members' watcher threads see the
//    registration: joinersWaiting() turns true on the members within a heartbeat interval.
//    The members agree on it in a step's commit vote and then all call admit(step) at the
//    same step boundary: the same agreement as recover() (a member dying meanwhile is
//    dropped in the same decision), whose decision adds every live joiner and makes a new
//    epoch. membership().joined lists the members admitted by the last decision: they
//    hold no training state yet, and the others send it (checkpoint/transfer.h,
//    broadcastState from rank 0, which is always an old member: joiners have higher ids).
//    A joiner that dies before or during that transfer fails the new group's collective,
//    and recover() drops it like any member; the others' state is untouched.
//    recover() never admits joiners: they wait for the next admit().
//  * Replicas (ElasticOptions::replicaSize = t > 1, tensor parallelism): each decision also
//    drops the live members of a replica (t consecutive ranks) that lost one
//    (Membership::left); recover()/admit() return to them with hasLeft() and no group, and
//    they record it in the store (membership::postLeft) so that dtrun neither counts their
//    exit as the job finishing nor as a death, and replaces them under --max-restarts.
//    Fewer members left than minSize (none, when no replica is left whole): every survivor,
//    leaving or not, throws MembershipError and the job stops. Joiners are admitted only in
//    whole replicas, in registration order.
//  * Not thread-safe: one training thread calls group() and recover(); the
//    watcher thread only beats and hands aborts to a second thread of this
//    class, which aborts the group. So beats go on while an abort takes its
//    time or an op is blocked in its backend (ProcessGroup::abort does not
//    wait for it either). The destructor stops both threads and destroys the
//    group.
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
  // A joiner: how long it waits for the members to admit it (they do at their next step
  // boundary once they see it).
  std::chrono::milliseconds joinTimeout = std::chrono::minutes(5);
  // Members form replicas of this many consecutive ranks (a tensor-parallel group: one model
  // replica split over them), which only work whole. A loss takes its whole replica out: the
  // decision drops the replica's survivors too (Membership::left; recover() returns to them
  // with hasLeft() and no group), so the ranks left still form whole replicas, each rank at
  // its old position inside its replica. Joiners are admitted replicaSize at a time; fewer
  // wait (joinersWaiting() stays false until replicaSize registered). 1: every member alone.
  int replicaSize = 1;
};

struct Membership {
  uint64_t epoch = 0;
  std::vector<int> members;  // member ids in rank order
  int rank = -1;             // this process's rank in the epoch
  // recover(): the step every member continues from.
  int64_t resumeStep = 0;
  // recover(): the members lost since the previous epoch, and how ("rank 2 (member 2) exited: signal SIGKILL").
  std::vector<std::string> lost;
  // The members admitted into this epoch (admit(), or the joiner's own admission): they
  // have no training state yet.
  std::vector<int> joined;
  // The live members dropped with a lost member's replica (ElasticOptions::replicaSize).
  std::vector<int> left;
  // ElasticOptions::replicaSize > 1: the previous epoch's replicas (member ids in rank order)
  // that lost a member in this decision.
  std::vector<std::vector<int>> brokenReplicas;
  int size() const { return static_cast<int>(members.size()); }
};

class ElasticGroup {
 public:
  // From dtrun --elastic's environment (initProcessGroup's variables; member id = RANK).
  static std::unique_ptr<ElasticGroup> fromEnvironment(ElasticOptions options = {});
  // Joins epoch 0 of `initialWorld` members over `store` (the job's store, shared by all).
  ElasticGroup(StorePtr store, int memberId, int initialWorld, ElasticOptions options = {});
  // A process joining a running job as member `memberId` (a fresh id, not a member of
  // epoch 0): registers, and returns once the members admitted it (blocking, joinTimeout).
  static std::unique_ptr<ElasticGroup> join(StorePtr store, int memberId, ElasticOptions options = {});
  ~ElasticGroup();
  ElasticGroup(const ElasticGroup&) = delete;
  ElasticGroup& operator=(const ElasticGroup&) = delete;

  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  // The job's store, unscoped (every epoch's keys are under it): for a caller's own keys about
  // the current epoch, such as a pipeline's first-failure cause; prefix them with the epoch.
  const StorePtr& store() const { return store_; }
  const Membership& membership() const { return membership_; }
  int memberId() const { return memberId_; }

  const Membership& recover(std::exception_ptr cause, int64_t stepsApplied);
  // The last decision dropped this live member with its replica (ElasticOptions::replicaSize):
  // it has no group and takes no part in the job any more; its process may end (exit 0).
  bool hasLeft() const;

  // True once a joiner registered that the members have not decided on yet. Cheap (an
  // atomic read of what the watcher thread saw), for the commit vote of every step.
  bool joinersWaiting() const;
  // Collective over the members, at a step boundary they agreed on: admits the live
  // joiners into a new epoch (membership().joined; possibly none, when they died first).
  const Membership& admit(int64_t stepsApplied);
  // This process was admitted by the last decision and must receive the training state.
  bool joinedNow() const;

 private:
  struct Watcher;
  struct Decision;
  struct JoinTag {
    int initialWorld = 0;  // epoch 0's members are [0, initialWorld); 0: not known
  };
  ElasticGroup(StorePtr store, int memberId, ElasticOptions options, JoinTag);
  void startWatcher();
  std::string everyMemberGone(uint64_t epoch, int initialWorld);
  // The agreement of recover() and admit(): every member of `before` reports or dies; the
  // lowest-numbered live one decides (and with `admitting`, adds the live joiners).
  Decision agree(const Membership& before, int64_t stepsApplied, bool admitting);
  // Drops the live members of replicas that lost one (ElasticOptions::replicaSize).
  void dropBrokenReplicas(const Membership& before, Decision& d) const;
  // The replicas of `before` (member ids in rank order) that lost a member in `d`.
  std::vector<std::vector<int>> brokenReplicas(const std::vector<int>& before, const Decision& d) const;
  // Fewer members than minSize in `d`: posts the job's stop and throws MembershipError.
  void requireMinimum(const Decision& d, const std::vector<std::string>& lost);
  // This member was dropped with its replica: the membership says so, without a group.
  const Membership& leave(uint64_t epoch, const Decision& d, std::vector<std::string> lost);
  // Moves to the epoch `d` describes (makes its group; a death meanwhile: recover()).
  const Membership& enter(uint64_t epoch, const Decision& d, std::vector<std::string> lost, int64_t stepsApplied);
  // "rank 2 (member 2) exited: signal SIGKILL" for each of `lost`.
  std::vector<std::string> describeLost(const std::vector<int>& members, const std::vector<int>& lost);
  // Stops watching and destroys the current group (aborted with `cause` first, if any).
  void leaveGroup(std::exception_ptr cause);
  std::shared_ptr<ProcessGroup> makeGroup(uint64_t epoch, int rank, int size);
  std::string who() const;

  StorePtr store_;
  int memberId_;
  ElasticOptions options_;
  Membership membership_;
  int64_t joinersDecided_ = 0;  // joiner registrations the decisions so far have settled
  std::shared_ptr<ProcessGroup> group_;
  std::unique_ptr<Watcher> watcher_;
};

}  // namespace dt::elastic
