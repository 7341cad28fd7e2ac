// EtcdClient: one HTTP connection (a libcurl easy handle) to etcd's v3 JSON
// gateway, with fail-over across the cluster's members, TLS and user/password
// authentication. EtcdStore and EtcdLease are built on it; the etcd tests use
// it to set a member up (users, roles).
//
// Contract:
//  * call(path, body, deadline) POSTs one JSON request to the member in use
//    and returns its JSON reply. Failures that another member (or the same
//    one a moment later) may not have - refused or reset connections, a
//    member without a leader, a leader change, an overloaded member - move on
//    to the next endpoint and try again, with backoff once every member has
//    failed, until `deadline`; then TimeoutError naming every endpoint and its
//    last error. A failure that trying again cannot fix (a TLS handshake that
//    fails, wrong credentials, a refused permission, something that is not an
//    etcd v3 gateway, a request too large) throws at once: NetworkError,
//    InvalidArgument for a too large request, with the endpoint and what to
//    check.
//  * A request that was sent but whose reply was lost may have been applied:
//    callers make mutating requests safe to repeat (EtcdStore's receipts).
//  * stream(path, body, deadline, onMessage) POSTs a streaming request (watch)
//    and hands each newline-delimited JSON message to onMessage until it
//    returns false (Stopped), the deadline passes (Deadline) or the stream
//    breaks (Broken: the member died; the caller resumes on another one).
//  * Authentication: the first request authenticates (POST
//    /v3/auth/authenticate) and the token is shared by every client of the
//    same EtcdSession; an expired token is renewed once per request.
// Thread safety: an EtcdClient is used by one thread at a time (its owner
// serialises). EtcdSession is thread-safe and shared by clones.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "store/store.h"

namespace dt::detail {

using Json = nlohmann::json;
using EtcdClock = std::chrono::steady_clock;

struct EtcdConfig {
  std::vector<std::string> urls;  // "http://host:port" / "https://host:port", in fail-over order
  std::string caFile, certFile, keyFile;
  std::string user, password;
  bool tls() const { return !urls.empty() && urls.front().starts_with("https://"); }
};

// Parses "host:port,host:port" (scheme optional; port 2379 when absent) into
// URLs; https when a scheme says so or when a CA/certificate is configured.
// Throws InvalidArgument naming `what` for an empty list or a bad entry.
std::vector<std::string> parseEtcdEndpoints(const std::string& text, bool tls, const std::string& what);

// What clones share: the configuration, the auth token and the member that
// answered last (so a clone starts where the cluster is known to work).
class EtcdSession {
 public:
  explicit EtcdSession(EtcdConfig config);
  const EtcdConfig& config() const { return config_; }
  std::string endpointList() const;
  size_t preferred() const { return preferred_.load(std::memory_order_relaxed); }
  void setPreferred(size_t index) { preferred_.store(index, std::memory_order_relaxed); }
  // The current token ("" without authentication) and its generation.
  std::pair<std::string, uint64_t> token();
  void setToken(std::string token, uint64_t generationSeen);
  void invalidateToken(uint64_t generation);
  // Held while a client authenticates.
  std::mutex& authMutex();
  // The cluster answered that authentication is disabled: send no token.
  std::atomic<bool> authDisabled{false};

 private:
  const EtcdConfig config_;
  std::atomic<size_t> preferred_{0};
  std::mutex mutex_;
  std::mutex authMutex_;
  std::string token_;
  uint64_t generation_ = 0;
};

class EtcdClient {
 public:
  explicit EtcdClient(std::shared_ptr<EtcdSession> session);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // `op` names the store operation in messages ("add(\"key\")").
  Json call(const char* path, const Json& body, EtcdClock::time_point deadline, const std::string& op);

  enum class StreamEnd { Stopped, Deadline, Broken };
  // `brokenReason` (when not null) receives why a Broken stream ended.
  StreamEnd stream(const char* path, const Json& body, EtcdClock::time_point deadline, const std::string& op,
                   const std::function<bool(const Json&)>& onMessage, std::string* brokenReason = nullptr);

  const std::shared_ptr<EtcdSession>& session() const { return session_; }
  // The endpoint the last request went to, for messages.
  std::string currentEndpoint() const;

 private:
  // The session's token and its generation, authenticating first when it has none.
  std::pair<std::string, uint64_t> token(EtcdClock::time_point deadline, const std::string& op);

  struct Impl;
  std::shared_ptr<EtcdSession> session_;
  std::unique_ptr<Impl> impl_;
};

// Base64 (standard alphabet, padded): how the gateway carries bytes.
std::string base64Encode(std::string_view bytes);
std::string base64Decode(std::string_view text);
// The gateway writes int64 fields as JSON strings and leaves zero fields out.
int64_t jsonInt(const Json& object, const char* field);
// The first key after every key that starts with `prefix` (etcd's range_end
// for a prefix range).
std::string prefixRangeEnd(const std::string& prefix);

}  // namespace dt::detail
