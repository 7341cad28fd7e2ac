#include "launcher/machine.h"

#include <arpa/inet.h>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/errors.h"
#include "common/strings.h"

namespace dt::launcher {

int countGpus() {
  int count = 0;
  if (DIR* dir = ::opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* entry = ::readdir(dir)) {
      if (entry->d_name[0] != '.') ++count;
    }
    ::closedir(dir);
  }
  if (count == 0 && ::access("/proc/driver/nvidia", F_OK) == 0) {
    if (FILE* pipe = ::popen("nvidia-smi -L 2>/dev/null", "r")) {
      char line[512];
      while (std::fgets(line, sizeof(line), pipe)) {
        if (std::strncmp(line, "GPU ", 4) == 0) ++count;
      }
      ::pclose(pipe);
    }
  }
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    const std::string text = trim(visible);
    int listed = 0;
    if (!text.empty()) {
      for (const auto& part : split(text, ',')) {
        const std::string id = trim(part);
        if (id.empty() || id == "-1") break;  // CUDA stops at the first invalid entry
        ++listed;
      }
    }
    count = std::min(count, listed);
  }
  return count;
}

int countCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

std::string hostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

std::string randomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  size_t got = 0;
  if (fd >= 0) {
    while (got < bytes) {
      const ssize_t n = ::read(fd, raw.data() + got, bytes - got);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    ::close(fd);
  }
  if (got < bytes) throw Error("dtrun: cannot read /dev/urandom for the store token");
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

uint16_t pickFreePort(const std::string& address) {
  const bool v6 = address.find(':') != std::string::npos;
  const int fd = ::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw NetworkError(str("dtrun: socket() failed: ", std::strerror(errno)));
  sockaddr_storage storage{};
  socklen_t length = 0;
  if (v6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&storage);
    a->sin6_family = AF_INET6;
    ::inet_pton(AF_INET6, address.c_str(), &a->sin6_addr);
    length = sizeof(*a);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&storage);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_ANY);
    if (!address.empty() && ::inet_pton(AF_INET, address.c_str(), &a->sin_addr) != 1) {
      a->sin_addr.s_addr = htonl(INADDR_ANY);
    }
    length = sizeof(*a);
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&storage), length) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&storage), &length) != 0) {
    const int saved = errno;
    ::close(fd);
    throw NetworkError(str("dtrun: cannot pick a free port on ", address.empty() ? "0.0.0.0" : address, ": ",
                           std::strerror(saved)));
  }
  ::close(fd);
  return ntohs(v6 ? reinterpret_cast<sockaddr_in6*>(&storage)->sin6_port
                  : reinterpret_cast<sockaddr_in*>(&storage)->sin_port);
}

int listenTcp(const std::string& address, uint16_t& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) throw NetworkError(str("dtrun: socket() failed: ", std::strerror(errno)));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  if (!address.empty() && ::inet_pton(AF_INET, address.c_str(), &a.sin_addr) != 1) a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), length) != 0 || ::listen(fd, 128) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &length) != 0) {
    const int saved = errno;
    ::close(fd);
    throw NetworkError(str("dtrun: cannot listen on ", address.empty() ? "0.0.0.0" : address, ": ", std::strerror(saved)));
  }
  port = ntohs(a.sin_port);
  return fd;
}

int connectTcp(const std::string& host, uint16_t port, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list);
  if (rc != 0) {
    error = str("cannot resolve ", host, ": ", ::gai_strerror(rc));
    return -1;
  }
  int fd = -1;
  for (addrinfo* ai = list; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      error = str("cannot connect to ", host, ":", port, ": ", std::strerror(errno));
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(list);
  return fd;
}

int64_t wallMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace dt::launcher
