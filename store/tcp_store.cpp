#include "store/tcp_store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <asio.hpp>

#include "common/check.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"
#include "store/internal/kv_state.h"
#include "store/internal/protocol.h"
#include "store/tcp_store_server.h"

namespace dt {
namespace {

// Whether this process has not yet logged a fail-over from `from` to `to` (and now has).
bool firstFailover(const std::string& from, const std::string& to) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  const std::lock_guard<std::mutex> lock(mutex);
  return seen.insert(from + " -> " + to).second;
}

namespace proto = store_proto;
using Clock = std::chrono::steady_clock;
using proto::Command;
using proto::Status;
using Ms = std::chrono::milliseconds;

// Extra time a client gives the server beyond a blocking request's own
// timeout before it stops waiting for the (server-side) Timeout reply.
constexpr Ms kReplyGrace{10'000};
// How often a client blocked on its socket wakes up to check its deadline.
constexpr Ms kWakeup{1000};

bool isLoopbackHost(const std::string& host) {
  return host == "localhost" || host.starts_with("127.") || host == "::1" || host == "[::1]";
}

// A connection that could not be made (retry) versus one that was refused by
// the server's handshake (fatal).
struct RetryableConnectError {
  std::string reason;
};

// The connection broke in the middle of a request (reset, closed, send
// failed); the request may be sent again on a new one.
struct ConnectionCut {
  std::string reason;
};

// How often one call sends its request again after its connection broke.
constexpr int kMaxResends = 3;
// How long a reconnect after a broken connection may take (bounded by the
// call's own deadline too): long enough for a busy server, short enough that
// a server that is gone fails the call promptly.
constexpr Ms kReconnectWindow{5000};
// Where a mutating request's number sits in its frame (after the length,
// the command byte and the client id).
constexpr size_t kRequestNumberOffset = proto::kHeaderBytes + 1 + 8;

uint64_t randomClientId() {
  std::random_device device;
  uint64_t id = 0;
  while (id == 0) id = (static_cast<uint64_t>(device()) << 32) ^ device();
  return id;
}

// Thousands of clients may live in one process (tests, benchmarks, a
// launcher's agents): let them use every descriptor the hard limit allows.
void raiseFileLimitOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    rlimit limit{};
    if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
      limit.rlim_cur = limit.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &limit);
    }
  });
}

Ms remainingUntil(Clock::time_point deadline) {
  return std::max(Ms(0), std::chrono::duration_cast<Ms>(deadline - Clock::now()));
}

// Where a store can be reached: the server, then its hot standby. Shared by a
// TcpStore and its clones, so that a standby learned later reaches them all.
struct ServerAddresses {
  std::mutex mutex;
  std::vector<std::pair<std::string, uint16_t>> list;

  std::vector<std::pair<std::string, uint16_t>> snapshot() {
    std::lock_guard lock(mutex);
    return list;
  }
};

// One connection attempt to one of several addresses may not take all of the
// time left: the next address may be the one that answers.
constexpr Ms kAttemptPerAddress{1000};
// Backoff between rounds over the addresses while a standby promotes itself.
constexpr Ms kFailoverBackoffMax{100};

}  // namespace

struct TcpStore::Client {
  // The address in use (the server, or its standby after a fail-over).
  std::string host;
  uint16_t port = 0;
  std::shared_ptr<ServerAddresses> addresses;
  std::string token;
  int rank = -1;
  bool worker = false;
  Ms connectTimeout{};
  size_t maxKey = 0, maxValue = 0;
  Logger log = logger("store");

  std::mutex mutex;  // one request at a time on the connection
  int fd = -1;
  bool reconnect = false;  // a client-side timeout dropped the connection; make a new one
  std::string lost;        // why the connection died, for later calls
  std::string out;
  std::string in;
  size_t inBegin = 0, inEnd = 0;

