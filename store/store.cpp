#include "store/store.h"

#include <thread>

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"

namespace dt {

Store::Duration Store::defaultTimeout() { return env::getDuration("DT_STORE_TIMEOUT"); }

namespace {

// Runs call() with the store's timeout set to `timeout`: the default per-call
// timeout for subclasses that only implement the store-wide one.
template <typename Call>
auto withTimeout(Store& store, Store::Duration timeout, Call&& call) {
  const Store::Duration saved = store.timeout();
  store.setTimeout(timeout);
  try {
    auto result = call();
    store.setTimeout(saved);
    return result;
  } catch (...) {
    store.setTimeout(saved);
    throw;
  }
}

}  // namespace

Bytes Store::get(const std::string& key, Duration timeout) {
  return withTimeout(*this, timeout, [&] { return get(key); });
}

std::vector<Bytes> Store::multiGet(const std::vector<std::string>& keys, Duration timeout) {
  return withTimeout(*this, timeout, [&] { return multiGet(keys); });
}

std::optional<Bytes> Store::queuePop(const std::string& key, bool block, Duration timeout) {
  return withTimeout(*this, timeout, [&] { return queuePop(key, block); });
}

void storeBarrier(Store& store, const std::string& key, int rank, int worldSize, Store::Duration timeout) {
  if (worldSize <= 0 || rank < 0 || rank >= worldSize) {
    throw InvalidArgument(str("storeBarrier(\"", key, "\"): rank ", rank, " is not in [0, ", worldSize, ")"));
  }
  // The counter keeps growing across uses of the same key: the n-th arrival
  // belongs to generation (n-1)/worldSize, so a key can be reused for a
  // sequence of barriers as long as every rank takes part in each.
  const int64_t arrived = store.add(key + "/arrived", 1);
  const int64_t generation = (arrived - 1) / worldSize;
  store.set(str(key, "/rank/", rank), std::to_string(generation));
  const std::string doneKey = str(key, "/done/", generation);
  if (arrived == (generation + 1) * worldSize) store.set(doneKey, "1");
  try {
    store.wait({doneKey}, timeout);
  } catch (const TimeoutError&) {
    // Who is missing: ranks whose marker is absent or from an older generation.
    std::vector<int> missing;
    for (int r = 0; r < worldSize; ++r) {
      const std::string rankKey = str(key, "/rank/", r);
      bool here = false;
      if (store.check({rankKey})) {
        const Bytes value = store.get(rankKey, timeout);
        here = value == std::to_string(generation);
      }
      if (!here) missing.push_back(r);
    }
    const int joined = worldSize - static_cast<int>(missing.size());
    throw TimeoutError(str("store barrier \"", key, "\" timed out after ", timeout.count(), " ms (rank ", rank,
                           "/", worldSize, ", store ", store.describe(), "): ", joined, "/", worldSize,
                           " joined; missing: rank", missing.size() == 1 ? " " : "s ", formatRanges(missing),
                           ". Did those ranks crash or call a different barrier?"));
  }
}

}  // namespace dt
