#include "process_group/shm/shm_segment.h"

#include <fcntl.h>
#include <sched.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <new>
#include <random>

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "common/thread_name.h"
#include "process_group/collective_runner.h"
#include "process_group/shm/core_placement.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DT_CPU_RELAX() _mm_pause()
#else
#define DT_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace dt::shm {
namespace {

constexpr uint64_t kMagic = 0x64747368'6d736567ull;  // "dtshmseg"
constexpr uint32_t kVersion = 3;  // 2: RankControl::cpu; 3: RankControl::yieldedAtNs
constexpr size_t kAlign = 4096;

size_t alignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

void futexWake(std::atomic<uint32_t>* word) { futex(word, FUTEX_WAKE, INT32_MAX, nullptr); }

// Sleeps while *word == expected, at most `slice`.
void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::microseconds slice) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(slice.count() / 1000000);
  ts.tv_nsec = static_cast<long>((slice.count() % 1000000) * 1000);
  futex(word, FUTEX_WAIT, expected, &ts);
}

// A process that has exited but was not reaped yet still answers kill(0).
bool isZombie(int32_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // "pid (comm) S ...": the state follows the last ')' (comm may hold one).
  const char* close = std::strrchr(buf, ')');
  return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

int64_t sinceEpochNs(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// The spin, yield and sleep bounds are in wait_rules.h, with the rules that use them.
constexpr uint32_t kInCollective = 1;  // RankControl::state bits
constexpr uint32_t kAsleep = 2;
// Pauses between looks at the clock and at the peer's core while spinning.
constexpr int kSpinsPerCheck = 64;
// A rank that slept for a core mate this many times in a row shares its core
// with it for good (see core_placement.h) and steps aside to an idle core,
// never to a core busy for more than 100 - kMinIdlePercent % of the last
// heartbeat interval with something other than the group's own ranks (a core
// a busy process holds is worse than sharing one with the peer), unless the
// pair's switches on their shared core are expensive on this host: then a
// busy core is the better place (SwitchCost). When it may
// try again: StepAsideBackoff (core_placement.h).
constexpr uint32_t kStackedWaits = 16;
constexpr int kMinIdlePercent = 80;
// Sleeping waiters check the peer's pid and heartbeat this often (the first
// check only after this long: a /proc read on every short sleep would cost
// more than the exchange).
constexpr auto kHealthCheckEvery = std::chrono::milliseconds(20);

uint64_t pidNamespaceInode() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

}  // namespace

struct ShmSegment::Header {
  uint64_t magic;
  uint32_t version;
  uint32_t worldSize;
  uint64_t slotBytes;
  uint64_t chunkBytes;
  uint64_t totalBytes;
  std::atomic<uint32_t> abortedBy;  // 0, or 1 + the rank that aborted
};

std::string runIdForNames() {
  const std::string runId = env::getString("DT_RUN_ID");
  return runId.empty() ? std::string("local") : safeNameComponent(runId);
}

ShmSegment::ShmSegment(StorePtr store, SegmentOptions options)
    : rank_(options.rank),
      size_(options.size),
      slotBytes_(alignUp(options.slotBytes, 64)),
      chunkBytes_(alignUp(options.chunkBytes, 64)),
      heartbeatTimeout_(options.heartbeatTimeout),
      heartbeatInterval_(options.heartbeatInterval),
      myPidNamespace_(pidNamespaceInode()),
      coreIdle_(static_cast<size_t>(std::max(1L, ::sysconf(_SC_NPROCESSORS_CONF)))),
      seenHeartbeat_(static_cast<size_t>(options.size), 0),
      heartbeatChanged_(static_cast<size_t>(options.size), Clock::now()) {
  for (auto& idle : coreIdle_) idle.store(kIdleUnknown, std::memory_order_relaxed);
  slotsOffset_ = alignUp(sizeof(Header), 64) + sizeof(RankControl) * static_cast<size_t>(size_);
  slotsOffset_ = alignUp(slotsOffset_, kAlign);
  channelStride_ = alignUp(sizeof(ChannelHeader), 64) + 2 * chunkBytes_;
  channelsOffset_ = alignUp(slotsOffset_ + 2 * slotBytes_ * static_cast<size_t>(size_), kAlign);
  bytes_ = alignUp(channelsOffset_ + channelStride_ * static_cast<size_t>(size_) * static_cast<size_t>(size_), kAlign);

  const std::string key = "shm/segment";
  const auto deadline = Clock::now() + options.timeout;
  const auto remaining = [&] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::max(Clock::duration(0), deadline - Clock::now()));
  };
  if (rank_ == 0) {
    std::random_device rd;
    const uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    objectName_ = str("/dtrain-", runIdForNames(), "-", safeNameComponent(options.name), "-", std::hex, nonce);
    const int fd = ::shm_open(objectName_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      throw BackendError(str("shm: cannot create shared memory ", objectName_, ": ", std::strerror(errno),
                             " (is /dev/shm mounted and writable?)"));
    }
    try {
      map(fd, true);
    } catch (...) {
      ::shm_unlink(objectName_.c_str());
      throw;
    }
    store->set(key, objectName_);
  } else {
    store->wait({key}, remaining());
    objectName_ = store->get(key);
    const int fd = ::shm_open(objectName_.c_str(), O_RDWR, 0600);
    if (fd < 0) {
      throw BackendError(str("shm: rank ", rank_, " cannot open shared memory ", objectName_, " of rank 0: ",
                             std::strerror(errno), ". Are all ranks of the group on one host (same /dev/shm)?"));
    }
    map(fd, false);
  }
  RankControl& me = control(rank_);
  me.pid = static_cast<int32_t>(::getpid());
  me.pidNamespace = myPidNamespace_;
  me.heartbeat.store(1);
  // The last rank to map the object unlinks its name: from then on it lives
  // exactly as long as the mappings, and a crash leaves nothing behind.
  if (store->add("shm/mapped", 1) == size_) {
    ::shm_unlink(objectName_.c_str());
    store->set("shm/all-mapped", "1");
  }
  try {
    store->wait({"shm/all-mapped"}, remaining());
  } catch (const TimeoutError&) {
    ::shm_unlink(objectName_.c_str());  // nobody else will
    const int64_t count = store->add("shm/mapped", 0);
    ::munmap(base_, bytes_);
    base_ = nullptr;
    throw TimeoutError(str("shm: only ", count, " of ", size_, " ranks mapped the group's shared memory ", objectName_,
                           " within ", formatDuration(options.timeout),
                           "; are the others running, and on this host?"));
  }
  heartbeatThread_ = std::thread([this] {
    setThreadName("dt-shm-beat");
    heartbeatLoop();
  });
}