  // Exactly once (store_proto's request ids): this client's id, fixed for its
  // life and across reconnects, and the number of its latest mutating request.
  const uint64_t clientId = randomClientId();
  uint64_t lastNumber = 0;
  bool mutating = false;  // the request in `out` carries a request id
  // A mutating request that timed out unanswered. If the next request is the
  // same, it is a repeat and keeps the number, so the server applies it at
  // most once; any other request abandons it.
  std::string unanswered;

  static std::unique_ptr<Client> make(std::shared_ptr<ServerAddresses> addresses, const TcpStoreOptions& options,
                                      bool worker) {
    auto client = std::make_unique<Client>();
    client->addresses = std::move(addresses);
    std::tie(client->host, client->port) = client->addresses->snapshot().front();
    client->token = options.token.value_or(env::getString("DT_STORE_TOKEN"));
    client->rank = options.rank;
    client->worker = worker;
    client->connectTimeout = options.connectTimeout;
    client->maxKey = static_cast<size_t>(env::getInt("DT_STORE_MAX_KEY_BYTES"));
    client->maxValue = static_cast<size_t>(env::getInt("DT_STORE_MAX_VALUE_BYTES"));
    return client;
  }

  ~Client() { closeFd(); }

  std::string address() const { return str(host, ":", port); }
  std::string where() const {
    return rank >= 0 ? str("rank ", rank, ", client of ", address()) : str("client of ", address());
  }

  void closeFd() {
    if (fd >= 0) ::close(fd);
    fd = -1;
    inBegin = inEnd = 0;
  }

  // --- connecting -------------------------------------------------------------
  void connect() {
    const auto start = Clock::now();
    const auto deadline = detail::deadlineAfter(connectTimeout, start);
    Ms backoff{10};
    std::mt19937 rng(std::random_device{}());
    auto lastLog = start - std::chrono::hours(1);
    int attempts = 0;
    while (true) {
      ++attempts;
      std::string reason;
      try {
        tryConnectAny(deadline);
        if (attempts > 1) log->info("connected to the store at {} after {} attempts", address(), attempts);
        return;
      } catch (const RetryableConnectError& e) {
        reason = e.reason;
      }
      const auto now = Clock::now();
      if (now >= deadline) {
        throw TimeoutError(str("could not connect to the store at ", address(), " within ",
                               formatDuration(connectTimeout), " (", attempts, " attempts; last error: ", reason,
                               "). Is the server (rank 0 or dtrun) running, and are host and port right? "
                               "DT_STORE_CONNECT_TIMEOUT sets how long to keep trying"));
      }
      if (now - start >= Ms(1000) && now - lastLog >= std::chrono::seconds(30)) {
        log->warn("waiting for the store at {} ({}; retrying for another {})", address(), reason,
                  formatDuration(remainingUntil(deadline)));
        lastLog = now;
      }
      std::uniform_real_distribution<double> jitter(0.5, 1.5);
      const Ms sleep = std::min(Ms(static_cast<int64_t>(backoff.count() * jitter(rng))), remainingUntil(deadline));
      std::this_thread::sleep_for(sleep);
      backoff = std::min(backoff * 2, Ms(1000));
    }
  }

  std::vector<std::pair<sockaddr_storage, socklen_t>> resolve() {
    std::vector<std::pair<sockaddr_storage, socklen_t>> out;
    std::error_code ec;
    auto add = [&](const asio::ip::tcp::endpoint& ep) {
      sockaddr_storage storage{};
      std::memcpy(&storage, ep.data(), ep.size());
      out.emplace_back(storage, static_cast<socklen_t>(ep.size()));
    };
    const std::string bare = host.size() > 2 && host.front() == '[' ? host.substr(1, host.size() - 2) : host;
    const auto address = asio::ip::make_address(bare, ec);
    if (!ec) {
      add(asio::ip::tcp::endpoint(address, port));
      return out;
    }
    asio::io_context io;
    asio::ip::tcp::resolver resolver(io);
    auto results = resolver.resolve(bare, std::to_string(port), asio::ip::tcp::resolver::numeric_service, ec);
    if (ec) throw RetryableConnectError{str("cannot resolve ", host, ": ", ec.message())};
    for (const auto& entry : results) add(entry.endpoint());
    return out;
  }

