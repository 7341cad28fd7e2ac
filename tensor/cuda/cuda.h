// CUDA support for tensors (only in builds with DT_HAVE_CUDA).
//
// Contract:
//  * No CUDA header leaks from here: callers see plain C++.
//  * deviceCount() never throws: 0 when there is no driver or no device, and
//    unavailableReason() then says why ("no CUDA driver (libcuda) on this
//    machine", ...), for messages and test skips.
//  * cudaAllocator() is the Allocator for DeviceType::CUDA (cudaMalloc on the
//    device's index, cudaFree on release); allocatorFor(Device::cuda(i)) uses
//    it. Allocation on a machine without a device throws NotSupportedError
//    naming the device and the reason.
//  * copyBytes(dst, dstDevice, src, srcDevice, n) copies between any pair of
//    CPU/CUDA buffers and returns when the copy is complete.
//  * Thread-safe. Never call into CUDA in a process that will fork afterwards.
#pragma once

#include <cstddef>
#include <string>

#include "tensor/device.h"
#include "tensor/storage.h"

namespace dt::cuda {

int deviceCount();
std::string unavailableReason();
Allocator& cudaAllocator();
void copyBytes(void* dst, Device dstDevice, const void* src, Device srcDevice, size_t bytes);
// Sets n float32 values at dst (device memory) to value; returns when done.
void fillFloat32(void* dst, Device device, size_t n, float value);

}  // namespace dt::cuda
