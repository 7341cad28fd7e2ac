// Coalescing: many tensors into one flat buffer and back, so a backend makes
// one library call for a list of tensors (and so DDP can bucket gradients).
//
// Contract: all tensors must share one dtype and device (InvalidArgument
// naming the first that differs). flattenTensors returns a fresh contiguous
// 1-D tensor holding the tensors' values in order; unflattenInto copies the
// flat values back into the tensors (strided tensors included). Not
// thread-safe for concurrent writes to the same tensors.
#pragma once

#include <vector>

#include "tensor/tensor.h"

namespace dt {

int64_t totalNumel(const std::vector<Tensor>& tensors);
Tensor flattenTensors(const std::vector<Tensor>& tensors);
void unflattenInto(const Tensor& flat, const std::vector<Tensor>& tensors);

// Copies `src` (any strides) into contiguous bytes at dst / from contiguous
// bytes at src into `dst` (any strides). CPU tensors only.
void copyToBytes(const Tensor& src, void* dst);
void copyFromBytes(const void* src, Tensor& dst);

}  // namespace dt
