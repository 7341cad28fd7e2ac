// TcpStore: the Store over TCP, with its server (one Asio event loop).
//
// Contract:
//  * TcpStore(host, port, options) with options.isServer = true starts a
//    TcpStoreServer bound to options.bindAddress (default: loopback when
//    `host` is a loopback name/address, else all interfaces) and port
//    (0 picks a free port; port() reports the bound one), then connects a
//    client to it. With isServer = false it only connects as a client.
//  * Connecting retries refused/reset/unresolvable addresses with exponential
//    backoff and jitter until options.connectTimeout, logging
//    "waiting for the store at host:port" at most every 30 s, then throws
//    TimeoutError naming the address.
//  * The handshake carries a magic number, the protocol version and the token
//    (options.token, default DT_STORE_TOKEN). A version mismatch or a wrong
//    token is a clear error on both sides.
//  * waitForWorkers: the server counts connected clients; the constructor of
//    a server store with waitForWorkers=true returns once numWorkers clients
//    (its own included) have joined, or throws TimeoutError listing how many
//    joined.
//  * A server that goes away fails blocked clients with NetworkError promptly.
//  * A connection that breaks in the middle of a call (reset or closed) is
//    made again once (within the call's deadline, at most 5 s) and the request
//    sent again, up to 3 times per call; when no new connection can be made
//    the call throws NetworkError and later calls fail at once with the reason.
//  * Exactly once: mutating calls (set, add, compareSet, deleteKey, append,
//    multiSet, queuePush, queuePop) carry this client object's random id and
//    a request number, and the server answers a request it has already
//    applied from memory. So a request sent again after a broken connection is
//    applied once, and after a call throws TimeoutError (the server never
//    answered), calling it again with the same arguments completes it at most
//    once: the next call, if identical, is treated as its repeat (any other
//    call abandons it). See tcp_store_server.h for how long replies are kept.
//  * One client object owns one connection; its calls are serialised by a
//    mutex. clone() opens a new connection (and has its own client id).
//  * Fail-over to a hot standby (tcp_store_server.h): a client that knows the
//    standby's address (options.standby, setStandby) treats a connection the
//    server's kernel closed (end-of-file, reset: proof that the server
//    process is gone) as above, except that the reconnect tries both
//    addresses, with backoff, for up to 5 s (and the call's deadline), and
//    sends the request again where one answers: the standby, once it has
//    promoted itself. The request keeps its number, and the standby holds the
//    primary's memory of replies, so a write the primary applied and did not
//    acknowledge is applied once. A blocked get/wait/queuePop goes on waiting
//    on the standby with the rest of its timeout. A reply that never comes
//    (a timeout) is only suspicion: it never makes a client switch.
//    A standby that is not serving answers the handshake with NotPrimary,
//    which a client takes as "try the other address".
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "store/store.h"

namespace dt {

struct TcpStoreOptions {
  bool isServer = false;
  // With isServer: how many clients (this one included) make up the job.
  std::optional<int> numWorkers;
  bool waitForWorkers = true;
  Store::Duration timeout = Store::defaultTimeout();
  // How long to keep retrying while the server is not up. DT_STORE_CONNECT_TIMEOUT.
  Store::Duration connectTimeout = defaultConnectTimeout();
  // Server listen address; empty: loopback for a loopback host, else 0.0.0.0.
  std::string bindAddress;
  // Authentication token; nullopt: DT_STORE_TOKEN.
  std::optional<std::string> token;
  // Client rank, for "missing: rank N" in waitForWorkers/barrier messages; -1 unknown.
  int rank = -1;
  // "host:port" of the server's hot standby ("": none); DT_STORE_STANDBY for
  // dtrun's workers. With isServer it is only passed to clients and clones.
  std::string standby;
  // With isServer: how long a standby attached to this server may leave a
  // write unacknowledged before the server retires it (tcp_store_server.h).
  Store::Duration standbyTimeout{10000};

  static Store::Duration defaultConnectTimeout();
};

class TcpStoreServer;

class TcpStore final : public Store {
 public:
  TcpStore(std::string host, uint16_t port, TcpStoreOptions options = {});
  ~TcpStore() override;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  // One round trip: the server waits for the key (up to timeout) and answers.
  Bytes get(const std::string& key, Duration timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  using Store::wait;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  int64_t numKeys() override;
  void append(const std::string& key, const Bytes& value) override;
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys) override;
  // One round trip: the server waits for all keys (up to timeout) and answers.
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys, Duration timeout) override;
  void multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override;
  void queuePush(const std::string& key, const Bytes& value) override;
  std::optional<Bytes> queuePop(const std::string& key, bool block) override;
  std::optional<Bytes> queuePop(const std::string& key, bool block, Duration timeout) override;
  int64_t queueLen(const std::string& key) override;
  std::shared_ptr<Store> clone() override;
  std::string describe() const override;

  // Adds "host:port", the server's hot standby, to the addresses this client
  // and every clone of it (made before or after) fail over to. Thread-safe.
  void setStandby(const std::string& hostPort);
  // Asks the server to replicate to a standby server (TcpStoreServerOptions::
  // standby) listening on `port` at this client's address as the server sees
  // it. Returns that address ("host:port", what clients should be given) once
  // the standby holds a full copy; throws Error when it cannot be attached.
  std::string attachStandby(uint16_t port);
  // The port the server listens on (the bound one when constructed with port 0).
  uint16_t port() const;
  const std::string& host() const;
  bool isServer() const;

 private:
  struct Client;
  struct CloneTag {};
  // clone(): a client that shares the server handle and does not count as a worker.
  TcpStore(CloneTag, const TcpStore& other);
  std::string host_;
  uint16_t port_;
  TcpStoreOptions options_;
  std::shared_ptr<TcpStoreServer> server_;  // set when isServer
  std::unique_ptr<Client> client_;
};

}  // namespace dt
