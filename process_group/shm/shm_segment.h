// ShmSegment: the shared memory of one shm group, and the way its ranks wait
// for each other in it.
//
// Layout (one POSIX shared-memory object per group instance):
//   header    magic, version, world size, sizes, the abort word
//   control   one cache line per rank: its step counter (a futex word), the
//             number of ranks sleeping on it, heartbeat, pid, the fingerprint
//             hash of the op it runs, its p2p doorbell
//   slots     per rank, two buffers of slotBytes (collective rounds alternate)
//   channels  per ordered pair of ranks, a p2p channel of two chunks
//
// Contract:
//  * create() is collective over the group: rank 0 creates the object
//    (shm_open O_EXCL, named "/dtrain-<run id>-<group>-<nonce>") and publishes
//    the name in the group's store; every rank maps it, counts itself in the
//    store, and the last rank to map it unlinks the name, so the object lives
//    only as long as the mappings (a crash leaves nothing in /dev/shm). A rank
//    that cannot finish set-up within the timeout unlinks it too.
//  * Steps: in every phase of a collective each rank publishes its data,
//    then arrive() (step + 1, waking sleepers), then waitForAll(): until every
//    rank's step has reached its own (or waitFor(r): only rank r's, for a
//    phase where only r publishes). A rank writes into its buffer only when
//    every rank has reached its current phase, so a buffer is never
//    rewritten while a slower rank may still read it.
//  * Waiting for a peer: each rank publishes the core it last ran on
//    (sched_getcpu, at every wait). A waiter whose peer, or another awake
//    rank of the group, last ran on the waiter's own core yields the core to
//    it with sched_yield (up to 2 ms); a yield that kept it away for over
//    500 us ends that wait asleep, and two such within 100 ms (a busy process
//    holds the core) make it sleep at once for the next 100 ms;
//    otherwise it spins for about what sleeping costs (10 us), or up to 1 ms
//    while the peer is inside a collective and not asleep in a wait of its
//    own (it is moving bytes toward this phase), or for a peer it has just
//    woken; then it sleeps on the peer's futex word, which the peer's arrival
//    wakes. It gives up (TransportTimeout) at the deadline, or (PeerLost)
//    when the abort word is set or a peer's pid is gone or its heartbeat
//    stopped for heartbeatTimeout (checked every 20 ms of sleep).
//    A rank that waited for a core mate 16 times in a row has been stacked
//    there by the kernel's wake-up placement and moves its waiting thread to
//    another core of its affinity mask (an idle one; a busy one where the
//    pair's switches are expensive; with more ranks than cores, a less
//    crowded one), leaving the mask as it was (core_placement.h, which also
//    says which of the two moves); the heartbeat thread samples the cores'
//    idle shares for that. A waiter that finds itself on a core of its own
//    mid-wait spins there. waitStats() counts which way the waits went.
//  * abort() sets the abort word (first caller wins) and wakes every sleeper:
//    every rank's wait fails promptly. Idempotent, thread-safe.
//  * One thread runs collectives (the runner's) and one runs p2p; they use
//    disjoint parts of the segment. The heartbeat thread bumps this rank's
//    heartbeat every `heartbeatInterval`.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "process_group/shm/core_placement.h"
#include "process_group/shm/wait_rules.h"
#include "store/store.h"

namespace dt::shm {

using Clock = std::chrono::steady_clock;

struct alignas(64) RankControl {
  std::atomic<uint32_t> step{0};      // phases this rank has completed (futex word)
  std::atomic<uint32_t> sleepers{0};  // ranks sleeping on `step`
  std::atomic<uint32_t> doorbell{0};  // p2p: bumped when a channel to or from this rank moved (futex word)
  std::atomic<uint32_t> doorbellSleepers{0};
  std::atomic<uint64_t> heartbeat{0};
  std::atomic<int32_t> cpu{-1};       // the core this rank's collective thread last ran on
  std::atomic<uint32_t> state{0};     // in a collective; asleep in a wait (shm_segment.cpp)
  std::atomic<int64_t> yieldedAtNs{0};  // steady clock when it last yielded its core to a core mate or slept for one
  // Fingerprint hash of this rank's collectives, by the parity of their
  // count (a peer is at most one collective ahead).
  std::atomic<uint64_t> opHash[2] = {0, 0};
  int32_t pid = 0;
  uint32_t mapped = 0;
  uint64_t pidNamespace = 0;          // inode of /proc/self/ns/pid (pid checks only within one)
};

// A p2p channel from one rank to another: two chunks the sender fills in
// turn (published) and the receiver empties (consumed).
struct alignas(64) ChannelHeader {
  std::atomic<uint32_t> published{0};
  std::atomic<uint32_t> consumed{0};
  struct Chunk {
    uint64_t message = 0;  // the sender's message number on this channel
    uint64_t total = 0;    // the message's bytes
    uint64_t offset = 0;   // this chunk's place in it
    uint64_t length = 0;
    uint32_t tag = 0;
  } chunks[2];
};

struct SegmentOptions {
  std::string name;  // group name (part of the object's name)
  int rank = 0;
  int size = 1;
  size_t slotBytes = size_t{1} << 20;
  size_t chunkBytes = size_t{256} << 10;  // p2p
  std::chrono::milliseconds timeout{60000};
  std::chrono::milliseconds heartbeatInterval{100};
  std::chrono::milliseconds heartbeatTimeout{5000};
};

class ShmSegment {
 public:
  ShmSegment(StorePtr store, SegmentOptions options);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t slotBytes() const { return slotBytes_; }
  size_t chunkBytes() const { return chunkBytes_; }
  const std::string& objectName() const { return objectName_; }

