// store_demo: the rendezvous every dtrain job starts with, on its own.
//
// Starts a TcpStore server on a free port, forks N worker processes that
// connect to it as ranks 0..N-1, greet each other through the store, add up
// their ranks with add(), pass a barrier, share work through a queue, and
// report back. Prints a short summary; exits 0 when everything matched.
//
// Usage: store_demo [--nproc N] [--port P]      (defaults: 4 workers, port 0 = any free port)
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/strings.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double msSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// One worker process: everything goes through the store.
int worker(int rank, int worldSize, int portPipe, const std::string& token) {
  uint16_t port = 0;
  if (::read(portPipe, &port, sizeof(port)) != sizeof(port)) return 3;  // parent died first
  ::close(portPipe);
  const auto start = Clock::now();
  dt::TcpStoreOptions options;
  options.token = token;
  options.rank = rank;
  options.timeout = 30s;
  auto tcp = std::make_shared<dt::TcpStore>("127.0.0.1", port, options);
  const double connectMs = msSince(start);
  dt::PrefixStore store("demo", tcp);

  // Greet everyone, then read everyone's greeting (get waits for late ranks).
  store.set(dt::str("hello/", rank), dt::str("hello from rank ", rank, " (pid ", ::getpid(), ")"));
  int greetings = 0;
  for (int r = 0; r < worldSize; ++r) {
    if (store.get(dt::str("hello/", r)).starts_with("hello from rank " + std::to_string(r))) ++greetings;
  }
  const int64_t sum = store.add("rank_sum", rank);
  dt::storeBarrier(store, "barrier", rank, worldSize, 30s);
  const int64_t total = std::stoll(store.get("rank_sum"));

  // Rank 0 hands out work items; everyone takes items until the queue is drained.
  constexpr int kItems = 16;
  if (rank == 0) {
    for (int i = 0; i < kItems; ++i) store.queuePush("work", std::to_string(i));
  }
  dt::storeBarrier(store, "queue_filled", rank, worldSize, 30s);
  int taken = 0;
  while (auto item = store.queuePop("work", false)) {
    store.add("work_done", 1);
    ++taken;
  }
  dt::storeBarrier(store, "queue_drained", rank, worldSize, 30s);

  store.set(dt::str("report/", rank),
            dt::str("rank ", rank, " (pid ", ::getpid(), "): connected in ", dt::str(static_cast<int>(connectMs * 10) / 10.0),
                    " ms, read ", greetings, "/", worldSize, " greetings, add() returned ", sum, ", saw total ",
                    total, ", took ", taken, " work items"));
  const int64_t expected = int64_t{worldSize} * (worldSize - 1) / 2;
  return greetings == worldSize && total == expected ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int nproc = 4;
  int port = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--nproc") && i + 1 < argc) nproc = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--port") && i + 1 < argc) port = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: store_demo [--nproc N] [--port P]\n");
      return 2;
    }
  }
  if (nproc < 1 || nproc > 512 || port < 0 || port > 65535) {
    std::fprintf(stderr, "store_demo: --nproc must be 1..512 and --port 0..65535\n");
    return 2;
  }
  const auto start = Clock::now();
  std::random_device rd;
  const std::string token = dt::str(std::hex, rd(), rd(), rd(), rd());

  // Fork the workers before this process starts the server's thread; they
  // wait on a pipe for the port.
  std::vector<pid_t> children;
  std::vector<int> pipes;
  for (int rank = 0; rank < nproc; ++rank) {
    int fds[2];
    if (::pipe(fds) != 0) {
      std::perror("pipe");
      return 1;
    }
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[1]);
      for (int fd : pipes) ::close(fd);
      int code = 1;
      try {
        code = worker(rank, nproc, fds[0], token);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "store_demo rank %d: %s\n", rank, e.what());
      }
      std::fflush(stdout);
      ::_exit(code);
    }
    ::close(fds[0]);
    children.push_back(pid);
    pipes.push_back(fds[1]);
  }

  int failures = 0;
  try {
    dt::TcpStoreOptions options;
    options.isServer = true;
    options.numWorkers = nproc + 1;  // the workers and this process's own client
    options.waitForWorkers = false;  // we report them instead
    options.token = token;
    options.timeout = 60s;
    dt::TcpStore server("127.0.0.1", static_cast<uint16_t>(port), options);
    const uint16_t bound = server.port();
    std::printf("store_demo: TcpStore server on 127.0.0.1:%u (loopback only, per-run token), %d worker processes\n",
                bound, nproc);
    for (int fd : pipes) {
      if (::write(fd, &bound, sizeof(bound)) != sizeof(bound)) ++failures;
      ::close(fd);
    }
    dt::PrefixStore store("demo", std::shared_ptr<dt::Store>(&server, [](dt::Store*) {}));
    for (int rank = 0; rank < nproc; ++rank) {
      std::printf("  %s\n", store.get(dt::str("report/", rank)).c_str());
    }
    const int64_t expected = int64_t{nproc} * (nproc - 1) / 2;
    const std::string sum = store.get("rank_sum");
    const std::string done = store.check({"work_done"}) ? store.get("work_done") : "0";
    std::printf("  add(): sum of ranks %s (expected %lld); barriers: 3 passed by all %d ranks\n", sum.c_str(),
                static_cast<long long>(expected), nproc);
    std::printf("  queue: 16 work items pushed by rank 0, %s popped in total (each exactly once)\n", done.c_str());
    std::printf("  store holds %lld keys; %d clients joined the server\n", static_cast<long long>(server.numKeys()),
                nproc + 1);
    if (sum != std::to_string(expected) || done != "16") ++failures;
  } catch (const dt::Error& e) {
    std::fprintf(stderr, "store_demo: %s: %s\n", e.kind(), e.what());
    ++failures;
  }
  for (pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failures;
  }
  std::printf("store_demo: %s in %.0f ms\n", failures == 0 ? "OK" : "FAILED", msSince(start));
  return failures == 0 ? 0 : 1;
}
