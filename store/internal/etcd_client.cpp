#include "store/internal/etcd_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <climits>
#include <thread>

#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"

namespace dt::detail {
namespace {

using Ms = std::chrono::milliseconds;

// How long one attempt at a unary request may take before the next member is
// tried. A member still following a leader that just died holds a write
// until etcd's own request timeout (5 s + two election timeouts); giving up
// on it after 2 s and asking the next member (a repeat is safe, see
// EtcdStore's receipts) gets through as soon as the new leader is elected.
// Each further attempt of the same request may take twice as long, up to
// 10 s, so that a request that is merely slow still completes.
constexpr Ms kFirstAttemptTimeout{2'000};
constexpr Ms kMaxAttemptTimeout{10'000};
// Within one pass over the members, an attempt takes at most an equal share of
// what is left of the deadline (and at least this): a request with a short
// deadline - a lease keep-alive has the rest of the lease's TTL, 1.3 s for a
// 2 s TTL - must not spend all of it on a member that holds it, while another
// member would answer. (It did: an elastic job whose etcd lost a member
// declared healthy nodes lost.)
constexpr Ms kMinAttemptShare{100};
// How long connecting to one member may take before the next one is tried.
constexpr Ms kConnectAttemptTimeout{2'000};
constexpr Ms kMaxBackoff{500};

void initCurlOnce() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

Ms remaining(EtcdClock::time_point deadline) {
  return std::max(Ms(0), std::chrono::duration_cast<Ms>(deadline - EtcdClock::now()));
}

bool contains(std::string_view text, std::string_view needle) { return text.find(needle) != std::string_view::npos; }

// How a failed request is handled.
enum class Verdict { Retry, RenewToken, Fatal, TooLarge };

// etcd's answers that another member, or the same one a moment later, may not give.
Verdict classifyEtcdError(const std::string& message, int64_t grpcCode) {
  if (contains(message, "invalid auth token") || contains(message, "revision of auth store is old")) {
    return Verdict::RenewToken;
  }
  if (contains(message, "request is too large") || contains(message, "message larger than max") ||
      contains(message, "too many operations in txn")) {
    return Verdict::TooLarge;
  }
  static constexpr std::string_view kTransient[] = {
      "leader changed", "no leader", "request timed out", "too many requests", "server stopped", "not capable",
      "unhealthy cluster", "transport is closing", "connection refused", "error reading from server",
      "timed out waiting for read index", "raft proposal dropped", "context canceled"};
  for (auto t : kTransient) {
    if (contains(message, t)) return Verdict::Retry;
  }
  // gRPC Unavailable, DeadlineExceeded, Canceled, ResourceExhausted: the member cannot serve now.
  if (grpcCode == 14 || grpcCode == 4 || grpcCode == 1 || grpcCode == 8) return Verdict::Retry;
  return Verdict::Fatal;
}

bool isTlsFailure(CURLcode code, const std::string& text) {
  switch (code) {
    case CURLE_SSL_CONNECT_ERROR:
      // A member that dies during the handshake resets it: that is worth another try.
      return !(contains(text, "reset by peer") || contains(text, "SSL_ERROR_SYSCALL") || contains(text, "unexpected eof"));
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CERTPROBLEM:
    case CURLE_SSL_CIPHER:
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_SSL_ISSUER_ERROR:
    case CURLE_SSL_PINNEDPUBKEYNOTMATCH:
    case CURLE_SSL_CRL_BADFILE:
    case CURLE_SSL_ENGINE_NOTFOUND:
    case CURLE_SSL_ENGINE_SETFAILED:
    case CURLE_SSL_ENGINE_INITFAILED:
    case CURLE_USE_SSL_FAILED:
      return true;
    default:
      // TLS 1.3: a server that refuses the client's certificate says so in an
      // alert the client reads after its side of the handshake completed.
      return (code == CURLE_RECV_ERROR || code == CURLE_SEND_ERROR) && contains(text, "alert");
  }
}

}  // namespace

std::vector<std::string> parseEtcdEndpoints(const std::string& text, bool tls, const std::string& what) {
  std::vector<std::string> urls;
  for (const auto& raw : split(text, ',')) {
    std::string entry = trim(raw);
    if (entry.empty()) continue;
    std::string scheme = tls ? "https://" : "http://";
    for (const char* s : {"http://", "https://"}) {
      if (entry.starts_with(s)) {
        scheme = s;
        entry = entry.substr(std::string_view(s).size());
      }
    }
    while (!entry.empty() && entry.back() == '/') entry.pop_back();
    // host, host:port, [v6], [v6]:port
    const bool bracketed = entry.starts_with("[");
    const auto close = bracketed ? entry.find(']') : std::string::npos;
    const auto colon = bracketed ? (close == std::string::npos ? std::string::npos : entry.find(':', close))
                                 : entry.rfind(':');
    std::string host = colon == std::string::npos ? entry : entry.substr(0, colon);
    std::string port = colon == std::string::npos ? "2379" : entry.substr(colon + 1);
    const bool portOk = !port.empty() && port.size() <= 5 &&
                        std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
                        std::stoi(port) >= 1 && std::stoi(port) <= 65535;
    if (host.empty() || (bracketed && close == std::string::npos) || !portOk || contains(host, "/")) {
      throw InvalidArgument(str(what, ": ", quoteBytes(raw), " is not an etcd endpoint; accepted: host:port, ",
                                "[v6 address]:port or http(s)://host:port, comma-separated"));
    }
    urls.push_back(str(scheme, host, ":", port));
  }
  if (urls.empty()) {
    throw InvalidArgument(str(what, " is empty; accepted: host:port[,host:port...] of the etcd cluster's members"));
  }
  return urls;
}

EtcdSession::EtcdSession(EtcdConfig config) : config_(std::move(config)) {}

std::string EtcdSession::endpointList() const { return join(config_.urls, ","); }

std::pair<std::string, uint64_t> EtcdSession::token() {
  std::lock_guard lock(mutex_);
  return {token_, generation_};
}

void EtcdSession::setToken(std::string token, uint64_t generationSeen) {
  std::lock_guard lock(mutex_);
  if (generationSeen != generation_) return;  // another client renewed it meanwhile
  token_ = std::move(token);
  ++generation_;
}

std::mutex& EtcdSession::authMutex() { return authMutex_; }

void EtcdSession::invalidateToken(uint64_t generation) {
  std::lock_guard lock(mutex_);
  if (generation == generation_) token_.clear();
}

namespace {

struct Attempt {
  CURLcode code = CURLE_OK;
  long status = 0;
  std::string curlError;
};

std::string describeCurl(const Attempt& a) {
  return a.curlError.empty() ? std::string(curl_easy_strerror(a.code)) : a.curlError;
}

// The error message and gRPC code of an etcd error reply; empty when the body is not one.
std::pair<std::string, int64_t> etcdError(const std::string& body) {
  Json reply = Json::parse(body, nullptr, false);
  if (reply.is_discarded() || !reply.is_object()) return {"", 0};
  if (reply.contains("error")) {
    const Json& error = reply["error"];
    if (error.is_string()) return {error.get<std::string>(), reply.value("code", int64_t{0})};
    if (error.is_object()) return {error.value("message", error.dump()), error.value("grpc_code", int64_t{0})};
  }
  if (reply.contains("message") && reply["message"].is_string()) {
    return {reply["message"].get<std::string>(), reply.value("code", int64_t{0})};
  }
  return {"", 0};
}

}  // namespace

struct EtcdClient::Impl {
  CURL* curl = nullptr;
  char errorText[CURL_ERROR_SIZE] = {};
  std::string reply;
  size_t current = 0;
  // Streaming requests.
  bool streaming = false;
  std::string pending;  // bytes of a message not complete yet
  const std::function<bool(const Json&)>* onMessage = nullptr;
  bool stopped = false;
  bool gotData = false;
  std::string streamError;
  Logger log = logger("store");

  ~Impl() {
    if (curl) curl_easy_cleanup(curl);
  }

  Attempt perform(const EtcdConfig& config, const std::string& url, const std::string& body, const std::string& token,
                  Ms timeout, Ms connectTimeout, bool requireLeader);

  static size_t onData(char* data, size_t size, size_t count, void* self) {
    auto* impl = static_cast<Impl*>(self);
    const size_t bytes = size * count;
    if (!impl->streaming) {
      impl->reply.append(data, bytes);
      return bytes;
    }
    long status = 0;
    curl_easy_getinfo(impl->curl, CURLINFO_RESPONSE_CODE, &status);
    if (status != 200) {  // an error reply, read whole
      impl->reply.append(data, bytes);
      return bytes;
    }
    impl->gotData = true;
    impl->pending.append(data, bytes);
    size_t begin = 0;
    while (true) {
      const auto newline = impl->pending.find('\n', begin);
      if (newline == std::string::npos) break;
      const std::string_view line(impl->pending.data() + begin, newline - begin);
      begin = newline + 1;
      if (trim(line).empty()) continue;
      Json message = Json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (message.is_discarded()) {
        impl->streamError = str("malformed message from the member: ", quoteBytes(line, 120));
        return 0;
      }
      if (message.contains("error")) {
        const Json& error = message["error"];
        impl->streamError = error.is_object() ? error.value("message", error.dump()) : error.dump();
        return 0;
      }
      if (!(*impl->onMessage)(message.contains("result") ? message["result"] : message)) {
        impl->stopped = true;
        return 0;  // aborts the transfer
      }
    }
    impl->pending.erase(0, begin);
    return bytes;
  }
};

EtcdClient::EtcdClient(std::shared_ptr<EtcdSession> session) : session_(std::move(session)), impl_(std::make_unique<Impl>()) {
  initCurlOnce();
  impl_->curl = curl_easy_init();
  if (!impl_->curl) throw Error("etcd store: curl_easy_init failed (out of memory?)");
  impl_->current = session_->preferred() % session_->config().urls.size();
}

EtcdClient::~EtcdClient() = default;

std::string EtcdClient::currentEndpoint() const { return session_->config().urls[impl_->current]; }

// One POST to the current member. Sets up the handle for a unary or a
// streaming request; the reply body lands in impl->reply (unary) or goes to
// the stream handler.
Attempt EtcdClient::Impl::perform(const EtcdConfig& config, const std::string& url, const std::string& body,
                                  const std::string& token, Ms timeout, Ms connectTimeout, bool requireLeader) {
  Impl& impl = *this;
  CURL* c = impl.curl;
  curl_easy_reset(c);
  impl.errorText[0] = '\0';
  impl.reply.clear();
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_POST, 1L);
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.data());
  curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_TCP_NODELAY, 1L);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, impl.errorText);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, &EtcdClient::Impl::onData);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &impl);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(std::clamp<int64_t>(timeout.count(), 1, LONG_MAX)));
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS,
                   static_cast<long>(std::clamp<int64_t>(connectTimeout.count(), 1, LONG_MAX)));
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
  if (!config.caFile.empty()) curl_easy_setopt(c, CURLOPT_CAINFO, config.caFile.c_str());
  if (!config.certFile.empty()) curl_easy_setopt(c, CURLOPT_SSLCERT, config.certFile.c_str());
  if (!config.keyFile.empty()) curl_easy_setopt(c, CURLOPT_SSLKEY, config.keyFile.c_str());
  curl_slist* headers = nullptr;
  headers = curl_slist_append(headers, "Content-Type: application/json");
  // Without this, curl waits up to a second for "100 Continue" before sending a large body.
  headers = curl_slist_append(headers, "Expect:");
  // A member without a leader answers "no leader" at once instead of holding the
  // request (etcd's require-leader metadata), and cancels a watch it can no longer serve.
  if (requireLeader) headers = curl_slist_append(headers, "Grpc-Metadata-hasleader: true");
  std::string authorization;
  if (!token.empty()) {
    authorization = "Authorization: " + token;
    headers = curl_slist_append(headers, authorization.c_str());
  }
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  Attempt a;
  a.code = curl_easy_perform(c);
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &a.status);
  a.curlError = impl.errorText;
  curl_slist_free_all(headers);
  return a;
}

