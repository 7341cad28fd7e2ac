// How a guard moves the calling thread to a CUDA device and back, apart from
// CUDA itself: DeviceGuard (stream.h) runs it over the CUDA runtime, tests run
// it over a fake that models which primary contexts exist. Header-only, no
// CUDA header, compiled in every build.
//
// Why the rule is not "save, set, restore":
//  * Since CUDA 12, cudaSetDevice(d) creates d's primary context when the
//    process has none there (hundreds of MiB of d's memory; in
//    EXCLUSIVE_PROCESS mode it fails when another process holds d).
//  * cudaGetDevice on a thread that never chose a device reads 0 and makes no
//    context. A guard that restored that 0 on a watchdog, callback or p2p
//    thread would open a context on cuda:0 in every rank of a host.
// So a switch sets the target only when it differs from the current device,
// and on leaving goes back only when the process already holds the previous
// device's primary context (going back then costs nothing). Otherwise the
// thread stays on the target: nothing in dtrain relies on a thread's device
// outliving a guard, and a thread that once worked for device d keeps d as
// its current device, which is what the next guard there wants anyway.
// (PyTorch's c10::cuda::MaybeSetDevice follows the same rule.)
//
// Thread safety: a DeviceSwitch belongs to the thread that made it; the ops
// are called on that thread only.
#pragma once

namespace dt::cuda {

// The three CUDA calls a switch needs. `set` may throw (a device that cannot
// be used); `setBack` and `hasPrimaryContext` run in destructors and must not.
struct DeviceSwitchOps {
  int (*current)();                          // cudaGetDevice: makes no context
  void (*set)(int device);                   // cudaSetDevice
  void (*setBack)(int device) noexcept;      // cudaSetDevice, errors ignored
  bool (*hasPrimaryContext)(int device) noexcept;  // makes no context either
};

class DeviceSwitch {
 public:
  DeviceSwitch(const DeviceSwitchOps& ops, int target) : ops_(&ops), previous_(ops.current()) {
    if (previous_ != target) {
      ops.set(target);
      changed_ = true;
    }
  }
  ~DeviceSwitch() {
    if (changed_ && ops_->hasPrimaryContext(previous_)) ops_->setBack(previous_);
  }
  DeviceSwitch(const DeviceSwitch&) = delete;
  DeviceSwitch& operator=(const DeviceSwitch&) = delete;

  int previous() const { return previous_; }
  bool changed() const { return changed_; }

 private:
  const DeviceSwitchOps* ops_;
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace dt::cuda
