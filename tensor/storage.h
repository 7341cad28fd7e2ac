// Raw tensor memory: per-device allocators and ref-counted Storage.
//
// Contract:
//  * An Allocator hands out DataPtrs that own their bytes and free them through
//    the allocator's deleter when destroyed. Allocators are process-wide,
//    thread-safe, and live until exit.
//  * The CPU allocator serves blocks of 64 KiB and more from a block cache
//    (tensor/cuda/caching_allocator.h, the CUDA allocator's core) over
//    segments it maps from the OS itself, on huge-page boundaries; smaller
//    blocks come from malloc. Training steps allocate the same shapes every
//    step, and re-faulting fresh pages from the OS each time costs more than
//    the math, so freed blocks stay cached and serve any later request they
//    fit (split, and merged again with free neighbours). The cache never holds
//    the footprint above what it needs: before it maps a new segment that
//    would take its reserved bytes past the most ever live at once (since
//    start or the last emptyCpuCache()), it unmaps idle segments. So the
//    resident set of a training loop follows its live peak. emptyCpuCache()
//    unmaps every idle segment.
//  * allocatorFor(device) returns the allocator registered for that device
//    type. The CPU allocator is built in (64-byte aligned, so BLAS and SIMD get
//    aligned rows). In a build with CUDA (DT_HAVE_CUDA) the CUDA allocator of
//    tensor/cuda/cuda.h serves CUDA devices; without it allocatorFor(CUDA)
//    throws NotSupportedError naming the device. registerAllocator() replaces
//    either (tests use it for fakes).
//  * Allocators report memory statistics (tensor/memory_stats.h) through
//    stats()/resetPeakStats()/snapshot(); the defaults throw
//    NotSupportedError naming the device, so an allocator opts in.
//  * Storage is a cheap, shared handle (copies share the bytes). Its contents
//    are not synchronised: concurrent writers must coordinate themselves.
//  * resizeBytes() replaces the bytes under every handle at once (the old ones
//    are freed first; the new ones are uninitialised), and resizeBytes(0)
//    frees them: how a sharded wrapper frees a unit's gathered parameters
//    between uses while tensors saved for backward keep pointing at the same
//    storage, and gives them memory again before backward reads them. Tensors
//    over a storage must not be read or written while it is smaller than
//    their extent; the caller guarantees that (nothing checks).
#pragma once

#include <cstddef>
#include <memory>

#include "tensor/device.h"
#include "tensor/memory_stats.h"

namespace dt {

// Owning pointer to device memory plus the way to free it.
class DataPtr {
 public:
  using Deleter = void (*)(void* context, void* ptr);
  DataPtr() = default;
  DataPtr(void* ptr, void* context, Deleter deleter, Device device)
      : ptr_(ptr), context_(context), deleter_(deleter), device_(device) {}
  DataPtr(DataPtr&& other) noexcept { *this = std::move(other); }
  DataPtr& operator=(DataPtr&& other) noexcept;
  DataPtr(const DataPtr&) = delete;
  DataPtr& operator=(const DataPtr&) = delete;
  ~DataPtr() { reset(); }

  void* get() const { return ptr_; }
  Device device() const { return device_; }
  void reset();

 private:
  void* ptr_ = nullptr;
  void* context_ = nullptr;
  Deleter deleter_ = nullptr;
  Device device_ = Device::cpu();
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  // Never returns null for bytes > 0; throws dt::Error when out of memory.
  virtual DataPtr allocate(size_t bytes) = 0;
  // On a specific device of this type (CUDA has several); the default ignores
  // the index, which is right for the CPU.
  virtual DataPtr allocateOn(Device device, size_t bytes) { return allocate(bytes); }
  virtual DeviceType deviceType() const = 0;
  virtual MemoryStats stats(Device device);
  virtual void resetPeakStats(Device device);
  virtual MemorySnapshot snapshot(Device device);
};

// The allocator for device.type; throws NotSupportedError if none is registered.
Allocator& allocatorFor(Device device);
// Installs the allocator for a device type (tensor/cuda does this for CUDA).
// The allocator must outlive every allocation made from it.
void registerAllocator(DeviceType type, Allocator* allocator);

// Unmaps the CPU allocator's idle cached segments. cpuCachedBytes(): what it holds beyond
// the live blocks of 64 KiB and more (idle blocks, and live ones' rounding to its block sizes).
void emptyCpuCache();
size_t cpuCachedBytes();

// Ref-counted bytes on one device.
class Storage {
 public:
  Storage() = default;
  // Allocates nbytes on device through its allocator.
  Storage(size_t nbytes, Device device);
  // Adopts memory someone else allocated.
  Storage(DataPtr data, size_t nbytes);

  bool defined() const { return impl_ != nullptr; }
  void* data() const { return impl_ ? impl_->data.get() : nullptr; }
  size_t nbytes() const { return impl_ ? impl_->nbytes : 0; }
  Device device() const { return impl_ ? impl_->data.device() : Device::cpu(); }
  long useCount() const { return impl_.use_count(); }
  bool isSameAs(const Storage& other) const { return impl_ == other.impl_; }
  // See the contract above: frees the current bytes, then (nbytes > 0) allocates nbytes on
  // the same device; every handle sharing this storage sees the new bytes.
  void resizeBytes(size_t nbytes);

 private:
  struct Impl {
    DataPtr data;
    size_t nbytes = 0;
  };
  std::shared_ptr<Impl> impl_;
};

}  // namespace dt
