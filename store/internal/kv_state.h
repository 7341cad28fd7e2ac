// KvState: the data and the semantics shared by every in-memory store
// (HashStore and the TcpStore server), so that both implement the c10d
// semantics the same way. Not thread-safe: the owner serialises access
// (HashStore with its mutex, the server by running on one event loop).
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "store/store.h"

namespace dt::detail {

class KvState {
 public:
  // nullptr when missing. The pointer is valid until the next write.
  const Bytes* find(const std::string& key) const;
  bool contains(const std::string& key) const { return data_.count(key) != 0; }
  void set(const std::string& key, Bytes value);
  // Missing key starts at 0. Throws InvalidArgument when the current value is
  // not a decimal integer, or on overflow.
  int64_t add(const std::string& key, int64_t delta);
  // c10d semantics; `wrote` tells whether the value changed (to wake waiters).
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired, bool& wrote);
  void append(const std::string& key, const Bytes& value);
  bool erase(const std::string& key);
  int64_t size() const { return static_cast<int64_t>(data_.size()); }
  bool hasAll(const std::vector<std::string>& keys) const;
  std::vector<std::string> missing(const std::vector<std::string>& keys) const;

  // Queues live in their own namespace: check/wait/numKeys do not see them.
  void queuePush(const std::string& key, Bytes value);
  std::optional<Bytes> queuePop(const std::string& key);
  int64_t queueLen(const std::string& key) const;

  // Every key and every queue (items oldest first), for a copy of the whole
  // state (a primary server's standby).
  const std::unordered_map<std::string, Bytes>& keys() const { return data_; }
  const std::unordered_map<std::string, std::deque<Bytes>>& queues() const { return queues_; }

 private:
  std::unordered_map<std::string, Bytes> data_;
  std::unordered_map<std::string, std::deque<Bytes>> queues_;
};

// current + delta for a counter stored as decimal ASCII (add()'s rule, shared
// by every store). Throws InvalidArgument naming the key when `current` is
// not a decimal integer or the sum overflows.
int64_t addToCounter(const std::string& key, const Bytes& current, int64_t delta);

// now + timeout, saturated: a timeout of hours, Duration::max() or a negative
// one must neither overflow the clock nor wrap into the past.
std::chrono::steady_clock::time_point deadlineAfter(Store::Duration timeout,
                                                    std::chrono::steady_clock::time_point now =
                                                        std::chrono::steady_clock::now());
// a + b for timeouts, saturated the same way.
Store::Duration addTimeouts(Store::Duration a, Store::Duration b);

// One-line messages shared by all stores.
std::string quoteKeys(const std::vector<std::string>& keys, size_t maxKeys = 8);
[[noreturn]] void throwWaitTimeout(const std::string& op, const std::vector<std::string>& keys,
                                   const std::vector<std::string>& missing, Store::Duration waited,
                                   const std::string& where);

}  // namespace dt::detail
