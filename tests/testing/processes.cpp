#include "tests/testing/processes.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <thread>

#include <gtest/gtest.h>

#include "common/strings.h"

namespace dt::testing {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

void writeAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

std::string readAll(int fd) {
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  return out;
}

}  // namespace

// Forks `n` children before any thread exists in this process, then hosts
// the store; child(rank, port) returns its report line. Children that hang
// are killed after `deadline`.
std::vector<ChildResult> runProcesses(int n, const std::function<std::string(int rank, uint16_t port)>& child,
                                      std::chrono::seconds deadline,
                                      const std::function<void(TcpStore&)>& afterChildren) {
  std::vector<int> portPipes(n), resultPipes(n);
  std::vector<pid_t> pids(n);
  std::fflush(nullptr);  // a child must not print the parent's buffered output again
  for (int r = 0; r < n; ++r) {
    int toChild[2], fromChild[2];
    EXPECT_EQ(::pipe(toChild), 0);
    EXPECT_EQ(::pipe(fromChild), 0);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(toChild[1]);
      ::close(fromChild[0]);
      uint16_t port = 0;
      if (::read(toChild[0], &port, sizeof port) != sizeof port) ::_exit(90);
      std::string report;
      try {
        report = child(r, port);
      } catch (const std::exception& e) {
        report = str("EXCEPTION ", e.what());
      }
      writeAll(fromChild[1], report);
      ::close(fromChild[1]);
      std::fflush(nullptr);
      ::_exit(0);
    }
    ::close(toChild[0]);
    ::close(fromChild[1]);
    portPipes[r] = toChild[1];
    resultPipes[r] = fromChild[0];
    pids[r] = pid;
  }
  TcpStoreOptions so;
  so.isServer = true;
  so.waitForWorkers = false;
  auto server = std::make_shared<TcpStore>("127.0.0.1", 0, so);
  const uint16_t port = server->port();
  for (int r = 0; r < n; ++r) {
    writeAll(portPipes[r], std::string(reinterpret_cast<const char*>(&port), sizeof port));
    ::close(portPipes[r]);
  }
  // A watchdog so a hung child fails the test instead of hanging it.
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    const auto end = Clock::now() + deadline;
    while (!done && Clock::now() < end) std::this_thread::sleep_for(50ms);
    if (!done) {
      for (pid_t p : pids) ::kill(p, SIGKILL);
    }
  });
  std::vector<ChildResult> results(n);
  for (int r = 0; r < n; ++r) {
    results[r].text = readAll(resultPipes[r]);
    ::close(resultPipes[r]);
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    results[r].killed = WIFSIGNALED(status);
    if (results[r].killed) results[r].signal = WTERMSIG(status);
    results[r].exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  done = true;
  watchdog.join();
  if (afterChildren) afterChildren(*server);
  return results;
}

std::shared_ptr<TcpStore> clientStore(uint16_t port, int rank) {
  TcpStoreOptions o;
  o.rank = rank;
  return std::make_shared<TcpStore>("127.0.0.1", port, o);
}

}  // namespace dt::testing
