// Helpers for CPU backends (gloo, shm): input checks, signatures for
// fingerprints, and staging of tensor lists into contiguous buffers.
//
// Contract: pure helpers, thread-safe for distinct tensors.
//  * checkCpu throws InvalidArgument for an undefined or non-CPU tensor,
//    naming the op, the backend and the tensor.
//  * stage(tensors): a single contiguous tensor is used as is (the backend
//    works in place); otherwise one flat buffer per dtype (in first-seen
//    order), whose copyBack() writes the results into the original tensors.
#pragma once

#include <string>
#include <vector>

#include "collectives/fingerprint.h"
#include "tensor/tensor.h"

namespace dt {

void checkCpu(const Tensor& t, const char* op, const std::string& who, const char* backend);
std::vector<TensorSignature> signatures(const std::vector<Tensor>& tensors);

struct Staged {
  std::vector<Tensor> buffers;
  std::vector<std::vector<Tensor>> members;  // empty: buffers[i] is the user's tensor
  void copyBack();
};

Staged stage(const std::vector<Tensor>& tensors);
// Always copies: one flat buffer per dtype, nothing to copy back (reduce's
// non-root ranks, whose tensors must stay unchanged).
Staged stageCopy(const std::vector<Tensor>& tensors);

}  // namespace dt