ShmSegment::~ShmSegment() {
  {
    std::lock_guard<std::mutex> lock(stopMutex_);
    stopping_ = true;
  }
  stopWake_.notify_all();
  if (heartbeatThread_.joinable()) heartbeatThread_.join();
  if (base_ != nullptr) ::munmap(base_, bytes_);
}

void ShmSegment::map(int fd, bool create) {
  if (create && ::ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
    const int err = errno;
    ::close(fd);
    throw BackendError(str("shm: cannot size shared memory ", objectName_, " to ", bytes_, " bytes: ",
                           std::strerror(err), " (is /dev/shm large enough?)"));
  }
  void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    throw BackendError(str("shm: cannot map shared memory ", objectName_, " (", bytes_, " bytes): ", std::strerror(err)));
  }
  base_ = static_cast<uint8_t*>(p);
  Header& h = header();
  if (create) {
    // The object is zero-filled; atomics at zero are valid as they are.
    new (&h) Header{kMagic, kVersion, static_cast<uint32_t>(size_), slotBytes_, chunkBytes_, bytes_, {}};
    for (int r = 0; r < size_; ++r) new (&control(r)) RankControl();
    for (int s = 0; s < size_; ++s) {
      for (int d = 0; d < size_; ++d) new (&channel(s, d)) ChannelHeader();
    }
  } else if (h.magic != kMagic || h.version != kVersion || h.worldSize != static_cast<uint32_t>(size_) ||
             h.slotBytes != slotBytes_ || h.totalBytes != bytes_) {
    throw BackendError(str("shm: shared memory ", objectName_, " has another layout (world ", h.worldSize,
                           ", slot ", h.slotBytes, " bytes) than this rank expects (world ", size_, ", slot ",
                           slotBytes_, " bytes): every rank must use the same dtrain and the same shm settings"));
  }
}

