#include "process_group/shm/wait_rules.h"

namespace dt::shm {

bool keepSpinning(const SpinCheck& check) {
  if (check.coreNeededByGroup) return false;
  if (check.spinning < kSpinBeforeSleeping) return true;
  if (check.peerInCollective && !check.peerAsleep && check.spinning < kSpinForWorkingPeer) return true;
  // A peer this rank has just woken is on its way (and about to work).
  return check.peerAsleep && check.sinceWokeSleepers < kSpinForWakingPeer;
}

MateWait afterYield(const YieldCheck& check) {
  if (check.peerReached) return MateWait::kReached;
  // A long yield: something other than the group's own ranks took the core.
  if (check.yieldTook > kForeignSlice) return MateWait::kGaveUp;
  if (check.movedOffCore || !check.coreStillNeededByGroup) return MateWait::kOwnCore;
  return check.yielding < kYieldToMateFor ? MateWait::kYieldAgain : MateWait::kGaveUp;
}

ThenWait afterMateWait(MateWait outcome) {
  switch (outcome) {
    case MateWait::kReached: return ThenWait::kDone;
    // Sleeping on a core of its own let the peer's wake-up put this thread back on the peer's
    // core (the kernel wakes a thread on its waker's core when its own core is busy): a rank
    // that stepped aside to a core a busy process holds was stacked again at once, 12 times in
    // a row in one launch (16 against 2.8 us per 4 KiB allreduce). So it spins there first.
    case MateWait::kOwnCore: return ThenWait::kSpinOnOwnCore;
    case MateWait::kYieldAgain:  // not an end: treated as giving up, never reached by the segment
    case MateWait::kGaveUp: break;
  }
  return ThenWait::kSleep;
}

}  // namespace dt::shm
