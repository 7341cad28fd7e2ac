// Tensor: a cheap, shared handle to a strided view of a Storage.
//
// Contract:
//  * Copying a Tensor copies the handle; both see the same TensorImpl (sizes,
//    strides, data, autograd metadata). View ops (view, reshape when possible,
//    transpose, permute, narrow, select, expand, squeeze, unsqueeze, as_strided)
//    return new handles over the same Storage; they copy nothing.
//  * Views share a version counter with their base; every in-place op bumps it.
//    Autograd uses it to detect in-place changes to tensors saved for backward.
//  * Not thread-safe for concurrent mutation of the same tensor; distinct
//    tensors may be used from different threads freely.
//  * Errors: bad shapes/dtypes/devices throw InvalidArgument naming both sides
//    (e.g. "view: shape [3, 5] is invalid for input float32[4, 4]"); an op on a
//    device it has no kernel for throws NotSupportedError naming op and device.
//  * Offsets and strides are in elements, not bytes.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/storage.h"

namespace dt {

class Tensor;
struct AutogradMeta;  // tensor/autograd/autograd.h
class Node;

using Shape = std::vector<int64_t>;

struct VersionCounter {
  std::atomic<uint32_t> value{0};
};

struct AutogradMetaDeleter {
  void operator()(AutogradMeta* meta) const;
};

struct TensorImpl {
  Storage storage;
  Shape sizes;
  Shape strides;
  int64_t offset = 0;  // in elements
  DType dtype = DType::Float32;
  int64_t numel = 0;
  bool contiguous = true;
  bool isView = false;  // a differentiable view of another tensor (autograd refuses in-place on it)
  std::shared_ptr<VersionCounter> version;
  std::unique_ptr<AutogradMeta, AutogradMetaDeleter> autograd;

  void refreshGeometry();  // recomputes numel/contiguous after sizes/strides change
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage.device(); }
  const Shape& sizes() const { return impl().sizes; }
  const Shape& strides() const { return impl().strides; }
  int64_t dim() const { return static_cast<int64_t>(impl().sizes.size()); }
  int64_t size(int64_t d) const;
  int64_t stride(int64_t d) const;
  int64_t numel() const { return impl().numel; }
  size_t itemsize() const { return itemSize(impl().dtype); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * itemsize(); }
  int64_t storageOffset() const { return impl().offset; }
  bool isContiguous() const { return impl().contiguous; }
  const Storage& storage() const { return impl().storage; }
  void* dataPtr();
  const void* dataPtr() const;
  template <typename T>
  T* data() {
    checkDType(DTypeOf<T>::value, "data<T>()");
    return static_cast<T*>(dataPtr());
  }
  template <typename T>
  const T* data() const {
    checkDType(DTypeOf<T>::value, "data<T>()");
    return static_cast<const T*>(dataPtr());
  }
  TensorImpl* unsafeImpl() const { return impl_.get(); }
  std::weak_ptr<TensorImpl> weakImpl() const { return impl_; }
  long useCount() const { return impl_.use_count(); }
  bool isSameAs(const Tensor& other) const { return impl_ == other.impl_; }
  // Identity of the underlying implementation, for maps keyed by tensor.
  const void* id() const { return impl_.get(); }

  // Version counter shared with views; in-place ops bump it.
  uint32_t version() const { return impl().version->value.load(std::memory_order_relaxed); }
  void bumpVersion() { impl().version->value.fetch_add(1, std::memory_order_relaxed); }

