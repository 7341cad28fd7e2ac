#include "launcher/etcd_rendezvous.h"

#include "common/errors.h"
#include "common/strings.h"

namespace dt::launcher {

EtcdRendezvous::EtcdRendezvous(std::shared_ptr<EtcdStore> job, std::shared_ptr<EtcdLease> lease)
    : job_(std::move(job)), lease_(std::move(lease)) {}

std::string EtcdRendezvous::nodeKey(int attempt, int node) { return str("dtrun/a", attempt, "/node/", node); }
std::string EtcdRendezvous::fullKey(int attempt) { return str("dtrun/a", attempt, "/full"); }

std::shared_ptr<EtcdStore> EtcdRendezvous::enterRound(bool joinRunning) {
  std::string current = job_->compareSet("round", "", "0");
  while (true) {
    const int n = std::stoi(current);
    auto store = job_->withPrefix(str(job_->prefix(), "/r", n));
    bool over = store->check({"dtrun/ended"});
    if (!over && store->check({"dtrun/started"})) {
      // A job runs (or ran) in this round: over if none of its nodes is alive any more.
      const auto claims = store->list("dtrun/a");
      bool alive = false;
      std::vector<std::string> nodes;
      for (const auto& entry : claims.entries) {
        if (entry.key.find("/node/") != std::string::npos && entry.lease != 0) {
          alive = true;
          nodes.push_back(split(entry.value, '\t').size() > 1 ? split(entry.value, '\t')[1] : entry.key);
        }
      }
      if (alive && joinRunning) {
        round_ = n;
        roundStore_ = store;
        return store;
      }
      if (alive) {
        throw InvalidArgument(str("dtrun: rendezvous id ", quoteBytes(job_->prefix()), " on ", job_->endpoints(),
                                  " is in use by a running job (round ", n, ", nodes on ", join(nodes),
                                  "); give this job its own --rdzv-id, or wait for that one to end"));
      }
      over = true;
    }
    if (!over) {
      round_ = n;
      roundStore_ = store;
      return store;
    }
    const std::string next = std::to_string(n + 1);
    const std::string now = job_->compareSet("round", current, next);
    current = now;  // ours, or a newer round another dtrun opened meanwhile
  }
}

std::optional<int> EtcdRendezvous::claim(int attempt, int node, int nnodes, const std::string& value,
                                         std::string& holder) {
  if (node >= 0) {
    auto existing = roundStore_->createWithLease(nodeKey(attempt, node), value, *lease_);
    if (!existing) return node;
    holder = *existing;
    return std::nullopt;
  }
  for (int slot = 0; slot < nnodes; ++slot) {
    if (!roundStore_->createWithLease(nodeKey(attempt, slot), value, *lease_)) return slot;
  }
  holder = str("all ", nnodes, " node slots are taken");
  return std::nullopt;
}

bool EtcdRendezvous::markIfFull(int attempt, int nnodes) {
  // Counted after our own claim: the last of the claimants sees them all.
  const auto claims = roundStore_->list(str("dtrun/a", attempt, "/node/"));
  if (static_cast<int>(claims.entries.size()) < nnodes) return false;
  roundStore_->set(fullKey(attempt), "1");
  return true;
}

}  // namespace dt::launcher