  // One attempt at each address, the one in use first; host/port name the one
  // that answered (else the server's, for messages).
  void tryConnectAny(Clock::time_point deadline) {
    auto candidates = addresses->snapshot();
    if (candidates.size() == 1) {
      tryConnectOnce(deadline);
      return;
    }
    std::stable_partition(candidates.begin(), candidates.end(),
                          [&](const auto& a) { return a.first == host && a.second == port; });
    std::string reasons;
    for (const auto& candidate : candidates) {
      std::tie(host, port) = candidate;
      try {
        tryConnectOnce(std::min(deadline, Clock::now() + kAttemptPerAddress));
        return;
      } catch (const RetryableConnectError& e) {
        reasons += str(reasons.empty() ? "" : "; ", address(), ": ", e.reason);
      }
    }
    std::tie(host, port) = addresses->snapshot().front();
    throw RetryableConnectError{reasons};
  }

  void tryConnectOnce(Clock::time_point deadline) {
    std::string lastError = "no address";
    for (auto& [addr, length] : resolve()) {
      int s = ::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (s < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          throw RetryableConnectError{str("out of file descriptors: ", std::strerror(errno))};
        }
        throw NetworkError(str("cannot create a socket for the store at ", address(), ": ", std::strerror(errno)));
      }
      int err = 0;
      if (::connect(s, reinterpret_cast<sockaddr*>(&addr), length) != 0) {
        err = errno;
        if (err == EINPROGRESS || err == EINTR) {
          pollfd p{s, POLLOUT, 0};
          int rc = 0;
          do {
            rc = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(remainingUntil(deadline).count(), 1)));
          } while (rc < 0 && errno == EINTR);
          socklen_t errLength = sizeof(err);
          if (rc == 0) err = ETIMEDOUT;
          else ::getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &errLength);
        }
      }
      if (err != 0) {
        ::close(s);
        lastError = std::strerror(err);
        continue;
      }
      const int one = 1;
      ::setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      // From here on the socket blocks, with a periodic wake-up (kWakeup) to
      // check deadlines: one recv per reply instead of poll + recv.
      ::fcntl(s, F_SETFL, ::fcntl(s, F_GETFL) & ~O_NONBLOCK);
      timeval tick{};
      tick.tv_sec = kWakeup.count() / 1000;
      tick.tv_usec = (kWakeup.count() % 1000) * 1000;
      ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tick, sizeof(tick));
      ::setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tick, sizeof(tick));
      fd = s;
      inBegin = inEnd = 0;
      try {
        handshake(deadline);
      } catch (const RetryableConnectError& e) {
        closeFd();
        lastError = e.reason;
        continue;
      } catch (...) {
        closeFd();
        throw;
      }
      return;
    }
    throw RetryableConnectError{lastError};
  }

  void handshake(Clock::time_point deadline) {
    // Its own buffer: a reconnect happens while `out` holds the request to send.
    std::string hello;
    proto::FrameWriter w(hello);
    w.u8(static_cast<uint8_t>(Command::Hello)).u32(proto::kMagic).u16(proto::kVersion).bytes(token).i32(rank);
    w.u8(worker ? proto::kHelloWorker : 0);
    w.finish();
    std::string_view body;
    try {
      const auto replyDeadline = std::max(deadline, Clock::now() + Ms(5000));
      sendAll(hello, replyDeadline);
      body = readFrame(replyDeadline, "handshake");
    } catch (const ConnectionCut& cut) {
      // Reset during the handshake: the server is starting, stopping or its
      // accept queue overflowed. Worth another try.
      throw RetryableConnectError{cut.reason};
    }
    proto::FrameReader r(body);
    const auto status = static_cast<Status>(r.u8());
    if (status == Status::Ok) return;
    const uint16_t serverVersion = r.u16();
    const std::string message = r.bytes(1 << 20, "message");
    if (status == Status::VersionMismatch) {
      throw NetworkError(str("store protocol version mismatch with ", address(), ": this client speaks version ",
                             proto::kVersion, ", the server version ", serverVersion, " (", message, ")"));
    }
    if (status == Status::AuthFailed) throw NetworkError(message);
    if (status == Status::NotPrimary) throw RetryableConnectError{message};
    throw NetworkError(str("the store at ", address(), " refused the handshake: ", message));
  }

  // --- one request ----------------------------------------------------------
  [[noreturn]] void connectionLost(const std::string& what) {
    closeFd();
    lost = what;
    throw NetworkError(what);
  }

  void sendAll(const std::string& data, Clock::time_point deadline) {
    size_t sent = 0;
    while (sent < data.size()) {
      const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (Clock::now() < deadline) continue;  // the server is slow to read: keep at it
        closeFd();
        reconnect = true;
        throw TimeoutError(str("store: could not send a request to the store at ", address(),
                               " before the deadline (", where(), "); the connection will be re-established",
                               repeatHint()));
      }
      throw ConnectionCut{str("lost the connection to the store at ", address(), " while sending (",
                              std::strerror(errno), "); the server is gone")};
    }
  }

  // Reads one frame; the returned view lives until the next read.
  std::string_view readFrame(Clock::time_point deadline, const char* op) {
    auto have = [&] { return inEnd - inBegin; };
    size_t need = proto::kHeaderBytes;
    bool haveHeader = false;
    while (true) {
      if (!haveHeader && have() >= proto::kHeaderBytes) {
        const uint32_t length = proto::readLength(in.data() + inBegin);
        if (length == 0 || length > maxValue + proto::kFrameSlack) {
          connectionLost(str("bad reply frame of ", length, " bytes from the store at ", address()));
        }
        need = proto::kHeaderBytes + length;
        haveHeader = true;
      }
      if (haveHeader && have() >= need) {
        std::string_view body(in.data() + inBegin + proto::kHeaderBytes, need - proto::kHeaderBytes);
        inBegin += need;
        if (inBegin == inEnd) inBegin = inEnd = 0;
        return body;
      }
      // Room for the rest of the frame (small to start: thousands of clients
      // may live in one process).
      if (in.size() - inBegin < need || in.size() - inEnd < 1024) {
        if (inBegin > 0) {
          std::memmove(in.data(), in.data() + inBegin, have());
          inEnd -= inBegin;
          inBegin = 0;
        }
        if (in.size() < std::max<size_t>(need, 4096)) in.resize(std::max<size_t>(need, 4096));
        if (in.size() - inEnd < 1024) in.resize(in.size() * 2);
      }
      // Blocking recv; EINTR (a signal) and the periodic wake-up just try again.
      const ssize_t n = ::recv(fd, in.data() + inEnd, in.size() - inEnd, 0);
      if (n > 0) {
        inEnd += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (Clock::now() < deadline) continue;
        // The stream may still carry our reply later: start over on a new connection.
        closeFd();
        reconnect = true;
        throw TimeoutError(str("store ", op, ": no reply from the store at ", address(),
                               " by the deadline (", where(), "); the connection will be re-established",
                               repeatHint()));
      }
      throw ConnectionCut{str("the store at ", address(), " closed the connection during ", op, " (",
                              n == 0 ? "server gone" : std::strerror(errno), "; ", where(), ")")};
    }
  }

  void ensureConnected() {
    if (fd >= 0) return;
    if (reconnect) {
      reconnect = false;
      worker = false;  // this client was counted when it first joined
      connect();
      return;
    }
    throw NetworkError(str("the connection to the store at ", address(), " was lost earlier: ", lost));
  }

  // Mutating requests: a timed-out request's number for its repeat, else the next.
  void numberRequest(bool blocking) {
    if (!mutating) return;
    uint64_t number = 0;
    if (isRepeatOfUnanswered(blocking)) {
      std::memcpy(&number, unanswered.data() + kRequestNumberOffset, 8);
    } else {
      number = ++lastNumber;
    }
    std::memcpy(out.data() + kRequestNumberOffset, &number, 8);
    unanswered.clear();
  }

  // Whether `out` is the unanswered request again: the same bytes but for
  // its number (and the timeout of a blocking request, its last 8 bytes).
  bool isRepeatOfUnanswered(bool blocking) const {
    if (unanswered.size() != out.size()) return false;
    const size_t numberEnd = kRequestNumberOffset + 8;
    const size_t compareEnd = blocking ? out.size() - 8 : out.size();
    return std::memcmp(out.data(), unanswered.data(), kRequestNumberOffset) == 0 &&
           std::memcmp(out.data() + numberEnd, unanswered.data() + numberEnd, compareEnd - numberEnd) == 0;
  }

  std::string repeatHint() const {
    return mutating ? ". Repeating the same call is safe: the server applies the request at most once" : "";
  }

  // After the connection broke mid-request: one new connection, and the same
  // request (same number, so the server applies it at most once; a blocking
  // one with the rest of its timeout). False when no connection could be made.
  bool reconnectAndResend(const char* op, Clock::time_point deadline,
                          std::optional<Ms> requestTimeout, Clock::time_point start) {
    closeFd();
    worker = false;  // this client was counted when it first joined
    const std::string before = address();
    const auto until = std::min(deadline, Clock::now() + kReconnectWindow);
    // With a standby, the cut is the proof that the server is gone: keep
    // trying both addresses while the standby promotes itself (milliseconds).
    const bool failover = addresses->snapshot().size() > 1;
    Ms backoff{10};
    while (true) {
      try {
        tryConnectAny(until);
        break;
      } catch (const RetryableConnectError&) {
      } catch (const NetworkError&) {
        return false;
      }
      if (!failover || Clock::now() >= until) return false;
      std::this_thread::sleep_for(std::min(backoff, remainingUntil(until)));
      backoff = std::min(backoff * 2, kFailoverBackoffMax);
    }
    if (requestTimeout) {
      const auto elapsed = std::chrono::duration_cast<Ms>(Clock::now() - start);
      const int64_t rest = std::max<int64_t>(0, detail::addTimeouts(*requestTimeout, -elapsed).count());
      std::memcpy(out.data() + out.size() - 8, &rest, 8);
    }
    if (address() != before) {
      // Every connection of the process (a group's, the heartbeat's, the recorder's...) fails
      // over on its own: the first says so, the others would repeat it.
      const auto level = firstFailover(before, address()) ? spdlog::level::warn : spdlog::level::debug;
      log->log(level, "lost the connection to the store at {} during {} ({}); failed over to {} and sent the request again",
               before, op, where(), address());
    } else {
      log->warn("lost the connection to the store at {} during {} ({}); reconnected and sent the request again",
                address(), op, where());
    }
    return true;
  }

  // Sends `out` (already framed by request()) and returns the reply body after
  // its status, throwing for Timeout / InvalidArgument / Error replies.
  // requestTimeout: the blocking request's own timeout (the last 8 bytes of
  // `out`); clientTimeout: how long to wait for any reply at all.
  proto::FrameReader roundTrip(const char* op, const std::vector<std::string>& keys, Ms clientTimeout,
                               std::optional<Ms> requestTimeout = std::nullopt) {
    ensureConnected();
    numberRequest(requestTimeout.has_value());
    const auto start = Clock::now();
    const auto deadline = detail::deadlineAfter(clientTimeout, start);
    std::string_view body;
    for (int resends = 0;; ++resends) {
      try {
        sendAll(out, deadline);
        body = readFrame(deadline, op);
        break;
      } catch (const ConnectionCut& cut) {
        if (resends == kMaxResends || !reconnectAndResend(op, deadline, requestTimeout, start)) {
          connectionLost(cut.reason);
        }
      } catch (const TimeoutError&) {
        if (mutating) unanswered = std::move(out);
        throw;
      }
    }
    proto::FrameReader r(body);
    try {
      const auto status = static_cast<Status>(r.u8());
      switch (status) {
        case Status::Ok:
          return r;
        case Status::Timeout: {
          std::vector<std::string> missing = r.keys(SIZE_MAX);
          if (std::string(op) == "queuePop") {
            throw TimeoutError(str("store queuePop(\"", keys.at(0), "\") timed out after ", requestTimeout->count(),
                                   " ms (", where(), "): the queue stayed empty. Is the producer running?"));
          }
          detail::throwWaitTimeout(op, keys, missing, requestTimeout.value_or(clientTimeout), where());
        }
        case Status::InvalidArgument:
          throw InvalidArgument(r.bytes(SIZE_MAX, "message"));
        default:
          throw Error(str("store ", op, " failed on the server ", address(), ": ", r.bytes(SIZE_MAX, "message")));
      }
    } catch (const proto::ProtocolError& e) {
      connectionLost(str("malformed reply to ", op, " from the store at ", address(), ": ", e.what()));
    }
  }

  void checkKey(const char* op, const std::string& key) const {
    if (key.size() > maxKey) {
      throw InvalidArgument(str("store ", op, ": key of ", key.size(), " bytes (", quoteBytes(key, 32),
                                ") exceeds DT_STORE_MAX_KEY_BYTES=", maxKey));
    }
  }
  void checkValue(const char* op, const std::string& key, size_t size) const {
    if (size > maxValue) {
      throw InvalidArgument(str("store ", op, "(\"", key, "\"): value of ", size,
                                " bytes exceeds DT_STORE_MAX_VALUE_BYTES=", maxValue));
    }
  }
  // Starts a request frame; a mutating one gets this client's id and a
  // number that roundTrip fills in.
  proto::FrameWriter request(Command command) {
    out.clear();
    mutating = proto::isMutating(command);
    proto::FrameWriter w(out);
    w.u8(static_cast<uint8_t>(command));
    if (mutating) w.u64(clientId).u64(0);
    return w;
  }
};


