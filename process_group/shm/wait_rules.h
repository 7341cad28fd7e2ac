// How a rank of a shared-memory group waits for a peer: the spin / yield /
// sleep decisions of ShmSegment::waitSlow, as pure functions of what the rank
// observes at each check. The segment gathers the observations (its peers'
// control words, sched_getcpu(), the clock); these functions decide. Tests
// feed them observations, so no test depends on where the kernel puts a
// thread; what the kernel then does with the decisions is measured by
// bench/scheduling_bench.cpp.
//
// Contract: pure functions of their arguments, no state, no system calls;
// callable from any thread.
#pragma once

#include <chrono>
#include <cstdint>

namespace dt::shm {

// How long a waiter spins for a peer that may be running on another core
// before it sleeps: about what sleeping costs (a futex wake-up plus a context
// switch, 4-7 us on the development machine), so that a wait never costs much
// more than the better of spinning and sleeping would have (the classic
// spin-then-block bound). A peer that needs this very core is never spun for.
constexpr std::chrono::nanoseconds kSpinBeforeSleeping = std::chrono::microseconds(10);
// A peer that is inside a collective and not asleep in a wait of its own is
// moving bytes toward the phase this rank waits for: it arrives within one
// round's copy (512 KiB, well under 1 ms), and sleeping would add a wake-up
// to every round. Past this it is probably descheduled: sleep.
constexpr std::chrono::nanoseconds kSpinForWorkingPeer = std::chrono::milliseconds(1);
// A peer this rank has just woken is on its way: a sleeping thread takes a
// while to run again (25-30 us on the development machine's idle cores, more
// than kSpinBeforeSleeping). Sleeping for it as well would make its next wait
// a wake-up too, and so on: a run where every exchange costs two wake-ups
// (about 60 us instead of 2 for a 4 KiB allreduce), the "slow mode" that
// stayed for the whole run once a stall started it. So a rank that woke its
// peer spins for it as for a working peer, which it is about to be. The
// bound used to be 200 us: on a day when the same VM took 50-170 us to run a
// woken thread, and in stretches over 200 us every time, launches fell into
// that mode for good (1091 and 1145 us per 4 KiB allreduce; 107 of 192 waits
// slept for a peer the rank had just woken).
constexpr std::chrono::nanoseconds kSpinForWakingPeer = kSpinForWorkingPeer;
// A rank that shares its core with a rank of its group hands the core over
// with sched_yield (a switch of ~1 us, no futex wake-up for either side),
// polling for this long before it sleeps. Yielding is only safe among our
// own ranks: a busy process on the core would take it for a whole time slice
// (milliseconds). A yield that kept this thread away longer than
// kForeignSlice may show one; the rank then sleeps instead of yielding, for
// how long: ForeignSlices (core_placement.h).
constexpr std::chrono::nanoseconds kYieldToMateFor = std::chrono::milliseconds(2);
constexpr std::chrono::nanoseconds kForeignSlice = std::chrono::microseconds(500);

// One look, while spinning, at a peer that last ran on another core.
struct SpinCheck {
  // The awaited peer, or another awake rank of the group, last ran on this
  // thread's core: it cannot run while this thread spins here.
  bool coreNeededByGroup = false;
  std::chrono::nanoseconds spinning{0};  // since this spin began
  bool peerInCollective = false;         // between enterCollective() and leaveCollective()
  bool peerAsleep = false;               // asleep in a wait of its own
  // Since this rank last woke sleeping peers (arrive()); a large value when never.
  std::chrono::nanoseconds sinceWokeSleepers = std::chrono::nanoseconds::max();
};

// True: spin on; false: stop spinning (the caller sleeps, or yields to the
// rank that needs the core).
bool keepSpinning(const SpinCheck& check);

// How yielding the core to a core mate ended, or that it goes on.
enum class MateWait {
  kYieldAgain,  // nothing changed: yield once more
  kReached,     // the awaited peer got there
  kOwnCore,     // this thread is on a core no awake rank of the group needs
  kGaveUp,      // yielding does not get the mate to run: sleep
};

// One look after a sched_yield() to a core mate.
struct YieldCheck {
  bool peerReached = false;
  std::chrono::nanoseconds yieldTook{0};  // how long that one yield kept this thread away
  std::chrono::nanoseconds yielding{0};   // since this wait's first yield
  bool movedOffCore = false;              // sched_getcpu() is not the core the wait began on
  // The awaited peer, or another awake rank of the group, still last ran on
  // the core the wait began on.
  bool coreStillNeededByGroup = true;
};

MateWait afterYield(const YieldCheck& check);

// What a wait for a core mate does once its yielding (or a step aside) ended.
enum class ThenWait {
  kDone,           // the peer got there
  kSpinOnOwnCore,  // wait as a rank on a free core does: spin, then sleep
  kSleep,
};

ThenWait afterMateWait(MateWait outcome);

}  // namespace dt::shm
