#include "store/internal/kv_state.h"

#include <algorithm>
#include <charconv>
#include <limits>

#include "common/errors.h"
#include "common/strings.h"

namespace dt::detail {

const Bytes* KvState::find(const std::string& key) const {
  auto it = data_.find(key);
  return it == data_.end() ? nullptr : &it->second;
}

void KvState::set(const std::string& key, Bytes value) { data_[key] = std::move(value); }

int64_t KvState::add(const std::string& key, int64_t delta) {
  auto [it, inserted] = data_.try_emplace(key, "0");
  try {
    const int64_t result = addToCounter(key, it->second, delta);
    it->second = std::to_string(result);
    return result;
  } catch (...) {
    if (inserted) data_.erase(it);
    throw;
  }
}

int64_t addToCounter(const std::string& key, const Bytes& current, int64_t delta) {
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(current.data(), current.data() + current.size(), value);
  if (current.empty() || ec != std::errc() || end != current.data() + current.size()) {
    throw InvalidArgument(str("store add(\"", key, "\", ", delta, "): the stored value ", quoteBytes(current),
                              " is not a decimal integer; add() only works on counters"));
  }
  int64_t result = 0;
  if (__builtin_add_overflow(value, delta, &result)) {
    throw InvalidArgument(str("store add(\"", key, "\", ", delta, "): ", value, " + ", delta, " overflows int64"));
  }
  return result;
}

Bytes KvState::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired, bool& wrote) {
  wrote = false;
  auto it = data_.find(key);
  if (it == data_.end()) {
    if (expected.empty()) {
      data_.emplace(key, desired);
      wrote = true;
      return desired;
    }
    return expected;
  }
  if (it->second == expected) {
    it->second = desired;
    wrote = true;
  }
  return it->second;
}

void KvState::append(const std::string& key, const Bytes& value) { data_[key] += value; }

bool KvState::erase(const std::string& key) { return data_.erase(key) != 0; }

bool KvState::hasAll(const std::vector<std::string>& keys) const {
  for (const auto& key : keys) {
    if (!data_.count(key)) return false;
  }
  return true;
}

std::vector<std::string> KvState::missing(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  for (const auto& key : keys) {
    if (!data_.count(key)) out.push_back(key);
  }
  return out;
}

void KvState::queuePush(const std::string& key, Bytes value) { queues_[key].push_back(std::move(value)); }

std::optional<Bytes> KvState::queuePop(const std::string& key) {
  auto it = queues_.find(key);
  if (it == queues_.end() || it->second.empty()) return std::nullopt;
  Bytes value = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) queues_.erase(it);
  return value;
}

int64_t KvState::queueLen(const std::string& key) const {
  auto it = queues_.find(key);
  return it == queues_.end() ? 0 : static_cast<int64_t>(it->second.size());
}

std::chrono::steady_clock::time_point deadlineAfter(Store::Duration timeout,
                                                    std::chrono::steady_clock::time_point now) {
  using Clock = std::chrono::steady_clock;
  // A century is "forever" for a store wait and far from overflowing.
  constexpr auto kForever = std::chrono::hours(24 * 365 * 100);
  const auto bounded = std::clamp<Store::Duration>(timeout, Store::Duration(0), kForever);
  return now + std::chrono::duration_cast<Clock::duration>(bounded);
}

Store::Duration addTimeouts(Store::Duration a, Store::Duration b) {
  int64_t sum = 0;
  if (__builtin_add_overflow(a.count(), b.count(), &sum)) return Store::Duration::max();
  return Store::Duration(sum);
}

std::string quoteKeys(const std::vector<std::string>& keys, size_t maxKeys) {
  std::string out = "[";
  for (size_t i = 0; i < keys.size() && i < maxKeys; ++i) {
    if (i) out += ", ";
    out += quoteBytes(keys[i], 80);
  }
  if (keys.size() > maxKeys) out += str(", ... (", keys.size(), " keys)");
  return out + "]";
}

void throwWaitTimeout(const std::string& op, const std::vector<std::string>& keys,
                      const std::vector<std::string>& missing, Store::Duration waited, const std::string& where) {
  std::vector<std::string> shown(missing.begin(), missing.begin() + std::min<size_t>(missing.size(), 16));
  std::string missingText = join(shown);
  if (missing.size() > shown.size()) missingText += str(", ... (", missing.size(), " missing)");
  throw TimeoutError(str("store ", op, "(", quoteKeys(keys), ") timed out after ", waited.count(), " ms (",
                         where, "). Keys still missing: ", missingText,
                         ". Is every rank running and using the same store address?"));
}

}  // namespace dt::detail
