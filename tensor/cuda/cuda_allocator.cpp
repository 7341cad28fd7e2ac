// The CUDA side of the caching allocator: BlockCache (caching_allocator.h)
// over cudaMalloc per device and over cudaHostAlloc for pinned host memory,
// the Allocators behind cudaAllocator()/pinnedHostAllocator(), recordStream
// and the asynchronous copy.
#include <cuda_runtime.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/cuda/caching_allocator.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/stream.h"

namespace dt::cuda {
namespace {

constexpr int kMaxDevices = 64;

void check(cudaError_t status, const char* what, const std::string& where) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  throw BackendError(str("CUDA ", what, " on ", where, " failed: ", cudaGetErrorString(status), " (",
                         static_cast<int>(status), ")"));
}

// The device exists on this machine; the messages match cudaAllocator's.
void requireDevice(Device device, const char* what) {
  if (!device.isCuda()) throw InvalidArgument(str(what, ": ", device.str(), " is not a CUDA device"));
  if (deviceCount() == 0) throw NotSupportedError(str(what, " on ", device.str(), ": ", unavailableReason()));
  if (device.index < 0 || device.index >= deviceCount() || device.index >= kMaxDevices) {
    throw InvalidArgument(str(what, ": device ", device.str(), " does not exist; this machine has ", deviceCount(),
                              " CUDA device(s)"));
  }
}

class EventMarker final : public UseMarker {
 public:
  explicit EventMarker(const Stream& stream) { event_.record(stream); }
  bool done() override { return event_.query(); }
  void wait() override { event_.synchronize(); }

 private:
  Event event_;
};

class DeviceRaw final : public RawMemory {
 public:
  explicit DeviceRaw(Device device) : device_(device) {}

  void* allocateSegment(size_t bytes) override {
    DeviceGuard guard(device_);
    void* ptr = nullptr;
    const cudaError_t status = cudaMalloc(&ptr, bytes);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return nullptr;
    }
    check(status, str("malloc of ", bytes, " bytes").c_str(), device_.str());
    return ptr;
  }
  void freeSegment(void* ptr, size_t) override {
    DeviceGuard guard(device_);
    check(cudaFree(ptr), "free", device_.str());
  }
  DeviceMemory deviceMemory() override {
    DeviceGuard guard(device_);
    DeviceMemory memory;
    check(cudaMemGetInfo(&memory.free, &memory.total), "memory info", device_.str());
    return memory;
  }
  std::unique_ptr<UseMarker> recordUse(StreamId stream) override {
    return std::make_unique<EventMarker>(Stream(device_, reinterpret_cast<void*>(stream)));
  }

 private:
  Device device_;
};

// A pinned block is used by copies on streams of any device, and the default
// stream's handle (null) is the same on every device, so the pinned cache
// names streams by their index in this table, from 1: its own blocks belong
// to stream 0, which no real stream has, so every copy's stream is recorded.
class PinnedStreams {
 public:
  StreamId idOf(const Stream& stream) {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < streams_.size(); ++i) {
      if (streams_[i] == stream) return i + 1;
    }
    streams_.push_back(stream);
    return streams_.size();
  }
  Stream streamOf(StreamId id) {
    std::lock_guard lock(mu_);
    return streams_.at(id - 1);
  }

 private:
  std::mutex mu_;
  std::vector<Stream> streams_;
};

constexpr StreamId kHostStream = 0;

// Page-locked memory is not a device's, but cudaHostAlloc and cudaFreeHost
// run in the calling thread's current context, and on a thread that never
// chose a device that would mean making cuda:0's. So they run on the current
// device when the process holds its context, else on the first device whose
// context it holds (a data-loading thread pins for the GPU its rank uses).
// With unified addressing the memory is pinned for every device alike.
Device deviceForHostCalls() {
  const int current = currentDevice();
  if (primaryContextActive(current)) return Device::cuda(current);
  for (int i = 0; i < deviceCount() && i < kMaxDevices; ++i) {
    if (primaryContextActive(i)) return Device::cuda(i);
  }
  return Device::cuda(current);  // no context anywhere yet: this call makes the first
}

