// core_roundtrip: how long a cache line takes to go from one CPU to another and back, the
// floor under every small shared-memory exchange. Two threads, pinned to two CPUs, bounce a
// counter between two cache lines; the median round trip is the result.
//
// Why a benchmark needs it: on a virtual machine the host decides where the guest's vCPUs run,
// and it can change that at any time without the guest seeing it. On the 2-vCPU development VM
// the round trip is 250-460 ns most of the time and 91 ns in some stretches (the host then runs
// the two vCPUs close together), and a 4 KiB allreduce of any implementation (dtrain, OpenMPI)
// takes 1.2 us in those stretches against 2.3-3.5 us otherwise. bench/run_small_ops_bench.sh
// probes after every launch, so a launch's median can be read against the machine it ran on.
//
//   core_roundtrip [--cpus A,B] [--trips N]
//   RESULT core_roundtrip cpus=0,1 trips=20000 median_ns=... min_ns=... p90_ns=...
// Default CPUs: the first two of the affinity mask. Exits 2 with a reason when there are fewer.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

struct alignas(64) Line {
  std::atomic<int> value{0};
};

bool pinCallingThread(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return ::pthread_setaffinity_np(::pthread_self(), sizeof set, &set) == 0;
}

int usage(const char* why) {
  std::fprintf(stderr, "core_roundtrip: %s\nusage: core_roundtrip [--cpus A,B] [--trips N]\n", why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  int cpuA = -1;
  int cpuB = -1;
  int trips = 20000;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) return usage(("missing value after " + arg).c_str());
    const std::string value = argv[++i];
    if (arg == "--cpus") {
      if (std::sscanf(value.c_str(), "%d,%d", &cpuA, &cpuB) != 2 || cpuA < 0 || cpuB < 0 || cpuA == cpuB) {
        return usage(("--cpus wants two different CPU numbers like 0,1, got '" + value + "'").c_str());
      }
    } else if (arg == "--trips") {
      trips = std::atoi(value.c_str());
      if (trips < 1) return usage(("--trips wants a positive count, got '" + value + "'").c_str());
    } else {
      return usage(("unknown argument " + arg).c_str());
    }
  }
  if (cpuA < 0) {
    cpu_set_t allowed;
    if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0) return usage("cannot read the affinity mask");
    for (int c = 0; c < CPU_SETSIZE && cpuB < 0; ++c) {
      if (!CPU_ISSET(c, &allowed)) continue;
      (cpuA < 0 ? cpuA : cpuB) = c;
    }
    if (cpuB < 0) return usage("needs two CPUs in the affinity mask, this process may use one");
  }

  Line ping;
  Line pong;
  bool echoPinned = false;  // read after join()
  std::thread echo([&] {
    echoPinned = pinCallingThread(cpuB);
    for (int i = 1; i <= trips; ++i) {
      while (ping.value.load(std::memory_order_acquire) != i) {
      }
      pong.value.store(i, std::memory_order_release);
    }
  });
  const bool pinnedHere = pinCallingThread(cpuA);
  std::vector<double> ns;
  ns.reserve(static_cast<size_t>(trips));
  for (int i = 1; i <= trips; ++i) {
    const auto start = std::chrono::steady_clock::now();
    ping.value.store(i, std::memory_order_release);
    while (pong.value.load(std::memory_order_acquire) != i) {
    }
    ns.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count());
  }
  echo.join();
  if (!echoPinned || !pinnedHere) {
    std::fprintf(stderr, "core_roundtrip: cannot pin threads to CPUs %d and %d\n", cpuA, cpuB);
    return 2;
  }
  std::sort(ns.begin(), ns.end());
  const auto at = [&](double q) { return ns[std::min(ns.size() - 1, static_cast<size_t>(q * static_cast<double>(ns.size())))]; };
  std::printf("RESULT core_roundtrip cpus=%d,%d trips=%d median_ns=%.0f min_ns=%.0f p90_ns=%.0f\n", cpuA, cpuB, trips,
              at(0.5), ns.front(), at(0.9));
  return 0;
}
