// EtcdStore: the Store over an etcd v3 cluster, so that a job's rendezvous
// survives the loss of any node (no node hosts it) and of a minority of the
// etcd members; plus leases, so that what a dead node registered vanishes by
// itself.
//
// Why etcd's JSON gateway over HTTP (libcurl + nlohmann/json) and not gRPC:
// every etcd since 3.4 serves the gateway on its client port, libcurl brings
// TLS with CA/client-certificate options and fail-over is ours to write either
// way; gRPC would need etcd's .proto files (with their gogoproto and
// google-api imports) compiled into the build, protoc/grpc_cpp_plugin at build
// time, and gRPC's own threads in every worker. The gateway's costs (base64 and
// JSON, one more hop inside the member) are measured in bench/etcd_bench.
//
// Contract:
//  * Everything in store.h, with TcpStore's semantics (the conformance suite
//    runs on it). Keys live at "<prefix>/k/<key>", queue items at
//    "<prefix>/q/<length>:<queue key>/<id>" (FIFO by etcd's create revision),
//    and each client object's receipt at "<prefix>/c/<client id>": nothing of
//    one prefix is visible through another.
//  * add, compareSet, append, deleteKey, queuePush, queuePop and the lease
//    calls are etcd transactions that also write the client's receipt (its
//    request number and result) and compare the receipt's revision, so a
//    request sent again after a lost reply (a member died in the middle) is
//    applied at most once and answers what the first one did. set and
//    multiSet are plain puts (a repeat writes the same value).
//  * get, wait, multiGet and queuePop(block) read, then watch from the
//    revision they read at (so no write in between is missed) until the keys
//    exist or the timeout passes; the TimeoutError names the keys still
//    missing. A watch that breaks resumes on another member from the last
//    revision it saw.
//  * Fail-over: each request goes to the member that answered last; a refused
//    or broken connection, a member without a leader, a leader change, an
//    overloaded member move to the next endpoint, for up to connectTimeout
//    (then TimeoutError naming every endpoint and its last error). Killing one
//    member of three is invisible to callers.
//  * Refusals that trying again cannot fix fail at once, naming the endpoint
//    and what to check: a TLS handshake that fails (CA, client certificate,
//    key, a plain-HTTP member), wrong user or password, a missing permission
//    on the prefix, a member that is not an etcd v3 gateway; a request over
//    etcd's size limits (1.5 MiB per request, 128 operations per transaction
//    by default) is InvalidArgument. The constructor makes one request, so an
//    unreachable cluster or bad credentials show up there.
//  * multiSet writes up to 64 keys per transaction (each batch is atomic).
//    Values are limited by etcd's --max-request-bytes, not by
//    DT_STORE_MAX_VALUE_BYTES.
// Thread safety: every method may be called from any thread; one EtcdStore
// has one connection for requests and one for watches, and serialises its
// calls (like TcpStore); clone() gives an independent client (own connections
// and receipt) that shares the configuration and the auth token.
// Ownership: held by std::shared_ptr (clone, withPrefix and grantLease need it).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "store/store.h"

namespace dt {

namespace detail {
class EtcdSession;
}

struct EtcdStoreOptions {
  // The members' client URLs: "host:port[,host:port...]" (port 2379 when
  // left out) or with http:// / https:// each. https when a scheme says so
  // or when a CA or client certificate is given.
  std::string endpoints;
  // Every key of this store lives under it ("/dtrain/<job id>"); no trailing '/'.
  std::string prefix = "/dtrain";
  Store::Duration timeout = Store::defaultTimeout();
  // How long each request keeps trying the members (also while the cluster
  // elects a new leader). DT_STORE_CONNECT_TIMEOUT.
  Store::Duration connectTimeout = defaultConnectTimeout();
  // TLS: the CA that signed the members' certificates (PEM; empty: the
  // system's CAs), and this client's certificate and key for members that
  // run with --client-cert-auth.
  std::string caFile, certFile, keyFile;
  // etcd authentication (users and roles); empty user: none.
  std::string user, password;
  // For messages: this client's rank, -1 when unknown.
  int rank = -1;