Store::Duration TcpStoreOptions::defaultConnectTimeout() { return env::getDuration("DT_STORE_CONNECT_TIMEOUT"); }

TcpStore::TcpStore(std::string host, uint16_t port, TcpStoreOptions options)
    : host_(std::move(host)), port_(port), options_(std::move(options)) {
  setTimeout(options_.timeout);
  if (!options_.token) options_.token = env::getString("DT_STORE_TOKEN");
  if (options_.isServer) {
    TcpStoreServerOptions serverOptions;
    serverOptions.bindAddress =
        !options_.bindAddress.empty() ? options_.bindAddress
                                      : (isLoopbackHost(host_) ? (host_.find(':') != std::string::npos ? "::1" : "127.0.0.1")
                                                              : "0.0.0.0");
    serverOptions.port = port_;
    serverOptions.token = *options_.token;
    serverOptions.standbyTimeout = options_.standbyTimeout;
    server_ = TcpStoreServer::start(serverOptions);
    port_ = server_->port();
  }
  raiseFileLimitOnce();
  auto addresses = std::make_shared<ServerAddresses>();
  addresses->list.emplace_back(host_, port_);
  client_ = Client::make(std::move(addresses), options_, /*worker=*/true);
  if (!options_.standby.empty()) setStandby(options_.standby);
  client_->connect();
  if (server_ && options_.waitForWorkers && options_.numWorkers) {
    server_->waitForWorkers(*options_.numWorkers, options_.timeout);
  }
}

