#include "store/etcd_store.h"

#include <algorithm>
#include <condition_variable>
#include <list>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>

#include <unistd.h>

#include "common/env.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"
#include "common/thread_name.h"
#include "store/internal/etcd_client.h"
#include "store/internal/kv_state.h"

namespace dt {
namespace {

using detail::base64Decode;
using detail::base64Encode;
using detail::EtcdClient;
using detail::EtcdClock;
using detail::jsonInt;
using detail::Json;
using Ms = std::chrono::milliseconds;

// Keys per transaction for multi-key reads and writes (etcd allows 128 operations).
constexpr size_t kBatch = 64;
// Values of this size or less are remembered per client (add/append start from them).
constexpr size_t kCacheValueBytes = 1024;
constexpr size_t kCacheEntries = 256;

std::string randomId() {
  std::random_device device;
  return str(std::hex, (static_cast<uint64_t>(device()) << 32) ^ device());
}

std::string normalisePrefix(std::string prefix) {
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  if (prefix.empty()) throw InvalidArgument("EtcdStore: the key prefix is empty; accepted: e.g. /dtrain/<job id>");
  return prefix;
}

Json rangeRequest(const std::string& key, const std::string& rangeEnd = "", bool countOnly = false) {
  Json r = {{"key", base64Encode(key)}};
  if (!rangeEnd.empty()) r["range_end"] = base64Encode(rangeEnd);
  if (countOnly) r["count_only"] = true;
  return r;
}

Json putRequest(const std::string& key, const Bytes& value, int64_t lease = 0) {
  Json r = {{"key", base64Encode(key)}, {"value", base64Encode(value)}};
  if (lease != 0) r["lease"] = std::to_string(lease);
  return r;
}

Json compareMod(const std::string& key, int64_t modRevision) {
  return {{"key", base64Encode(key)}, {"target", "MOD"}, {"result", "EQUAL"}, {"mod_revision", std::to_string(modRevision)}};
}

Json compareValue(const std::string& key, const Bytes& value) {
  return {{"key", base64Encode(key)}, {"target", "VALUE"}, {"result", "EQUAL"}, {"value", base64Encode(value)}};
}

Json compareMissing(const std::string& key) {
  return {{"key", base64Encode(key)}, {"target", "CREATE"}, {"result", "EQUAL"}, {"create_revision", "0"}};
}

Json compareExists(const std::string& key) {
  return {{"key", base64Encode(key)}, {"target", "CREATE"}, {"result", "GREATER"}, {"create_revision", "0"}};
}

// The first key-value of a range response, if any.
const Json* firstKv(const Json& rangeResponse) {
  const auto it = rangeResponse.find("kvs");
  if (it == rangeResponse.end() || !it->is_array() || it->empty()) return nullptr;
  return &(*it)[0];
}

Bytes kvValue(const Json& kv) { return kv.contains("value") ? base64Decode(kv["value"].get<std::string>()) : Bytes(); }
std::string kvKey(const Json& kv) { return base64Decode(kv.value("key", "")); }

// The i-th range response of a failure branch (after the receipt's).
Json failedRange(const Json& failed, size_t i) {
  return i < failed.size() ? failed[i].value("response_range", Json::object()) : Json::object();
}

// responses[i].response_range of a transaction reply.
const Json& txnRange(const Json& reply, size_t i) {
  static const Json empty = Json::object();
  const auto it = reply.find("responses");
  if (it == reply.end() || i >= it->size()) return empty;
  const Json& entry = (*it)[i];
  const auto range = entry.find("response_range");
  return range == entry.end() ? empty : *range;
}

}  // namespace

// ---- options ----------------------------------------------------------------

Store::Duration EtcdStoreOptions::defaultConnectTimeout() { return env::getDuration("DT_STORE_CONNECT_TIMEOUT"); }

EtcdStoreOptions EtcdStoreOptions::fromEnvironment() {
  EtcdStoreOptions o;
  o.endpoints = env::getString("DT_ETCD_ENDPOINTS");
  o.prefix = env::getString("DT_ETCD_PREFIX");
  o.caFile = env::getString("DT_ETCD_CA");
  o.certFile = env::getString("DT_ETCD_CERT");
  o.keyFile = env::getString("DT_ETCD_KEY");
  o.user = env::getString("DT_ETCD_USER");
  o.password = env::getString("DT_ETCD_PASSWORD");
  return o;
}

// ---- leases -------------------------------------------------------------------

struct EtcdLease::State {
  std::shared_ptr<detail::EtcdSession> session;
  int64_t id = 0;
  Ms ttl{0};
  std::mutex mutex;
  std::condition_variable wake;
  bool stop = false;
  bool alive = true;
  std::string lost;
  std::function<void(const std::string&)> onLost;
  std::thread keeper;
  Logger log = logger("store");

