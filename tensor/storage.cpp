#include "tensor/storage.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <cstdlib>
#include <mutex>
#include <pthread.h>
#include <sys/mman.h>
#include <new>
#include <unordered_map>
#include <vector>

#include "common/errors.h"
#include "common/strings.h"
#include "common/config.h"
#include "tensor/profiler.h"
#if DT_HAVE_CUDA
#include "tensor/cuda/cuda.h"
#endif

namespace dt {

DataPtr& DataPtr::operator=(DataPtr&& other) noexcept {
  if (this != &other) {
    reset();
    ptr_ = other.ptr_;
    context_ = other.context_;
    deleter_ = other.deleter_;
    device_ = other.device_;
    other.ptr_ = nullptr;
    other.context_ = nullptr;
    other.deleter_ = nullptr;
  }
  return *this;
}

void DataPtr::reset() {
  if (deleter_ != nullptr) deleter_(context_, ptr_);
  ptr_ = nullptr;
  context_ = nullptr;
  deleter_ = nullptr;
}

namespace {

constexpr size_t kCpuAlignment = 64;
constexpr size_t kPageBytes = 4096;
// Blocks at least this big are mapped from the OS directly (not through
// malloc), cached on free and reused for the next request of the same rounded
// size. Training loops allocate the same shapes every step (activations,
// gradients); handing those pages back to the OS and faulting them in again
// costs more than the arithmetic on them. Mapping them ourselves means that a
// block the cache lets go is returned to the OS at once: malloc would keep it
// (its heap only shrinks from the top, and each large free raises its mmap
// threshold so the next ones land in that heap too), and the process's
// resident set would stay above what it uses.
constexpr size_t kHugePageBytes = size_t{2} << 20;
constexpr size_t kCacheMinBytes = 64 * 1024;
constexpr size_t kCacheMaxBytes = size_t{512} << 20;  // idle bytes kept at most

// Always-on counters. The live total is one shared atomic (the peak needs it);
// the cumulative counts are per thread, each written by its thread alone with
// plain (unlocked) relaxed stores and summed when read, so that counting costs
// one locked add per allocation and one per free.
struct ThreadCounters {
  std::atomic<uint64_t> totalBytes{0};
  std::atomic<uint64_t> allocations{0};
  std::atomic<uint64_t> frees{0};

