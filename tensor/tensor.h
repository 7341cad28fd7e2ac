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
//  * A Shape of {} means a 0-dim tensor (one element) in every call that takes
//    a shape, fromVector included; fromVector(values) without a shape is 1-D.
//  * The math members (x.sum({1}), x.matmul(w), x.exp(), ...) are the free
//    functions of tensor/ops.h spelled as members, as LibTorch has them:
//    x.f(args) is dt::f(x, args), same kernels, same autograd, same errors.
//  * fromBlob wraps memory the caller allocated; see its comment below for who
//    frees it and when.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/storage.h"
#include "tensor/tensor_options.h"

namespace dt {

class Tensor;
struct AutogradMeta;  // tensor/autograd/autograd.h
class Node;
struct ValuesIndices;  // defined below, after Tensor

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
  // This tensor's dtype and device, requiresGrad false (as LibTorch's options()):
  // zeros(shape, x.options()) makes a fresh leaf like x, not a copy of its autograd state.
  TensorOptions options() const { return TensorOptions().dtype(dtype()).device(device()); }
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

  // ---- math: member forms of tensor/ops.h (tensor_methods.cpp) ----------------
  // Each is one call of the free function of the same name with *this first.
  Tensor add(const Tensor& other, double alpha = 1.0) const;
  Tensor add(double other) const;
  Tensor sub(const Tensor& other, double alpha = 1.0) const;
  Tensor sub(double other) const;
  Tensor mul(const Tensor& other) const;
  Tensor mul(double other) const;
  Tensor div(const Tensor& other) const;
  Tensor div(double other) const;
  Tensor pow(const Tensor& exponent) const;
  Tensor pow(double exponent) const;
  Tensor maximum(const Tensor& other) const;
  Tensor minimum(const Tensor& other) const;
  Tensor neg() const;
  Tensor exp() const;
  Tensor log() const;
  Tensor sqrt() const;
  Tensor abs() const;
  Tensor clamp(std::optional<double> low, std::optional<double> high) const;
  Tensor relu() const;
  Tensor gelu() const;
  Tensor tanh() const;
  Tensor sigmoid() const;

  Tensor eq(const Tensor& other) const;
  Tensor ne(const Tensor& other) const;
  Tensor lt(const Tensor& other) const;
  Tensor le(const Tensor& other) const;
  Tensor gt(const Tensor& other) const;
  Tensor ge(const Tensor& other) const;
  Tensor gt(double other) const;
  Tensor lt(double other) const;

  Tensor sum() const;
  Tensor sum(const std::vector<int64_t>& dims, bool keepdim = false) const;
  Tensor mean() const;
  Tensor mean(const std::vector<int64_t>& dims, bool keepdim = false) const;
  Tensor max() const;
  Tensor min() const;
  ValuesIndices max(int64_t dim, bool keepdim = false) const;
  ValuesIndices min(int64_t dim, bool keepdim = false) const;
  Tensor amax(const std::vector<int64_t>& dims, bool keepdim = false) const;
  Tensor argmax() const;
  Tensor argmax(int64_t dim, bool keepdim = false) const;
  Tensor argmin(int64_t dim, bool keepdim = false) const;

  Tensor mm(const Tensor& other) const;
  Tensor bmm(const Tensor& other) const;
  Tensor matmul(const Tensor& other) const;
  Tensor softmax(int64_t dim) const;
  Tensor logSoftmax(int64_t dim) const;
  Tensor indexSelect(int64_t dim, const Tensor& index) const;
  bool allclose(const Tensor& other, double rtol = 1e-5, double atol = 1e-8) const;