class PinnedRaw final : public RawMemory {
 public:
  void* allocateSegment(size_t bytes) override {
    DeviceGuard guard(deviceForHostCalls());
    void* ptr = nullptr;
    const cudaError_t status = cudaHostAlloc(&ptr, bytes, cudaHostAllocDefault);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return nullptr;
    }
    check(status, str("host alloc of ", bytes, " bytes").c_str(), "pinned host memory");
    return ptr;
  }
  void freeSegment(void* ptr, size_t) override {
    DeviceGuard guard(deviceForHostCalls());
    check(cudaFreeHost(ptr), "free host", "pinned host memory");
  }
  DeviceMemory deviceMemory() override {
    const long page = sysconf(_SC_PAGESIZE);
    const long available = sysconf(_SC_AVPHYS_PAGES);
    const long total = sysconf(_SC_PHYS_PAGES);
    if (page <= 0 || available < 0 || total <= 0) throw BackendError("sysconf cannot tell the host's memory");
    return {static_cast<size_t>(available) * static_cast<size_t>(page),
            static_cast<size_t>(total) * static_cast<size_t>(page)};
  }
  std::unique_ptr<UseMarker> recordUse(StreamId stream) override {
    return std::make_unique<EventMarker>(streams.streamOf(stream));
  }

  PinnedStreams streams;
};

// The deleter of every block: a DataPtr frees from any thread, often in a
// destructor, where an exception cannot travel.
void freeBlock(void* cache, void* ptr) {
  try {
    static_cast<BlockCache*>(cache)->free(ptr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain: CUDA caching allocator: freeing %p failed: %s\n", ptr, e.what());
  }
}

struct DeviceCache {
  explicit DeviceCache(Device device) : raw(device), cache(device.str(), raw) {}
  DeviceRaw raw;
  BlockCache cache;
};

struct PinnedCache {
  PinnedCache() : cache("pinned host memory", raw) {}
  PinnedRaw raw;
  BlockCache cache;
};

std::mutex gCreateMu;
std::array<std::atomic<DeviceCache*>, kMaxDevices> gDeviceCaches{};
std::atomic<PinnedCache*> gPinnedCache{nullptr};

// Caches are never destroyed: tensors in static objects may free their blocks
// after the CUDA runtime has shut down, and the process frees it all at exit.
DeviceCache& cacheFor(Device device) {
  auto& slot = gDeviceCaches[static_cast<size_t>(device.index)];
  if (DeviceCache* cache = slot.load(std::memory_order_acquire)) return *cache;
  std::lock_guard lock(gCreateMu);
  if (slot.load(std::memory_order_relaxed) == nullptr) slot.store(new DeviceCache(device), std::memory_order_release);
  return *slot.load(std::memory_order_relaxed);
}

PinnedCache& pinnedCache() {
  if (PinnedCache* cache = gPinnedCache.load(std::memory_order_acquire)) return *cache;
  std::lock_guard lock(gCreateMu);
  if (gPinnedCache.load(std::memory_order_relaxed) == nullptr) {
    gPinnedCache.store(new PinnedCache, std::memory_order_release);
  }
  return *gPinnedCache.load(std::memory_order_relaxed);
}

StreamId idOf(const Stream& stream) { return reinterpret_cast<StreamId>(stream.handle()); }

class CachingCudaAllocator final : public Allocator {
 public:
  // The current device, when the caller does not name one.
  DataPtr allocate(size_t bytes) override {
    if (deviceCount() == 0) {
      throw NotSupportedError(str("cannot allocate ", bytes, " bytes on CUDA: ", unavailableReason()));
    }
    return allocateOn(Device::cuda(currentDevice()), bytes);
  }
  DeviceType deviceType() const override { return DeviceType::CUDA; }

  DataPtr allocateOn(Device device, size_t bytes) override {
    if (deviceCount() == 0) {
      throw NotSupportedError(str("cannot allocate ", bytes, " bytes on ", device.str(), ": ", unavailableReason()));
    }
    requireDevice(device, "allocate");
    if (bytes == 0) return DataPtr(nullptr, nullptr, nullptr, device);
    BlockCache& cache = cacheFor(device).cache;
    void* ptr = cache.allocate(bytes, idOf(currentStream(device)));
    return DataPtr(ptr, &cache, &freeBlock, device);
  }

  MemoryStats stats(Device device) override {
    requireDevice(device, "memory statistics");
    return cacheFor(device).cache.memoryStats(device);
  }
  void resetPeakStats(Device device) override {
    requireDevice(device, "reset peak memory statistics");
    cacheFor(device).cache.resetPeakStats();
  }
  MemorySnapshot snapshot(Device device) override {
    requireDevice(device, "memory snapshot");
    return cacheFor(device).cache.memorySnapshot(device);
  }
};

class PinnedHostAllocator final : public Allocator {
 public:
  DataPtr allocate(size_t bytes) override {
    if (deviceCount() == 0) {
      throw NotSupportedError(str("cannot allocate ", bytes, " bytes of pinned host memory: ", unavailableReason()));
    }
    if (bytes == 0) return DataPtr(nullptr, nullptr, nullptr, Device::cpu());
    BlockCache& cache = pinnedCache().cache;
    return DataPtr(cache.allocate(bytes, kHostStream), &cache, &freeBlock, Device::cpu());
  }
  DeviceType deviceType() const override { return DeviceType::CPU; }
  MemoryStats stats(Device device) override { return pinnedCache().cache.memoryStats(device); }
  void resetPeakStats(Device) override { pinnedCache().cache.resetPeakStats(); }
  MemorySnapshot snapshot(Device device) override { return pinnedCache().cache.memorySnapshot(device); }
};

bool pinnedCacheOwns(const void* ptr) {
  PinnedCache* cache = gPinnedCache.load(std::memory_order_acquire);
  return cache != nullptr && cache->cache.owns(ptr);
}

// Page-locked host memory (ours or registered by someone else): a copy from
// or to it may run while the host goes on. A runtime call: the caller's
// device guard must already be in place (on a thread without a context the
// query would otherwise make cuda:0's).
bool isPinnedHost(const void* ptr) {
  if (pinnedCacheOwns(ptr)) return true;
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, ptr);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

}  // namespace