TcpStore::TcpStore(CloneTag, const TcpStore& other)
    : host_(other.host_), port_(other.port_), options_(other.options_), server_(other.server_) {
  setTimeout(other.timeout());
  client_ = Client::make(other.client_->addresses, options_, /*worker=*/false);
  client_->connect();
}

TcpStore::~TcpStore() = default;

void TcpStore::set(const std::string& key, const Bytes& value) {
  client_->checkKey("set", key);
  client_->checkValue("set", key, value.size());
  std::lock_guard lock(client_->mutex);
  client_->request(Command::Set).bytes(key).bytes(value).finish();
  client_->roundTrip("set", {key}, timeout());
}

Bytes TcpStore::get(const std::string& key) { return get(key, timeout()); }

Bytes TcpStore::get(const std::string& key, Duration timeout) {
  client_->checkKey("get", key);
  std::lock_guard lock(client_->mutex);
  client_->request(Command::Get).bytes(key).i64(timeout.count()).finish();
  auto r = client_->roundTrip("get", {key}, detail::addTimeouts(timeout, kReplyGrace), timeout);
  return r.bytes(SIZE_MAX, "value");
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  client_->checkKey("add", key);
  std::lock_guard lock(client_->mutex);
  client_->request(Command::Add).bytes(key).i64(delta).finish();
  return client_->roundTrip("add", {key}, timeout()).i64();
}