  // Rank r's collective buffer `parity` (0 or 1).
  uint8_t* slot(int r, int parity) const;
  RankControl& control(int r) const;
  // The p2p channel from `src` to `dst`: its header and two chunk buffers.
  ChannelHeader& channel(int src, int dst) const;
  uint8_t* channelChunk(int src, int dst, int index) const;

  // ---- collective phases -------------------------------------------------------
  // Around each collective's phases: peers spin longer for a rank inside one.
  void enterCollective();
  void leaveCollective();
  // Publishes this rank's arrival at the next phase.
  void arrive();
  // Waits until every rank (or rank r) arrived at this rank's current phase
  // (see contract).
  void waitForAll(Clock::time_point deadline);
  void waitFor(int r, Clock::time_point deadline);
  uint32_t currentStep() const { return mySteps_; }
  // How this rank's waits for peers ended (only the collective thread waits).
  struct WaitStats {
    uint64_t spun = 0;              // the peer arrived while this rank spun
    uint64_t slept = 0;             // slept after spinning for 10 us
    uint64_t forCoreMate = 0;       // a rank of the group needed this core: yielded, or slept, or moved
    uint64_t steppedAside = 0;      // moved to an idle core, away from a core mate (core_placement.h)
    uint64_t spunForWaking = 0;     // of `spun`: the peer was asleep when the wait began (woken, on its way)
    uint64_t sleptForWoken = 0;     // of `slept`: for a peer its arrival at this phase had woken
    uint64_t spunOnOwnCore = 0;     // of `forCoreMate`: moved to a core of its own, then spun there
    uint64_t sleptForCoreMate = 0;  // of `forCoreMate`: slept, as its yields did not get the mate to run
  };
  WaitStats waitStats() const;

  // ---- p2p doorbells ---------------------------------------------------------------
  void ring(int r);
  // Sleeps until this rank's doorbell moves past `seen` or `until`.
  void waitDoorbell(uint32_t seen, Clock::time_point until);
  uint32_t doorbell() const;

  // ---- failure ----------------------------------------------------------------------
  void abort(int byRank);
  // 0 while healthy, else 1 + the rank that aborted.
  uint32_t abortedBy() const;
  // Throws PeerLost when the group was aborted or `r` is dead or frozen.
  void checkPeer(int r) const;
  void checkAbort() const;

 private:
  struct Header;
  Header& header() const;
  void map(int fd, bool create);
  void heartbeatLoop();
  bool peerDead(int r, std::string* why) const;
  void waitSlow(int r, uint32_t target, Clock::time_point deadline);
  bool spinFor(int r, uint32_t target, int here);
  // Moves this thread off `here` when the pair has been stacked long enough (true: moved).
  bool stepAside(int here);
  int awakeRankOnCore(int here) const;
  MateWait yieldToMate(int r, uint32_t target, int here);
  void timeSwitch(Clock::time_point yielded, Clock::time_point back);

  const int rank_;
  const int size_;
  size_t slotBytes_;
  size_t chunkBytes_;
  std::chrono::milliseconds heartbeatTimeout_;
  std::chrono::milliseconds heartbeatInterval_;
  std::string objectName_;
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
  size_t slotsOffset_ = 0;
  size_t channelsOffset_ = 0;
  size_t channelStride_ = 0;
  uint32_t mySteps_ = 0;
  std::atomic<uint64_t> spun_{0};
  std::atomic<uint64_t> slept_{0};
  std::atomic<uint64_t> spunForWaking_{0};
  std::atomic<uint64_t> sleptForWoken_{0};
  std::atomic<uint64_t> forCoreMate_{0};
  std::atomic<uint64_t> steppedAside_{0};
  std::atomic<uint64_t> spunOnOwnCore_{0};
  std::atomic<uint64_t> sleptForCoreMate_{0};
  uint32_t matesInARow_ = 0;  // collective thread only
  StepAsideBackoff stepAsideBackoff_;  // collective thread only
  SwitchCost switchCost_;              // collective thread only: this run of stacked waits
  ForeignSlices foreignSlices_;        // collective thread only: long yields (a busy process on this core?)
  Clock::time_point wokeSleepersAt_{};  // collective thread only: arrive() last woke a sleeping peer
  uint32_t wokeSleepersAtStep_ = 0;     // ... on arriving at this phase
  // Each core's idle share over the last heartbeat interval (heartbeat thread writes).
  uint64_t myPidNamespace_ = 0;
  std::vector<std::atomic<uint8_t>> coreIdle_;

  // Last heartbeat seen per peer and when it changed (waiters only).
  mutable std::mutex heartbeatMutex_;
  mutable std::vector<uint64_t> seenHeartbeat_;
  mutable std::vector<Clock::time_point> heartbeatChanged_;

  std::mutex stopMutex_;
  std::condition_variable stopWake_;
  bool stopping_ = false;
  std::thread heartbeatThread_;
};

// The run id part of object names: DT_RUN_ID with characters outside
// [A-Za-z0-9._-] replaced by '_', or "local". dtrun removes leftovers whose
// names start with "/dev/shm/dtrain-<run id>-" when a job ends.
std::string runIdForNames();

}  // namespace dt::shm