  // In place (bump the version; the free functions' autograd rules apply).
  Tensor& add_(const Tensor& other, double alpha = 1.0);
  Tensor& add_(double other);
  Tensor& sub_(const Tensor& other, double alpha = 1.0);
  Tensor& mul_(const Tensor& other);
  Tensor& mul_(double other);
  Tensor& div_(const Tensor& other);
  Tensor& relu_();
  Tensor& clamp_(std::optional<double> low, std::optional<double> high);
  Tensor& sqrt_();

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

// Result of max/min along a dimension.
struct ValuesIndices {
  Tensor values;
  Tensor indices;  // int64
};

std::ostream& operator<<(std::ostream& out, const Tensor& t);
std::string describeShape(const Shape& sizes);  // "[4, 1024]"

// ---- factories ---------------------------------------------------------------
// Each has a positional (dtype, device) form and a TensorOptions form
// (tensor_options.h), which also takes requiresGrad.
Tensor empty(Shape sizes, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor empty(Shape sizes, const TensorOptions& options);
Tensor emptyStrided(Shape sizes, Shape strides, DType dtype = DType::Float32,
                    Device device = Device::cpu());
Tensor emptyLike(const Tensor& t);
Tensor zeros(Shape sizes, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor zeros(Shape sizes, const TensorOptions& options);
Tensor zerosLike(const Tensor& t);
Tensor ones(Shape sizes, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor ones(Shape sizes, const TensorOptions& options);
Tensor onesLike(const Tensor& t);
Tensor full(Shape sizes, double value, DType dtype = DType::Float32, Device device = Device::cpu());
Tensor full(Shape sizes, double value, const TensorOptions& options);
// A 0-dim tensor; the same as full({}, value, ...).
Tensor scalarTensor(double value, DType dtype = DType::Float32);
Tensor scalarTensor(double value, const TensorOptions& options);
Tensor arange(int64_t n, DType dtype = DType::Int64);
Tensor arange(int64_t n, const TensorOptions& options);
Tensor arange(double start, double end, double step, DType dtype = DType::Float32);
Tensor arange(double start, double end, double step, const TensorOptions& options);

// Copies values into a new tensor. Without sizes the tensor is 1-D of values.size(); with
// sizes the values must fill them exactly, and sizes {} is a 0-dim tensor of exactly one value
// (as {} means everywhere else). Otherwise InvalidArgument names the shape and the count.
template <typename T>
Tensor fromVector(const std::vector<T>& values);
template <typename T>
Tensor fromVector(const std::vector<T>& values, Shape sizes);
template <typename T>
Tensor fromVector(const std::vector<T>& values, Shape sizes, DType dtype);
template <typename T>
Tensor fromVector(const std::vector<T>& values, Shape sizes, const TensorOptions& options);

// fromBlob: a tensor over memory the caller allocated; nothing is copied, and writes through
// the tensor (or any view of it) land in the caller's memory.
//
// Lifetime. The tensor, its views (view, transpose, narrow, ...), tensors detach() gives, and
// autograd graphs that saved it for backward all share one Storage; the memory must stay
// valid until the last of them is gone.
//  * With a deleter (it takes ownership): deleter(data) runs exactly once, when the last of
//    them is destroyed, on whichever thread drops it (an autograd or backend worker thread
//    too), so it must be safe to call from any thread. It runs for an empty tensor as well.
//    It must not throw; if it does, the exception is logged ("tensor" logger) and dropped,
//    because it runs inside a destructor. If fromBlob itself throws, the deleter is not
//    called and the caller still owns the memory.
//  * Without one (an empty std::function): the caller keeps ownership and must keep the
//    memory alive, unmoved, for as long as any of the above refers to it; dtrain never frees
//    it. Copies (clone, contiguous on a strided blob, to(dtype)) are ordinary tensors.
// Checks, each an InvalidArgument naming the value: data is null while the shape has
// elements (null is allowed for zero elements); data is not aligned to the dtype's alignment
// (alignof of its C++ type: 4 for float32, 8 for float64/int64, 2 for 16-bit types); a
// negative size or stride; strides whose length differs from sizes. Unaligned memory is
// refused rather than copied because the kernels access elements through typed pointers.
// Only cpu memory can be wrapped for now: another device throws NotSupportedError.
// Strides are in elements, like everywhere in Tensor; the first element is at data.
using BlobDeleter = std::function<void(void* data)>;
Tensor fromBlob(void* data, Shape sizes, DType dtype = DType::Float32, BlobDeleter deleter = {});
Tensor fromBlob(void* data, Shape sizes, Shape strides, DType dtype = DType::Float32, BlobDeleter deleter = {});
Tensor fromBlob(void* data, Shape sizes, const TensorOptions& options, BlobDeleter deleter = {});
Tensor fromBlob(void* data, Shape sizes, Shape strides, const TensorOptions& options, BlobDeleter deleter = {});

// Helpers shared by ops.
int64_t wrapDim(int64_t dim, int64_t ndim, const char* op);
int64_t shapeNumel(const Shape& sizes);
Shape contiguousStrides(const Shape& sizes);

// ---- template definitions --------------------------------------------------------
namespace detail {
void readScalars(const Tensor& t, DType as, void* out);  // contiguous out, numel elements
Tensor fromBytes(const void* data, Shape sizes, DType srcType, size_t count);
// Converts a fresh tensor to options' dtype and device and sets requiresGrad.
Tensor applyOptions(Tensor fresh, const TensorOptions& options);
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
Tensor fromVector(const std::vector<T>& values) {
  return fromVector(values, Shape{static_cast<int64_t>(values.size())});
}

template <typename T>
Tensor fromVector(const std::vector<T>& values, Shape sizes) {
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

template <typename T>
Tensor fromVector(const std::vector<T>& values, Shape sizes, const TensorOptions& options) {
  return detail::applyOptions(fromVector(values, std::move(sizes)), options);
}

}  // namespace dt