Bytes TcpStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  client_->checkKey("compareSet", key);
  client_->checkValue("compareSet", key, std::max(expected.size(), desired.size()));
  std::lock_guard lock(client_->mutex);
  client_->request(Command::CompareSet).bytes(key).bytes(expected).bytes(desired).finish();
  return client_->roundTrip("compareSet", {key}, timeout()).bytes(SIZE_MAX, "value");
}

void TcpStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  for (const auto& key : keys) client_->checkKey("wait", key);
  std::lock_guard lock(client_->mutex);
  client_->request(Command::Wait).keys(keys).i64(timeout.count()).finish();
  client_->roundTrip("wait", keys, detail::addTimeouts(timeout, kReplyGrace), timeout);
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  for (const auto& key : keys) client_->checkKey("check", key);
  std::lock_guard lock(client_->mutex);
  client_->request(Command::Check).keys(keys).finish();
  return client_->roundTrip("check", keys, timeout()).u8() != 0;
}

bool TcpStore::deleteKey(const std::string& key) {
  client_->checkKey("deleteKey", key);
  std::lock_guard lock(client_->mutex);
  client_->request(Command::Delete).bytes(key).finish();
  return client_->roundTrip("deleteKey", {key}, timeout()).u8() != 0;
}

int64_t TcpStore::numKeys() {
  std::lock_guard lock(client_->mutex);
  client_->request(Command::NumKeys).finish();
  return client_->roundTrip("numKeys", {}, timeout()).i64();
}

