// Finite-difference check of autograd gradients.
//
// Contract: fn must be deterministic and inputs float64 CPU leaves requiring grad
// (any strides, including non-contiguous). gradcheck projects the output on a
// fixed pseudo-random vector v, compares the analytical v·J from backward with
// central differences (eps) for every input element, and reports the worst
// mismatch. It perturbs inputs in place and restores them; it is slow by
// design (2 evaluations per input element) and meant for small tensors.
// Not thread-safe with respect to the inputs.
#pragma once

#include <functional>
#include <string>

#include "tensor/autograd/autograd.h"

namespace dt {

struct GradcheckOptions {
  double eps = 1e-6;
  double atol = 1e-5;
  double rtol = 1e-3;
  uint64_t seed = 1234;
};

struct GradcheckResult {
  bool ok = true;
  std::string message;  // names the input, element, analytical and numerical values on failure
};

GradcheckResult gradcheck(const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs,
                          const GradcheckOptions& options = {});

}  // namespace dt
