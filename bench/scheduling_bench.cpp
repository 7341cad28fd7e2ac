// What the kernel does with the shared-memory wait rules (process_group/shm/wait_rules.h):
// the rules are tested as decisions in tests/process_group/scheduling_test.cpp; where the
// kernel then puts the threads and how fast it wakes them depends on the host and its load,
// so it is measured here and reported, never asserted.
//
//   scheduling_bench [runs]
//
// Two threads as ranks of one segment:
//  * stacked-then-free: both start pinned to core 0; at round 100 rank 1 may use core 1 too.
//    Reported: how often rank 1 stepped aside, and of the waits it found itself on a core of
//    its own in, how many its spin got through (the rest slept).
//  * woken-peer: ranks on cores 0 and 1; rank 1 stalls 5 ms outside any collective every 50
//    rounds, so rank 0 sleeps; then rank 1 wakes rank 0 and waits for it. Reported: how often
//    rank 1 slept for the peer it had just woken (the rule spins up to 1 ms instead), next to
//    the host's wake-up latency of an idle core.
#include <pthread.h>
#include <sched.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "bench/bench_common.h"
#include "process_group/shm/shm_segment.h"
#include "store/hash_store.h"

namespace {

using namespace std::chrono_literals;
using dt::shm::ShmSegment;

void pinTo(std::initializer_list<int> list) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : list) CPU_SET(c, &set);
  ::pthread_setaffinity_np(::pthread_self(), sizeof set, &set);
}

std::vector<ShmSegment::WaitStats> exchange(const char* name, int rounds, const std::function<int(int)>& coreOf,
                                            const std::function<void(int, int)>& beforeRound) {
  auto store = std::make_shared<dt::HashStore>();
  std::vector<ShmSegment::WaitStats> stats(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      pinTo({coreOf(rank)});
      dt::shm::SegmentOptions options;
      options.name = name;
      options.rank = rank;
      options.size = 2;
      options.slotBytes = 4096;
      ShmSegment segment(store, options);
      const auto deadline = std::chrono::steady_clock::now() + 60s;
      for (int i = 0; i < rounds; ++i) {
        beforeRound(rank, i);
        segment.enterCollective();
        *reinterpret_cast<int*>(segment.slot(rank, i & 1)) = i;
        segment.arrive();
        segment.waitForAll(deadline);
        segment.arrive();
        segment.waitForAll(deadline);
        segment.leaveCollective();
      }
      stats[rank] = segment.waitStats();
    });
  }
  for (auto& t : ranks) t.join();
  return stats;
}

// Microseconds from a futex wake on core 0 to the sleeper running on idle core 1, sorted.
std::vector<double> wakeUpLatencies(int count) {
  std::atomic<int> word{0};
  std::atomic<int64_t> ranAt{0};
  const auto nowNs = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  std::vector<double> us;
  std::thread sleeper([&] {
    pinTo({1});
    for (int i = 1; i <= count; ++i) {
      while (word.load() < i) ::syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, i - 1, nullptr, nullptr, 0);
      ranAt.store(nowNs());
    }
  });
  pinTo({0});
  for (int i = 1; i <= count; ++i) {
    std::this_thread::sleep_for(1ms);
    ranAt.store(0);
    const int64_t wokeAt = nowNs();
    word.store(i);
    ::syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
    while (ranAt.load() == 0) {
    }
    us.push_back(static_cast<double>(ranAt.load() - wokeAt) / 1e3);
  }
  sleeper.join();
  std::sort(us.begin(), us.end());
  return us;
}

}  // namespace

int main(int argc, char** argv) {
  if (std::thread::hardware_concurrency() < 2) {
    std::printf("scheduling_bench: needs two cores, this machine has one: nothing measured\n");
    return 0;
  }
  const int runs = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
  std::printf("%-18s %4s %12s %12s %12s %12s\n", "case", "run", "stepped", "own-core", "spun-there", "slept-woken");
  uint64_t steppedTotal = 0, spunThereTotal = 0, sleptWokenTotal = 0;
  for (int run = 0; run < runs; ++run) {
    const auto stats = exchange("sched-bench-stacked", 3000, [](int) { return 0; }, [](int rank, int round) {
      if (rank == 1 && round == 100) pinTo({0, 1});
    });
    steppedTotal += stats[1].steppedAside;
    spunThereTotal += stats[1].spunOnOwnCore;
    std::printf("%-18s %4d %12llu %12s %12llu %12s\n", "stacked-then-free", run,
                static_cast<unsigned long long>(stats[1].steppedAside), "-",
                static_cast<unsigned long long>(stats[1].spunOnOwnCore), "-");
  }
  constexpr int kStalls = 20;
  for (int run = 0; run < runs; ++run) {
    const auto stats = exchange("sched-bench-woken", 50 * kStalls, [](int rank) { return rank; }, [](int rank, int round) {
      if (rank == 1 && round % 50 == 25) std::this_thread::sleep_for(5ms);
    });
    sleptWokenTotal += stats[1].sleptForWoken;
    std::printf("%-18s %4d %12s %12s %12s %12llu\n", "woken-peer", run, "-", "-", "-",
                static_cast<unsigned long long>(stats[1].sleptForWoken));
  }
  std::vector<double> wakeUps;
  std::thread([&] { wakeUps = wakeUpLatencies(100); }).join();
  std::printf("RESULT sched_stacked runs=%d stepped_aside=%llu spun_on_own_core=%llu\n", runs,
              static_cast<unsigned long long>(steppedTotal), static_cast<unsigned long long>(spunThereTotal));
  std::printf("RESULT sched_woken runs=%d stalls_per_run=%d slept_for_woken=%llu (without the rule: at least the stalls)\n",
              runs, kStalls, static_cast<unsigned long long>(sleptWokenTotal));
  std::printf("RESULT wake_up_idle_core median_us=%.1f p90_us=%.1f over_1ms=%ld\n", wakeUps[50], wakeUps[90],
              static_cast<long>(std::count_if(wakeUps.begin(), wakeUps.end(), [](double us) { return us > 1000; })));
  return 0;
}
