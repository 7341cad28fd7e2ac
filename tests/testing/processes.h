// Processes as ranks: forked children over a TcpStore the parent hosts.
//
//  * runProcesses(n, child, deadline): forks n children (call it before any
//    thread exists in the test process: a forked child inherits only the
//    forking thread), then hosts a TcpStore on a free loopback port and
//    hands each child its port. child(rank, port) runs in the child; what it
//    returns (or "EXCEPTION <what>" if it throws) comes back as that rank's
//    text. Children still running after `deadline` are killed, so a hang
//    becomes a failed expectation rather than a stuck test. afterChildren,
//    if given, runs in the parent against the store once all have exited.
//  * clientStore(port, rank): a TcpStore client of the parent's store.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "store/tcp_store.h"

namespace dt::testing {

struct ChildResult {
  std::string text;   // what the child returned ("" if nothing)
  bool killed = false;
  int signal = 0;     // the signal that ended it, if killed
  int exitCode = -1;
};

std::vector<ChildResult> runProcesses(int n, const std::function<std::string(int rank, uint16_t port)>& child,
                                      std::chrono::seconds deadline = std::chrono::seconds(60),
                                      const std::function<void(TcpStore&)>& afterChildren = nullptr);

std::shared_ptr<TcpStore> clientStore(uint16_t port, int rank);

}  // namespace dt::testing
