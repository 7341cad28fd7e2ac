// A small worker program for dtrun's end-to-end tests. The first argument
// picks what it does; see usage(). It reads the launcher's environment like a
// real worker would (RANK, DT_STORE_ADDR, ...).
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <unistd.h>

#include "common/strings.h"
#include "store/tcp_store.h"

namespace {

int envInt(const char* name, int fallback = -1) {
  const char* value = std::getenv(name);
  return value ? std::atoi(value) : fallback;
}

std::string envStr(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

void sleepMs(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

std::shared_ptr<dt::TcpStore> connectStore() {
  const std::string addr = envStr("DT_STORE_ADDR");
  const auto colon = addr.rfind(':');
  if (colon == std::string::npos) {
    std::fprintf(stderr, "DT_STORE_ADDR not set\n");
    std::exit(90);
  }
  dt::TcpStoreOptions options;
  options.rank = envInt("RANK");
  options.timeout = std::chrono::seconds(60);
  return std::make_shared<dt::TcpStore>(addr.substr(0, colon), static_cast<uint16_t>(std::stoi(addr.substr(colon + 1))), options);
}

volatile sig_atomic_t lastSignal = 0;
void onSignal(int sig) { lastSignal = sig; }

int usage() {
  std::fprintf(stderr,
               "usage: dtrun_test_worker env | exit CODE RANK [DELAY_MS] | raise SIG RANK | sleep MS | trap | pidfile DIR |\n"
               "       restart FAIL_UNTIL | progress STALL_RANK | exchange | lines N | ignoreterm\n");
  return 64;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  const std::string mode = argv[1];
  const int rank = envInt("RANK");
  setvbuf(stdout, nullptr, _IOLBF, 0);

  if (mode == "env") {
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                             "MASTER_PORT", "DT_STORE_ADDR", "DT_STORE_TOKEN", "DT_RUN_ID", "DT_RESTART_COUNT",
                             "DT_MAX_RESTARTS", "OMP_NUM_THREADS", "DT_NUM_THREADS"}) {
      std::printf("ENV %s=%s\n", name, envStr(name).c_str());
    }
    std::printf("PGID %d PID %d\n", static_cast<int>(getpgrp()), static_cast<int>(getpid()));
    return 0;
  }
  if (mode == "exit" && argc >= 4) {
    const int code = std::atoi(argv[2]);
    const int failing = std::atoi(argv[3]);
    const int delay = argc >= 5 ? std::atoi(argv[4]) : 0;
    if (rank == failing) {
      sleepMs(delay);
      std::fprintf(stderr, "worker rank %d: failing on purpose with code %d\n", rank, code);
      return code;
    }
    sleepMs(60000);
    return 0;
  }
  if (mode == "raise" && argc >= 4) {
    if (rank == std::atoi(argv[3])) {
      sleepMs(100);
      std::fprintf(stderr, "worker rank %d: raising signal %s\n", rank, argv[2]);
      // The default action, even under a sanitizer that installs its own handler.
      std::signal(std::atoi(argv[2]), SIG_DFL);
      std::raise(std::atoi(argv[2]));
    }
    sleepMs(60000);
    return 0;
  }
  if (mode == "leave-shm") {
    // What a worker killed while setting up a shm group leaves behind.
    const std::string path = "/dev/shm/dtrain-" + envStr("DT_RUN_ID") + "-test-leftover-" + std::to_string(rank);
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) return 3;
    std::fclose(f);
    std::printf("left %s\n", path.c_str());
    return 0;
  }
  if (mode == "sleep" && argc >= 3) {
    sleepMs(std::atoi(argv[2]));
    return 0;
  }
  if (mode == "trap") {
    // Reports the signals it gets; TERM and INT end it (code 10 + signal).
    for (int sig : {SIGUSR1, SIGUSR2, SIGHUP, SIGTERM, SIGINT}) std::signal(sig, onSignal);
    std::printf("ready rank %d\n", rank);
    for (int i = 0; i < 600; ++i) {
      sleepMs(50);
      if (lastSignal != 0) {
        const int sig = lastSignal;
        lastSignal = 0;
        std::printf("rank %d got signal %d\n", rank, sig);
        if (sig == SIGTERM || sig == SIGINT) return 10 + sig;
      }
    }
    return 0;
  }
  if (mode == "pidfile" && argc >= 3) {
    // A grandchild in the worker's process group, like a data-loader process:
    // it has no parent-death signal of its own.
    const pid_t child = fork();
    if (child == 0) {
      sleepMs(120000);
      _exit(0);
    }
    std::ofstream(dt::str(argv[2], "/rank", rank, ".pid")) << getpid() << " " << child << "\n";
    std::printf("pid written rank %d\n", rank);
    sleepMs(120000);
    return 0;
  }
  if (mode == "restart" && argc >= 3) {
    // Rank 0 fails until DT_RESTART_COUNT reaches FAIL_UNTIL; each attempt
    // counts itself in the store, which must survive the restarts.
    const int failUntil = std::atoi(argv[2]);
    auto store = connectStore();
    if (rank == 0) store->add("test/attempts", 1);
    const int restart = envInt("DT_RESTART_COUNT");
    if (rank == 0 && restart < failUntil) {
      std::fprintf(stderr, "rank 0 failing in attempt %d\n", restart);
      return 3;
    }
    if (rank == 0) {
      sleepMs(100);
      std::printf("attempts seen %lld restart count %d\n", static_cast<long long>(store->add("test/attempts", 0)), restart);
      return 0;
    }
    sleepMs(rank == 0 ? 0 : 1500);
    return 0;
  }
  if (mode == "progress" && argc >= 3) {
    // Writes dt/progress/<rank> like the process group does; STALL_RANK stops
    // after collective #3, the others after #5; then everyone hangs.
    const int stall = std::atoi(argv[2]);
    auto store = connectStore();
    const int last = rank == stall ? 3 : 5;
    for (int seq = 1; seq <= last; ++seq) {
      store->set(dt::str("dt/progress/", rank), dt::str(seq, " allreduce"));
      sleepMs(50);
    }
    sleepMs(120000);
    return 0;
  }
  if (mode == "exchange") {
    // Every rank publishes a value and sums everyone's: data across nodes through the store.
    auto store = connectStore();
    const int world = envInt("WORLD_SIZE");
    store->set(dt::str("test/value/", rank), dt::str(rank + 1));
    long sum = 0;
    for (int r = 0; r < world; ++r) sum += std::stol(store->get(dt::str("test/value/", r)));
    std::printf("rank %d group %d sum %ld expected %d\n", rank, envInt("GROUP_RANK"), sum, world * (world + 1) / 2);
    // Stay alive a little so that a test can cut the network under a running job.
    const int linger = envInt("TEST_LINGER_MS", 0);
    if (linger > 0) {
      std::printf("lingering rank %d\n", rank);
      sleepMs(linger);
    }
    return sum == world * (world + 1) / 2 ? 0 : 1;
  }
  if (mode == "lines" && argc >= 3) {
    // Writes long lines in two pieces with a pause in between, so lines of
    // different ranks would interleave mid-line without dtrun's line buffering.
    const int n = std::atoi(argv[2]);
    const std::string body(200, static_cast<char>('a' + rank % 26));
    for (int i = 0; i < n; ++i) {
      const std::string first = dt::str("L", rank, ":", i, ":", body.substr(0, 100));
      const std::string second = dt::str(body.substr(100), ":end\n");
      ssize_t ignored = write(1, first.data(), first.size());
      sleepMs(1);
      ignored = write(1, second.data(), second.size());
      (void)ignored;
    }
    std::fprintf(stderr, "stderr line from rank %d\n", rank);
    return 0;
  }
  if (mode == "ignoreterm") {
    std::signal(SIGTERM, SIG_IGN);
    std::printf("ignoring SIGTERM rank %d\n", rank);
    if (rank == 0) {
      sleepMs(200);
      return 4;
    }
    sleepMs(120000);
    return 0;
  }
  return usage();
}
