#include "launcher/process.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/errors.h"
#include "common/strings.h"

namespace dt::launcher {
namespace {

bool isExecutableFile(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

[[noreturn]] void childFail(const char* what, const char* path) {
  // Async-signal-safe reporting: the message lands in the worker's stderr pipe.
  const char* reason = strerror(errno);  // not strictly AS-safe, but reads a static table in glibc
  const char* parts[] = {"dtrun: cannot start worker: ", what, " ", path, ": ", reason, "\n"};
  for (const char* part : parts) {
    ssize_t ignored = ::write(2, part, strlen(part));
    (void)ignored;
  }
  _exit(127);
}

}  // namespace

std::string resolveExecutable(const std::string& program, const std::string& pathEnv) {
  if (program.find('/') != std::string::npos) {
    if (!isExecutableFile(program)) {
      throw InvalidArgument(str("cannot run ", quoteBytes(program), ": ",
                                ::access(program.c_str(), F_OK) == 0 ? "not an executable file" : "no such file",
                                "; give the path of an executable program"));
    }
    return program;
  }
  for (const auto& dir : split(pathEnv.empty() ? "/usr/local/bin:/usr/bin:/bin" : pathEnv, ':')) {
    const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    if (isExecutableFile(candidate)) return candidate;
  }
  throw InvalidArgument(str("cannot run ", quoteBytes(program), ": not found in PATH; give a path (./", program,
                            ") or an installed program"));
}

SpawnedWorker spawnWorker(const std::string& path, const std::vector<std::string>& argv,
                          const std::vector<std::string>& envp, const sigset_t& childMask) {
  // Everything the child needs is prepared before fork: it may not allocate.
  std::vector<char*> argvPtrs;
  for (const auto& a : argv) argvPtrs.push_back(const_cast<char*>(a.c_str()));
  argvPtrs.push_back(nullptr);
  std::vector<char*> envPtrs;
  for (const auto& e : envp) envPtrs.push_back(const_cast<char*>(e.c_str()));
  envPtrs.push_back(nullptr);

  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) throw Error(str("dtrun: pipe2 failed: ", strerror(errno)));
  if (::pipe2(err, O_CLOEXEC) != 0) {
    ::close(out[0]);
    ::close(out[1]);
    throw Error(str("dtrun: pipe2 failed: ", strerror(errno)));
  }
  const int devNull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t parent = ::getpid();

  const pid_t pid = ::fork();
  if (pid < 0) {
    const int saved = errno;
    for (int fd : {out[0], out[1], err[0], err[1], devNull}) ::close(fd);
    throw Error(str("dtrun: fork failed: ", strerror(saved), " (too many processes? check ulimit -u)"));
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) _exit(128 + SIGKILL);  // dtrun died before prctl took effect
    // dup2 clears close-on-exec on the new descriptors 0-2.
    if (devNull >= 0) ::dup2(devNull, 0);
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    // Descriptors dtrun did not open close-on-exec (store sockets) stay with dtrun.
#ifdef SYS_close_range
    ::syscall(SYS_close_range, 3U, ~0U, 4U /* CLOSE_RANGE_CLOEXEC */);
#endif
    struct sigaction dfl{};
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; ++sig) {
      if (sig != SIGKILL && sig != SIGSTOP) ::sigaction(sig, &dfl, nullptr);
    }
    ::sigprocmask(SIG_SETMASK, &childMask, nullptr);
    ::execve(path.c_str(), argvPtrs.data(), envPtrs.data());
    childFail("execve", path.c_str());
  }
  ::setpgid(pid, pid);  // may fail with EACCES once the child has exec'd; the child did it then
  ::close(out[1]);
  ::close(err[1]);
  if (devNull >= 0) ::close(devNull);
  for (int fd : {out[0], err[0]}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  return SpawnedWorker{pid, out[0], err[0]};
}

bool signalGroup(pid_t pgid, int sig) {
  if (pgid <= 0) return false;
  return ::kill(-pgid, sig) == 0;
}

SignalChannel::SignalChannel(const std::vector<int>& signals) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGCHLD);
  for (int sig : signals) sigaddset(&set, sig);
  if (::pthread_sigmask(SIG_BLOCK, &set, &original_) != 0) throw Error("dtrun: pthread_sigmask failed");
  fd_ = ::signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
  if (fd_ < 0) throw Error(str("dtrun: signalfd failed: ", strerror(errno)));
  // A worker that exits early must not kill dtrun through a broken pipe on
  // its console; writes then fail with EPIPE instead.
  ::signal(SIGPIPE, SIG_IGN);
}

SignalChannel::~SignalChannel() {
  if (fd_ >= 0) ::close(fd_);
  ::pthread_sigmask(SIG_SETMASK, &original_, nullptr);
}

void SignalChannel::drain(std::vector<int>& out) {
  signalfd_siginfo info{};
  while (true) {
    const ssize_t n = ::read(fd_, &info, sizeof(info));
    if (n != static_cast<ssize_t>(sizeof(info))) break;
    out.push_back(static_cast<int>(info.ssi_signo));
  }
}

}  // namespace dt::launcher
