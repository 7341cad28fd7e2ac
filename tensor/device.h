// Where a tensor's bytes live.
//
// Contract: plain value type, thread-safe, no allocation except str().
// A CUDA device can always be named; it can be allocated on only in a build
// with CUDA (DT_HAVE_CUDA) on a machine that has it: deviceAvailable() says
// whether it can, and deviceUnavailableReason() why not, without touching
// CUDA for CPU devices (a CPU-only program never initialises the driver).
#pragma once

#include <ostream>
#include <string>

namespace dt {

enum class DeviceType { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu() { return Device{DeviceType::CPU, 0}; }
  static Device cuda(int index = 0) { return Device{DeviceType::CUDA, index}; }
  bool isCpu() const { return type == DeviceType::CPU; }
  bool isCuda() const { return type == DeviceType::CUDA; }
  // "cpu", "cuda:0"
  std::string str() const;
  // "cpu", "cuda" (= cuda:0), "cuda:N"; anything else throws InvalidArgument
  // naming the text.
  static Device parse(const std::string& text);
  bool operator==(const Device& other) const = default;
};

std::ostream& operator<<(std::ostream& out, const Device& device);

// How many devices of `type` this process can use: 1 for the CPU; for CUDA
// 0 without a driver, a device or a CUDA build.
int deviceCount(DeviceType type);
// True when tensors can be allocated on `device` in this process.
bool deviceAvailable(Device device);
// Why deviceAvailable(device) is false, in a sentence ("" when it is true).
std::string deviceUnavailableReason(Device device);
// Makes a CUDA device the calling thread's current one (what CUDA calls
// without a device use: do it first in each rank, so that no rank also opens
// a context on cuda:0). A no-op for the CPU; an unusable device throws
// NotSupportedError/InvalidArgument with the reason.
void setCurrentDevice(Device device);

}  // namespace dt