  // ---- copies and conversions ------------------------------------------------
  Tensor contiguous() const;  // this handle if already contiguous
  Tensor clone() const;       // always a fresh contiguous copy
  // Copies src into this (broadcasting src to this shape, converting dtype).
  Tensor& copy_(const Tensor& src);
  Tensor to(DType dtype) const;  // this handle if already that dtype
  Tensor to(Device device) const;
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }

  // ---- views ---------------------------------------------------------------
  Tensor view(Shape sizes) const;  // one -1 allowed; throws if strides do not allow it
  Tensor reshape(Shape sizes) const;  // a view when possible, else a copy
  Tensor flatten(int64_t startDim = 0, int64_t endDim = -1) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor transpose(int64_t dim0, int64_t dim1) const;
  Tensor t() const;  // 2-D transpose
  Tensor permute(Shape dims) const;
  Tensor expand(Shape sizes) const;  // -1 keeps a size
  Tensor expandAs(const Tensor& other) const { return expand(other.sizes()); }
  Tensor squeeze() const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor asStrided(Shape sizes, Shape strides, int64_t storageOffset = -1) const;

  // ---- element access ----------------------------------------------------------
  template <typename T>
  T item() const;
  template <typename T>
  std::vector<T> toVector() const;

  std::string toString() const;  // "tensor(float32[2, 2], cpu) [[1, 2], [3, 4]]"
  std::string describe() const;  // "float32[4, 1024]"

  // ---- autograd (tensor/autograd/autograd.cpp) ---------------------------------
  bool requiresGrad() const;
  Tensor& setRequiresGrad(bool requiresGrad = true);
  Tensor grad() const;
  void setGrad(const Tensor& grad);
  std::shared_ptr<Node> gradFn() const;
  bool isLeaf() const;
  // New handle on the same data with no autograd history (shares the version counter).
  Tensor detach() const;
  Tensor& detach_();
  void retainGrad();
  bool retainsGrad() const;
  // hook(grad) runs when this tensor's gradient is computed; returning a defined
  // tensor replaces the gradient. Returns a handle for removeHook.
  int registerHook(std::function<Tensor(const Tensor&)> hook);
  void removeHook(int handle);
  // Leaves only: hook(param) runs right after param.grad() has been updated
  // during backward (what DDP uses to start bucket reductions).
  int registerPostAccumulateGradHook(std::function<void(Tensor&)> hook);
  // Computes gradients of this tensor (a scalar unless grad is given).
  void backward(const Tensor& grad = Tensor(), bool retainGraph = false) const;
  // Display name used in autograd errors ("weight", "input"); optional.
  void setName(const std::string& name);
  std::string name() const;

  AutogradMeta* autogradMeta() const { return impl().autograd.get(); }
  AutogradMeta& ensureAutogradMeta() const;

  void checkDType(DType expected, const char* what) const;

 private:
  [[noreturn]] void throwItemNotScalar() const;
  TensorImpl& impl() const;
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& out, const Tensor& t);
std::string describeShape(const Shape& sizes);  // "[4, 1024]"

// ---- factories ---------------------------------------------------------------
Tensor empty(Shape sizes, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor emptyStrided(Shape sizes, Shape strides, DType dtype = DType::Float32,
                    Device device = Device::cpu());
Tensor emptyLike(const Tensor& t);
Tensor zeros(Shape sizes, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor zerosLike(const Tensor& t);
Tensor ones(Shape sizes, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor onesLike(const Tensor& t);
Tensor full(Shape sizes, double value, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor scalarTensor(double value, DType dtype = DType::Float32);
Tensor arange(int64_t n, DType dtype = DType::Int64);
Tensor arange(double start, double end, double step, DType dtype = DType::Float32);

// Copies values into a new tensor; sizes default to {values.size()}.
template <typename T>
Tensor fromVector(const std::vector<T>& values, Shape sizes = {});
template <typename T>
Tensor fromVector(const std::vector<T>& values, Shape sizes, DType dtype);

// Helpers shared by ops.
int64_t wrapDim(int64_t dim, int64_t ndim, const char* op);
int64_t shapeNumel(const Shape& sizes);
Shape contiguousStrides(const Shape& sizes);

// ---- template definitions --------------------------------------------------------
namespace detail {
void readScalars(const Tensor& t, DType as, void* out);  // contiguous out, numel elements
Tensor fromBytes(const void* data, Shape sizes, DType srcType, size_t count);
}  // namespace detail

template <typename T>
T Tensor::item() const {
  if (numel() != 1) {
    throwItemNotScalar();
  }
  T value{};
  detail::readScalars(*this, DTypeOf<T>::value, &value);
  return value;
}

template <typename T>
std::vector<T> Tensor::toVector() const {
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<uint8_t> bytes(static_cast<size_t>(numel()));
    detail::readScalars(*this, DType::Bool, bytes.data());
    return std::vector<bool>(bytes.begin(), bytes.end());
  } else {
    std::vector<T> out(static_cast<size_t>(numel()));
    detail::readScalars(*this, DTypeOf<T>::value, out.data());
    return out;
  }
}

template <typename T>
Tensor fromVector(const std::vector<T>& values, Shape sizes) {
  if (sizes.empty()) sizes = {static_cast<int64_t>(values.size())};
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<uint8_t> bytes(values.begin(), values.end());
    return detail::fromBytes(bytes.data(), std::move(sizes), DType::Bool, values.size());
  } else {
    return detail::fromBytes(values.data(), std::move(sizes), DTypeOf<T>::value, values.size());
  }
}

template <typename T>
Tensor fromVector(const std::vector<T>& values, Shape sizes, DType dtype) {
  return fromVector(values, std::move(sizes)).to(dtype);
}

}  // namespace dt