void TcpStore::append(const std::string& key, const Bytes& value) {
  client_->checkKey("append", key);
  client_->checkValue("append", key, value.size());
  std::lock_guard lock(client_->mutex);
  client_->request(Command::Append).bytes(key).bytes(value).finish();
  client_->roundTrip("append", {key}, timeout());
}

std::vector<Bytes> TcpStore::multiGet(const std::vector<std::string>& keys) { return multiGet(keys, timeout()); }

std::vector<Bytes> TcpStore::multiGet(const std::vector<std::string>& keys, Duration timeout) {
  for (const auto& key : keys) client_->checkKey("multiGet", key);
  std::lock_guard lock(client_->mutex);
  client_->request(Command::MultiGet).keys(keys).i64(timeout.count()).finish();
  auto r = client_->roundTrip("multiGet", keys, detail::addTimeouts(timeout, kReplyGrace), timeout);
  const uint32_t count = r.u32();
  std::vector<Bytes> values;
  values.reserve(count);
  for (uint32_t i = 0; i < count; ++i) values.push_back(r.bytes(SIZE_MAX, "value"));
  return values;
}

void TcpStore::multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  DT_CHECK_EQ(keys.size(), values.size(), "store multiSet: one value per key");
  size_t total = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    client_->checkKey("multiSet", keys[i]);
    client_->checkValue("multiSet", keys[i], values[i].size());
    total += keys[i].size() + values[i].size() + 8;
  }
  if (total > client_->maxValue + proto::kFrameSlack / 2) {
    throw InvalidArgument(str("store multiSet of ", keys.size(), " keys: ", total,
                              " bytes in one request exceed DT_STORE_MAX_VALUE_BYTES=", client_->maxValue));
  }
  std::lock_guard lock(client_->mutex);
  auto w = client_->request(Command::MultiSet);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (size_t i = 0; i < keys.size(); ++i) w.bytes(keys[i]).bytes(values[i]);
  w.finish();
  client_->roundTrip("multiSet", keys, timeout());
}

