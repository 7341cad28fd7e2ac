// Guardian: a tiny helper process that outlives dtrun only to clean up after it.
//
// The parent-death signal ends each worker when dtrun dies, but not the
// worker's own children (data loaders, shells, servers) that would keep ports
// and GPUs. dtrun tells the guardian, over a pipe, which process groups its
// workers lead; when the pipe closes without a goodbye (dtrun died, even by
// SIGKILL), the guardian sends SIGKILL to every group still listed, then exits.
//
// Contract: start() forks the guardian and must run before any thread exists
// (the child then uses ordinary library calls safely). The guardian sits in
// its own process group (terminal signals do not reach it), holds no
// descriptor of dtrun's but its pipe, and exits when the pipe closes.
// watch/release/goodbye are cheap writes; single-threaded use (dtrun's main thread).
#pragma once

#include <memory>
#include <sys/types.h>

namespace dt::launcher {

class Guardian {
 public:
  // nullptr when the guardian cannot be started (dtrun then relies on the
  // parent-death signal alone).
  static std::unique_ptr<Guardian> start();
  ~Guardian();
  Guardian(const Guardian&) = delete;
  Guardian& operator=(const Guardian&) = delete;

  void watch(pid_t pgid);
  void release(pid_t pgid);
  // dtrun is exiting normally: the guardian leaves every group alone.
  void goodbye();
  pid_t pid() const { return pid_; }

 private:
  Guardian(int fd, pid_t pid) : fd_(fd), pid_(pid) {}
  void send(char op, pid_t pgid);
  int fd_;
  pid_t pid_;
};

}  // namespace dt::launcher
