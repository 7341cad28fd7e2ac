// FileStore: the Store over a shared filesystem, for clusters where no TCP
// port is reachable between nodes (every process names the same file).
//
// Contract: all of store.h. The file is an append-only log of records
// (set/delete/append/queue push/queue pop); writers hold an exclusive flock()
// while they read up to the end and append, readers a shared one, so every
// process sees one order of writes. add/compareSet are computed under the
// lock and logged as plain sets. Blocking calls poll the file with backoff
// (1 ms doubling to 50 ms) until the keys appear or the timeout passes.
// Works across processes and threads; flock must work on the filesystem
// (local disks, NFSv4, Lustre with flock enabled).
// Thread safety: one FileStore serialises its calls with a mutex; clone()
// opens the file again (independent lock and blocking).
// The file is never truncated or removed by dtrain: the job owns it.
#pragma once

#include <memory>
#include <mutex>

#include "store/store.h"

namespace dt {

namespace detail {
class KvState;
}

class FileStore final : public Store {
 public:
  explicit FileStore(std::string path);
  ~FileStore() override;

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

  const std::string& path() const { return path_; }

 private:
  class Locked;
  // Calls fn(state) under the file lock (exclusive when `write`), after
  // catching up with the log. fn may append records with log().
  template <typename Fn>
  auto locked(bool write, Fn&& fn);
  // Polls until ready(state) holds under a shared lock, then returns fn(state)
  // (under an exclusive lock when `write`). Throws via onTimeout.
  void logRecord(uint8_t op, const std::string& key, const Bytes& value);
  void catchUp();
  void flushPending();

  std::string path_;
  int fd_ = -1;
  std::mutex mutex_;
  int64_t offset_ = 0;  // bytes of the log applied to state_
  std::unique_ptr<detail::KvState> state_;
  std::string pending_;  // records to append before unlocking
};

}  // namespace dt
