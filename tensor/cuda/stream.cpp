#include "tensor/cuda/stream.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <utility>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/cuda/cuda.h"

namespace dt::cuda {
namespace {

constexpr int kMaxDevices = 64;

void check(cudaError_t status, const char* what, Device device) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  if (deviceCount() == 0) throw NotSupportedError(str("CUDA ", what, " on ", device.str(), ": ", unavailableReason()));
  throw BackendError(str("CUDA ", what, " on ", device.str(), " failed: ", cudaGetErrorString(status), " (",
                         static_cast<int>(status), ")"));
}

void requireDevice(Device device, const char* what) {
  if (!device.isCuda() || device.index < 0 || device.index >= kMaxDevices) {
    throw InvalidArgument(str(what, ": ", device.str(), " is not a CUDA device"));
  }
  if (deviceCount() == 0) throw NotSupportedError(str(what, " on ", device.str(), ": ", unavailableReason()));
  if (device.index >= deviceCount()) {
    throw InvalidArgument(str(what, ": device ", device.str(), " does not exist; this machine has ", deviceCount(),
                              " CUDA device(s)"));
  }
}

cudaStream_t raw(const Stream& s) { return static_cast<cudaStream_t>(s.handle()); }

thread_local std::array<void*, kMaxDevices> currentStreams{};

// The driver's primary-context query, found through the runtime (which loads
// the driver anyway), so that dtrain links no libcuda and a CUDA build still
// starts on a machine without a driver.
using DeviceGetFn = CUresult (*)(CUdevice*, int);
using PrimaryCtxGetStateFn = CUresult (*)(CUdevice, unsigned int*, int*);
struct PrimaryContextQuery {
  DeviceGetFn deviceGet = nullptr;
  PrimaryCtxGetStateFn getState = nullptr;
};

const PrimaryContextQuery& primaryContextQuery() {
  static const PrimaryContextQuery query = [] {
    PrimaryContextQuery q;
    if (deviceCount() == 0) return q;
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuDeviceGet", &fn, 12000, cudaEnableDefault, &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      q.deviceGet = reinterpret_cast<DeviceGetFn>(fn);
    }
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      q.getState = reinterpret_cast<PrimaryCtxGetStateFn>(fn);
    }
    cudaGetLastError();
    return q;
  }();
  return query;
}

int runtimeCurrentDevice() {
  int index = 0;
  check(cudaGetDevice(&index), "get device", Device::cuda(0));
  return index;
}

void runtimeSetDevice(int index) { check(cudaSetDevice(index), "set device", Device::cuda(index)); }

void runtimeSetDeviceBack(int index) noexcept {
  if (cudaSetDevice(index) != cudaSuccess) cudaGetLastError();
}

constexpr DeviceSwitchOps kRuntimeSwitch{&runtimeCurrentDevice, &runtimeSetDevice, &runtimeSetDeviceBack,
                                         &primaryContextActive};

int checkedIndex(Device device, const char* what) {
  requireDevice(device, what);
  return device.index;
}

}  // namespace

bool primaryContextActive(int index) noexcept {
  const PrimaryContextQuery& q = primaryContextQuery();
  if (q.deviceGet == nullptr || q.getState == nullptr) return false;
  CUdevice device = 0;
  if (q.deviceGet(&device, index) != CUDA_SUCCESS) return false;
  unsigned int flags = 0;
  int active = 0;
  if (q.getState(device, &flags, &active) != CUDA_SUCCESS) return false;
  return active != 0;
}

int currentDevice() { return runtimeCurrentDevice(); }

void setCurrentDevice(int index) {
  requireDevice(Device::cuda(index), "set device");
  check(cudaSetDevice(index), "set device", Device::cuda(index));
}

Stream Stream::create(Device device, int priority) {
  requireDevice(device, "create stream");
  DeviceGuard guard(device);
  cudaStream_t handle = nullptr;
  check(cudaStreamCreateWithPriority(&handle, cudaStreamNonBlocking, priority), "create stream", device);
  return Stream(device, handle);
}

