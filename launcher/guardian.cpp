#include "launcher/guardian.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <set>
#include <string>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace dt::launcher {
namespace {

[[noreturn]] void guardianMain(int fd) {
  std::set<pid_t> groups;
  std::string pending;
  char buf[4096];
  bool bye = false;
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (n == 0) break;
    pending.append(buf, static_cast<size_t>(n));
    size_t nl;
    while ((nl = pending.find('\n')) != std::string::npos) {
      const std::string line = pending.substr(0, nl);
      pending.erase(0, nl + 1);
      if (line.empty()) continue;
      if (line[0] == 'q') bye = true;
      const pid_t pgid = static_cast<pid_t>(std::atol(line.c_str() + 1));
      if (pgid <= 0) continue;
      if (line[0] == '+') groups.insert(pgid);
      if (line[0] == '-') groups.erase(pgid);
    }
  }
  if (!bye) {
    for (pid_t pgid : groups) ::kill(-pgid, SIGKILL);
  }
  _exit(0);
}

}  // namespace

std::unique_ptr<Guardian> Guardian::start() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return nullptr;
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return nullptr;
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    const int devNull = ::open("/dev/null", O_RDWR);
    if (devNull >= 0) {
      ::dup2(devNull, 0);
      ::dup2(devNull, 1);
      ::dup2(devNull, 2);
    }
    // Keep only the read end: anything else (dtrun's pipes and sockets to
    // come are opened later, but inherited descriptors are not) goes.
    ::close(fds[1]);  // or the guardian would never see the pipe close
    const int keep = ::dup2(fds[0], 3) == 3 ? 3 : fds[0];
#ifdef SYS_close_range
    ::syscall(SYS_close_range, static_cast<unsigned>(keep + 1), ~0U, 0U);
#endif
    ::prctl(PR_SET_NAME, "dtrun-guardian");
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGPIPE}) std::signal(sig, SIG_IGN);
    guardianMain(keep);
  }
  ::close(fds[0]);
  return std::unique_ptr<Guardian>(new Guardian(fds[1], pid));
}

Guardian::~Guardian() {
  if (fd_ >= 0) ::close(fd_);
}

void Guardian::send(char op, pid_t pgid) {
  char line[32];
  const int n = std::snprintf(line, sizeof(line), "%c%d\n", op, static_cast<int>(pgid));
  // A short pipe write (< PIPE_BUF) is atomic; a dead guardian just loses it.
  ssize_t ignored = ::write(fd_, line, static_cast<size_t>(n));
  (void)ignored;
}

void Guardian::watch(pid_t pgid) { send('+', pgid); }
void Guardian::release(pid_t pgid) { send('-', pgid); }
void Guardian::goodbye() { send('q', 0); }

}  // namespace dt::launcher
