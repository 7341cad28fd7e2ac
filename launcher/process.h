// Starting and signalling worker processes.
//
// Contract:
//  * spawnWorker forks and execs one worker: in its own process group
//    (setpgid in both parent and child, so signalling the group never races
//    the child's own call), with PR_SET_PDEATHSIG=SIGKILL so that it dies
//    with dtrun even when dtrun is SIGKILLed (the child checks getppid()
//    afterwards: if dtrun died between fork and prctl, it exits at once),
//    the signal mask and dispositions dtrun changed restored, stdin from
//    /dev/null, stdout/stderr into pipes the caller reads, and every other
//    descriptor closed on exec. Between fork and exec the child calls only
//    async-signal-safe functions (dtrun has store threads).
//  * Must be called from the thread that lives as long as the workers (the
//    parent-death signal fires when the forking *thread* exits).
//  * resolveExecutable searches PATH in the parent, before any fork, and
//    throws InvalidArgument naming the program when it cannot run it.
//  * SignalChannel blocks the given signals plus SIGCHLD in the calling thread
//    (call it before starting any thread, so every thread inherits the mask)
//    and delivers them through a pollable descriptor (signalfd).
#pragma once

#include <csignal>
#include <string>
#include <sys/types.h>
#include <vector>

namespace dt::launcher {

struct SpawnedWorker {
  pid_t pid = -1;
  int stdoutFd = -1;  // read ends, non-blocking, close-on-exec
  int stderrFd = -1;
};

std::string resolveExecutable(const std::string& program, const std::string& pathEnv);

// argv[0] is kept as given; `path` is what is executed.
SpawnedWorker spawnWorker(const std::string& path, const std::vector<std::string>& argv,
                          const std::vector<std::string>& envp, const sigset_t& childMask);

// kill(-pgid, sig); ignores a group that no longer exists. Returns whether it was delivered.
bool signalGroup(pid_t pgid, int sig);

class SignalChannel {
 public:
  explicit SignalChannel(const std::vector<int>& signals);
  ~SignalChannel();
  SignalChannel(const SignalChannel&) = delete;
  SignalChannel& operator=(const SignalChannel&) = delete;

  int fd() const { return fd_; }
  // Reads pending signals (non-blocking); appends their numbers.
  void drain(std::vector<int>& out);
  // The mask to give children: the one before this channel blocked anything.
  const sigset_t& originalMask() const { return original_; }

 private:
  int fd_ = -1;
  sigset_t original_{};
};

}  // namespace dt::launcher