bool Stream::query() const {
  DeviceGuard guard(device_);
  const cudaError_t status = cudaStreamQuery(raw(*this));
  if (status == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(status, "query stream", device_);
  return true;
}

namespace {
std::atomic<uint64_t> hostSyncs{0};
}  // namespace

uint64_t hostSyncCount() { return hostSyncs.load(std::memory_order_relaxed); }
void countHostSync() { hostSyncs.fetch_add(1, std::memory_order_relaxed); }

void Stream::synchronize() const {
  countHostSync();
  DeviceGuard guard(device_);
  check(cudaStreamSynchronize(raw(*this)), "synchronize stream", device_);
}

std::string Stream::str() const {
  if (isDefault()) return dt::str(device_.str(), "/default");
  return dt::str(device_.str(), "/stream 0x", std::hex, reinterpret_cast<uintptr_t>(handle_));
}

Stream currentStream(Device device) {
  if (!device.isCuda() || device.index < 0 || device.index >= kMaxDevices) {
    throw InvalidArgument(str("currentStream: ", device.str(), " is not a CUDA device"));
  }
  return Stream(device, currentStreams[static_cast<size_t>(device.index)]);
}

void setCurrentStream(const Stream& stream) {
  requireDevice(stream.device(), "setCurrentStream");
  currentStreams[static_cast<size_t>(stream.device().index)] = stream.handle();
}

DeviceGuard::DeviceGuard(Device device) : switch_(kRuntimeSwitch, checkedIndex(device, "DeviceGuard")) {}

StreamGuard::StreamGuard(const Stream& stream)
    : device_(stream.device()), previous_(currentStream(stream.device())) {
  setCurrentStream(stream);
}

StreamGuard::~StreamGuard() { currentStreams[static_cast<size_t>(previous_.device().index)] = previous_.handle(); }

namespace {

// Destroying an event is a runtime call like any other: on a thread with no
// current context it would make cuda:0's, so it runs on the event's device.
void destroyEvent(void* handle, Device device) noexcept {
  if (handle == nullptr) return;
  try {
    DeviceGuard guard(device);
    cudaEventDestroy(static_cast<cudaEvent_t>(handle));
  } catch (const std::exception&) {
    cudaEventDestroy(static_cast<cudaEvent_t>(handle));  // the device is unusable; free what we can
  }
}

}  // namespace

Event::~Event() { destroyEvent(handle_, device_); }

Event::Event(Event&& other) noexcept { *this = std::move(other); }

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    destroyEvent(handle_, device_);
    timing_ = other.timing_;
    device_ = other.device_;
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

void Event::record(const Stream& stream) {
  DeviceGuard guard(stream.device());
  if (handle_ != nullptr && device_ != stream.device()) {
    throw InvalidArgument(str("Event::record: the event belongs to ", device_.str(), ", the stream to ",
                              stream.device().str(), "; use one event per device"));
  }
  if (handle_ == nullptr) {
    cudaEvent_t created = nullptr;
    check(cudaEventCreateWithFlags(&created, timing_ ? cudaEventDefault : cudaEventDisableTiming), "create event",
          stream.device());
    handle_ = created;
    device_ = stream.device();
  }
  check(cudaEventRecord(static_cast<cudaEvent_t>(handle_), raw(stream)), "record event", stream.device());
}

void Event::block(const Stream& stream) const {
  if (handle_ == nullptr) return;
  DeviceGuard guard(stream.device());
  check(cudaStreamWaitEvent(raw(stream), static_cast<cudaEvent_t>(handle_), 0), "stream wait event",
        stream.device());
}

bool Event::query() const {
  if (handle_ == nullptr) return true;
  DeviceGuard guard(device_);
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(handle_));
  if (status == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(status, "query event", device_);
  return true;
}

void Event::synchronize() const {
  if (handle_ == nullptr) return;
  countHostSync();
  DeviceGuard guard(device_);
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)), "synchronize event", device_);
}

float Event::elapsedMs(const Event& later) const {
  if (handle_ == nullptr || later.handle_ == nullptr) {
    throw InvalidArgument("Event::elapsedMs: both events must have been recorded");
  }
  if (!timing_ || !later.timing_) {
    throw InvalidArgument("Event::elapsedMs: both events must be made with Event(/*timing=*/true)");
  }
  float ms = 0;
  DeviceGuard guard(device_);
  check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(handle_), static_cast<cudaEvent_t>(later.handle_)),
        "event elapsed time", device_);
  return ms;
}

}  // namespace dt::cuda