ShmSegment::Header& ShmSegment::header() const { return *reinterpret_cast<Header*>(base_); }

RankControl& ShmSegment::control(int r) const {
  return reinterpret_cast<RankControl*>(base_ + alignUp(sizeof(Header), 64))[r];
}

uint8_t* ShmSegment::slot(int r, int parity) const {
  return base_ + slotsOffset_ + (static_cast<size_t>(r) * 2 + static_cast<size_t>(parity)) * slotBytes_;
}

ChannelHeader& ShmSegment::channel(int src, int dst) const {
  return *reinterpret_cast<ChannelHeader*>(base_ + channelsOffset_ +
                                           (static_cast<size_t>(src) * size_ + static_cast<size_t>(dst)) * channelStride_);
}

uint8_t* ShmSegment::channelChunk(int src, int dst, int index) const {
  return reinterpret_cast<uint8_t*>(&channel(src, dst)) + alignUp(sizeof(ChannelHeader), 64) +
         static_cast<size_t>(index) * chunkBytes_;
}

// ---- phases ---------------------------------------------------------------------------------------

void ShmSegment::arrive() {
  RankControl& me = control(rank_);
  ++mySteps_;
  me.cpu.store(::sched_getcpu(), std::memory_order_relaxed);
  me.step.store(mySteps_, std::memory_order_seq_cst);
  if (me.sleepers.load(std::memory_order_seq_cst) != 0) {
    futexWake(&me.step);
    wokeSleepersAt_ = Clock::now();
    wokeSleepersAtStep_ = mySteps_;
  }
}

void ShmSegment::enterCollective() { control(rank_).state.fetch_or(kInCollective, std::memory_order_relaxed); }

void ShmSegment::leaveCollective() { control(rank_).state.fetch_and(~kInCollective, std::memory_order_relaxed); }

void ShmSegment::waitForAll(Clock::time_point deadline) {
  // Peers that last ran on this core first: they cannot run until this
  // thread gets off it, which waiting for them does at once.
  const int here = ::sched_getcpu();
  for (int r = 0; r < size_; ++r) {
    if (r != rank_ && control(r).cpu.load(std::memory_order_relaxed) == here) waitFor(r, deadline);
  }
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) waitFor(r, deadline);
  }
}

void ShmSegment::waitFor(int r, Clock::time_point deadline) {
  const uint32_t target = mySteps_;
  RankControl& peer = control(r);
  if (!reached(peer.step.load(std::memory_order_acquire), target)) {
    waitSlow(r, target, deadline);
    // Whatever waitSlow saw the step with, this acquire load pairs with the
    // peer's release of it (steps only grow), so its data is visible here.
    // (A load rather than a fence: ThreadSanitizer understands loads.)
    (void)peer.step.load(std::memory_order_acquire);
  }
}

ShmSegment::WaitStats ShmSegment::waitStats() const {
  return WaitStats{spun_.load(std::memory_order_relaxed), slept_.load(std::memory_order_relaxed),
                   forCoreMate_.load(std::memory_order_relaxed), steppedAside_.load(std::memory_order_relaxed),
                   spunForWaking_.load(std::memory_order_relaxed), sleptForWoken_.load(std::memory_order_relaxed),
                   spunOnOwnCore_.load(std::memory_order_relaxed), sleptForCoreMate_.load(std::memory_order_relaxed)};
}

bool ShmSegment::stepAside(int here) {
  matesInARow_ = 0;
  const auto now = Clock::now();
  if (!stepAsideBackoff_.due(now)) return false;
  cpu_set_t allowed;
  if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0) {
    stepAsideBackoff_.refused(now);
    return false;
  }
  std::vector<int> taken;
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) taken.push_back(control(r).cpu.load(std::memory_order_relaxed));
  }
  std::vector<uint8_t> idle(coreIdle_.size());
  for (size_t c = 0; c < idle.size(); ++c) idle[c] = coreIdle_[c].load(std::memory_order_relaxed);
  const bool acceptBusyCore = switchCost_.expensive();
  switchCost_.reset();
  const int core = chooseStepAsideCore(allowed, here, taken, idle, kMinIdlePercent, acceptBusyCore);
  if (core >= 0 && moveCallingThreadTo(core)) {
    control(rank_).cpu.store(core, std::memory_order_relaxed);
    steppedAside_.fetch_add(1, std::memory_order_relaxed);
    stepAsideBackoff_.moved(now);
    return true;
  }
  stepAsideBackoff_.refused(now);
  return false;
}

