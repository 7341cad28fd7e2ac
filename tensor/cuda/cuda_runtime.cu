#include <cuda_runtime.h>

#include <cstring>
#include <mutex>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/kernels.h"
#include "tensor/cuda/stream.h"

namespace dt::cuda {
namespace {

void throwIfFailed(cudaError_t status, const char* what, Device device) {
  if (status != cudaSuccess) {
    throw BackendError(str("CUDA ", what, " on ", device.str(), " failed: ", cudaGetErrorString(status),
                           " (", static_cast<int>(status), ")"));
  }
}

struct Probe {
  int count = 0;
  std::string reason;
};

const Probe& probe() {
  static const Probe result = [] {
    Probe p;
    const cudaError_t status = cudaGetDeviceCount(&p.count);
    if (status != cudaSuccess) {
      p.count = 0;
      p.reason = status == cudaErrorInsufficientDriver || status == cudaErrorNoDevice
                     ? str("no usable CUDA device: ", cudaGetErrorString(status))
                     : str("CUDA is unavailable: ", cudaGetErrorString(status));
      cudaGetLastError();  // clear the sticky error so later calls start clean
    } else if (p.count == 0) {
      p.reason = "no CUDA device on this machine";
    }
    return p;
  }();
  return result;
}

__global__ void fillKernel(float* dst, size_t n, float value) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = value;
  }
}

}  // namespace

int deviceCount() { return probe().count; }
std::string unavailableReason() { return probe().reason; }

void copyBytes(void* dst, Device dstDevice, const void* src, Device srcDevice, size_t bytes) {
  if (bytes == 0) return;
  const Device active = dstDevice.isCuda() ? dstDevice : srcDevice;
  if (active.isCuda() && deviceCount() == 0) {
    throw NotSupportedError(str("cannot copy to ", dstDevice.str(), " from ", srcDevice.str(), ": ",
                                unavailableReason()));
  }
  // On the CUDA side's device: on a thread that never chose one, the copy
  // would otherwise run in (and first create) cuda:0's context.
  if (!active.isCuda()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  DeviceGuard guard(active);
  throwIfFailed(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "memcpy", active);
}

void fillFloat32(void* dst, Device device, size_t n, float value) {
  if (n == 0) return;
  DeviceGuard guard(device);
  fillKernel<<<gridForThreads(static_cast<int64_t>(n)), kBlockThreads>>>(static_cast<float*>(dst), n, value);
  throwIfFailed(cudaGetLastError(), "fill kernel launch", device);
  throwIfFailed(cudaDeviceSynchronize(), "fill kernel", device);
}

}  // namespace dt::cuda
