#include "tensor/storage.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <pthread.h>
#include <unistd.h>
#include <sys/mman.h>
#include <new>
#include <unordered_map>
#include <vector>

#include "common/errors.h"
#include "common/strings.h"
#include "common/config.h"
#include "tensor/profiler.h"
#include "tensor/cuda/caching_allocator.h"
#if DT_HAVE_CUDA
#include "tensor/cuda/cuda.h"
#endif
#include "common/sanitizers.h"
#if defined(DT_ADDRESS_SANITIZER)
#include <sanitizer/asan_interface.h>
// AddressSanitizer does not see into the segments this allocator maps itself: they are
// poisoned when mapped and each block is unpoisoned while live, so that reading past a tensor
// or into a freed (cached) block is still reported.
#define DT_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define DT_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define DT_POISON(p, n) ((void)(p), (void)(n))
#define DT_UNPOISON(p, n) ((void)(p), (void)(n))
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
// Blocks at least this big come from a block cache (tensor/cuda/caching_allocator.h, the
// CUDA allocator's core) over memory mapped from the OS directly, not from malloc. Training
// loops allocate the same shapes every step (activations, gradients); handing those pages
// back to the OS and faulting them in again costs more than the arithmetic on them, so freed
// blocks stay cached, and a cached block serves any request it fits (split, and merged with
// its free neighbours again), not only one of its own size. The cache gives idle segments
// back before it would grow past the most the process ever had live at once, so the resident
// set follows the live peak; malloc would keep freed blocks in its heap instead.
constexpr size_t kCacheMinBytes = 64 * 1024;
constexpr size_t kHugePageBytes = size_t{2} << 20;

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

// A segment for the block cache (a multiple of 2 MiB), on transparent huge pages: fewer page
// faults on first touch and fewer TLB misses in every sweep over it (memcpy, reductions, the
// kernel's socket copies). The mapping is over-sized by one huge page and trimmed to an
// aligned start. Advisory: ignored where THP is off. nullptr when the system has no memory.
void* mapSegment(size_t bytes) {
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

// The CPU block cache's raw memory: one "stream", so no use markers are ever asked for.
class MappedMemory final : public cuda::RawMemory {
 public:
  void* allocateSegment(size_t bytes) override {
    void* p = mapSegment(bytes);
    if (p != nullptr) DT_POISON(p, bytes);
    return p;
  }
  void freeSegment(void* ptr, size_t bytes) override {
    DT_UNPOISON(ptr, bytes);
    ::munmap(ptr, bytes);
  }
  DeviceMemory deviceMemory() override {
    const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    return {static_cast<size_t>(::sysconf(_SC_AVPHYS_PAGES)) * page, static_cast<size_t>(::sysconf(_SC_PHYS_PAGES)) * page};
  }
  std::unique_ptr<cuda::UseMarker> recordUse(cuda::StreamId) override { return nullptr; }
};

class CpuAllocator final : public Allocator {
 public:
  DataPtr allocate(size_t bytes) override {
    const size_t rounded = roundSize(bytes);
    if (rounded >= kCacheMinBytes) return allocateLarge(rounded);
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
      for (const auto& [p, block] : liveLarge_) {
        snap.blocks.push_back({p, block.bytes, block.op != nullptr ? block.op : ""});
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
    blocks_.emptyCache();
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
    // Idle blocks, and the rounding of live ones up to the cache's block sizes.
    return blocks_.stats().reservedBytes - liveLargeBytes_;
  }

 private:
  struct ListedBlock {
    size_t bytes = 0;
    const char* op = nullptr;
  };

  static size_t roundSize(size_t bytes) {
    // Never hand out null, even for 0 bytes; big blocks round to pages.
    const size_t unit = bytes >= kCacheMinBytes ? kPageBytes : kCpuAlignment;
    const size_t r = (bytes + unit - 1) / unit * unit;
    return r == 0 ? kCpuAlignment : r;
  }
  // A block of kCacheMinBytes and more, from the block cache (which throws when out of memory).
  DataPtr allocateLarge(size_t rounded) {
    std::lock_guard lock(mu_);
    void* p = blocks_.allocate(rounded, 0);
    DT_UNPOISON(p, rounded);  // as malloc would: kernels may touch the rounding
    liveLarge_[p] = {rounded, profiler::currentOp()};
    liveLargeBytes_ += rounded;
    counters_.onAllocate(rounded);
    return DataPtr(p, this, &CpuAllocator::release, Device::cpu());
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
    const auto it = liveLarge_.find(p);
    const size_t size = it->second.bytes;
    liveLarge_.erase(it);
    counters_.onFree(size);
    liveLargeBytes_ -= size;
    DT_POISON(p, size);
    blocks_.free(p);
  }

  Counters counters_;
  std::mutex mu_;
  MappedMemory mapped_;
  // mmap is cheap: a segment per medium request wastes nothing on rounding to a shared one.
  cuda::BlockCache blocks_{"cpu", mapped_,
                          {.shareMediumSegments = false, .boundReservedByLivePeak = true, .emptyCacheCall = "dt::emptyCpuCache()"}};
  // Live blocks of kCacheMinBytes and more, with the op that made them (nullptr when none was
  // profiled), and their sizes' sum.
  std::unordered_map<void*, ListedBlock> liveLarge_;
  size_t liveLargeBytes_ = 0;
  // Small blocks made while a profiler recorded.
  std::unordered_map<void*, ListedBlock> listedSmall_;
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