// A rank of the group other than this one that last ran on `here` and is
// not asleep in a wait: it is runnable but cannot run while this thread
// holds the core. -1 if none.
int ShmSegment::awakeRankOnCore(int here) const {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const RankControl& c = control(r);
    if (c.cpu.load(std::memory_order_relaxed) == here && (c.state.load(std::memory_order_relaxed) & kAsleep) == 0) {
      return r;
    }
  }
  return -1;
}

// Yields the core to the ranks of the group that share it until rank r
// reaches `target`, this thread runs on a core no awake rank of the group
// needs, or it gives up (the caller sleeps).
MateWait ShmSegment::yieldToMate(int r, uint32_t target, int here) {
  const RankControl& peer = control(r);
  const auto start = Clock::now();
  if (foreignSlices_.sleepInstead(start)) return MateWait::kGaveUp;
  auto now = start;
  while (true) {
    const auto before = now;
    control(rank_).yieldedAtNs.store(sinceEpochNs(before), std::memory_order_relaxed);
    ::sched_yield();
    now = Clock::now();
    timeSwitch(before, now);
    YieldCheck check;
    check.peerReached = reached(peer.step.load(std::memory_order_acquire), target);
    check.yieldTook = now - before;
    check.yielding = now - start;
    check.movedOffCore = ::sched_getcpu() != here;
    check.coreStillNeededByGroup =
        peer.cpu.load(std::memory_order_relaxed) == here || awakeRankOnCore(here) >= 0;
    const MateWait outcome = afterYield(check);
    if (outcome == MateWait::kYieldAgain) continue;
    if (outcome == MateWait::kGaveUp && check.yieldTook > kForeignSlice) foreignSlices_.longYield(now);
    return outcome;
  }
}

// The core came back to this thread after a rank of the group had yielded it (or gone to sleep
// for a core mate), later than this thread handed it over: from then to now is one switch.
void ShmSegment::timeSwitch(Clock::time_point yielded, Clock::time_point back) {
  int64_t latest = 0;
  for (int q = 0; q < size_; ++q) {
    if (q != rank_) latest = std::max(latest, control(q).yieldedAtNs.load(std::memory_order_relaxed));
  }
  if (latest > sinceEpochNs(yielded)) switchCost_.record(back - Clock::time_point(std::chrono::nanoseconds(latest)));
}

// Spins while rank r works towards `target` on another core (true: it got there), and gives up
// when a rank of the group needs this core or after the spin bounds below.
bool ShmSegment::spinFor(int r, uint32_t target, int here) {
  const RankControl& peer = control(r);
  const auto spinStart = Clock::now();
  while (true) {
    for (int i = 0; i < kSpinsPerCheck; ++i) {
      DT_CPU_RELAX();
      if (reached(peer.step.load(std::memory_order_acquire), target)) return true;
    }
    const auto now = Clock::now();
    const uint32_t state = peer.state.load(std::memory_order_relaxed);
    SpinCheck check;
    check.coreNeededByGroup = peer.cpu.load(std::memory_order_relaxed) == here || awakeRankOnCore(here) >= 0;
    check.spinning = now - spinStart;
    check.peerInCollective = (state & kInCollective) != 0;
    check.peerAsleep = (state & kAsleep) != 0;
    if (wokeSleepersAt_ != Clock::time_point{}) check.sinceWokeSleepers = now - wokeSleepersAt_;
    if (!keepSpinning(check)) return false;
  }
}

