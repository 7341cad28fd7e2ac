#include "tests/testing/testing.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <unistd.h>

#include "common/strings.h"

namespace dt::testing {

char processState(int pid) {
  std::ifstream stat(str("/proc/", pid, "/stat"));
  std::string line;
  std::getline(stat, line);
  const auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() ? '?' : line[close + 2];
}

void runRanks(int worldSize, const std::function<void(int rank)>& fn, std::chrono::milliseconds deadline) {
  std::mutex mutex;
  std::condition_variable done;
  std::vector<bool> finished(worldSize, false);
  int finishedCount = 0;
  std::exception_ptr firstError;
  std::vector<std::thread> threads;
  threads.reserve(worldSize);
  for (int rank = 0; rank < worldSize; ++rank) {
    threads.emplace_back([&, rank] {
      std::exception_ptr error;
      try {
        fn(rank);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (error && !firstError) firstError = error;
      finished[rank] = true;
      ++finishedCount;
      done.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    if (!done.wait_for(lock, deadline, [&] { return finishedCount == worldSize; })) {
      std::vector<int> stuck;
      for (int r = 0; r < worldSize; ++r) {
        if (!finished[r]) stuck.push_back(r);
      }
      const std::string message = str("runRanks: ranks still running after ", deadline.count(),
                                      " ms: ", formatRanges(stuck), " (of ", worldSize, ")");
      ADD_FAILURE() << message;
      std::fprintf(stderr, "%s; aborting the test process so the hang fails fast\n", message.c_str());
      std::fflush(stderr);
      std::_Exit(3);
    }
  }
  for (auto& t : threads) t.join();
  if (firstError) std::rethrow_exception(firstError);
}

TempDir::TempDir() {
  std::random_device rd;
  path_ = std::filesystem::temp_directory_path() /
          str("dtrain-test-", ::getpid(), "-", std::hex, rd());
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

ScopedEnv::ScopedEnv(std::string name, const std::string& value) : name_(std::move(name)) {
  if (const char* old = std::getenv(name_.c_str())) {
    hadOld_ = true;
    old_ = old;
  }
  ::setenv(name_.c_str(), value.c_str(), 1);
}

ScopedEnv::~ScopedEnv() {
  if (hadOld_) {
    ::setenv(name_.c_str(), old_.c_str(), 1);
  } else {
    ::unsetenv(name_.c_str());
  }
}

PortReservation::PortReservation() {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(addr);
  if (fd_ < 0 || ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
      ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    const int error = errno;
    if (fd_ >= 0) ::close(fd_);
    throw std::runtime_error(std::string("cannot reserve a loopback port: ") + std::strerror(error));
  }
  port_ = ntohs(addr.sin_port);
}

PortReservation::~PortReservation() { ::close(fd_); }

}  // namespace dt::testing
