// Test helper: runs a command (usually dtrun) as a child process, collects
// its stdout/stderr, and lets a test wait for output, send signals and wait
// for the exit with a deadline (a hang becomes a test failure, and the child
// is killed).
#pragma once

#include <chrono>
#include <string>
#include <sys/types.h>
#include <vector>

namespace dt::testing {

struct ProcessResult {
  int exitCode = -1;   // exit status, or 128 + signal
  bool timedOut = false;
  std::string out, err;
  double seconds = 0;
};

class ChildProcess {
 public:
  // argv[0] is executed as is (a path); extraEnv entries NAME=VALUE are added
  // to (or replace in) the test's environment.
  explicit ChildProcess(const std::vector<std::string>& argv, const std::vector<std::string>& extraEnv = {});
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  // Waits until stdout+stderr contain `needle` `count` times; false on timeout or exit.
  bool waitForOutput(const std::string& needle, std::chrono::milliseconds timeout, int count = 1);
  void signal(int sig);
  // SIGKILLs the child's own children, then the child (a stopped dtrun and its stopped workers:
  // SIGKILL reaches stopped processes, and dtrun would not pass anything on), and reaps it.
  void killWithChildren();
  // Waits for exit (killing the child at the deadline).
  ProcessResult wait(std::chrono::milliseconds timeout);
  std::string output() const { return out_ + err_; }

 private:
  void pump(int timeoutMs);
  pid_t pid_ = -1;
  int fds_[2] = {-1, -1};
  std::string out_, err_;
  bool exited_ = false;
  int status_ = 0;
  std::chrono::steady_clock::time_point start_;
};

// Runs to completion.
ProcessResult runProcess(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                         const std::vector<std::string>& extraEnv = {});

// Counts non-overlapping occurrences.
int countOccurrences(const std::string& text, const std::string& needle);

}  // namespace dt::testing