  // The keep-alive loop: one keep-alive every ttl/3; each one may fail over
  // for up to the rest of the TTL (after which etcd has dropped the lease).
  void run() {
    setThreadName("dt-etcd-lease");
    EtcdClient client(session);
    auto lastRenewal = EtcdClock::now();
    const Ms interval = std::max(Ms(100), ttl / 3);
    while (true) {
      {
        std::unique_lock lock(mutex);
        if (wake.wait_for(lock, interval, [&] { return stop; })) return;
      }
      const auto expires = lastRenewal + ttl;
      std::string failure;
      try {
        const Json reply = client.call("/v3/lease/keepalive", Json{{"ID", std::to_string(id)}},
                                       std::max(expires, EtcdClock::now() + Ms(100)), str("keep-alive of lease ", id));
        const Json& result = reply.contains("result") ? reply["result"] : reply;
        if (jsonInt(result, "TTL") > 0) {
          lastRenewal = EtcdClock::now();
          continue;
        }
        failure = str("etcd reports lease ", id, " expired (no keep-alive reached it within its TTL of ",
                      formatDuration(ttl), "); every key bound to it is gone");
      } catch (const std::exception& e) {
        if (EtcdClock::now() < expires) continue;  // the next keep-alive may get through
        failure = str("lease ", id, " could not be kept alive for its TTL of ", formatDuration(ttl), ": ", e.what());
      }
      std::function<void(const std::string&)> callback;
      {
        std::lock_guard lock(mutex);
        if (stop) return;
        alive = false;
        lost = failure;
        callback = onLost;
      }
      log->error("{}", failure);
      if (callback) callback(failure);
      return;
    }
  }

  void stopKeeper() {
    {
      std::lock_guard lock(mutex);
      stop = true;
    }
    wake.notify_all();
    if (keeper.joinable() && keeper.get_id() != std::this_thread::get_id()) keeper.join();
  }
};

EtcdLease::EtcdLease(std::shared_ptr<State> state) : state_(std::move(state)) {}

EtcdLease::~EtcdLease() {
  try {
    revoke();
  } catch (const std::exception& e) {
    state_->log->warn("could not revoke etcd lease {}: {} (it ends by itself within {})", state_->id, e.what(),
                      formatDuration(state_->ttl));
  }
  if (state_->keeper.joinable()) state_->keeper.join();
}

int64_t EtcdLease::id() const { return state_->id; }
Store::Duration EtcdLease::ttl() const { return state_->ttl; }

bool EtcdLease::alive() const {
  std::lock_guard lock(state_->mutex);
  return state_->alive;
}

std::string EtcdLease::lostReason() const {
  std::lock_guard lock(state_->mutex);
  return state_->lost;
}

void EtcdLease::onLost(std::function<void(const std::string& reason)> callback) {
  std::lock_guard lock(state_->mutex);
  state_->onLost = std::move(callback);
}

void EtcdLease::revoke() {
  bool wasAlive = false;
  {
    std::lock_guard lock(state_->mutex);
    wasAlive = state_->alive && !state_->stop;
  }
  state_->stopKeeper();
  if (!wasAlive) return;
  {
    std::lock_guard lock(state_->mutex);
    state_->alive = false;
    state_->lost = "revoked";
  }
  EtcdClient client(state_->session);
  client.call("/v3/lease/revoke", Json{{"ID", std::to_string(state_->id)}}, EtcdClock::now() + Ms(2000),
              str("revoke of lease ", state_->id));
}

// ---- the client -----------------------------------------------------------------

struct EtcdStore::Client {
  std::mutex mutex;  // one call at a time
  EtcdClient requests;
  EtcdClient watches;  // its own connection: aborting a watch must not cost the requests theirs
  std::string prefix;  // normalised, no trailing '/'
  std::string keyPrefix, queuePrefix;
  const std::string clientId = randomId();
  std::string receiptKey;
  int64_t receiptMod = 0;  // the receipt's mod revision as this client last wrote or read it
  uint64_t lastNumber = 0;
  uint64_t itemCounter = 0;
  Ms connectTimeout;
  int rank = -1;
  // Recently seen small values: key -> (value, mod revision), least recently used first.
  std::list<std::pair<std::string, std::pair<Bytes, int64_t>>> cacheOrder;
  std::unordered_map<std::string, decltype(cacheOrder)::iterator> cache;

  Client(const std::shared_ptr<detail::EtcdSession>& session, const std::string& normalisedPrefix, Ms connect, int r)
      : requests(session), watches(session), prefix(normalisedPrefix), connectTimeout(connect), rank(r) {
    keyPrefix = prefix + "/k/";
    queuePrefix = prefix + "/q/";
    receiptKey = prefix + "/c/" + clientId;
  }