Allocator& cudaAllocator() {
  static CachingCudaAllocator allocator;
  return allocator;
}

Allocator& pinnedHostAllocator() {
  static PinnedHostAllocator allocator;
  return allocator;
}

void emptyCache() {
  for (auto& slot : gDeviceCaches) {
    if (DeviceCache* cache = slot.load(std::memory_order_acquire)) cache->cache.emptyCache();
  }
  if (PinnedCache* cache = gPinnedCache.load(std::memory_order_acquire)) cache->cache.emptyCache();
}

CacheStats cacheStats(Device device) {
  requireDevice(device, "cacheStats");
  return cacheFor(device).cache.stats();
}

CacheSnapshot cacheSnapshot(Device device) {
  requireDevice(device, "cacheSnapshot");
  return cacheFor(device).cache.snapshot();
}

CacheStats pinnedCacheStats() { return pinnedCache().cache.stats(); }
CacheSnapshot pinnedCacheSnapshot() { return pinnedCache().cache.snapshot(); }

void recordStream(const Storage& storage, const Stream& stream) {
  if (!storage.defined()) throw InvalidArgument("recordStream: the storage is undefined");
  if (storage.data() == nullptr) return;  // zero bytes: nothing to protect
  const Device device = storage.device();
  if (device.isCuda()) {
    if (stream.device() != device) {
      throw InvalidArgument(str("recordStream: the storage is on ", device.str(), ", the stream ", stream.str(),
                                " on another device; record a stream of the storage's device"));
    }
    requireDevice(device, "recordStream");
    cacheFor(device).cache.recordStream(storage.data(), idOf(stream));
    return;
  }
  if (!pinnedCacheOwns(storage.data())) {
    throw InvalidArgument(str("recordStream: the storage at ", storage.data(),
                              " on cpu is not pinned memory from dt::cuda::pinnedHostAllocator() (pageable memory "
                              "needs no recording: copies from and to it are synchronous)"));
  }
  PinnedCache& pinned = pinnedCache();
  pinned.cache.recordStream(storage.data(), pinned.raw.streams.idOf(stream));
}

void copyBytesAsync(void* dst, Device dstDevice, const void* src, Device srcDevice, size_t bytes,
                    const Stream& stream) {
  if (bytes == 0) return;
  if (dstDevice.isCpu() && srcDevice.isCpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  if (deviceCount() == 0) {
    throw NotSupportedError(str("cannot copy to ", dstDevice.str(), " from ", srcDevice.str(), ": ",
                                unavailableReason()));
  }
  if (stream.device() != dstDevice && stream.device() != srcDevice) {
    throw InvalidArgument(str("copyBytesAsync to ", dstDevice.str(), " from ", srcDevice.str(), " on stream ",
                              stream.str(), ": the stream must belong to one of the two devices"));
  }
  requireDevice(stream.device(), "copyBytesAsync");
  const void* host = dstDevice.isCpu() ? dst : srcDevice.isCpu() ? src : nullptr;
  DeviceGuard guard(stream.device());
  const bool pageable = host != nullptr && !isPinnedHost(host);
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream.handle())),
        str("memcpy of ", bytes, " bytes to ", dstDevice.str(), " from ", srcDevice.str()).c_str(), stream.str());
  if (pageable) {
    // CUDA may return before a pageable source is staged or a pageable
    // destination written; waiting makes the rule simple: pageable means done.
    countHostSync();
    check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle())), "synchronize after memcpy",
          stream.str());
  } else if (host != nullptr && pinnedCacheOwns(host)) {
    // Freeing the pinned block must not let a new owner write it while this copy still reads it.
    PinnedCache& pinned = pinnedCache();
    pinned.cache.recordStream(host, pinned.raw.streams.idOf(stream));
  }
}

}  // namespace dt::cuda
