// The etcd rendezvous backend of dtrun (--rdzv-backend etcd): no node hosts
// anything; nodes meet in etcd under "/dtrain/<rdzv id>", each holding a lease
// (its liveness: kept alive by a thread, TTL --node-timeout) to which its
// registrations are bound, so a dead dtrun's registration vanishes by itself.
//
// Layout (EtcdStore keys; <P> = /dtrain/<rdzv id>):
//   <P>         round                       the current round number
//   <P>/r<n>    dtrun/a<k>/node/<i>         node i's claim on attempt k of round n:
//                                           "<nproc>\t<host>\t<nonce>", bound to its lease
//               dtrun/a<k>/full             set by the node whose claim completed attempt k
//               dtrun/meta                  node 0's "<run id>\t<worker port>\t<address>"
//               dtrun/started               the round's first attempt is running
//               dtrun/ended                 the job of this round is over (any outcome)
//               dtrun/exit/<i>, dtrun/a<k>/failed, dtrun/a<k>/done/<i>, dt/progress/<r>
//                                           as with node 0's store (coordinator.h)
//               everything the workers write (their store is <P>/r<n> too)
// A round is one job's lifetime: a new dtrun joins the current round unless
// it has ended, or it started and every claim of it has vanished (a job that
// crashed); then it opens the next round. So a job id can be reused, and a
// job's keys never mix with an earlier job's.
//
// Contract: every call blocks on etcd (bounded by the store's timeouts) and
// throws dt::Error subclasses with one-line messages. Not thread-safe; used by
// the agent's thread.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "store/etcd_store.h"

namespace dt::launcher {

class EtcdRendezvous {
 public:
  // `job`: an EtcdStore on <P>; `lease`: this dtrun's liveness lease.
  EtcdRendezvous(std::shared_ptr<EtcdStore> job, std::shared_ptr<EtcdLease> lease);

  // Picks the round to join (see above) and returns its store (<P>/r<n>).
  // Throws InvalidArgument when a live job already runs under this id, unless
  // `joinRunning` (dtrun --elastic --nnodes MIN:MAX: this node joins it).
  std::shared_ptr<EtcdStore> enterRound(bool joinRunning = false);
  int round() const { return round_; }
  const std::shared_ptr<EtcdStore>& roundStore() const { return roundStore_; }
  const std::shared_ptr<EtcdLease>& lease() const { return lease_; }

  // Claims node slot `node` of attempt `attempt` (bound to the lease), or
  // with node < 0 the first free one of [0, nnodes). Returns the slot taken,
  // or nullopt when `node` is held by another dtrun (its value in `holder`).
  std::optional<int> claim(int attempt, int node, int nnodes, const std::string& value, std::string& holder);
  // After a claim: when every slot of the attempt is held, marks the attempt
  // full (what the other nodes wait for). Returns whether it is full.
  bool markIfFull(int attempt, int nnodes);
  static std::string fullKey(int attempt);
  static std::string nodeKey(int attempt, int node);

 private:
  std::shared_ptr<EtcdStore> job_;
  std::shared_ptr<EtcdLease> lease_;
  std::shared_ptr<EtcdStore> roundStore_;
  int round_ = -1;
};

}  // namespace dt::launcher