  std::string where(const std::string& describe) const {
    return rank >= 0 ? str("rank ", rank, ", ", describe) : describe;
  }
  std::string full(const std::string& key) const { return keyPrefix + key; }
  std::string queueOf(const std::string& key) const { return str(queuePrefix, key.size(), ":", key, "/"); }
  EtcdClock::time_point requestDeadline() const { return detail::deadlineAfter(connectTimeout); }

  Json call(const char* path, const Json& body, const std::string& op) {
    return requests.call(path, body, requestDeadline(), op);
  }

  void remember(const std::string& key, const Bytes& value, int64_t mod) {
    forget(key);
    if (value.size() > kCacheValueBytes) return;
    cacheOrder.emplace_back(key, std::make_pair(value, mod));
    cache[key] = std::prev(cacheOrder.end());
    if (cache.size() > kCacheEntries) {
      cache.erase(cacheOrder.front().first);
      cacheOrder.pop_front();
    }
  }
  void forget(const std::string& key) {
    auto it = cache.find(key);
    if (it == cache.end()) return;
    cacheOrder.erase(it->second);
    cache.erase(it);
  }
  const std::pair<Bytes, int64_t>* cached(const std::string& key) {
    auto it = cache.find(key);
    if (it == cache.end()) return nullptr;
    cacheOrder.splice(cacheOrder.end(), cacheOrder, it->second);
    return &it->second->second;
  }

  // One attempt of a mutating operation, as its builder plans it.
  struct Plan {
    enum class Kind { Write, Done } kind = Kind::Write;
    Json compare = Json::array(), success = Json::array(), failure = Json::array();
    Bytes result;  // what the operation returns once written (recorded in the receipt)
  };

  // Runs a mutating operation exactly once. `plan(failure)` is called with
  // nullptr first, then with the failure-branch responses (after the receipt's
  // range at index 0) whenever the operation's own comparisons failed; it
  // returns the next attempt or Done with the answer. A transaction the
  // gateway sent again after a broken connection, or one applied but
  // unanswered, is recognised by the receipt: its request number is ours.
  template <typename PlanFn>
  Bytes mutate(const std::string& op, PlanFn&& plan) {
    const uint64_t number = ++lastNumber;
    const std::string numberText = std::to_string(number);
    const Json* failed = nullptr;
    Json reply;
    const auto deadline = requestDeadline();
    for (int attempt = 0;; ++attempt) {
      Plan p = plan(failed);
      if (p.kind == Plan::Kind::Done) return p.result;
      Json txn;
      p.compare.push_back(compareMod(receiptKey, receiptMod));
      p.success.push_back({{"request_put", putRequest(receiptKey, numberText + "\n" + p.result)}});
      Json failureOps = Json::array({{{"request_range", rangeRequest(receiptKey)}}});
      for (auto& f : p.failure) failureOps.push_back(std::move(f));
      txn["compare"] = std::move(p.compare);
      txn["success"] = std::move(p.success);
      txn["failure"] = std::move(failureOps);
      reply = requests.call("/v3/kv/txn", txn, deadline, op);
      if (reply.value("succeeded", false)) {
        receiptMod = jsonInt(reply["header"], "revision");
        return p.result;
      }
      const Json& receiptRange = txnRange(reply, 0);
      const Json* receipt = firstKv(receiptRange);
      const int64_t mod = receipt ? jsonInt(*receipt, "mod_revision") : 0;
      if (receipt) {
        const Bytes recorded = kvValue(*receipt);
        const auto newline = recorded.find('\n');
        if (recorded.substr(0, newline) == numberText) {  // applied before: its reply was lost
          receiptMod = mod;
          return newline == std::string::npos ? Bytes() : recorded.substr(newline + 1);
        }
      }
      if (mod != receiptMod) {  // our picture of the receipt was stale; the operation's own test may have passed
        receiptMod = mod;
        failed = nullptr;
        continue;
      }
      // The operation's comparison failed: let the builder look at what is there now.
      static const Json none = Json::array();
      reply["responses"].erase(reply["responses"].begin());
      failed = reply.contains("responses") ? &reply["responses"] : &none;
      if (attempt > 0 && attempt % 1000 == 0) {
        logger("store")->warn("etcd store {}: {} attempts lost a race with other writers so far", op, attempt);
      }
    }
  }

