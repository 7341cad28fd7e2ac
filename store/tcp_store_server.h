// TcpStoreServer: the store's server, one Asio event loop on its own thread.
//
// Contract:
//  * start() binds and listens before it returns (so port() is final and an
//    "address already in use" is thrown to the caller as NetworkError naming
//    the address), then serves until the object is destroyed. Destroying it
//    closes every connection, so blocked clients fail with NetworkError at once.
//  * Never blocks on a client and never trusts one: handshakes are checked
//    (magic, version, token), frames are bounded (maxKeyBytes, maxValueBytes),
//    and a malformed frame, an unknown command, or a client that stalls in the
//    middle of a request for stallTimeout loses its connection with a logged
//    reason (peer address). Stored data is never dropped for that.
//  * Memory follows what peers have proven, not what they claim:
//    - before its handshake a connection may claim a frame of at most
//      store_proto::kMaxHandshakeBytes (larger: closed at once), must complete
//      the handshake within handshakeTimeout, and buffers at most 16 KiB;
//    - at most maxUnauthenticated connections may be waiting for their
//      handshake; one more closes the oldest of them (a real client sends its
//      handshake at once, so it is never the oldest for long);
//    - after the handshake a connection's buffer grows with the bytes that
//      arrive, never ahead of them; a request over 64 KiB takes a share of
//      maxBufferedBytes while it arrives, and a connection whose request does
//      not fit is not read (TCP pushes back on its sender) until earlier
//      large requests complete, first come first served.
//    Warnings about unauthenticated peers and about the caps are rate-limited
//    (10 per 10 s each, then a count of those left out).
//  * Exactly once: the reply to each client's latest mutating request is
//    remembered (store_proto's request ids), so a request repeated after a
//    lost connection or a timeout is answered, not applied again. Memory:
//    the latest reply of at most 65536 clients, 64 MiB of replies, each kept
//    until its client has been idle for an hour, least recently used first
//    out. A client forgotten that way gets its repeat applied again.
//  * waitForWorkers(n, timeout) blocks the caller (any thread but the loop's)
//    until n worker clients have completed the handshake, or throws
//    TimeoutError: "3/4 joined; missing: rank 2".
//  * Raises RLIMIT_NOFILE's soft limit to the hard limit so that thousands of
//    clients fit.
//  * Hot standby (options.standby): a second server that a primary replicates
//    to synchronously. A client asks the primary for it (TcpStore::
//    attachStandby(port)); the primary connects to that port at the client's
//    address, copies its whole state over, and from then on sends the standby
//    every write it applies, in order, and holds every reply that could
//    reveal a write (the write's own, and any read after it) until the
//    standby has applied that write. So no reply a client saw is lost with the
//    primary. A standby refuses ordinary clients (NotPrimary: they try their
//    other address) until its primary's replication connection is closed by
//    the peer's kernel (end-of-file or reset: proof that the primary process
//    is gone); then it serves as the primary, with the replies it remembers
//    for exactly-once retries. Silence on that connection is only suspicion:
//    a standby never promotes itself for it. A primary whose standby leaves a
//    write unacknowledged for standbyTimeout tells it to retire (it will never
//    serve) and goes on alone; so does one whose standby's connection closes.
//    A standby serves one primary once: after promotion, retirement or a
//    replication connection lost before the copy was complete, it never
//    follows again.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace dt {

struct TcpStoreServerOptions {
  std::string bindAddress = "127.0.0.1";
  uint16_t port = 0;
  std::string token;
  // 0: DT_STORE_MAX_KEY_BYTES / DT_STORE_MAX_VALUE_BYTES.
  size_t maxKeyBytes = 0;
  size_t maxValueBytes = 0;
  // How long a client may sit in the middle of a request (or before its
  // handshake) before it is disconnected. 0: DT_STORE_STALL_TIMEOUT.
  std::chrono::milliseconds stallTimeout{0};
  // How long a new connection has for its handshake (the smaller of this and
  // stallTimeout applies). 0: DT_STORE_HANDSHAKE_TIMEOUT.
  std::chrono::milliseconds handshakeTimeout{0};
  // Connections still waiting for their handshake; at the cap a new one
  // closes the oldest. 0: DT_STORE_MAX_UNAUTHENTICATED.
  size_t maxUnauthenticated = 0;
  // Input buffered for large requests across all connections. 0:
  // DT_STORE_MAX_BUFFERED_BYTES.
  size_t maxBufferedBytes = 0;
  // A hot standby: refuses clients until promoted (see the contract).
  bool standby = false;
  // Primary: how long the standby may leave a write unacknowledged (or take
  // to accept the replication connection) before the primary retires it.
  std::chrono::milliseconds standbyTimeout{10000};
};

class TcpStoreServer {
 public:
  static std::shared_ptr<TcpStoreServer> start(TcpStoreServerOptions options);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  uint16_t port() const;
  // "127.0.0.1:29500", for messages.
  std::string address() const;
  void waitForWorkers(int numWorkers, std::chrono::milliseconds timeout);
  // Worker clients that completed the handshake so far (ever, not just now).
  int joinedWorkers() const;
  // "primary", "standby" (not serving yet) or "retired" (a standby that will never serve).
  std::string role() const;

  struct Impl;

 private:
  explicit TcpStoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dt