  static void bump(std::atomic<uint64_t>& counter, uint64_t by) {
    counter.store(counter.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  }
};

class Counters {
 public:
  void onAllocate(size_t bytes) {
    ThreadCounters& mine = threadCounters();
    ThreadCounters::bump(mine.totalBytes, bytes);
    ThreadCounters::bump(mine.allocations, 1);
    const size_t now = allocatedBytes_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    size_t peak = peakBytes_.load(std::memory_order_relaxed);
    while (now > peak && !peakBytes_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  void onFree(size_t bytes) {
    ThreadCounters::bump(threadCounters().frees, 1);
    allocatedBytes_.fetch_sub(bytes, std::memory_order_relaxed);
  }

  void lockForFork() { threadsMutex_.lock(); }
  void unlockAfterFork() { threadsMutex_.unlock(); }
  size_t allocatedBytes() const { return allocatedBytes_.load(std::memory_order_relaxed); }
  size_t peakBytes() const { return peakBytes_.load(std::memory_order_relaxed); }
  void resetPeak() { peakBytes_.store(allocatedBytes(), std::memory_order_relaxed); }
  struct Sums {
    uint64_t totalBytes = 0, allocations = 0, frees = 0;
  };
  Sums sums() {
    Sums out;
    std::lock_guard lock(threadsMutex_);
    for (const ThreadCounters* t : threads_) {
      out.totalBytes += t->totalBytes.load(std::memory_order_relaxed);
      out.allocations += t->allocations.load(std::memory_order_relaxed);
      out.frees += t->frees.load(std::memory_order_relaxed);
    }
    return out;
  }

 private:
  ThreadCounters& threadCounters() {
    // A plain pointer (no TLS destructor): frees may run during thread exit.
    thread_local ThreadCounters* mine = nullptr;
    if (mine == nullptr) [[unlikely]] {
      // Kept after the thread ends: its counts stay part of the sums.
      mine = new ThreadCounters();
      std::lock_guard lock(threadsMutex_);
      threads_.push_back(mine);
    }
    return *mine;
  }

  std::atomic<size_t> allocatedBytes_{0};
  std::atomic<size_t> peakBytes_{0};
  std::mutex threadsMutex_;
  std::vector<ThreadCounters*> threads_;
};

class CpuAllocator final : public Allocator {
 public:
  DataPtr allocate(size_t bytes) override {
    const size_t rounded = roundSize(bytes);
    if (rounded >= kCacheMinBytes) return allocateLarge(rounded, bytes);
    void* p = std::aligned_alloc(kCpuAlignment, rounded);
    if (p == nullptr) {
      emptyCache();
      p = std::aligned_alloc(kCpuAlignment, rounded);
    }
    if (p == nullptr) throw Error(str("cpu allocator: out of memory allocating ", bytes, " bytes"));
    counters_.onAllocate(rounded);
    if (profiler::profilingMemory()) [[unlikely]] {
      std::lock_guard lock(mu_);
      listedSmall_[p] = {rounded, profiler::currentOp()};
      return DataPtr(p, this, &CpuAllocator::freeListedSmall, Device::cpu());
    }
    // The block's size rides in the deleter's context: small frees need no lookup.
    return DataPtr(p, reinterpret_cast<void*>(rounded), &CpuAllocator::freeSmall, Device::cpu());
  }
  DeviceType deviceType() const override { return DeviceType::CPU; }

  MemoryStats stats(Device device) override {
    MemoryStats s;
    s.device = device;
    s.allocatedBytes = counters_.allocatedBytes();
    s.peakAllocatedBytes = std::max(s.allocatedBytes, counters_.peakBytes());
    const Counters::Sums sums = counters_.sums();
    s.totalAllocatedBytes = sums.totalBytes;
    s.allocations = sums.allocations;
    s.frees = sums.frees;
    s.reservedBytes = s.allocatedBytes + cachedBytes();
    for (const MemoryBlock& block : snapshot(device).blocks) {
      if (s.largestLiveBlocks.size() == 8) break;
      s.largestLiveBlocks.push_back(block.bytes);
    }
    return s;
  }
  void resetPeakStats(Device) override {
    counters_.resetPeak();
  }
  MemorySnapshot snapshot(Device device) override {
    MemorySnapshot snap;
    snap.device = device;
    size_t listedBytes = 0;
    {
      std::lock_guard lock(mu_);
      for (const auto& [p, op] : liveOps_) {
        snap.blocks.push_back({p, sizes_.at(p), op != nullptr ? op : ""});
      }
      for (const auto& [p, block] : listedSmall_) {
        snap.blocks.push_back({p, block.bytes, block.op != nullptr ? block.op : ""});
      }
    }
    for (const MemoryBlock& b : snap.blocks) listedBytes += b.bytes;
    std::sort(snap.blocks.begin(), snap.blocks.end(),
              [](const MemoryBlock& a, const MemoryBlock& b) { return a.bytes > b.bytes; });
    const Counters::Sums sums = counters_.sums();
    const uint64_t live = sums.allocations - sums.frees;
    const size_t liveBytes = counters_.allocatedBytes();
    // Other threads may allocate between the reads above: never report a negative remainder.
    snap.unlistedBlocks = live > snap.blocks.size() ? live - snap.blocks.size() : 0;
    snap.unlistedBytes = liveBytes > listedBytes ? liveBytes - listedBytes : 0;
    return snap;
  }

  void emptyCache() {
    std::lock_guard lock(mu_);
    while (cachedBytes_ > 0) evictOldestIdle();
    cache_.clear();
    highWater_ = liveLarge_;
  }
  void lockForFork() {
    mu_.lock();
    counters_.lockForFork();
  }
  void unlockAfterFork() {
    counters_.unlockAfterFork();
    mu_.unlock();
  }
  size_t cachedBytes() {
    std::lock_guard lock(mu_);
    return cachedBytes_;
  }

 private:
  struct SmallBlock {
    size_t bytes = 0;
    const char* op = nullptr;
  };

  static size_t roundSize(size_t bytes) {
    // Never hand out null, even for 0 bytes; big blocks round to pages so sizes repeat.
    const size_t unit = bytes >= kHugePageBytes ? kHugePageBytes : bytes >= kCacheMinBytes ? kPageBytes : kCpuAlignment;
    const size_t r = (bytes + unit - 1) / unit * unit;
    return r == 0 ? kCpuAlignment : r;
  }
  // A block of kCacheMinBytes and more: an idle cached one of the same size, else a new mapping.
  DataPtr allocateLarge(size_t rounded, size_t requested) {
    std::lock_guard lock(mu_);
    void* p = nullptr;
    auto it = cache_.find(rounded);
    if (it != cache_.end() && !it->second.empty()) {
      p = it->second.back().block;  // the most recently used: its pages are the likeliest in cache
      it->second.pop_back();
      cachedBytes_ -= rounded;
    } else {
      // New memory. Idle blocks are kept only while live and idle together stay within the
      // most this process has had live at once (since start or emptyCpuCache()): the oldest
      // idle ones go back to the OS first, so that the cache never raises the resident set
      // above the live high-water mark.
      highWater_ = std::max(highWater_, liveLarge_ + rounded);
      while (cachedBytes_ > 0 && liveLarge_ + cachedBytes_ + rounded > highWater_) evictOldestIdle();
      p = mapBlock(rounded);
      if (p == nullptr) {
        while (cachedBytes_ > 0) evictOldestIdle();
        p = mapBlock(rounded);
      }
      if (p == nullptr) throw Error(str("cpu allocator: out of memory allocating ", requested, " bytes"));
      sizes_[p] = rounded;
    }
    liveLarge_ += rounded;
    liveOps_[p] = profiler::currentOp();
    counters_.onAllocate(rounded);
    return DataPtr(p, this, &CpuAllocator::release, Device::cpu());
  }
  static void* mapBlock(size_t bytes) {
    if (bytes < kHugePageBytes) {
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      return p == MAP_FAILED ? nullptr : p;
    }
    // Large tensors on transparent huge pages: fewer page faults on first touch and fewer TLB
    // misses in every sweep over them (memcpy, reductions, the kernel's socket copies). The
    // mapping is over-sized by one huge page and trimmed to an aligned start. Advisory:
    // ignored where THP is off.
    const size_t span = bytes + kHugePageBytes;
    void* raw = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const auto start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    if (aligned > start) ::munmap(raw, aligned - start);
    const uintptr_t end = start + span;
    if (end > aligned + bytes) ::munmap(reinterpret_cast<void*>(aligned + bytes), end - (aligned + bytes));
    void* p = reinterpret_cast<void*>(aligned);
    ::madvise(p, bytes, MADV_HUGEPAGE);
    return p;
  }
  // Returns the block idle the longest to the OS (mu_ held, cache not empty).
  void evictOldestIdle() {
    auto oldest = cache_.end();
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
      if (!it->second.empty() && (oldest == cache_.end() || it->second.front().since < oldest->second.front().since)) {
        oldest = it;
      }
    }
    void* p = oldest->second.front().block;
    oldest->second.pop_front();
    cachedBytes_ -= oldest->first;
    sizes_.erase(p);
    ::munmap(p, oldest->first);
  }
  static CpuAllocator& instance();
  static void freeSmall(void* size, void* ptr) {
    instance().counters_.onFree(reinterpret_cast<size_t>(size));
    std::free(ptr);
  }
  static void freeListedSmall(void* ctx, void* ptr) { static_cast<CpuAllocator*>(ctx)->unlistSmall(ptr); }
  static void release(void* ctx, void* ptr) { static_cast<CpuAllocator*>(ctx)->cacheBlock(ptr); }
  void unlistSmall(void* p) {
    size_t bytes = 0;
    {
      std::lock_guard lock(mu_);
      auto it = listedSmall_.find(p);
      bytes = it->second.bytes;
      listedSmall_.erase(it);
    }
    counters_.onFree(bytes);
    std::free(p);
  }
  void cacheBlock(void* p) {
    std::lock_guard lock(mu_);
    const size_t size = sizes_.at(p);
    counters_.onFree(size);
    liveOps_.erase(p);
    liveLarge_ -= size;
    if (cachedBytes_ + size > kCacheMaxBytes) {
      sizes_.erase(p);
      ::munmap(p, size);
      return;
    }
    cache_[size].push_back({p, ++idleClock_});
    cachedBytes_ += size;
  }

  Counters counters_;
  std::mutex mu_;
  struct IdleBlock {
    void* block = nullptr;
    uint64_t since = 0;  // idleClock_ when it was cached
  };
  // Idle blocks by size, oldest first.
  std::unordered_map<size_t, std::deque<IdleBlock>> cache_;
  uint64_t idleClock_ = 0;
  std::unordered_map<void*, size_t> sizes_;  // every block of kCacheMinBytes and more, live or cached
  // Live blocks of kCacheMinBytes and more -> the op that made them (nullptr when none was profiled).
  std::unordered_map<void*, const char*> liveOps_;
  // Small blocks made while a profiler recorded.
  std::unordered_map<void*, SmallBlock> listedSmall_;
  size_t cachedBytes_ = 0;
  size_t liveLarge_ = 0;  // live blocks of kCacheMinBytes and more
  size_t highWater_ = 0;  // the most liveLarge_ has been since start or emptyCache()
};

CpuAllocator& cpuAllocator() {
  // Leaked on purpose: tensors in static objects may be freed after main returns.
  static CpuAllocator* instance = [] {
    auto* a = new CpuAllocator();
    // Keep the cache lock consistent across fork (a child must not inherit it held).
    pthread_atfork([] { cpuAllocator().lockForFork(); }, [] { cpuAllocator().unlockAfterFork(); },
                   [] { cpuAllocator().unlockAfterFork(); });
    return a;
  }();
  return *instance;
}

CpuAllocator& CpuAllocator::instance() { return cpuAllocator(); }

std::array<std::atomic<Allocator*>, 2>& registry() {
  static std::array<std::atomic<Allocator*>, 2> table{&cpuAllocator(), nullptr};
  return table;
}

}  // namespace

Allocator& allocatorFor(Device device) {
  Allocator* a = registry()[static_cast<size_t>(device.type)].load(std::memory_order_acquire);
#if DT_HAVE_CUDA
  if (a == nullptr && device.isCuda()) {
    // Installed lazily so that a CPU-only program never initialises CUDA
    // (and may fork freely).
    Allocator* expected = nullptr;
    registry()[static_cast<size_t>(device.type)].compare_exchange_strong(expected, &cuda::cudaAllocator());
    a = registry()[static_cast<size_t>(device.type)].load(std::memory_order_acquire);
  }
#endif
  if (a == nullptr) {
    throw NotSupportedError(str("no allocator for device ", device.str(),
                                ": this build of dtrain has no GPU support (tensor/cuda); use Device::cpu()"));
  }
  return *a;
}

void emptyCpuCache() { cpuAllocator().emptyCache(); }
size_t cpuCachedBytes() { return cpuAllocator().cachedBytes(); }

namespace {
NotSupportedError noStats(Device device) {
  return NotSupportedError(str("memory statistics: the allocator for ", device.str(), " does not report them"));
}
}  // namespace

MemoryStats Allocator::stats(Device device) { throw noStats(device); }
void Allocator::resetPeakStats(Device device) { throw noStats(device); }
MemorySnapshot Allocator::snapshot(Device device) { throw noStats(device); }

MemoryStats memoryStats(Device device) { return allocatorFor(device).stats(device); }
void resetPeakMemoryStats(Device device) { allocatorFor(device).resetPeakStats(device); }
MemorySnapshot memorySnapshot(Device device) { return allocatorFor(device).snapshot(device); }

void registerAllocator(DeviceType type, Allocator* allocator) {
  registry()[static_cast<size_t>(type)].store(allocator, std::memory_order_release);
}

Storage::Storage(size_t nbytes, Device device) : impl_(std::make_shared<Impl>()) {
  impl_->data = allocatorFor(device).allocateOn(device, nbytes);
  impl_->nbytes = nbytes;
}

Storage::Storage(DataPtr data, size_t nbytes) : impl_(std::make_shared<Impl>()) {
  impl_->data = std::move(data);
  impl_->nbytes = nbytes;
}

void Storage::resizeBytes(size_t nbytes) {
  if (!impl_) throw InvalidArgument("Storage::resizeBytes on an undefined storage");
  const Device device = impl_->data.device();
  // Free first, so that the peak is the larger of the two sizes, not their sum.
  impl_->data.reset();
  impl_->nbytes = 0;
  if (nbytes == 0) return;
  impl_->data = allocatorFor(device).allocateOn(device, nbytes);
  impl_->nbytes = nbytes;
}

}  // namespace dt