  // A read-modify-write of one key's value (add, append): `next(current,
  // existed)` gives the value to write.
  template <typename NextFn>
  Bytes readModifyWrite(const std::string& op, const std::string& key, NextFn&& next, bool cacheIt) {
    const std::string k = full(key);
    bool known = false;
    Bytes current;
    int64_t mod = 0;
    if (const auto* c = cached(k)) {
      known = true;
      current = c->first;
      mod = c->second;
    }
    Bytes written;
    mutate(op, [&](const Json* failed) {
      if (failed) {
        const Json range = failedRange(*failed, 0);
        const Json* kv = firstKv(range);
        current = kv ? kvValue(*kv) : Bytes();
        mod = kv ? jsonInt(*kv, "mod_revision") : 0;
        known = true;
      } else if (!known) {
        mod = 0;  // first guess: the key is new (one round trip when it is)
      }
      Plan p;
      written = next(current, mod != 0);
      p.compare.push_back(compareMod(k, mod));
      p.success.push_back({{"request_put", putRequest(k, written)}});
      p.failure.push_back({{"request_range", rangeRequest(k)}});
      p.result = written;
      return p;
    });
    if (cacheIt) remember(k, written, receiptMod);
    return written;
  }

  // Values (or presence) of full keys, one transaction per batch. `values`
  // gets the value of each present key; returns the revision read at.
  int64_t readKeys(const std::string& op, const std::vector<std::string>& keys, bool countOnly,
                   std::vector<std::optional<Bytes>>& values) {
    values.assign(keys.size(), std::nullopt);
    int64_t revision = 0;
    for (size_t begin = 0; begin < keys.size(); begin += kBatch) {
      const size_t end = std::min(keys.size(), begin + kBatch);
      Json txn;
      txn["success"] = Json::array();
      for (size_t i = begin; i < end; ++i) {
        Json r = rangeRequest(keys[i], "", countOnly);
        if (revision != 0) r["revision"] = std::to_string(revision);  // the same snapshot for every batch
        txn["success"].push_back({{"request_range", r}});
      }
      const Json reply = call("/v3/kv/txn", txn, op);
      if (revision == 0) revision = jsonInt(reply["header"], "revision");
      for (size_t i = begin; i < end; ++i) {
        const Json& range = txnRange(reply, i - begin);
        if (countOnly) {
          if (jsonInt(range, "count") > 0) values[i] = Bytes();
        } else if (const Json* kv = firstKv(range)) {
          values[i] = kvValue(*kv);
        }
      }
    }
    return revision;
  }

  // Waits until every key in `missing` (full keys) has been put after
  // `revision`, filling `values` (indexed like `keys`). Throws TimeoutError
  // at the deadline naming the keys still missing.
  void awaitKeys(const std::string& opName, const std::vector<std::string>& userKeys, const std::vector<std::string>& keys,
                 std::vector<std::optional<Bytes>>& values, int64_t revision, Ms timeout,
                 EtcdClock::time_point deadline, const std::string& where) {
    std::map<std::string, std::vector<size_t>> missing;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!values[i]) missing[keys[i]].push_back(i);
    }
    auto timedOut = [&] {
      std::vector<std::string> still;
      for (size_t i = 0; i < keys.size(); ++i) {
        if (!values[i]) still.push_back(userKeys[i]);
      }
      still.erase(std::unique(still.begin(), still.end()), still.end());
      detail::throwWaitTimeout(opName, userKeys, still, timeout, where);
    };
    int64_t resumeFrom = revision + 1;
    while (!missing.empty()) {
      if (EtcdClock::now() >= deadline) timedOut();
      Json create = {{"key", base64Encode(missing.begin()->first)}, {"start_revision", std::to_string(resumeFrom)},
                     {"filters", Json::array({"NODELETE"})}};
      if (missing.size() > 1) create["range_end"] = base64Encode(std::prev(missing.end())->first + '\0');
      std::string cancelled;
      int64_t compacted = 0;
      const auto end = watches.stream(
          "/v3/watch", Json{{"create_request", create}}, deadline, opName, [&](const Json& message) {
            if (message.value("canceled", false)) {
              cancelled = message.value("cancel_reason", "cancelled by the member");
              compacted = jsonInt(message, "compact_revision");
              return false;
            }
            const auto events = message.find("events");
            if (events == message.end()) return true;
            for (const Json& event : *events) {
              const Json& kv = event["kv"];
              resumeFrom = std::max(resumeFrom, jsonInt(kv, "mod_revision"));
              if (event.value("type", "PUT") != "PUT") continue;
              auto it = missing.find(kvKey(kv));
              if (it == missing.end()) continue;
              const Bytes value = kvValue(kv);
              for (size_t i : it->second) values[i] = value;
              missing.erase(it);
            }
            return !missing.empty();
          });
      if (missing.empty()) return;
      if (end == EtcdClient::StreamEnd::Deadline) timedOut();
      if (!cancelled.empty()) {
        if (compacted == 0 && cancelled.find("no leader") == std::string::npos) {
          throw NetworkError(str("etcd store ", opName, ": the member cancelled the watch: ", cancelled, " (", where, ")"));
        }
        // History was compacted (or the member lost its leader): read afresh and watch from there.
        std::vector<std::string> still;
        std::vector<size_t> index;
        for (const auto& [key, positions] : missing) {
          still.push_back(key);
          index.push_back(positions.front());
        }
        std::vector<std::optional<Bytes>> fresh;
        resumeFrom = readKeys(opName, still, false, fresh) + 1;
        for (size_t j = 0; j < still.size(); ++j) {
          if (!fresh[j]) continue;
          for (size_t i : missing[still[j]]) values[i] = fresh[j];
          missing.erase(still[j]);
        }
      }
      // Broken: resume (on the next member) from the last revision seen; events of that revision may repeat.
    }
  }
};

