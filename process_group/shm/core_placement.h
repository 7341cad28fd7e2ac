// Core placement for ranks that wait for each other in shared memory.
//
// Why: ranks hand off through futex wake-ups, and the kernel places a woken
// thread on its waker's core when its own core is busy at that instant (wake
// affinity). Once two ranks share a core that way they stay there: only one
// of them is ever runnable, so the load balancer sees nothing to balance, and
// every exchange costs two context switches (~5 us for a 4 KiB allreduce
// instead of ~2.5 us) while another core idles. A rank that finds itself
// stacked on its peer's core (ShmSegment counts its waits for a core mate)
// steps aside to an idle core of its own affinity mask, and leaves that mask
// as it was.
//
// Contract:
//  * CoreIdleSampler::sample() reads /proc/stat and returns each core's idle
//    share (0-100) since the previous call; the first call returns an empty
//    vector (nothing to compare with yet). Not thread-safe; one owner.
//  * runnableThreads(): /proc/stat's procs_running (threads running or
//    waiting for a core, machine-wide, this one included); -1 if unreadable.
//    It also counts threads that have just gone to sleep: since Linux 6.12
//    the scheduler (EEVDF's delayed dequeue) keeps a thread that sleeps
//    owing CPU time on its run queue until that debt is paid. Measured on
//    Linux 6.18: a thread that ran 3 ms and then slept 10 ms next to a
//    spinning thread on its core was still counted for the first 5 ms of its
//    sleep in 28 % of the reads.
//  * runnableThreadsListed(procRoot) counts the same thing task by task:
//    the threads whose state in <procRoot>/<pid>/task/<tid>/stat is R
//    (running or waiting for a core), which leaves the sleeping ones out.
//    About 0.4 ms for 70 processes, so only a second opinion where
//    procs_running refuses a step-aside that matters (below); -1 if
//    procRoot cannot be read.
//  * chooseIdleCore() is a pure function: among the allowed cores other than
//    `here` that no other rank of the group last ran on (`taken`: the core
//    each other rank last ran on, one entry per rank), one that
//    should be idle now, or -1. `runnable` is runnableThreads() as read by a
//    thread that knows one more thread waits for its core (its core mate):
//    the threads running elsewhere are runnable - 2, and unless they are
//    fewer than the other allowed cores none of those is idle. Cores with a
//    known idle share (idlePercent, 255 = unknown) below minIdlePercent are
//    skipped; the idlest known core wins, then the lowest number. With
//    acceptBusyCore (the stacked pair's switches are expensive, below) a
//    busy core will do too: no idle-share floor, and only four or more
//    threads running elsewhere per other allowed core refuse the move (with
//    three, the rank gets a quarter of the core, and back-to-back small ops
//    cost about four times what they cost between free cores: what the
//    stacked pair paid where a switch took 4.8 us; the count includes
//    short-lived threads waiting for the busy core at a job's start). With
//    more ranks than cores every core holds a rank of the group; then a core
//    with at least two ranks fewer than `here` (this one included) and at
//    least one (a core with none is the idle search's) will do, the one with
//    the fewest: three ranks on one core and one on the other stayed so for
//    whole launches (the lone rank spinning for its peers looks as loaded
//    to the kernel as the three that share a core), at up to 1.7x the time
//    of a 2+2 launch for a 16 MiB broadcast at world 4 on 2 cores.
//  * chooseStepAsideCore() is chooseIdleCore() with `runnable` read from
//    procs_running, and where that refuses a move with acceptBusyCore, from
//    the listed count when that is lower: next to a busy process procs_running
//    read 6 at every attempt for 3 ms where a listing found 3 runnable threads
//    (the pair and the busy process), and the pair stayed stacked at 4x the
//    op's time; where stacking costs that much, the listing's 0.4 ms is worth
//    it. The counts come from the two callables (the /proc readers above by
//    default; a test passes its own).
//  * mayStepAside(rank, mate, mateAsleep): which rank of a stacked pair may
//    move. The higher one (both moving would swap cores: in a trial where
//    either could, both moved to the same core within 0.1-0.3 ms, again and
//    again), or the lower one while its mate sleeps: a sleeping mate cannot be
//    moving too, and a rank that sleeps for its mate (a busy process took the
//    core on one of its yields) seldom waits itself (38-51 waits for a core
//    mate in a launch whose other rank had 370), so it seldom gets to move.
//    Pure.
//  * SwitchCost measures what a switch between two ranks that share a core
//    costs on this host: record() takes the time from one rank's sched_yield
//    (or its going to sleep for its core mate) to the moment the other runs,
//    and expensive() says whether the fastest of at least kSamples of them
//    since the last reset() took longer than kExpensive. Plain value; one
//    owner.
//  * forgetSharesOfGroupCores() sets to kIdleUnknown the idle share of every
//    core a rank of the group was on at the start or at the end of the
//    sampled interval: that core's busy time is (at least partly) the
//    group's own. After the kernel stacks two ranks, the core one of them
//    left looked busy for a whole heartbeat interval (its own spinning) and
//    refused every step-aside to it; for such a core the choice rests on
//    procs_running alone. Pure; negative entries (not yet known) are skipped.
//  * moveCallingThreadTo(core) pins the calling thread to `core` (the kernel
//    migrates it before returning), then restores its previous mask, so the
//    thread's affinity is unchanged and only its current core moved. Returns
//    false (and changes nothing) if the mask cannot be read or set.
//  * ForeignSlices says when a rank waiting for its core mate should sleep
//    instead of yielding: after a yield that kept it away too long (another
//    thread took the core) it sleeps for that wait; after a second one within
//    kMemory it sleeps for every wait of the next kMemory. Plain value; one
//    owner.
//  * StepAsideBackoff says when a stacked rank may try again: 100 us after
//    a move or after its first refused attempt, each refusal in a row
//    doubling the pause up to 128 ms. Plain value; one owner.
#pragma once

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

