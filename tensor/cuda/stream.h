// CUDA devices, streams and events (only in builds with DT_HAVE_CUDA).
//
// Contract:
//  * No CUDA header leaks from here: handles are opaque (void*), callers see
//    plain C++.
//  * A Stream is a value: a device and a cudaStream_t. The default stream of
//    a device has a null handle (CUDA's legacy default stream, which orders
//    itself with every blocking stream). Stream::create() makes a
//    non-blocking stream; streams are never destroyed (a handle may be held
//    by work still in flight), so create a few and keep them.
//  * currentStream(device) is per thread and per device and starts as the
//    default stream. Kernels, copies and collectives of dtrain launch on the
//    current stream of their tensors' device. StreamGuard sets the current
//    stream (and the current device) for a scope and restores both;
//    DeviceGuard does the same for the current device only. Neither opens a
//    context on a device the process never used: a guard goes back to the
//    previous device only when the process already holds its primary
//    context (device_switch.h says why), so a thread that never chose a
//    device stays on the guard's one afterwards.
//  * Every call below that needs a context runs with its object's device
//    current (events are queried, synchronised and destroyed under a guard
//    for their device), so it works from any thread without touching
//    cuda:0.
//  * Event: move-only owner of a cudaEvent_t created on its first record().
//    record(stream) captures the work queued on that stream so far;
//    block(stream) makes another stream wait for it without blocking the
//    host; query() never blocks (true when never recorded); synchronize()
//    blocks the host. elapsedMs() needs events made with timing on.
//  * Errors throw dt::BackendError naming the call, the device and CUDA's
//    error string; a machine without a device gets NotSupportedError with
//    cuda::unavailableReason().
//  * Thread safety: as CUDA's. Distinct objects may be used from any thread;
//    one Event shared by threads needs the caller's lock.
#pragma once

#include <cstdint>
#include <string>

#include "tensor/cuda/device_switch.h"
#include "tensor/device.h"

namespace dt::cuda {

// The calling thread's current CUDA device index, and setting it.
int currentDevice();
void setCurrentDevice(int index);
// Whether this process holds the primary context of CUDA device `index`
// (asking makes none; false without a driver or when the driver cannot tell).
bool primaryContextActive(int index) noexcept;

// How many times tensor/cuda made the host wait for a device in this process: each
// Stream::synchronize, Event::synchronize, and copy to or from pageable host memory
// (copyBytesAsync waits there) counts one, so a read of a value (item()) counts two (the copy,
// then cudaCopy's wait for its stream). For tests that check an op queues its work without
// waiting (crossEntropy, embedding) or that a step waits a known number of times (clipGradNorm
// reads its norm once). Waits elsewhere (NCCL, cuBLAS, emptyCache) are not counted.
uint64_t hostSyncCount();
void countHostSync();  // for tensor/cuda's own waits outside stream.cpp

class Stream {
 public:
  // The default stream of cuda:0.
  Stream() = default;
  Stream(Device device, void* handle) : device_(device), handle_(handle) {}
  static Stream defaultFor(Device device) { return Stream(device, nullptr); }
  // A new non-blocking stream on device; a lower priority number runs first
  // (CUDA's convention: 0 is normal, negative is higher).
  static Stream create(Device device, int priority = 0);

  Device device() const { return device_; }
  void* handle() const { return handle_; }
  bool isDefault() const { return handle_ == nullptr; }
  // True when all work queued so far has finished.
  bool query() const;
  void synchronize() const;
  std::string str() const;  // "cuda:0/default", "cuda:1/stream 0x..."

  friend bool operator==(const Stream& a, const Stream& b) {
    return a.device_ == b.device_ && a.handle_ == b.handle_;
  }
  friend bool operator!=(const Stream& a, const Stream& b) { return !(a == b); }

 private:
  Device device_ = Device::cuda(0);
  void* handle_ = nullptr;
};

Stream currentStream(Device device);
// Makes `stream` current for its device on this thread.
void setCurrentStream(const Stream& stream);

class DeviceGuard {
 public:
  explicit DeviceGuard(Device device);
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  DeviceSwitch switch_;
};

class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  DeviceGuard device_;
  Stream previous_;
};

class Event {
 public:
  explicit Event(bool timing = false) : timing_(timing) {}
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(const Stream& stream);
  // `stream` waits (on the device) for the work this event captured; a
  // never-recorded event makes it wait for nothing.
  void block(const Stream& stream) const;
  bool query() const;
  void synchronize() const;
  // Milliseconds from this event to `later`; both recorded with timing on.
  float elapsedMs(const Event& later) const;
  bool isRecorded() const { return handle_ != nullptr; }
  Device device() const { return device_; }

 private:
  bool timing_ = false;
  Device device_ = Device::cuda(0);
  void* handle_ = nullptr;
};

}  // namespace dt::cuda
