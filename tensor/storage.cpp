#include "tensor/storage.h"

#include <array>
#include <atomic>
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
// Blocks at least this big are cached on free and reused for the next request of
// the same rounded size. Training loops allocate the same shapes every step
// (activations, gradients); handing those pages back to the OS and faulting
// them in again costs more than the arithmetic on them.
constexpr size_t kHugePageBytes = size_t{2} << 20;
constexpr size_t kCacheMinBytes = 64 * 1024;
constexpr size_t kCacheMaxBytes = size_t{512} << 20;  // idle bytes kept at most

class CpuAllocator final : public Allocator {
 public:
  DataPtr allocate(size_t bytes) override {
    const size_t rounded = roundSize(bytes);
    if (rounded >= kCacheMinBytes) {
      std::lock_guard lock(mu_);
      auto it = cache_.find(rounded);
      if (it != cache_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cachedBytes_ -= rounded;
        return DataPtr(p, this, &CpuAllocator::release, Device::cpu());
      }
    }
    const size_t alignment = rounded >= kHugePageBytes ? kHugePageBytes : kCpuAlignment;
    void* p = std::aligned_alloc(alignment, rounded);
    if (p == nullptr) {
      emptyCache();
      p = std::aligned_alloc(alignment, rounded);
    }
    if (p == nullptr) {
      throw Error(str("cpu allocator: out of memory allocating ", bytes, " bytes"));
    }
    // Large tensors on transparent huge pages: fewer page faults on first
    // touch and fewer TLB misses in every sweep over them (memcpy, reductions,
    // the kernel's socket copies). Advisory: ignored where THP is off.
    if (alignment == kHugePageBytes) ::madvise(p, rounded, MADV_HUGEPAGE);
    if (rounded >= kCacheMinBytes) {
      std::lock_guard lock(mu_);
      sizes_[p] = rounded;
    }
    return DataPtr(p, this, rounded >= kCacheMinBytes ? &CpuAllocator::release : &CpuAllocator::freeSmall,
                   Device::cpu());
  }
  DeviceType deviceType() const override { return DeviceType::CPU; }

  void emptyCache() {
    std::lock_guard lock(mu_);
    for (auto& [size, blocks] : cache_) {
      for (void* p : blocks) {
        sizes_.erase(p);
        std::free(p);
      }
    }
    cache_.clear();
    cachedBytes_ = 0;
  }
  void lockForFork() { mu_.lock(); }
  void unlockAfterFork() { mu_.unlock(); }
  size_t cachedBytes() {
    std::lock_guard lock(mu_);
    return cachedBytes_;
  }

 private:
  static size_t roundSize(size_t bytes) {
    // Never hand out null, even for 0 bytes; big blocks round to pages so sizes repeat.
    const size_t unit = bytes >= kHugePageBytes ? kHugePageBytes : bytes >= (size_t{1} << 20) ? 4096 : kCpuAlignment;
    const size_t r = (bytes + unit - 1) / unit * unit;
    return r == 0 ? kCpuAlignment : r;
  }
  static void freeSmall(void*, void* ptr) { std::free(ptr); }
  static void release(void* ctx, void* ptr) { static_cast<CpuAllocator*>(ctx)->cacheBlock(ptr); }
  void cacheBlock(void* p) {
    std::lock_guard lock(mu_);
    const size_t size = sizes_.at(p);
    if (cachedBytes_ + size > kCacheMaxBytes) {
      sizes_.erase(p);
      std::free(p);
      return;
    }
    cache_[size].push_back(p);
    cachedBytes_ += size;
  }

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> cache_;
  std::unordered_map<void*, size_t> sizes_;
  size_t cachedBytes_ = 0;
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

}  // namespace dt
