// Shared test helpers.
//
//  * runRanks(n, fn, deadline): runs fn(rank) on n threads ("threads as
//    ranks"), joins them, and rethrows the first exception. If they have not
//    all finished by the deadline it fails the test naming the ranks still
//    running, then aborts the process so the hang becomes a failure rather than
//    a stuck CI job (this is test code, not library code).
//  * TempDir: a fresh directory removed at scope exit.
//  * expectThrowsWith<E>(fn, {"substring", ...}): the call throws E and its
//    message contains every substring.
//  * eventually(pred, limit): polls pred until it holds (true) or limit passes
//    (false): waiting for an event with a deadline, not a fixed sleep.
//  * processState(pid): the state letter of /proc/<pid>/stat (R, S, T for
//    stopped, ...; '?' when unreadable): SIGSTOP takes effect asynchronously.
//  * PortReservation: a loopback TCP port nobody else is handed while it
//    lives, for a server another process starts on a fixed port (dtrun's
//    --master-port, MASTER_PORT). It is bound with SO_REUSEADDR and never
//    listens: the kernel gives the port to no bind(0) and no connect's
//    ephemeral end, a connect to it is refused until the server listens, and
//    a server that binds with SO_REUSEADDR (as TcpStore does) still gets it.
//    A port found free and released may be taken by another test before the
//    server binds it. Close-on-exec; children forked without exec share it
//    (harmless: it never listens).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace dt::testing {

char processState(int pid);

template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = std::chrono::seconds(20)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

void runRanks(int worldSize, const std::function<void(int rank)>& fn,
              std::chrono::milliseconds deadline = std::chrono::seconds(60));

class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Runs fn, expects it to throw E whose what() contains every needle.
// Returns the message so a test can check more.
template <typename E>
std::string expectThrowsWith(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const E& e) {
    const std::string message = e.what();
    for (const auto& needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos)
          << "message lacks \"" << needle << "\": " << message;
    }
    return message;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a different exception type: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "did not throw";
  return {};
}

class PortReservation {
 public:
  PortReservation();  // throws std::runtime_error naming the errno
  ~PortReservation();
  PortReservation(const PortReservation&) = delete;
  PortReservation& operator=(const PortReservation&) = delete;
  uint16_t port() const { return port_; }
  std::string text() const { return std::to_string(port_); }

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
};

// Scoped environment variable (restores the old value).
class ScopedEnv {
 public:
  ScopedEnv(std::string name, const std::string& value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  bool hadOld_ = false;
  std::string old_;
};

}  // namespace dt::testing
