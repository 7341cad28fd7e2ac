#include "bench/bench_common.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace dt::bench {
namespace {

uint16_t freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace

std::string inChild(const std::function<std::string()>& query) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error(std::string("inChild: pipe failed: ") + std::strerror(errno));
  std::fflush(nullptr);  // or the child's exit would write the parent's buffered output again
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int error = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    throw std::runtime_error(std::string("inChild: fork failed: ") + std::strerror(error));
  }
  if (pid == 0) {
    ::close(fds[0]);
    std::string answer;
    int rc = 0;
    try {
      answer = query();
    } catch (const std::exception& e) {
      answer = e.what();
      rc = 1;
    }
    for (size_t at = 0; at < answer.size();) {
      const ssize_t n = ::write(fds[1], answer.data() + at, answer.size() - at);
      if (n <= 0) break;
      at += static_cast<size_t>(n);
    }
    ::_exit(rc);  // no exit handlers: they belong to the parent (and may touch CUDA)
  }
  ::close(fds[1]);
  std::string answer;
  char chunk[4096];
  for (ssize_t n; (n = ::read(fds[0], chunk, sizeof chunk)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    answer.append(chunk, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    const std::string how = WIFEXITED(status) ? "exited with status " + std::to_string(WEXITSTATUS(status))
                                              : "was killed by signal " + std::to_string(WTERMSIG(status));
    throw std::runtime_error("inChild: the child " + how + (answer.empty() ? "" : ": " + answer));
  }
  return answer;
}

int forkRanks(int nproc, const std::function<int()>& runRank) {
  const uint16_t port = freePort();
  std::fflush(nullptr);  // or each child's exit would write the parent's buffered output again
  std::vector<pid_t> pids;
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::unsetenv("DT_STORE_ADDR");
      int rc = 1;
      try {
        rc = runRank();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
      std::fflush(nullptr);
      ::_exit(rc);
    }
    pids.push_back(pid);
  }
  int worst = 0;
  for (pid_t p : pids) {
    int status = 0;
    ::waitpid(p, &status, 0);
    worst = std::max(worst, WIFEXITED(status) ? WEXITSTATUS(status) : 128);
  }
  return worst;
}

int rankMain(int nproc, const std::function<int()>& runRank, const char* name) {
  if (nproc > 0) return forkRanks(nproc, runRank);
  try {
    return runRank();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

double peakRssMb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}

void resetPeakRss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  if (n == 0) return 0;
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

double percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double rank = std::ceil(q * static_cast<double>(values.size()));
  const size_t index = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(values.size()))) - 1;
  return values[index];
}

std::string blasName() {
  std::ifstream f("/proc/self/maps");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string maps = ss.str();
  const std::pair<const char*, const char*> probes[] = {
      {"openblas", "openblas"}, {"libblis", "blis"}, {"libmkl", "mkl"}, {"/blas/libblas.so", "reference"},
      {"libblas.so", "libblas"}};
  for (auto& [needle, label] : probes) {
    if (maps.find(needle) != std::string::npos) return label;
  }
  return "unknown";
}

}  // namespace dt::bench
