#include "tests/store/tcp_test_support.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace dt::store_testing {

namespace proto = store_proto;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

Child::Child(const std::function<void()>& fn) {
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    int code = 0;
    try {
      fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d failed: %s\n", ::getpid(), e.what());
      code = 1;
    }
    std::fflush(stderr);
    ::_exit(code);
  }
}

Child::~Child() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
}

bool Child::alive() const { return ::waitpid(pid_, nullptr, WNOHANG) == 0; }

int Child::join(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    }
    std::this_thread::sleep_for(5ms);
  }
  return -1000;
}

void Child::kill() {
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

ServerProcess::ServerProcess(std::vector<std::pair<std::string, std::string>> env, std::string stderrPath,
                             uint16_t port, std::chrono::milliseconds startDelay) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
  child_ = std::make_unique<Child>([&] {
    ::close(fds[0]);
    ::signal(SIGPIPE, SIG_IGN);  // the parent may not read the port
    if (!stderrPath.empty()) {
      const int fd = ::open(stderrPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      ::dup2(fd, 2);
    }
    for (auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::this_thread::sleep_for(startDelay);
    TcpStoreOptions options;
    options.isServer = true;
    options.waitForWorkers = false;
    options.token = kToken;
    TcpStore server("127.0.0.1", port, options);
    const uint16_t bound = server.port();
    // Fails (EPIPE) when the parent knew the port and did not wait to read it.
    [[maybe_unused]] const ssize_t ignored = ::write(fds[1], &bound, sizeof(bound));
    while (true) ::pause();
  });
  ::close(fds[1]);
  if (port == 0) {
    if (::read(fds[0], &port_, sizeof(port_)) != sizeof(port_)) throw std::runtime_error("server child died");
  } else {
    port_ = port;
  }
  ::close(fds[0]);
}

std::shared_ptr<TcpStore> client(uint16_t port, std::string token, int rank) {
  TcpStoreOptions options;
  options.token = std::move(token);
  options.rank = rank;
  options.connectTimeout = 20s;
  return std::make_shared<TcpStore>("127.0.0.1", port, options);
}

int rawConnect(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

void rawSend(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n <= 0) return;  // the server may have closed us; the caller checks
    data.remove_prefix(static_cast<size_t>(n));
  }
}

std::optional<std::string> rawReadFrame(int fd, std::chrono::milliseconds timeout) {
  std::string data;
  const auto deadline = Clock::now() + timeout;
  size_t need = 4;
  while (data.size() < need) {
    pollfd p{fd, POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return std::nullopt;
    char buffer[4096];
    const ssize_t n = ::recv(fd, buffer, std::min(sizeof(buffer), need - data.size()), 0);
    if (n <= 0) return std::nullopt;
    data.append(buffer, static_cast<size_t>(n));
    if (data.size() == 4 && need == 4) need = 4 + proto::readLength(data.data());
  }
  return data.substr(4);
}

bool closedByPeer(int fd, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) > 0) {
      char buffer[4096];
      const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
      if (n <= 0) return true;
    }
  }
  return false;
}

std::string helloFrame(const std::string& token, uint16_t version) {
  std::string out;
  proto::FrameWriter w(out);
  w.u8(static_cast<uint8_t>(proto::Command::Hello)).u32(proto::kMagic).u16(version).bytes(token).i32(-1).u8(0);
  w.finish();
  return out;
}

std::string setFrame(const std::string& key, const std::string& value, uint64_t clientId, uint64_t number) {
  std::string out;
  proto::FrameWriter w(out);
  w.u8(static_cast<uint8_t>(proto::Command::Set)).u64(clientId).u64(number).bytes(key).bytes(value);
  w.finish();
  return out;
}

std::string addFrame(const std::string& key, int64_t delta, uint64_t clientId, uint64_t number) {
  std::string out;
  proto::FrameWriter w(out);
  w.u8(static_cast<uint8_t>(proto::Command::Add)).u64(clientId).u64(number).bytes(key).i64(delta);
  w.finish();
  return out;
}

uint8_t statusOf(const std::string& body) { return static_cast<uint8_t>(body.at(0)); }

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int loopbackListener(uint16_t& port) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(addr);
  if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(listener, 64) != 0 || ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    if (listener >= 0) ::close(listener);
    return -1;
  }
  port = ntohs(addr.sin_port);
  return listener;
}

int64_t rssKiB(pid_t pid, const std::string& field) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

}  // namespace dt::store_testing
