// Internal: glue between the ops (tensor/ops_*.cpp, tensor.cpp, optim) and tensor/cuda/kernels.h.
// Only included under DT_HAVE_CUDA. Helpers take tensors already on one CUDA device and return
// tensors on it; nothing here waits for the device.
#pragma once

#include <vector>

#include "tensor/cuda/kernels.h"
#include "tensor/tensor.h"

namespace dt::detail {

// Copies src (any device, broadcastable to dst) into dst, converting dtype; dst may be strided.
void cudaCopy(Tensor& dst, const Tensor& src);

}  // namespace dt::detail