void ShmSegment::waitSlow(int r, uint32_t target, Clock::time_point deadline) {
  RankControl& peer = control(r);
  int here = ::sched_getcpu();
  control(rank_).cpu.store(here, std::memory_order_relaxed);
  // Spin only while no rank of the group needs this core. The awaited peer,
  // or any other awake rank, that last ran here cannot run while this thread
  // holds the core, and spinning would only keep it off: that was the 100x
  // cliff of ranks sharing a core. Yielding instead would hand the core to
  // any busy process for a whole time slice; sleeping lets the scheduler run
  // the rank here or move one of the two to an idle core.
  const int mate = peer.cpu.load(std::memory_order_relaxed) == here ? r : awakeRankOnCore(here);
  bool sleepsForMate = false;
  if (mate >= 0) {
    forCoreMate_.fetch_add(1, std::memory_order_relaxed);
    const auto mateAsleep = [&] { return (control(mate).state.load(std::memory_order_relaxed) & kAsleep) != 0; };
    const bool steppedAside =
        ++matesInARow_ >= kStackedWaits && mayStepAside(rank_, mate, mateAsleep()) && stepAside(here);
    const ThenWait next = afterMateWait(steppedAside ? MateWait::kOwnCore : yieldToMate(r, target, here));
    if (next == ThenWait::kDone) return;
    sleepsForMate = next == ThenWait::kSleep;
    if (sleepsForMate) sleptForCoreMate_.fetch_add(1, std::memory_order_relaxed);
    if (next == ThenWait::kSpinOnOwnCore) {
      // On a core of its own now (it stepped aside, the scheduler moved it, or its mate left).
      here = ::sched_getcpu();
      control(rank_).cpu.store(here, std::memory_order_relaxed);
      if (spinFor(r, target, here)) {
        spunOnOwnCore_.fetch_add(1, std::memory_order_relaxed);
        matesInARow_ = 0;
        switchCost_.reset();
        return;
      }
    }
  } else {
    const bool peerWasAsleep = (peer.state.load(std::memory_order_relaxed) & kAsleep) != 0;
    if (spinFor(r, target, here)) {
      spun_.fetch_add(1, std::memory_order_relaxed);
      if (peerWasAsleep) spunForWaking_.fetch_add(1, std::memory_order_relaxed);
      matesInARow_ = 0;
      switchCost_.reset();
      return;
    }
    slept_.fetch_add(1, std::memory_order_relaxed);
    if (peerWasAsleep && wokeSleepersAtStep_ == target) sleptForWoken_.fetch_add(1, std::memory_order_relaxed);
  }
  // Sleep on the peer's word, checking the deadline, the abort word and
  // the peer's health between slices. Going to sleep hands the core to a mate
  // as a yield does, and is timed the same way: where a rank sleeps for its
  // mate (a busy process took the core on a yield) and the mate yields, the
  // mate's only switches are these.
  RankControl& me = control(rank_);
  const auto sleptAt = Clock::now();
  if (sleepsForMate) me.yieldedAtNs.store(sinceEpochNs(sleptAt), std::memory_order_relaxed);
  me.state.fetch_or(kAsleep, std::memory_order_relaxed);
  struct Awake {
    RankControl& me;
    ~Awake() { me.state.fetch_and(~kAsleep, std::memory_order_relaxed); }
  } awake{me};
  auto nextHealthCheck = sleptAt + kHealthCheckEvery;
  while (true) {
    const uint32_t seen = peer.step.load(std::memory_order_acquire);
    if (reached(seen, target)) {
      if (sleepsForMate) timeSwitch(sleptAt, Clock::now());
      return;
    }
    checkAbort();
    const auto now = Clock::now();
    if (now >= nextHealthCheck) {
      checkPeer(r);
      nextHealthCheck = now + kHealthCheckEvery;
    }
    if (now >= deadline) {
      throw TransportTimeout(str("waited for rank ", r, " at phase ", target, "; it is at phase ", seen));
    }
    peer.sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!reached(peer.step.load(std::memory_order_seq_cst), target)) {
      futexWait(&peer.step, seen, std::chrono::milliseconds(10));
    }
    peer.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

// ---- doorbells ------------------------------------------------------------------------------------

void ShmSegment::ring(int r) {
  RankControl& c = control(r);
  c.doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (c.doorbellSleepers.load(std::memory_order_seq_cst) != 0) futexWake(&c.doorbell);
}

uint32_t ShmSegment::doorbell() const { return control(rank_).doorbell.load(std::memory_order_acquire); }

void ShmSegment::waitDoorbell(uint32_t seen, Clock::time_point until) {
  RankControl& me = control(rank_);
  const auto now = Clock::now();
  if (now >= until) return;
  me.doorbellSleepers.fetch_add(1, std::memory_order_seq_cst);
  if (me.doorbell.load(std::memory_order_seq_cst) == seen && header().abortedBy.load() == 0) {
    futexWait(&me.doorbell, seen, std::chrono::duration_cast<std::chrono::microseconds>(until - now));
  }
  me.doorbellSleepers.fetch_sub(1, std::memory_order_seq_cst);
}

// ---- failure ----------------------------------------------------------------------------------------

void ShmSegment::abort(int byRank) {
  if (base_ == nullptr) return;
  uint32_t expected = 0;
  header().abortedBy.compare_exchange_strong(expected, static_cast<uint32_t>(byRank) + 1);
  // Wake everyone sleeping anywhere: they re-check the abort word.
  for (int r = 0; r < size_; ++r) {
    futexWake(&control(r).step);
    futexWake(&control(r).doorbell);
  }
}

uint32_t ShmSegment::abortedBy() const { return header().abortedBy.load(std::memory_order_acquire); }

void ShmSegment::checkAbort() const {
  const uint32_t by = abortedBy();
  if (by == 0) return;
  // Usually a peer aborted because another one died: name the dead directly.
  std::vector<int> gone;
  std::string why;
  for (int p = 0; p < size_; ++p) {
    std::string reason;
    if (p != rank_ && peerDead(p, &reason)) {
      gone.push_back(p);
      if (why.empty()) why = reason;
    }
  }
  if (!gone.empty()) throw PeerLost(why, gone);
  const int r = static_cast<int>(by) - 1;
  if (r == rank_) throw PeerLost("this rank aborted the group's transfers after a failure");
  throw PeerLost(str("rank ", r, " aborted the group's transfers after a failure of its own"));
}

bool ShmSegment::peerDead(int r, std::string* why) const {
  const RankControl& peer = control(r);
  const int32_t pid = peer.pid;
  if (pid > 0 && pid != ::getpid() && peer.pidNamespace == myPidNamespace_ && myPidNamespace_ != 0) {
    if ((::kill(pid, 0) != 0 && errno == ESRCH) || isZombie(pid)) {
      *why = str("rank ", r, " (pid ", pid, ") exited");
      return true;
    }
  }
  const uint64_t beat = peer.heartbeat.load(std::memory_order_acquire);
  std::lock_guard<std::mutex> lock(heartbeatMutex_);
  const auto now = Clock::now();
  if (beat != seenHeartbeat_[r]) {
    seenHeartbeat_[r] = beat;
    heartbeatChanged_[r] = now;
    return false;
  }
  if (now - heartbeatChanged_[r] > heartbeatTimeout_) {
    *why = str("rank ", r, " (pid ", pid, ") stopped its heartbeat ",
               std::chrono::duration_cast<std::chrono::milliseconds>(now - heartbeatChanged_[r]).count(),
               " ms ago (frozen or hung)");
    return true;
  }
  return false;
}

void ShmSegment::checkPeer(int r) const {
  checkAbort();
  std::string why;
  if (peerDead(r, &why)) throw PeerLost(why, {r});
}

void ShmSegment::heartbeatLoop() {
  CoreIdleSampler sampler;
  std::vector<int> groupCoresBefore;
  std::unique_lock<std::mutex> lock(stopMutex_);
  while (!stopping_) {
    control(rank_).heartbeat.fetch_add(1, std::memory_order_release);
    if (size_ > 1) {
      auto idle = sampler.sample();
      std::vector<int> groupCores(size_);
      for (int r = 0; r < size_; ++r) groupCores[r] = control(r).cpu.load(std::memory_order_relaxed);
      forgetSharesOfGroupCores(idle, groupCoresBefore, groupCores);
      groupCoresBefore = std::move(groupCores);
      for (size_t c = 0; c < idle.size() && c < coreIdle_.size(); ++c) {
        coreIdle_[c].store(idle[c], std::memory_order_relaxed);
      }
    }
    stopWake_.wait_for(lock, heartbeatInterval_, [&] { return stopping_; });
  }
}

}  // namespace dt::shm
