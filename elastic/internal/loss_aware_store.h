// LossAwareStore: the store an elastic epoch's process group runs on. Its
// blocking calls wait in slices and, between them, ask whether a member of
// the epoch has died (store/membership.h, in the job's store); if one has, they throw
// MemberLostError at once instead of waiting out their timeout. So a group
// that is being made, or a monitored barrier, does not hang on a member that
// died after the epoch was agreed (the next agreement follows at once).
//
// Contract: everything else is the wrapped store's (store.h); the lookup of
// deaths uses its own client (clone of the wrapped store), one at a time.
// Thread-safe as the wrapped store is. Holds shared_ptrs to both clients.
#pragma once

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "store/store.h"

namespace dt::elastic {

class LossAwareStore final : public Store {
 public:
  // `store`: what the group uses (scoped to the epoch); `jobStore`: the job's whole store,
  // where the launcher posts deaths (a client of its own is made from it); `members`: the
  // epoch's member ids, ranks in order.
  LossAwareStore(StorePtr store, StorePtr jobStore, std::vector<int> members);

  void set(const std::string& key, const Bytes& value) override { store_->set(key, value); }
  Bytes get(const std::string& key) override { return get(key, timeout()); }
  Bytes get(const std::string& key, Duration timeout) override;
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override {
    return store_->compareSet(key, expected, desired);
  }
  using Store::wait;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  bool check(const std::vector<std::string>& keys) override { return store_->check(keys); }
  bool deleteKey(const std::string& key) override { return store_->deleteKey(key); }
  int64_t numKeys() override { return store_->numKeys(); }
  void append(const std::string& key, const Bytes& value) override { store_->append(key, value); }
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys) override { return multiGet(keys, timeout()); }
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys, Duration timeout) override;
  void multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override {
    store_->multiSet(keys, values);
  }
  void queuePush(const std::string& key, const Bytes& value) override { store_->queuePush(key, value); }
  std::optional<Bytes> queuePop(const std::string& key, bool block) override { return queuePop(key, block, timeout()); }
  std::optional<Bytes> queuePop(const std::string& key, bool block, Duration timeout) override;
  int64_t queueLen(const std::string& key) override { return store_->queueLen(key); }
  std::shared_ptr<Store> clone() override;
  std::string describe() const override { return store_->describe(); }

 private:
  // Throws MemberLostError when a member of the epoch has died.
  void throwIfLost();

  StorePtr store_;
  StorePtr deaths_;
  std::mutex deathsMutex_;
  std::vector<int> members_;
};

}  // namespace dt::elastic
