// Helpers for TcpStore tests that need separate processes or raw sockets.
//
//  * Child: a forked child running fn (fork before the test starts threads);
//    killed (SIGKILL) and reaped on destruction. fn throwing exits with 1.
//  * ServerProcess: a TcpStore server (token kToken, loopback) in a child
//    process, with extra environment and its stderr in a file if given; the
//    constructor returns once it listens.
//  * Raw sockets speaking store/internal/protocol.h: rawConnect, rawSend,
//    rawReadFrame (nullopt on EOF, reset or timeout), closedByPeer, and
//    frames to send (helloFrame, setFrame, addFrame).
//  * loopbackListener: for fake servers and proxies. A port for a server
//    that starts later: dt::testing::PortReservation (tests/testing/testing.h).
//  * rssKiB(pid, field): "VmRSS" / "VmHWM" of a process from /proc, in KiB.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "store/internal/protocol.h"
#include "store/tcp_store.h"

namespace dt::store_testing {

inline constexpr const char* kToken = "process-test-token";

class Child {
 public:
  explicit Child(const std::function<void()>& fn);
  ~Child();
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  pid_t pid() const { return pid_; }
  bool alive() const;
  // Exit code, or -signal; -1000 on timeout.
  int join(std::chrono::milliseconds timeout = std::chrono::seconds(60));
  void kill();

 private:
  pid_t pid_ = -1;
};

class ServerProcess {
 public:
  explicit ServerProcess(std::vector<std::pair<std::string, std::string>> env = {}, std::string stderrPath = "",
                         uint16_t port = 0, std::chrono::milliseconds startDelay = std::chrono::milliseconds(0));
  uint16_t port() const { return port_; }
  Child& child() { return *child_; }

 private:
  std::unique_ptr<Child> child_;
  uint16_t port_ = 0;
};

std::shared_ptr<TcpStore> client(uint16_t port, std::string token = kToken, int rank = -1);

int rawConnect(uint16_t port);
void rawSend(int fd, std::string_view data);
std::optional<std::string> rawReadFrame(int fd, std::chrono::milliseconds timeout = std::chrono::seconds(10));
bool closedByPeer(int fd, std::chrono::milliseconds timeout = std::chrono::seconds(10));

std::string helloFrame(const std::string& token = kToken, uint16_t version = store_proto::kVersion);
// Mutating requests with a request id; client id 0 (the default) opts out of
// exactly-once.
std::string setFrame(const std::string& key, const std::string& value, uint64_t clientId = 0,
                     uint64_t number = 0);
std::string addFrame(const std::string& key, int64_t delta, uint64_t clientId = 0, uint64_t number = 0);
uint8_t statusOf(const std::string& body);

std::string readFile(const std::string& path);
int loopbackListener(uint16_t& port);
int64_t rssKiB(pid_t pid, const std::string& field = "VmRSS");

}  // namespace dt::store_testing
