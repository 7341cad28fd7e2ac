// Where a tensor's bytes live.
//
// Contract: plain value type, thread-safe, no allocation except str().
// CUDA is named from the start so that the GPU issue adds kernels and an
// allocator without changing this vocabulary; in a CPU-only build a CUDA
// device can be named but not allocated on (allocatorFor throws).
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
  bool operator==(const Device& other) const = default;
};

std::ostream& operator<<(std::ostream& out, const Device& device);

}  // namespace dt