namespace dt::shm {

class CoreIdleSampler {
 public:
  std::vector<uint8_t> sample();

 private:
  struct Times {
    uint64_t idle = 0;
    uint64_t total = 0;
  };
  std::vector<Times> last_;
};

constexpr uint8_t kIdleUnknown = 255;

int runnableThreads();
int runnableThreadsListed(const char* procRoot = "/proc");

int chooseIdleCore(const cpu_set_t& allowed, int here, const std::vector<int>& taken, int runnable,
                   const std::vector<uint8_t>& idlePercent, int minIdlePercent, bool acceptBusyCore = false);

int chooseStepAsideCore(const cpu_set_t& allowed, int here, const std::vector<int>& taken,
                        const std::vector<uint8_t>& idlePercent, int minIdlePercent, bool acceptBusyCore,
                        const std::function<int()>& procsRunning = runnableThreads,
                        const std::function<int()>& listed = [] { return runnableThreadsListed(); });

inline bool mayStepAside(int rank, int mate, bool mateAsleep) { return mate < rank || mateAsleep; }

// Stacked, a small op costs its work plus two switches per exchange; moved to a core that a
// busy process holds, a rank gets half of that core, so back-to-back small ops cost about twice
// what they cost between free cores (5.4 against 2.7 us per 4 KiB allreduce at world 2). The two
// meet at switches of about 2 us. Where they cost about 1 us (the Intel development VM) stacking
// wins; a paravirtualized AMD guest takes 4.8 us (a system call alone costs ~1 us there), and the
// stacked pair's 4 KiB allreduce took 12 us per op against 2.6-3.0 us moved.
class SwitchCost {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::nanoseconds kExpensive{2500};
  static constexpr int kSamples = 4;

  void record(Clock::duration switchTime) {
    fastest_ = samples_ == 0 ? switchTime : std::min(fastest_, switchTime);
    ++samples_;
  }
  bool expensive() const { return samples_ >= kSamples && fastest_ > kExpensive; }
  void reset() { samples_ = 0; }

 private:
  int samples_ = 0;
  Clock::duration fastest_{};
};

void forgetSharesOfGroupCores(std::vector<uint8_t>& idlePercent, const std::vector<int>& groupCoresAtStart,
                              const std::vector<int>& groupCoresAtEnd);

bool moveCallingThreadTo(int core);

// A long yield usually means a busy process took the core for a time slice, and it will take
// every yield after it; sleeping lets the mate's wake-up take the core back at once. But a mate
// that works through a large op can keep the core as long (1.4-1.7 ms seen at world 4, 16 MiB
// allreduce): remembering every long yield for 100 ms made such ranks sleep for most of a
// launch's 16 MiB ops (443-903 waits) and cost them 5-9 % against yielding. Two long yields
// within 100 ms show the busy process; one is only slept on once.
class ForeignSlices {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds kMemory{100};

  void longYield(Clock::time_point now) {
    if (seenAny_ && now - lastLong_ < kMemory) sleepUntil_ = now + kMemory;
    lastLong_ = now;
    seenAny_ = true;
  }
  bool sleepInstead(Clock::time_point now) const { return now < sleepUntil_; }

 private:
  bool seenAny_ = false;
  Clock::time_point lastLong_{};
  Clock::time_point sleepUntil_{};
};

// After a move the kernel may stack the pair again (another wake-up that finds
// the core busy), and procs_running is one instant's count: at a job's start
// the runtime's own set-up threads (store server, heartbeats, progress) often
// run for a few hundred microseconds, and a small op's whole run may last one
// or two milliseconds. So the next attempt may come 100 us later (a first pause
// of 1 ms left such runs stacked throughout: 6.1 against 2.1-3.9 us per 4 KiB
// allreduce); refusals in a row double the pause up to 128 ms, as an attempt
// costs a /proc/stat read (6-7 us) and a busy process may hold the other core
// for good.
class StepAsideBackoff {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::microseconds kFirstPause{100};
  static constexpr std::chrono::microseconds kLongestPause{128'000};

  bool due(Clock::time_point now) const { return now >= next_; }
  void refused(Clock::time_point now);
  void moved(Clock::time_point now);

 private:
  Clock::time_point next_{};
  std::chrono::microseconds pause_ = kFirstPause;
};

}  // namespace dt::shm
