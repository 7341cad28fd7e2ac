#include "store/hash_store.h"

#include <condition_variable>
#include <mutex>

#include "common/check.h"
#include "common/errors.h"
#include "common/strings.h"
#include "store/internal/kv_state.h"

namespace dt {

struct HashStore::Shared {
  std::mutex mutex;
  std::condition_variable changed;  // notified on every write
  detail::KvState state;
};

HashStore::HashStore() : shared_(std::make_shared<Shared>()) {}
HashStore::HashStore(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}
HashStore::~HashStore() = default;

void HashStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard lock(shared_->mutex);
    shared_->state.set(key, value);
  }
  shared_->changed.notify_all();
}

Bytes HashStore::get(const std::string& key, Duration timeout) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(shared_->mutex);
  if (!shared_->changed.wait_until(lock, detail::deadlineAfter(timeout, start), [&] { return shared_->state.contains(key); })) {
    detail::throwWaitTimeout("get", {key}, {key}, timeout, describe());
  }
  return *shared_->state.find(key);
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t value = 0;
  {
    std::lock_guard lock(shared_->mutex);
    value = shared_->state.add(key, delta);
  }
  shared_->changed.notify_all();
  return value;
}

Bytes HashStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  bool wrote = false;
  Bytes result;
  {
    std::lock_guard lock(shared_->mutex);
    result = shared_->state.compareSet(key, expected, desired, wrote);
  }
  if (wrote) shared_->changed.notify_all();
  return result;
}

void HashStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(shared_->mutex);
  if (!shared_->changed.wait_until(lock, detail::deadlineAfter(timeout, start), [&] { return shared_->state.hasAll(keys); })) {
    detail::throwWaitTimeout("wait", keys, shared_->state.missing(keys), timeout, describe());
  }
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard lock(shared_->mutex);
  return shared_->state.hasAll(keys);
}

bool HashStore::deleteKey(const std::string& key) {
  std::lock_guard lock(shared_->mutex);
  return shared_->state.erase(key);
}

int64_t HashStore::numKeys() {
  std::lock_guard lock(shared_->mutex);
  return shared_->state.size();
}

void HashStore::append(const std::string& key, const Bytes& value) {
  {
    std::lock_guard lock(shared_->mutex);
    shared_->state.append(key, value);
  }
  shared_->changed.notify_all();
}

std::vector<Bytes> HashStore::multiGet(const std::vector<std::string>& keys, Duration limit) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(shared_->mutex);
  if (!shared_->changed.wait_until(lock, detail::deadlineAfter(limit, start), [&] { return shared_->state.hasAll(keys); })) {
    detail::throwWaitTimeout("multiGet", keys, shared_->state.missing(keys), limit, describe());
  }
  std::vector<Bytes> values;
  values.reserve(keys.size());
  for (const auto& key : keys) values.push_back(*shared_->state.find(key));
  return values;
}

void HashStore::multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  DT_CHECK_EQ(keys.size(), values.size(), "store multiSet: one value per key");
  {
    std::lock_guard lock(shared_->mutex);
    for (size_t i = 0; i < keys.size(); ++i) shared_->state.set(keys[i], values[i]);
  }
  shared_->changed.notify_all();
}

void HashStore::queuePush(const std::string& key, const Bytes& value) {
  {
    std::lock_guard lock(shared_->mutex);
    shared_->state.queuePush(key, value);
  }
  shared_->changed.notify_all();
}

std::optional<Bytes> HashStore::queuePop(const std::string& key, bool block, Duration timeout) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(shared_->mutex);
  if (!block) return shared_->state.queuePop(key);
  if (!shared_->changed.wait_until(lock, detail::deadlineAfter(timeout, start), [&] { return shared_->state.queueLen(key) > 0; })) {
    throw TimeoutError(str("store queuePop(\"", key, "\") timed out after ", timeout.count(), " ms (",
                           describe(), "): the queue stayed empty. Is the producer running?"));
  }
  return shared_->state.queuePop(key);
}

int64_t HashStore::queueLen(const std::string& key) {
  std::lock_guard lock(shared_->mutex);
  return shared_->state.queueLen(key);
}

std::shared_ptr<Store> HashStore::clone() {
  auto copy = std::shared_ptr<HashStore>(new HashStore(shared_));
  copy->setTimeout(timeout());
  return copy;
}

std::string HashStore::describe() const { return "in-process HashStore"; }

}  // namespace dt
