// Store: the key-value rendezvous every dtrain job bootstraps through.
//
// Contract (every implementation; tests/store/store_conformance_test.cpp checks it):
//  * Keys are strings, values are bytes (std::string used as a byte buffer).
//    Counters written by add() are decimal ASCII ("42").
//  * set() returns once the value is stored (for TcpStore: acknowledged by the
//    server), so a failed write is never silent.
//  * get() waits until the key exists (up to the timeout), then returns it.
//  * add(key, delta): a missing key starts from 0; returns the new value.
//  * compareSet(key, expected, desired): if the key is missing and expected is
//    empty, creates it with desired; if missing and expected non-empty,
//    writes nothing and returns expected; if the current value equals
//    expected, writes desired. Returns the value now stored (or expected, as
//    above).
//  * wait(keys[, timeout]) returns when all keys exist. check(keys) never
//    blocks. deleteKey returns whether a key was removed. numKeys counts keys.
//  * append creates a missing key. multiGet keeps the order of its keys and
//    waits like get, for all of them under one deadline (the per-call timeout
//    or timeout()); its TimeoutError names the keys still missing. multiSet
//    sets all.
//  * queuePush/queuePop/queueLen: FIFO queues; queuePop(key, true) blocks
//    until an item arrives (or the timeout), queuePop(key, false) returns
//    nullopt at once when the queue is empty.
//  * Blocking calls throw dt::TimeoutError after `timeout()` (or the per-call
//    timeout), naming the keys still missing, the store and the time waited.
//    A timed-out call leaves the store usable.
//  * Network failures throw dt::NetworkError; bad arguments dt::InvalidArgument.
//
// Thread safety: every method may be called from any thread; calls from
// several threads on one Store object are serialised where the
// implementation needs it (a TcpStore client has one connection; use clone()
// for an independent connection that blocks independently).
// Ownership: stores are held by std::shared_ptr; clone() returns a new one.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dt {

using Bytes = std::string;

class Store {
 public:
  using Duration = std::chrono::milliseconds;
  // The default store timeout: DT_STORE_TIMEOUT, 300 s unless set.
  static Duration defaultTimeout();

  virtual ~Store() = default;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  virtual Bytes get(const std::string& key) = 0;
  // get with a per-call timeout. dtrain's stores override it without touching
  // timeout(); the default (for other subclasses) swaps timeout() around the
  // call, so it is not safe against a concurrent setTimeout.
  virtual Bytes get(const std::string& key, Duration timeout);
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  virtual Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }
  virtual void wait(const std::vector<std::string>& keys, Duration timeout) = 0;
  virtual bool check(const std::vector<std::string>& keys) = 0;
  virtual bool deleteKey(const std::string& key) = 0;
  virtual int64_t numKeys() = 0;
  virtual void append(const std::string& key, const Bytes& value) = 0;
  virtual std::vector<Bytes> multiGet(const std::vector<std::string>& keys) = 0;
  // multiGet with a per-call timeout; default as for get above.
  virtual std::vector<Bytes> multiGet(const std::vector<std::string>& keys, Duration timeout);
  virtual void multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) = 0;
  virtual void queuePush(const std::string& key, const Bytes& value) = 0;
  // block=true waits up to timeout() for an item.
  virtual std::optional<Bytes> queuePop(const std::string& key, bool block) = 0;
  // queuePop with a per-call timeout (block=true); default as for get above.
  virtual std::optional<Bytes> queuePop(const std::string& key, bool block, Duration timeout);
  virtual int64_t queueLen(const std::string& key) = 0;

  // Atomic: one thread may change the timeout while others are in calls.
  virtual void setTimeout(Duration timeout) { timeoutMs_.store(timeout.count(), std::memory_order_relaxed); }
  Duration timeout() const { return Duration(timeoutMs_.load(std::memory_order_relaxed)); }

  // An independent handle to the same data (for TcpStore, a new connection).
  virtual std::shared_ptr<Store> clone() = 0;
  // Where this store lives, for messages: "127.0.0.1:29500", "in-process", a path.
  virtual std::string describe() const = 0;

 protected:
  std::atomic<int64_t> timeoutMs_{defaultTimeout().count()};
};

using StorePtr = std::shared_ptr<Store>;

// Barrier over the store: each of `worldSize` callers adds itself to
// `<key>/arrived` (recording its rank under `<key>/rank/<r>`) and waits for
// all. A timeout says how many arrived and which ranks are missing
// ("3/4 joined; missing: rank 2").
void storeBarrier(Store& store, const std::string& key, int rank, int worldSize,
                  Store::Duration timeout);

}  // namespace dt
