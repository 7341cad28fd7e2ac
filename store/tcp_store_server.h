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
//  * waitForWorkers(n, timeout) blocks the caller (any thread but the loop's)
//    until n worker clients have completed the handshake, or throws
//    TimeoutError: "3/4 joined; missing: rank 2".
//  * Raises RLIMIT_NOFILE's soft limit to the hard limit so that thousands of
//    clients fit.
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

  struct Impl;

 private:
  explicit TcpStoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dt
