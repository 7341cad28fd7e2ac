// TensorOptions: the dtype, device and requiresGrad of a tensor to be made, as one value.
//
// Contract:
//  * A plain value type: copyable, never allocates, thread-safe. Defaults are float32, cpu and
//    requiresGrad false, the same defaults the factories' positional arguments have.
//  * Setters take the new value and return a modified copy; they never change the object they
//    are called on. So options chain on a temporary, and a shared `const` set can be specialised
//    without being changed:
//        zeros({2, 3}, TensorOptions().dtype(DType::Float64).requiresGrad(true))
//    Getters are the same names without an argument (options.dtype()).
//  * Factories that take options (tensor.h: empty, zeros, ones, full, scalarTensor, arange,
//    fromVector, fromBlob) make the tensor with options.dtype() on options.device() (the dtype is
//    used as given: arange(5, TensorOptions()) is float32) and then mark it a leaf that requires
//    grad when asked. requiresGrad on a dtype that is not floating point throws InvalidArgument,
//    as Tensor::setRequiresGrad does.
//  * Neither DType nor Device converts implicitly to TensorOptions: the factories keep their
//    positional (dtype, device) overloads, and an implicit conversion would make those calls
//    ambiguous.
#pragma once

#include <ostream>

#include "tensor/device.h"
#include "tensor/dtype.h"

namespace dt {

class TensorOptions {
 public:
  TensorOptions() = default;

  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool requiresGrad() const { return requiresGrad_; }

  TensorOptions dtype(DType value) const {
    TensorOptions changed = *this;
    changed.dtype_ = value;
    return changed;
  }
  TensorOptions device(Device value) const {
    TensorOptions changed = *this;
    changed.device_ = value;
    return changed;
  }
  TensorOptions requiresGrad(bool value) const {
    TensorOptions changed = *this;
    changed.requiresGrad_ = value;
    return changed;
  }

  bool operator==(const TensorOptions& other) const = default;

 private:
  DType dtype_ = DType::Float32;
  Device device_ = Device::cpu();
  bool requiresGrad_ = false;
};

// "TensorOptions(dtype=float64, device=cpu, requiresGrad=true)"
std::ostream& operator<<(std::ostream& out, const TensorOptions& options);

}  // namespace dt
