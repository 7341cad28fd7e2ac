// CUDA support for tensors (only in builds with DT_HAVE_CUDA).
//
// Contract:
//  * No CUDA header leaks from here: callers see plain C++.
//  * deviceCount() never throws: 0 when there is no driver or no device, and
//    unavailableReason() then says why ("no CUDA driver (libcuda) on this
//    machine", ...), for messages and test skips.
//  * cudaAllocator() is the Allocator for DeviceType::CUDA; allocatorFor(
//    Device::cuda(i)) uses it. It is a caching allocator (the rules are in
//    tensor/cuda/caching_allocator.h): one cache per device, a block belongs
//    to the current stream of its device (currentStream(device)) on the
//    allocating thread and is reused only on that stream. A freed block stays
//    reserved until emptyCache(). memoryStats/memorySnapshot(Device::cuda(i))
//    report through it (every live block is listed); cacheStats() and
//    cacheSnapshot() add cache hits, segments and per-block states.
//    Allocation on a machine without a device throws NotSupportedError naming
//    the device and the reason; running out of memory throws BackendError
//    naming the device and the bytes asked, allocated, reserved and free.
//  * recordStream(storage, stream): the storage's memory is used by work on
//    `stream` as well as on the stream it was allocated on; when freed it is
//    not reused until that work has finished (an event per recorded stream,
//    checked without blocking on later allocations). Needed whenever a
//    kernel or copy on another stream touches a tensor.
//  * pinnedHostAllocator(): page-locked host memory (cudaHostAlloc) for fast,
//    truly asynchronous copies, cached the same way (Device::cpu() DataPtrs).
//    copyBytesAsync records the copy's stream on a pinned block itself, so a
//    freed pinned block is reused only after its copies finished.
//  * copyBytes(dst, dstDevice, src, srcDevice, n) copies between any pair of
//    CPU/CUDA buffers and returns when the copy is complete.
//    copyBytesAsync(..., stream) queues the copy on `stream` (which must
//    belong to one of the two devices) and may return before it is done when
//    the host side is pinned memory, or for device to device; the caller
//    synchronises the stream before touching the destination (or changing
//    the source). With pageable host memory it returns when the copy is
//    complete. CPU to CPU is a plain memcpy.
//  * emptyCache() blocks until recorded streams' work is done, then gives
//    every idle cached segment (all devices and pinned) back to CUDA, for
//    other processes or libraries; tensors keep working afterwards.
//  * Thread-safe. Never call into CUDA in a process that will fork afterwards.
#pragma once

#include <cstddef>
#include <string>

#include "tensor/cuda/caching_allocator.h"
#include "tensor/cuda/stream.h"
#include "tensor/device.h"
#include "tensor/storage.h"

namespace dt::cuda {

int deviceCount();
std::string unavailableReason();

Allocator& cudaAllocator();
Allocator& pinnedHostAllocator();
void emptyCache();
void recordStream(const Storage& storage, const Stream& stream);
// The device's cache in detail; the device must exist.
CacheStats cacheStats(Device device);
CacheSnapshot cacheSnapshot(Device device);
CacheStats pinnedCacheStats();
CacheSnapshot pinnedCacheSnapshot();

void copyBytes(void* dst, Device dstDevice, const void* src, Device srcDevice, size_t bytes);
void copyBytesAsync(void* dst, Device dstDevice, const void* src, Device srcDevice, size_t bytes,
                    const Stream& stream);
// Sets n float32 values at dst (device memory) to value; returns when done.
void fillFloat32(void* dst, Device device, size_t n, float value);

}  // namespace dt::cuda
