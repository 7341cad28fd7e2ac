// PrefixStore: a view of another store in which every key is "<prefix>/key",
// so that process groups, jobs or restarts sharing one store never collide.
//
// Contract: all of store.h, delegated to the wrapped store (its blocking,
// thread safety and errors apply; messages name the prefixed keys, i.e. what
// is really stored). numKeys() counts the whole wrapped store, as in c10d.
// The timeout is this view's own: blocking calls pass it down per call.
// clone() wraps a clone of the wrapped store. Holds a shared_ptr to it.
#pragma once

#include "store/store.h"

namespace dt {

class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, StorePtr store);

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override { return get(key, timeout()); }
  Bytes get(const std::string& key, Duration timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  using Store::wait;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  int64_t numKeys() override;
  void append(const std::string& key, const Bytes& value) override;
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys) override { return multiGet(keys, timeout()); }
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys, Duration timeout) override;
  void multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override;
  void queuePush(const std::string& key, const Bytes& value) override;
  std::optional<Bytes> queuePop(const std::string& key, bool block) override {
    return queuePop(key, block, timeout());
  }
  std::optional<Bytes> queuePop(const std::string& key, bool block, Duration timeout) override;
  int64_t queueLen(const std::string& key) override;
  std::shared_ptr<Store> clone() override;
  std::string describe() const override;

  const std::string& prefix() const { return prefix_; }
  const StorePtr& underlying() const { return store_; }

 private:
  std::string prefixed(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> prefixed(const std::vector<std::string>& keys) const;

  std::string prefix_;
  StorePtr store_;
};

}  // namespace dt