  static Store::Duration defaultConnectTimeout();
  // DT_ETCD_ENDPOINTS, DT_ETCD_PREFIX, DT_ETCD_CA, DT_ETCD_CERT, DT_ETCD_KEY,
  // DT_ETCD_USER, DT_ETCD_PASSWORD (what dtrun gives its workers), and the
  // store timeouts.
  static EtcdStoreOptions fromEnvironment();
};

// A lease: etcd deletes every key bound to it once it ends. A background
// thread keeps it alive (a keep-alive every third of its TTL, failing over
// like any request) until it is released or revoked, so what a process
// registered vanishes by itself within the TTL when the process dies
// (SIGKILL included) or loses the cluster.
// Thread safety: all methods are thread-safe. The destructor revokes it (its
// keys vanish at once) unless revoke() already ran.
class EtcdLease {
 public:
  ~EtcdLease();
  EtcdLease(const EtcdLease&) = delete;
  EtcdLease& operator=(const EtcdLease&) = delete;

  int64_t id() const;
  // The TTL etcd granted (whole seconds; etcd raises very small ones).
  Store::Duration ttl() const;
  // False once the lease ended: revoked, or etcd answered a keep-alive with
  // "expired" (the keep-alives failed for longer than the TTL: this
  // process was frozen or cut off). Its keys are gone then.
  bool alive() const;
  // Why it is no longer alive ("" while it is).
  std::string lostReason() const;
  // Called once, on the keep-alive thread, when the lease expires (not when
  // revoked). Replaces an earlier callback; must not call back into the lease.
  void onLost(std::function<void(const std::string& reason)> callback);
  // Ends the lease now: its keys vanish. Idempotent.
  void revoke();

 private:
  friend class EtcdStore;
  struct State;
  explicit EtcdLease(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

class EtcdStore final : public Store, public std::enable_shared_from_this<EtcdStore> {
 public:
  explicit EtcdStore(EtcdStoreOptions options);
  ~EtcdStore() override;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override { return get(key, timeout()); }
  Bytes get(const std::string& key, Duration timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  using Store::wait;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  // Keys under this store's prefix (queues and receipts are not keys).
  int64_t numKeys() override;
  void append(const std::string& key, const Bytes& value) override;
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys) override { return multiGet(keys, timeout()); }
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys, Duration timeout) override;
  void multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override;
  void queuePush(const std::string& key, const Bytes& value) override;
  std::optional<Bytes> queuePop(const std::string& key, bool block) override { return queuePop(key, block, timeout()); }
  std::optional<Bytes> queuePop(const std::string& key, bool block, Duration timeout) override;
  int64_t queueLen(const std::string& key) override;
  std::shared_ptr<Store> clone() override;
  // "etcd http://10.0.0.1:2379,http://10.0.0.2:2379 (prefix \"/dtrain/job7\")"
  std::string describe() const override;

  // ---- liveness and membership (what an elastic rendezvous builds on) ----
  // A new lease with (at least) this TTL, kept alive until released.
  std::shared_ptr<EtcdLease> grantLease(Duration ttl);
  // set() with the key bound to `lease`: etcd deletes it when the lease ends.
  void setWithLease(const std::string& key, const Bytes& value, const EtcdLease& lease);
  // Creates key = value bound to `lease` when the key does not exist.
  // Returns nullopt when it created it, else the value already there.
  std::optional<Bytes> createWithLease(const std::string& key, const Bytes& value, const EtcdLease& lease);

  struct Entry {
    std::string key;  // without this store's prefix
    Bytes value;
    int64_t modRevision = 0;
    int64_t lease = 0;  // 0: not bound to a lease
  };
  struct Listing {
    std::vector<Entry> entries;  // in key order
    int64_t revision = 0;        // the cluster's revision the listing was read at
  };
  // Every key that starts with keyPrefix ("" for all), read at one revision.
  Listing list(const std::string& keyPrefix);
  struct Change {
    std::string key;
    Bytes value;           // empty for a deletion
    bool deleted = false;  // deleted, or its lease ended
    int64_t revision = 0;
  };
  // Waits for changes to keys starting with keyPrefix made after
  // `afterRevision` (a Listing's revision, or the last Change's) and returns
  // them (at least one), or an empty list when `timeout` passes first.
  std::vector<Change> watchPrefix(const std::string& keyPrefix, int64_t afterRevision, Duration timeout);

  // A store over the same cluster and session (token, member in use) with
  // another prefix, e.g. one per rendezvous round.
  std::shared_ptr<EtcdStore> withPrefix(const std::string& prefix);
  const std::string& prefix() const;
  // The endpoints as URLs, comma-separated.
  std::string endpoints() const;

 private:
  struct Client;
  EtcdStore(std::shared_ptr<detail::EtcdSession> session, EtcdStoreOptions options);
  EtcdStoreOptions options_;
  std::shared_ptr<detail::EtcdSession> session_;
  std::unique_ptr<Client> client_;
};

}  // namespace dt
