#include "tests/launcher/dtrun_process.h"

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace dt::testing {

ChildProcess::ChildProcess(const std::vector<std::string>& argv, const std::vector<std::string>& extraEnv) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    bool replaced = false;
    for (const auto& extra : extraEnv) {
      if (entry.substr(0, entry.find('=') + 1) == extra.substr(0, extra.find('=') + 1)) replaced = true;
    }
    if (!replaced) env.push_back(entry);
  }
  for (const auto& extra : extraEnv) env.push_back(extra);
  std::vector<char*> argvPtrs, envPtrs;
  for (const auto& a : argv) argvPtrs.push_back(const_cast<char*>(a.c_str()));
  argvPtrs.push_back(nullptr);
  for (const auto& e : env) envPtrs.push_back(const_cast<char*>(e.c_str()));
  envPtrs.push_back(nullptr);
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) std::abort();
  start_ = std::chrono::steady_clock::now();
  pid_ = fork();
  if (pid_ == 0) {
    dup2(out[1], 1);
    dup2(err[1], 2);
    execve(argvPtrs[0], argvPtrs.data(), envPtrs.data());
    _exit(127);
  }
  close(out[1]);
  close(err[1]);
  fds_[0] = out[0];
  fds_[1] = err[0];
  for (int fd : fds_) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

ChildProcess::~ChildProcess() {
  if (!exited_ && pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, &status_, 0);
  }
  for (int fd : fds_) {
    if (fd >= 0) close(fd);
  }
}

void ChildProcess::pump(int timeoutMs) {
  pollfd pfds[2];
  int n = 0;
  int which[2];
  for (int i = 0; i < 2; ++i) {
    if (fds_[i] >= 0) {
      pfds[n] = {fds_[i], POLLIN, 0};
      which[n++] = i;
    }
  }
  if (n > 0) {
    poll(pfds, n, timeoutMs);
    for (int k = 0; k < n; ++k) {
      if (!pfds[k].revents) continue;
      char buf[65536];
      const ssize_t got = read(fds_[which[k]], buf, sizeof(buf));
      if (got > 0) {
        (which[k] == 0 ? out_ : err_).append(buf, static_cast<size_t>(got));
      } else if (got == 0 || (errno != EAGAIN && errno != EINTR)) {
        close(fds_[which[k]]);
        fds_[which[k]] = -1;
      }
    }
  } else {
    usleep(static_cast<useconds_t>(timeoutMs) * 1000);
  }
  if (!exited_ && waitpid(pid_, &status_, WNOHANG) == pid_) exited_ = true;
}

bool ChildProcess::waitForOutput(const std::string& needle, std::chrono::milliseconds timeout, int count) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (countOccurrences(out_ + err_, needle) >= count) return true;
    if (exited_ && fds_[0] < 0 && fds_[1] < 0) return false;
    pump(20);
  }
  return countOccurrences(out_ + err_, needle) >= count;
}

void ChildProcess::signal(int sig) {
  if (!exited_) kill(pid_, sig);
}

void ChildProcess::killWithChildren() {
  if (exited_) return;
  std::ifstream children("/proc/" + std::to_string(pid_) + "/task/" + std::to_string(pid_) + "/children");
  for (pid_t child = 0; children >> child;) kill(child, SIGKILL);
  kill(pid_, SIGKILL);
  wait(std::chrono::seconds(60));
}

ProcessResult ChildProcess::wait(std::chrono::milliseconds timeout) {
  ProcessResult result;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::chrono::steady_clock::time_point exitSeen{};
  while (!(exited_ && fds_[0] < 0 && fds_[1] < 0)) {
    if (std::chrono::steady_clock::now() >= deadline) {
      result.timedOut = true;
      if (!exited_) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status_, 0);
        exited_ = true;
      }
      break;
    }
    pump(20);
    // Output pipes held open by leftover grandchildren must not hang the test.
    if (exited_ && exitSeen == std::chrono::steady_clock::time_point{}) exitSeen = std::chrono::steady_clock::now();
    if (exited_ && std::chrono::steady_clock::now() - exitSeen > std::chrono::seconds(2)) break;
  }
  pump(0);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  result.exitCode = WIFSIGNALED(status_) ? 128 + WTERMSIG(status_) : WEXITSTATUS(status_);
  result.out = out_;
  result.err = err_;
  return result;
}

ProcessResult runProcess(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                         const std::vector<std::string>& extraEnv) {
  ChildProcess child(argv, extraEnv);
  return child.wait(timeout);
}

int countOccurrences(const std::string& text, const std::string& needle) {
  if (needle.empty()) return 0;
  int count = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + needle.size())) ++count;
  return count;
}

}  // namespace dt::testing