// ---- the store --------------------------------------------------------------------

namespace {

std::shared_ptr<detail::EtcdSession> makeSession(const EtcdStoreOptions& o) {
  detail::EtcdConfig config;
  const bool tls = !o.caFile.empty() || !o.certFile.empty() || !o.keyFile.empty();
  config.urls = detail::parseEtcdEndpoints(o.endpoints, tls, "EtcdStore endpoints");
  if (o.certFile.empty() != o.keyFile.empty()) {
    throw InvalidArgument(str("EtcdStore: a client certificate needs its key and the other way round (certFile=",
                              quoteBytes(o.certFile), ", keyFile=", quoteBytes(o.keyFile), ")"));
  }
  for (const auto* file : {&o.caFile, &o.certFile, &o.keyFile}) {
    if (!file->empty() && ::access(file->c_str(), R_OK) != 0) {
      throw InvalidArgument(str("EtcdStore: cannot read ", quoteBytes(*file), " (TLS CA, certificate or key file)"));
    }
  }
  config.caFile = o.caFile;
  config.certFile = o.certFile;
  config.keyFile = o.keyFile;
  config.user = o.user;
  config.password = o.password;
  return std::make_shared<detail::EtcdSession>(std::move(config));
}

}  // namespace

EtcdStore::EtcdStore(EtcdStoreOptions options) : EtcdStore(makeSession(options), options) {}

EtcdStore::EtcdStore(std::shared_ptr<detail::EtcdSession> session, EtcdStoreOptions options)
    : options_(std::move(options)), session_(std::move(session)) {
  options_.prefix = normalisePrefix(options_.prefix);
  setTimeout(options_.timeout);
  client_ = std::make_unique<Client>(session_, options_.prefix, options_.connectTimeout, options_.rank);
  // One request now, so that an unreachable cluster, a TLS or credential
  // problem or a missing permission shows up here rather than mid-job.
  client_->call("/v3/kv/range", rangeRequest(client_->keyPrefix, detail::prefixRangeEnd(client_->keyPrefix), true),
                "connect");
}

EtcdStore::~EtcdStore() {
  if (client_ && client_->receiptMod != 0) {
    try {  // the receipt is of no use once this client is gone
      client_->requests.call("/v3/kv/deleterange", rangeRequest(client_->receiptKey), EtcdClock::now() + Ms(500),
                             "deleteKey(receipt)");
    } catch (const std::exception&) {
    }
  }
}

void EtcdStore::set(const std::string& key, const Bytes& value) {
  std::lock_guard lock(client_->mutex);
  client_->forget(client_->full(key));
  client_->call("/v3/kv/put", putRequest(client_->full(key), value), str("set(\"", key, "\")"));
}

Bytes EtcdStore::get(const std::string& key, Duration timeout) {
  const auto deadline = detail::deadlineAfter(timeout);
  std::lock_guard lock(client_->mutex);
  std::vector<std::optional<Bytes>> values;
  const std::vector<std::string> keys = {client_->full(key)};
  const int64_t revision = client_->readKeys("get", keys, false, values);
  if (!values[0]) client_->awaitKeys("get", {key}, keys, values, revision, timeout, deadline, client_->where(describe()));
  return *values[0];
}

int64_t EtcdStore::add(const std::string& key, int64_t delta) {
  std::lock_guard lock(client_->mutex);
  const Bytes written = client_->readModifyWrite(
      str("add(\"", key, "\", ", delta, ")"), key,
      [&](const Bytes& current, bool existed) {
        return std::to_string(detail::addToCounter(key, existed ? current : Bytes("0"), delta));
      },
      true);
  return std::stoll(written);
}

