#include "launcher/status_server.h"

#include <arpa/inet.h>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <iterator>
#include <map>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"
#include "launcher/machine.h"

namespace dt::launcher {

// Generated at build time from launcher/status_page/index.html (launcher/embed_file.cmake).
extern const unsigned char kStatusPageData[];
extern const size_t kStatusPageSize;

std::string_view statusPageHtml() { return {reinterpret_cast<const char*>(kStatusPageData), kStatusPageSize}; }

namespace {

constexpr size_t kMaxHead = 16 * 1024;
constexpr int64_t kConnectionMs = 10000;
constexpr size_t kMaxConnections = 64;

struct Connection {
  std::string in, out;
  size_t written = 0;
  int64_t deadlineMs = 0;
  bool responded = false;
};

std::string response(int code, const char* reason, const char* type, const std::string& body, bool head) {
  std::string out = str("HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", type, "\r\nContent-Length: ", body.size(),
                        "\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n");
  if (!head) out += body;
  return out;
}

std::string hexDecode(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '%' && i + 2 < text.size()) {
      const std::string hex(text.substr(i + 1, 2));
      char* end = nullptr;
      const long v = std::strtol(hex.c_str(), &end, 16);
      if (end == hex.c_str() + 2) {
        out += static_cast<char>(v);
        i += 2;
        continue;
      }
    }
    out += text[i] == '+' ? ' ' : text[i];
  }
  return out;
}

// Compares in time independent of where the strings differ: the token is a secret.
bool sameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

}  // namespace