void TcpStore::queuePush(const std::string& key, const Bytes& value) {
  client_->checkKey("queuePush", key);
  client_->checkValue("queuePush", key, value.size());
  std::lock_guard lock(client_->mutex);
  client_->request(Command::QueuePush).bytes(key).bytes(value).finish();
  client_->roundTrip("queuePush", {key}, timeout());
}

std::optional<Bytes> TcpStore::queuePop(const std::string& key, bool block) { return queuePop(key, block, timeout()); }

std::optional<Bytes> TcpStore::queuePop(const std::string& key, bool block, Duration timeout) {
  client_->checkKey("queuePop", key);
  std::lock_guard lock(client_->mutex);
  client_->request(Command::QueuePop).bytes(key).u8(block ? 1 : 0).i64(timeout.count()).finish();
  auto r = client_->roundTrip("queuePop", {key}, detail::addTimeouts(timeout, kReplyGrace), timeout);
  if (r.u8() == 0) return std::nullopt;
  return r.bytes(SIZE_MAX, "value");
}

int64_t TcpStore::queueLen(const std::string& key) {
  client_->checkKey("queueLen", key);
  std::lock_guard lock(client_->mutex);
  client_->request(Command::QueueLen).bytes(key).finish();
  return client_->roundTrip("queueLen", {key}, timeout()).i64();
}

void TcpStore::setStandby(const std::string& hostPort) {
  const auto colon = hostPort.rfind(':');
  int port = -1;
  if (colon != std::string::npos && colon > 0) {
    try {
      port = std::stoi(hostPort.substr(colon + 1));
    } catch (const std::exception&) {
    }
  }
  if (port <= 0 || port > 65535) {
    throw InvalidArgument(str("TcpStore standby address ", quoteBytes(hostPort), " is not host:port"));
  }
  std::string host = hostPort.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  auto& addresses = *client_->addresses;
  std::lock_guard lock(addresses.mutex);
  const std::pair<std::string, uint16_t> standby{host, static_cast<uint16_t>(port)};
  if (std::find(addresses.list.begin(), addresses.list.end(), standby) == addresses.list.end()) {
    addresses.list.push_back(standby);
  }
}

std::string TcpStore::attachStandby(uint16_t port) {
  std::lock_guard lock(client_->mutex);
  client_->request(Command::AttachStandby).u16(port).finish();
  return client_->roundTrip("attachStandby", {}, timeout()).bytes(SIZE_MAX, "address");
}

std::shared_ptr<Store> TcpStore::clone() { return std::shared_ptr<TcpStore>(new TcpStore(CloneTag{}, *this)); }

std::string TcpStore::describe() const { return str(host_, ":", port_); }
uint16_t TcpStore::port() const { return port_; }
const std::string& TcpStore::host() const { return host_; }
bool TcpStore::isServer() const { return server_ != nullptr; }

}  // namespace dt