Bytes EtcdStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  std::lock_guard lock(client_->mutex);
  const std::string k = client_->full(key);
  client_->forget(k);
  using Plan = Client::Plan;
  return client_->mutate(str("compareSet(\"", key, "\")"), [&](const Json* failed) {
    Plan p;
    p.result = desired;
    p.failure.push_back({{"request_range", rangeRequest(k)}});
    p.success.push_back({{"request_put", putRequest(k, desired)}});
    if (!failed) {
      p.compare.push_back(expected.empty() ? compareMissing(k) : compareValue(k, expected));
      return p;
    }
    const Json range = failedRange(*failed, 0);
        const Json* kv = firstKv(range);
    if (!kv) {
      if (!expected.empty()) return Plan{Plan::Kind::Done, {}, {}, {}, expected};
      p.compare.push_back(compareMissing(k));
      return p;
    }
    const Bytes current = kvValue(*kv);
    if (current != expected) return Plan{Plan::Kind::Done, {}, {}, {}, current};
    // It holds `expected` (an empty value when expected is empty): replace exactly that version.
    p.compare.push_back(compareMod(k, jsonInt(*kv, "mod_revision")));
    return p;
  });
}

void EtcdStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  const auto deadline = detail::deadlineAfter(timeout);
  std::lock_guard lock(client_->mutex);
  std::vector<std::string> full;
  for (const auto& key : keys) full.push_back(client_->full(key));
  std::vector<std::optional<Bytes>> values;
  const int64_t revision = client_->readKeys("wait", full, true, values);
  client_->awaitKeys("wait", keys, full, values, revision, timeout, deadline, client_->where(describe()));
}

bool EtcdStore::check(const std::vector<std::string>& keys) {
  std::lock_guard lock(client_->mutex);
  std::vector<std::string> full;
  for (const auto& key : keys) full.push_back(client_->full(key));
  std::vector<std::optional<Bytes>> values;
  client_->readKeys("check", full, true, values);
  return std::all_of(values.begin(), values.end(), [](const auto& v) { return v.has_value(); });
}

bool EtcdStore::deleteKey(const std::string& key) {
  std::lock_guard lock(client_->mutex);
  const std::string k = client_->full(key);
  client_->forget(k);
  using Plan = Client::Plan;
  const Bytes deleted = client_->mutate(str("deleteKey(\"", key, "\")"), [&](const Json* failed) {
    if (failed) return Plan{Plan::Kind::Done, {}, {}, {}, "0"};  // it was not there
    Plan p;
    p.compare.push_back(compareExists(k));
    p.success.push_back({{"request_delete_range", rangeRequest(k)}});
    p.result = "1";
    return p;
  });
  return deleted == "1";
}

int64_t EtcdStore::numKeys() {
  std::lock_guard lock(client_->mutex);
  const Json reply = client_->call(
      "/v3/kv/range", rangeRequest(client_->keyPrefix, detail::prefixRangeEnd(client_->keyPrefix), true), "numKeys");
  return jsonInt(reply, "count");
}

void EtcdStore::append(const std::string& key, const Bytes& value) {
  std::lock_guard lock(client_->mutex);
  client_->readModifyWrite(
      str("append(\"", key, "\")"), key, [&](const Bytes& current, bool) { return current + value; }, true);
}

std::vector<Bytes> EtcdStore::multiGet(const std::vector<std::string>& keys, Duration timeout) {
  const auto deadline = detail::deadlineAfter(timeout);
  std::lock_guard lock(client_->mutex);
  std::vector<std::string> full;
  for (const auto& key : keys) full.push_back(client_->full(key));
  std::vector<std::optional<Bytes>> values;
  const int64_t revision = client_->readKeys("multiGet", full, false, values);
  client_->awaitKeys("multiGet", keys, full, values, revision, timeout, deadline, client_->where(describe()));
  std::vector<Bytes> out;
  out.reserve(values.size());
  for (auto& v : values) out.push_back(std::move(*v));
  return out;
}

void EtcdStore::multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  if (keys.size() != values.size()) {
    throw InvalidArgument(str("store multiSet: ", keys.size(), " keys but ", values.size(), " values; give one value per key"));
  }
  std::lock_guard lock(client_->mutex);
  for (size_t begin = 0; begin < keys.size(); begin += kBatch) {
    const size_t end = std::min(keys.size(), begin + kBatch);
    Json txn;
    txn["success"] = Json::array();
    std::set<std::string> seen;  // etcd refuses a key twice in one transaction: the last value wins
    for (size_t i = end; i-- > begin;) {
      const std::string k = client_->full(keys[i]);
      client_->forget(k);
      if (seen.insert(k).second) txn["success"].push_back({{"request_put", putRequest(k, values[i])}});
    }
    client_->call("/v3/kv/txn", txn, str("multiSet(", keys.size(), " keys)"));
  }
}

void EtcdStore::queuePush(const std::string& key, const Bytes& value) {
  std::lock_guard lock(client_->mutex);
  const std::string item = str(client_->queueOf(key), client_->clientId, ".", ++client_->itemCounter);
  client_->mutate(str("queuePush(\"", key, "\")"), [&](const Json*) {
    Client::Plan p;
    p.success.push_back({{"request_put", putRequest(item, value)}});
    return p;
  });
}