bool isLoopbackAddress(const std::string& address) {
  if (address == "localhost" || address == "::1") return true;
  in_addr a{};
  return ::inet_pton(AF_INET, address.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

RequestTarget parseTarget(const std::string& target) {
  RequestTarget out;
  const auto q = target.find('?');
  out.path = hexDecode(target.substr(0, q));
  if (q == std::string::npos) return out;
  for (const auto& pair : split(std::string_view(target).substr(q + 1), '&')) {
    const auto eq = pair.find('=');
    if (eq != std::string::npos && pair.substr(0, eq) == "token") out.token = hexDecode(pair.substr(eq + 1));
  }
  return out;
}

struct StatusServer::Impl {
  Config config;
  std::string chartJs;
  int listenFd = -1;
  int wakeFd = -1;
  uint16_t port = 0;
  std::thread thread;
  std::map<int, Connection> connections;

  ~Impl() {
    for (auto& [fd, c] : connections) ::close(fd);
    if (listenFd >= 0) ::close(listenFd);
    if (wakeFd >= 0) ::close(wakeFd);
  }

  void listen() {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo* list = nullptr;
    const std::string where = str(config.bind, ":", config.port);
    const int rc = ::getaddrinfo(config.bind.empty() ? nullptr : config.bind.c_str(), std::to_string(config.port).c_str(),
                                 &hints, &list);
    if (rc != 0) {
      throw Error(str("dtrun: --status-bind ", quoteBytes(config.bind), " does not resolve (", ::gai_strerror(rc),
                      "); accepted: an address of this machine, e.g. 127.0.0.1 or 0.0.0.0"));
    }
    std::string failure = "no address";
    int savedErrno = 0;
    for (addrinfo* ai = list; ai != nullptr && listenFd < 0; ai = ai->ai_next) {
      const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
      if (fd < 0) continue;
      const int one = 1;
      // A dtrun started again at once finds the port in TIME_WAIT, not in use.
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, 64) != 0) {
        savedErrno = errno;
        failure = std::strerror(errno);
        ::close(fd);
        continue;
      }
      sockaddr_storage bound{};
      socklen_t length = sizeof(bound);
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length);
      port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                               : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      listenFd = fd;
    }
    ::freeaddrinfo(list);
    if (listenFd >= 0) return;
    if (savedErrno == EADDRINUSE) {
      throw Error(str("dtrun: --status-port ", config.port, " on ", config.bind,
                      " is in use (another dtrun's page, or another server); pass another port, or 0 for any free one"));
    }
    throw Error(str("dtrun: cannot serve the status page on ", where, ": ", failure));
  }

  void readChartJs() {
    std::ifstream in(config.chartJsPath, std::ios::binary);
    if (!in) {
      throw Error(str("dtrun: the status page needs Chart.js at ", config.chartJsPath,
                      ", which is missing: install Debian's libjs-chart.js (scripts/setup.sh does)"));
    }
    chartJs.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  std::string answer(const std::string& head) {
    const auto lineEnd = head.find("\r\n");
    const auto parts = split(head.substr(0, lineEnd), ' ');
    if (parts.size() != 3 || !parts[1].starts_with("/") || !parts[2].starts_with("HTTP/1.")) {
      return response(400, "Bad Request", "text/plain; charset=utf-8", "dtrun: a malformed request line\n", false);
    }
    const bool isHead = parts[0] == "HEAD";
    if (parts[0] != "GET" && !isHead) {
      return response(405, "Method Not Allowed", "text/plain; charset=utf-8", str("dtrun: ", parts[0], " is not served; use GET\n"), false);
    }
    const RequestTarget target = parseTarget(parts[1]);
    if (!config.token.empty()) {
      std::string given = target.token;
      for (const auto& line : split(head, '\n')) {
        const std::string text = trim(line);
        const auto colon = text.find(':');
        if (colon == std::string::npos || lower(text.substr(0, colon)) != "authorization") continue;
        const std::string value = trim(text.substr(colon + 1));
        if (lower(value.substr(0, 7)) == "bearer ") given = trim(value.substr(7));
      }
      if (!sameSecret(given, config.token)) {
        return response(403, "Forbidden", "text/plain; charset=utf-8",
                        "dtrun: this status page needs the token dtrun printed with its address "
                        "(?token=... or Authorization: Bearer ...)\n",
                        isHead);
      }
    }
    try {
      if (target.path == "/" || target.path == "/index.html") {
        return response(200, "OK", "text/html; charset=utf-8", std::string(statusPageHtml()), isHead);
      }
      if (target.path == "/chart.js") return response(200, "OK", "text/javascript; charset=utf-8", chartJs, isHead);
      if (target.path == "/status.json") return response(200, "OK", "application/json", config.json(), isHead);
      if (target.path == "/metrics") {
        return response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", config.metrics(), isHead);
      }
    } catch (const std::exception& e) {
      return response(500, "Internal Server Error", "text/plain; charset=utf-8", str("dtrun: ", e.what(), "\n"), isHead);
    }
    return response(404, "Not Found", "text/plain; charset=utf-8",
                    str("dtrun: no ", quoteBytes(target.path), " here; the status page serves /, /status.json, /metrics and /chart.js\n"),
                    isHead);
  }

  // Reads what arrived; once the head is complete, the response replaces it. Returns false
  // when the connection is over (closed, broken, or its response fully written).
  bool onReadable(int fd, Connection& c) {
    char buf[4096];
    bool ended = false;
    while (true) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n > 0) {
        c.in.append(buf, static_cast<size_t>(n));
        if (c.in.size() > kMaxHead) {
          logger("dtrun")->warn("status page: a request head over {} bytes; its connection is closed", kMaxHead);
          return false;
        }
        continue;
      }
      if (n == 0) {
        ended = true;
        break;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      return false;
    }
    const auto end = c.in.find("\r\n\r\n");
    if (end == std::string::npos) return !ended;  // a client that stopped mid-head gets nothing
    c.out = answer(c.in.substr(0, end));
    c.responded = true;
    c.in.clear();
    return true;
  }

  bool onWritable(int fd, Connection& c) {
    while (c.written < c.out.size()) {
      const ssize_t n = ::send(fd, c.out.data() + c.written, c.out.size() - c.written, MSG_NOSIGNAL);
      if (n > 0) {
        c.written += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      return false;
    }
    return false;  // all written: Connection: close
  }

  void serve() {
    while (true) {
      std::vector<pollfd> fds = {{wakeFd, POLLIN, 0}, {listenFd, POLLIN, 0}};
      for (const auto& [fd, c] : connections) {
        fds.push_back({fd, static_cast<short>(c.responded ? POLLOUT : POLLIN), 0});
      }
      ::poll(fds.data(), fds.size(), 1000);
      if (fds[0].revents != 0) return;
      const int64_t now = wallMs();
      if (fds[1].revents & POLLIN) {
        int fd;
        while ((fd = ::accept4(listenFd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0) {
          if (connections.size() >= kMaxConnections) {
            ::close(fd);
            continue;
          }
          connections[fd].deadlineMs = now + kConnectionMs;
        }
      }
      for (size_t i = 2; i < fds.size(); ++i) {
        const int fd = fds[i].fd;
        auto it = connections.find(fd);
        if (it == connections.end()) continue;
        Connection& c = it->second;
        bool keep = now < c.deadlineMs;
        if (keep && (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) && !c.responded) keep = onReadable(fd, c);
        if (keep && c.responded && ((fds[i].revents & (POLLOUT | POLLERR)) != 0 || c.written == 0)) keep = onWritable(fd, c);
        if (!keep) {
          ::close(fd);
          connections.erase(it);
        }
      }
    }
  }
};

StatusServer::StatusServer(Config config) : impl_(std::make_unique<Impl>()) {
  impl_->config = std::move(config);
  impl_->readChartJs();
  impl_->listen();
  impl_->wakeFd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (impl_->wakeFd < 0) throw Error(str("dtrun: status page: eventfd failed: ", std::strerror(errno)));
  impl_->thread = std::thread([impl = impl_.get()] { impl->serve(); });
}

StatusServer::~StatusServer() {
  const uint64_t one = 1;
  if (::write(impl_->wakeFd, &one, sizeof(one)) < 0) {
    // The eventfd cannot be full after one write; nothing else to do here.
  }
  if (impl_->thread.joinable()) impl_->thread.join();
}

uint16_t StatusServer::port() const { return impl_->port; }

std::string StatusServer::url() const {
  const std::string& bind = impl_->config.bind;
  std::string host = bind.empty() || bind == "0.0.0.0" || bind == "::" ? hostName() : bind;
  if (host.find(':') != std::string::npos) host = str("[", host, "]");
  return str("http://", host, ":", impl_->port, "/", impl_->config.token.empty() ? std::string() : str("?token=", impl_->config.token));
}

}  // namespace dt::launcher