namespace {

// Whether host:port of a plain-HTTP URL completes a TLS handshake (its certificate unchecked).
bool speaksTls(const std::string& httpUrl) {
  CURL* probe = curl_easy_init();
  if (!probe) return false;
  const std::string url = "https://" + httpUrl.substr(std::string_view("http://").size());
  curl_easy_setopt(probe, CURLOPT_URL, url.c_str());
  curl_easy_setopt(probe, CURLOPT_CONNECT_ONLY, 1L);
  curl_easy_setopt(probe, CURLOPT_SSL_VERIFYPEER, 0L);
  curl_easy_setopt(probe, CURLOPT_SSL_VERIFYHOST, 0L);
  curl_easy_setopt(probe, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(probe, CURLOPT_TIMEOUT_MS, 1000L);
  const CURLcode code = curl_easy_perform(probe);
  curl_easy_cleanup(probe);
  return code == CURLE_OK;
}

[[noreturn]] void throwTlsFailure(const EtcdConfig& config, const std::string& url, const std::string& what,
                                  const std::string& op) {
  std::string hint;
  if (contains(what, "wrong version number") || contains(what, "packet length too long")) {
    hint = "the member may speak plain HTTP: use an http:// endpoint (or drop the TLS options)";
  } else {
    hint = str("check the CA file (", config.caFile.empty() ? "system default" : config.caFile,
               ") that signed the member's certificate, that the certificate names the host in the endpoint ",
               "(subjectAltName), and the client certificate and key (", config.certFile.empty() ? "none" : config.certFile,
               ", ", config.keyFile.empty() ? "none" : config.keyFile, ") that the member's --trusted-ca-file accepts");
  }
  throw NetworkError(str("etcd store ", op, ": the TLS handshake with ", url, " failed: ", what, ". Hint: ", hint));
}

[[noreturn]] void throwRefused(const EtcdConfig& config, const std::string& url, const std::string& path,
                               const std::string& message, const std::string& op) {
  std::string hint;
  if (contains(message, "user name is empty")) {
    hint = "the cluster has authentication enabled: give a user and password (EtcdStoreOptions user/password; "
           "dtrun --rdzv-user/--rdzv-password, workers DT_ETCD_USER/DT_ETCD_PASSWORD)";
  } else if (contains(message, "authentication failed") || contains(message, "user name not found")) {
    hint = str("check the user name (", quoteBytes(config.user), ") and password (dtrun --rdzv-user/--rdzv-password, ",
               "workers DT_ETCD_USER/DT_ETCD_PASSWORD)");
  } else if (contains(message, "permission denied")) {
    hint = str("user ", quoteBytes(config.user), " lacks read-write permission on this job's key prefix: ",
               "grant its role the prefix (etcdctl role grant-permission --prefix ROLE readwrite PREFIX)");
  } else if (contains(message, "database space exceeded")) {
    hint = "the cluster's database is full (NOSPACE alarm): its operator must compact, defragment and disarm it";
  } else if (contains(message, "CommonName of client")) {
    hint = "with authentication on, etcd 3.4's gateway refuses client certificates that carry a CommonName (etcd "
           "would take it for the user name); use a client certificate without a CN, or drop user/password";
  } else if (contains(message, "lease not found")) {
    hint = "the lease expired (its keep-alives stopped for longer than its TTL) or was revoked";
  } else {
    hint = "is the endpoint an etcd v3.4+ client URL (port 2379, not the peer port 2380)?";
  }
  throw NetworkError(str("etcd store ", op, ": ", url, " refused ", path, ": ", message, ". Hint: ", hint));
}

}  // namespace

Json EtcdClient::call(const char* path, const Json& body, EtcdClock::time_point deadline, const std::string& op) {
  const EtcdConfig& config = session_->config();
  const size_t members = config.urls.size();
  const std::string payload = body.dump();
  const bool authenticating = std::string_view(path) == "/v3/auth/authenticate";
  std::vector<std::string> lastErrors(members);
  Ms backoff{10};
  Ms attemptTimeout = kFirstAttemptTimeout;
  int failures = 0;
  bool renewed = false;
  const auto start = EtcdClock::now();
  impl_->streaming = false;
  while (true) {
    std::string token;
    uint64_t generation = 0;
    if (!authenticating) std::tie(token, generation) = this->token(deadline, op);
    const std::string& url = config.urls[impl_->current];
    const Ms left = remaining(deadline);
    const auto notYetAsked = static_cast<Ms::rep>(members - static_cast<size_t>(failures) % members);
    const Ms share = std::max(kMinAttemptShare, left / notYetAsked);
    const Attempt a = impl_->perform(config, url + path, payload, token, std::min({left, attemptTimeout, share}),
                                     std::min(left, kConnectAttemptTimeout), true);
    if (a.code == CURLE_OPERATION_TIMEDOUT) attemptTimeout = std::min(attemptTimeout * 2, kMaxAttemptTimeout);
    std::string failure;
    if (a.code == CURLE_OK && a.status == 200) {
      Json reply = Json::parse(impl_->reply, nullptr, false);
      if (!reply.is_discarded()) {
        session_->setPreferred(impl_->current);
        return reply;
      }
      throwRefused(config, url, path, str("an answer that is not JSON: ", quoteBytes(impl_->reply, 120)), op);
    }
    if (a.code == CURLE_OK) {
      const auto [message, grpcCode] = etcdError(impl_->reply);
      if (message.empty()) {
        if (contains(impl_->reply, "HTTP request to an HTTPS server")) {
          throw NetworkError(str("etcd store ", op, ": ", url, " speaks HTTPS but was addressed over plain HTTP. ",
                                 "Hint: use an https:// endpoint and give the CA file (dtrun --rdzv-ca, DT_ETCD_CA)"));
        }
        if (contains(impl_->reply, "CommonName of client")) throwRefused(config, url, path, trim(impl_->reply), op);
        throwRefused(config, url, path,
                     str("HTTP ", a.status, " with ", quoteBytes(impl_->reply, 80), " (not an etcd v3 gateway reply)"), op);
      }
      if (authenticating && contains(message, "authentication is not enabled")) return Json{{"token", ""}};
      switch (classifyEtcdError(message, grpcCode)) {
        case Verdict::RenewToken:
          if (!renewed && !token.empty()) {
            renewed = true;
            session_->invalidateToken(generation);
            continue;
          }
          throwRefused(config, url, path, message, op);
        case Verdict::TooLarge:
          throw InvalidArgument(str("etcd store ", op, ": ", url, " refused the request (", payload.size(),
                                    " bytes of JSON): ", message, ". Values and multi-key requests must fit etcd's ",
                                    "--max-request-bytes (1.5 MiB by default) and --max-txn-ops (128)"));
        case Verdict::Fatal:
          throwRefused(config, url, path, message, op);
        case Verdict::Retry:
          failure = message;
          break;
      }
    } else {
      const std::string what = describeCurl(a);
      if (isTlsFailure(a.code, what)) throwTlsFailure(config, url, what, op);
      // A TLS member drops a plain-HTTP request without a word: ask it for a handshake.
      if (a.code == CURLE_GOT_NOTHING && url.starts_with("http://") && speaksTls(url)) {
        throw NetworkError(str("etcd store ", op, ": ", url, " speaks HTTPS but was addressed over plain HTTP. ",
                               "Hint: use an https:// endpoint and give the CA file (dtrun --rdzv-ca, DT_ETCD_CA)"));
      }
      failure = what;
    }
    lastErrors[impl_->current] = failure;
    ++failures;
    if (failures == 1 || failures % static_cast<int>(members * 10) == 0) {
      impl_->log->info("etcd store {}: {} failed ({}); trying {}", op, url, failure,
                       config.urls[(impl_->current + 1) % members]);
    }
    impl_->current = (impl_->current + 1) % members;
    if (EtcdClock::now() >= deadline) {
      std::string errors;
      for (size_t i = 0; i < members; ++i) {
        if (i) errors += "; ";
        errors += str(config.urls[i], ": ", lastErrors[i].empty() ? "not tried" : lastErrors[i]);
      }
      throw TimeoutError(str("etcd store ", op, ": no etcd member answered within ",
                             formatDuration(std::chrono::duration_cast<Ms>(EtcdClock::now() - start)), " (", failures,
                             " attempts; ", errors, "). Is etcd running at ", session_->endpointList(),
                             ", and are the endpoints its client URLs? DT_STORE_CONNECT_TIMEOUT sets how long to keep trying"));
    }
    if (failures % members == 0) {  // every member failed once more: back off
      std::this_thread::sleep_for(std::min(backoff, remaining(deadline)));
      backoff = std::min(backoff * 2, kMaxBackoff);
    }
  }
}

std::pair<std::string, uint64_t> EtcdClient::token(EtcdClock::time_point deadline, const std::string& op) {
  const EtcdConfig& config = session_->config();
  if (config.user.empty() || session_->authDisabled.load()) return {"", 0};
  auto [token, generation] = session_->token();
  if (!token.empty()) return {token, generation};
  // One client authenticates at a time, so that clones starting together
  // cost the member one password check (bcrypt), not one each.
  std::lock_guard lock(session_->authMutex());
  std::tie(token, generation) = session_->token();
  if (!token.empty()) return {token, generation};
  const Json reply = call("/v3/auth/authenticate", Json{{"name", config.user}, {"password", config.password}}, deadline, op);
  const std::string fresh = reply.value("token", "");
  if (fresh.empty()) {
    // "authentication is not enabled": the member accepts anyone; go on without a token.
    session_->authDisabled.store(true);
    impl_->log->warn("etcd at {} has authentication disabled; the user name {} is not needed", currentEndpoint(),
                     quoteBytes(config.user));
    return {"", generation};
  }
  session_->setToken(fresh, generation);
  return session_->token();
}

EtcdClient::StreamEnd EtcdClient::stream(const char* path, const Json& body, EtcdClock::time_point deadline,
                                         const std::string& op, const std::function<bool(const Json&)>& onMessage,
                                         std::string* brokenReason) {
  const EtcdConfig& config = session_->config();
  const size_t members = config.urls.size();
  const std::string payload = body.dump();
  Ms backoff{10};
  int failures = 0;
  bool renewed = false;
  while (true) {
    auto [token, generation] = this->token(deadline, op);
    const std::string& url = config.urls[impl_->current];
    impl_->streaming = true;
    impl_->pending.clear();
    impl_->onMessage = &onMessage;
    impl_->stopped = false;
    impl_->gotData = false;
    impl_->streamError.clear();
    const Ms left = remaining(deadline);
    Attempt a;
    try {
      a = impl_->perform(config, url + path, payload, token, left, std::min(left, kConnectAttemptTimeout), true);
    } catch (...) {
      impl_->streaming = false;
      throw;
    }
    impl_->streaming = false;
    if (impl_->stopped) {
      session_->setPreferred(impl_->current);
      return StreamEnd::Stopped;
    }
    if (a.code == CURLE_OPERATION_TIMEDOUT && EtcdClock::now() >= deadline) return StreamEnd::Deadline;
    std::string failure;
    bool established = impl_->gotData;
    if (!impl_->streamError.empty()) {
      const std::string message = impl_->streamError;
      switch (classifyEtcdError(message, 0)) {
        case Verdict::RenewToken:
          if (!renewed && !token.empty()) {
            renewed = true;
            session_->invalidateToken(generation);
            continue;
          }
          throwRefused(config, url, path, message, op);
        case Verdict::TooLarge:
        case Verdict::Fatal:
          throwRefused(config, url, path, message, op);
        case Verdict::Retry:
          failure = message;
          break;
      }
    } else if (a.code == CURLE_OK && a.status != 200) {
      const auto [message, grpcCode] = etcdError(impl_->reply);
      if (message.empty()) throwRefused(config, url, path, str("HTTP ", a.status, " ", quoteBytes(impl_->reply, 80)), op);
      if (classifyEtcdError(message, grpcCode) == Verdict::RenewToken && !renewed && !token.empty()) {
        renewed = true;
        session_->invalidateToken(generation);
        continue;
      }
      if (classifyEtcdError(message, grpcCode) != Verdict::Retry) throwRefused(config, url, path, message, op);
      failure = message;
      established = false;
    } else if (a.code == CURLE_OK) {
      failure = "the member ended the stream";
    } else {
      const std::string what = describeCurl(a);
      if (isTlsFailure(a.code, what)) throwTlsFailure(config, url, what, op);
      failure = what;
    }
    impl_->current = (impl_->current + 1) % members;
    if (established) {
      // The stream worked and then broke (the member died): the caller resumes from what it saw.
      if (brokenReason) *brokenReason = str(url, ": ", failure);
      return StreamEnd::Broken;
    }
    ++failures;
    if (EtcdClock::now() >= deadline) return StreamEnd::Deadline;
    if (failures % members == 0) {
      std::this_thread::sleep_for(std::min(backoff, remaining(deadline)));
      backoff = std::min(backoff * 2, kMaxBackoff);
    }
  }
}

std::string base64Encode(std::string_view bytes) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t n = (static_cast<uint8_t>(bytes[i]) << 16) | (static_cast<uint8_t>(bytes[i + 1]) << 8) |
                       static_cast<uint8_t>(bytes[i + 2]);
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += kAlphabet[(n >> 6) & 63];
    out += kAlphabet[n & 63];
  }
  if (i < bytes.size()) {
    uint32_t n = static_cast<uint8_t>(bytes[i]) << 16;
    if (i + 1 < bytes.size()) n |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += i + 1 < bytes.size() ? kAlphabet[(n >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string base64Decode(std::string_view text) {
  static const auto table = [] {
    std::array<int8_t, 256> t{};
    t.fill(-1);
    const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; ++i) t[static_cast<uint8_t>(alphabet[i])] = static_cast<int8_t>(i);
    return t;
  }();
  std::string out;
  out.reserve(text.size() / 4 * 3);
  uint32_t bits = 0;
  int count = 0;
  for (char c : text) {
    if (c == '=') break;
    const int8_t v = table[static_cast<uint8_t>(c)];
    if (v < 0) throw Error(str("etcd store: malformed base64 from the gateway: ", quoteBytes(text, 40)));
    bits = (bits << 6) | static_cast<uint32_t>(v);
    if (++count == 4) {
      out += static_cast<char>((bits >> 16) & 0xff);
      out += static_cast<char>((bits >> 8) & 0xff);
      out += static_cast<char>(bits & 0xff);
      bits = 0;
      count = 0;
    }
  }
  if (count == 2) out += static_cast<char>((bits >> 4) & 0xff);
  if (count == 3) {
    out += static_cast<char>((bits >> 10) & 0xff);
    out += static_cast<char>((bits >> 2) & 0xff);
  }
  return out;
}

int64_t jsonInt(const Json& object, const char* field) {
  if (!object.is_object()) return 0;
  const auto it = object.find(field);
  if (it == object.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    const std::string& s = it->get_ref<const std::string&>();
    try {
      return std::stoll(s);
    } catch (const std::exception&) {
      throw Error(str("etcd store: field ", field, " is not an integer: ", quoteBytes(s)));
    }
  }
  if (it->is_boolean()) return it->get<bool>() ? 1 : 0;
  return 0;
}

std::string prefixRangeEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<uint8_t>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<uint8_t>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

}  // namespace dt::detail