std::optional<Bytes> EtcdStore::queuePop(const std::string& key, bool block, Duration timeout) {
  const auto deadline = detail::deadlineAfter(timeout);
  std::lock_guard lock(client_->mutex);
  const std::string queue = client_->queueOf(key);
  const std::string op = str("queuePop(\"", key, "\")");
  while (true) {
    Json oldest = rangeRequest(queue, detail::prefixRangeEnd(queue));
    oldest["sort_target"] = "CREATE";
    oldest["sort_order"] = "ASCEND";
    oldest["limit"] = "1";
    const Json reply = client_->call("/v3/kv/range", oldest, op);
    if (const Json* kv = firstKv(reply)) {
      const std::string item = kvKey(*kv);
      const Bytes value = kvValue(*kv);
      const int64_t mod = jsonInt(*kv, "mod_revision");
      bool taken = true;
      const Bytes popped = client_->mutate(op, [&](const Json* failed) {
        if (failed) {  // another consumer took it first
          taken = false;
          return Client::Plan{Client::Plan::Kind::Done, {}, {}, {}, {}};
        }
        Client::Plan p;
        p.compare.push_back(compareMod(item, mod));
        p.success.push_back({{"request_delete_range", rangeRequest(item)}});
        p.result = value;
        return p;
      });
      if (taken) return popped;
      continue;
    }
    if (!block) return std::nullopt;
    // Empty: wait for a push after the revision the range was read at.
    const int64_t revision = jsonInt(reply["header"], "revision");
    bool pushed = false;
    std::string cancelled;
    while (!pushed) {
      if (EtcdClock::now() >= deadline) break;
      Json create = {{"key", base64Encode(queue)}, {"range_end", base64Encode(detail::prefixRangeEnd(queue))},
                     {"start_revision", std::to_string(revision + 1)}, {"filters", Json::array({"NODELETE"})}};
      const auto end = client_->watches.stream("/v3/watch", Json{{"create_request", create}}, deadline, op,
                                               [&](const Json& message) {
                                                 if (message.value("canceled", false)) {
                                                   cancelled = message.value("cancel_reason", "cancelled");
                                                   return false;
                                                 }
                                                 const auto events = message.find("events");
                                                 pushed = events != message.end() && !events->empty();
                                                 return !pushed;
                                               });
      if (end == detail::EtcdClient::StreamEnd::Deadline) break;
      if (!cancelled.empty()) break;  // read the queue again
    }
    if (!pushed && cancelled.empty()) {
      throw TimeoutError(str("store queuePop(\"", key, "\") timed out after ", timeout.count(), " ms (",
                             client_->where(describe()), "): the queue stayed empty. Is the producer running?"));
    }
  }
}

int64_t EtcdStore::queueLen(const std::string& key) {
  std::lock_guard lock(client_->mutex);
  const std::string queue = client_->queueOf(key);
  const Json reply = client_->call("/v3/kv/range", rangeRequest(queue, detail::prefixRangeEnd(queue), true),
                                   str("queueLen(\"", key, "\")"));
  return jsonInt(reply, "count");
}

std::shared_ptr<Store> EtcdStore::clone() {
  auto copy = std::shared_ptr<EtcdStore>(new EtcdStore(session_, options_));
  copy->setTimeout(timeout());
  return copy;
}

std::shared_ptr<EtcdStore> EtcdStore::withPrefix(const std::string& prefix) {
  EtcdStoreOptions options = options_;
  options.prefix = prefix;
  auto copy = std::shared_ptr<EtcdStore>(new EtcdStore(session_, options));
  copy->setTimeout(timeout());
  return copy;
}

std::string EtcdStore::describe() const { return str("etcd ", session_->endpointList(), " (prefix \"", options_.prefix, "\")"); }
const std::string& EtcdStore::prefix() const { return options_.prefix; }
std::string EtcdStore::endpoints() const { return session_->endpointList(); }

// ---- leases and membership ------------------------------------------------------------

std::shared_ptr<EtcdLease> EtcdStore::grantLease(Duration ttl) {
  const int64_t seconds = std::max<int64_t>(1, (ttl.count() + 999) / 1000);
  Json reply;
  {
    std::lock_guard lock(client_->mutex);
    reply = client_->call("/v3/lease/grant", Json{{"TTL", std::to_string(seconds)}}, str("grantLease(", seconds, " s)"));
  }
  auto state = std::make_shared<EtcdLease::State>();
  state->session = session_;
  state->id = jsonInt(reply, "ID");
  state->ttl = Ms(jsonInt(reply, "TTL") * 1000);
  if (state->id == 0 || state->ttl.count() <= 0) {
    throw NetworkError(str("etcd store grantLease: ", client_->requests.currentEndpoint(), " answered without a lease: ",
                           quoteBytes(reply.dump(), 120)));
  }
  EtcdLease::State* raw = state.get();
  state->keeper = std::thread([raw] { raw->run(); });
  return std::shared_ptr<EtcdLease>(new EtcdLease(std::move(state)));
}

