// HashStore: the Store in process memory, for threads as ranks and tests.
//
// Contract: all of store.h. Thread-safe; blocking calls (get, wait,
// multiGet, queuePop(block)) wait on a condition variable until the keys
// appear or the timeout passes, and are not disturbed by signals. clone()
// returns a new handle (own timeout) onto the same data; the data lives as
// long as any handle does.
#pragma once

#include <memory>

#include "store/store.h"

namespace dt {

class HashStore final : public Store {
 public:
  HashStore();
  ~HashStore() override;

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

 private:
  struct Shared;
  explicit HashStore(std::shared_ptr<Shared> shared);
  std::shared_ptr<Shared> shared_;
};

}  // namespace dt