void EtcdStore::setWithLease(const std::string& key, const Bytes& value, const EtcdLease& lease) {
  std::lock_guard lock(client_->mutex);
  client_->forget(client_->full(key));
  client_->call("/v3/kv/put", putRequest(client_->full(key), value, lease.id()),
                str("setWithLease(\"", key, "\", lease ", lease.id(), ")"));
}

std::optional<Bytes> EtcdStore::createWithLease(const std::string& key, const Bytes& value, const EtcdLease& lease) {
  std::lock_guard lock(client_->mutex);
  const std::string k = client_->full(key);
  client_->forget(k);
  std::optional<Bytes> existing;
  client_->mutate(str("createWithLease(\"", key, "\", lease ", lease.id(), ")"), [&](const Json* failed) {
    using Plan = Client::Plan;
    if (failed) {
      const Json range = failedRange(*failed, 0);
        const Json* kv = firstKv(range);
      if (kv) {
        existing = kvValue(*kv);
        return Plan{Plan::Kind::Done, {}, {}, {}, {}};
      }
    }
    Plan p;
    p.compare.push_back(compareMissing(k));
    p.success.push_back({{"request_put", putRequest(k, value, lease.id())}});
    p.failure.push_back({{"request_range", rangeRequest(k)}});
    return p;
  });
  return existing;
}

EtcdStore::Listing EtcdStore::list(const std::string& keyPrefix) {
  std::lock_guard lock(client_->mutex);
  const std::string from = client_->full(keyPrefix);
  const Json reply = client_->call("/v3/kv/range", rangeRequest(from, detail::prefixRangeEnd(from)),
                                   str("list(\"", keyPrefix, "\")"));
  Listing out;
  out.revision = jsonInt(reply["header"], "revision");
  if (reply.contains("kvs")) {
    for (const Json& kv : reply["kvs"]) {
      out.entries.push_back(Entry{kvKey(kv).substr(client_->keyPrefix.size()), kvValue(kv), jsonInt(kv, "mod_revision"),
                                  jsonInt(kv, "lease")});
    }
  }
  return out;
}

std::vector<EtcdStore::Change> EtcdStore::watchPrefix(const std::string& keyPrefix, int64_t afterRevision,
                                                      Duration timeout) {
  const auto deadline = detail::deadlineAfter(timeout);
  std::lock_guard lock(client_->mutex);
  const std::string from = client_->full(keyPrefix);
  const std::string op = str("watchPrefix(\"", keyPrefix, "\")");
  std::vector<Change> changes;
  int64_t resumeFrom = afterRevision + 1;
  while (changes.empty() && EtcdClock::now() < deadline) {
    Json create = {{"key", base64Encode(from)}, {"range_end", base64Encode(detail::prefixRangeEnd(from))},
                   {"start_revision", std::to_string(resumeFrom)}};
    std::string cancelled;
    int64_t compacted = 0;
    const auto end = client_->watches.stream("/v3/watch", Json{{"create_request", create}}, deadline, op,
                                             [&](const Json& message) {
                                               if (message.value("canceled", false)) {
                                                 cancelled = message.value("cancel_reason", "cancelled");
                                                 compacted = jsonInt(message, "compact_revision");
                                                 return false;
                                               }
                                               const auto events = message.find("events");
                                               if (events == message.end()) return true;
                                               for (const Json& event : *events) {
                                                 const Json& kv = event["kv"];
                                                 Change c;
                                                 c.key = kvKey(kv).substr(client_->keyPrefix.size());
                                                 c.deleted = event.value("type", "PUT") == "DELETE";
                                                 if (!c.deleted) c.value = kvValue(kv);
                                                 c.revision = jsonInt(kv, "mod_revision");
                                                 changes.push_back(std::move(c));
                                               }
                                               return changes.empty();
                                             });
    if (end == detail::EtcdClient::StreamEnd::Deadline) break;
    if (!cancelled.empty() && changes.empty()) {
      if (compacted != 0) {
        throw NetworkError(str("etcd store ", op, ": revision ", afterRevision, " was compacted away (oldest kept: ",
                               compacted, "); list() again and watch from its revision"));
      }
      if (cancelled.find("no leader") == std::string::npos) {
        throw NetworkError(str("etcd store ", op, ": the member cancelled the watch: ", cancelled));
      }
    }
  }
  return changes;
}

}  // namespace dt
