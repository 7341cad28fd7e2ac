#include "tensor/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "common/check.h"
#include "common/config.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"
#include "tensor/deferred_checks.h"
#include "tensor/internal/detail.h"
#include "tensor/internal/loop.h"
#include "tensor/internal/op_scope.h"
#include "tensor/internal/ops_internal.h"
#include "tensor/parallel.h"

#if DT_HAVE_CUDA
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/stream.h"
#include "tensor/internal/cuda_ops.h"
#endif

namespace dt {

// ---- geometry helpers ------------------------------------------------------------

int64_t shapeNumel(const Shape& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

Shape contiguousStrides(const Shape& sizes) {
  Shape strides(sizes.size());
  int64_t s = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(sizes[i], 1);
  }
  return strides;
}

int64_t wrapDim(int64_t dim, int64_t ndim, const char* op) {
  const int64_t range = std::max<int64_t>(ndim, 1);
  if (dim < -range || dim >= range) {
    throw InvalidArgument(str(op, ": dimension ", dim, " out of range for a tensor with ", ndim,
                              " dims (expected [", -range, ", ", range - 1, "])"));
  }
  return dim < 0 ? dim + range : dim;
}

std::string describeShape(const Shape& sizes) {
  std::string out;
  out.reserve(2 + sizes.size() * 6);
  out.push_back('[');
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) out.append(", ");
    out.append(std::to_string(sizes[i]));
  }
  out.push_back(']');
  return out;
}

void TensorImpl::refreshGeometry() {
  numel = shapeNumel(sizes);
  contiguous = true;
  int64_t expected = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] == 1) continue;
    if (strides[i] != expected) {
      contiguous = false;
      break;
    }
    expected *= sizes[i];
  }
}

namespace {

std::shared_ptr<TensorImpl> makeImpl(Storage storage, Shape sizes, Shape strides, int64_t offset, DType dtype,
                                     std::shared_ptr<VersionCounter> version) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->sizes = std::move(sizes);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = dtype;
  impl->version = version ? std::move(version) : std::make_shared<VersionCounter>();
  impl->refreshGeometry();
  return impl;
}

void checkSizes(const Shape& sizes, const char* op) {
  for (int64_t s : sizes) {
    if (s < 0) throw InvalidArgument(str(op, ": negative size in shape ", describeShape(sizes)));
  }
}

}  // namespace

// ---- Tensor basics ---------------------------------------------------------------

TensorImpl& Tensor::impl() const {
  if (!impl_) throw InvalidArgument("operation on an undefined tensor (default-constructed Tensor)");
  return *impl_;
}

int64_t Tensor::size(int64_t d) const { return impl().sizes[wrapDim(d, dim(), "size")]; }
int64_t Tensor::stride(int64_t d) const { return impl().strides[wrapDim(d, dim(), "stride")]; }

void* Tensor::dataPtr() {
  auto& i = impl();
  return static_cast<char*>(i.storage.data()) + i.offset * static_cast<int64_t>(itemSize(i.dtype));
}
const void* Tensor::dataPtr() const {
  auto& i = impl();
  return static_cast<const char*>(i.storage.data()) + i.offset * static_cast<int64_t>(itemSize(i.dtype));
}

void Tensor::checkDType(DType expected, const char* what) const {
  if (dtype() != expected) {
    throw InvalidArgument(str(what, ": tensor is ", describe(), " but ", expected, " was requested"));
  }
}

void Tensor::throwItemNotScalar() const {
  throw InvalidArgument(str("item(): tensor ", describe(), " has ", numel(), " elements, expected exactly 1"));
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined";
  std::string s = str(dtype(), describeShape(sizes()));
  if (!device().isCpu()) s += str(" on ", device());
  return s;
}

// ---- factories -------------------------------------------------------------------------

Tensor empty(Shape sizes, DType dtype, Device device) {
  checkSizes(sizes, "empty");
  const size_t bytes = static_cast<size_t>(shapeNumel(sizes)) * itemSize(dtype);
  Shape strides = contiguousStrides(sizes);
  return Tensor(makeImpl(Storage(bytes, device), std::move(sizes), std::move(strides), 0, dtype, nullptr));
}

Tensor emptyStrided(Shape sizes, Shape strides, DType dtype, Device device) {
  checkSizes(sizes, "emptyStrided");
  DT_CHECK_EQ(sizes.size(), strides.size(), "emptyStrided: sizes and strides differ in length");
  int64_t span = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) span = 0;
  }
  if (span != 0) {
    for (size_t i = 0; i < sizes.size(); ++i) span += (sizes[i] - 1) * strides[i];
  }
  return Tensor(makeImpl(Storage(static_cast<size_t>(span) * itemSize(dtype), device), std::move(sizes),
                         std::move(strides), 0, dtype, nullptr));
}

Tensor emptyLike(const Tensor& t) { return empty(t.sizes(), t.dtype(), t.device()); }

Tensor zeros(Shape sizes, DType dtype, Device device) {
  detail::OpScope opScope("zeros");
  Tensor t = empty(std::move(sizes), dtype, device);
  if (t.device().isCpu()) {
    std::memset(t.dataPtr(), 0, t.nbytes());
  } else {
    t.fill_(0.0);
  }
  return t;
}
Tensor zerosLike(const Tensor& t) { return zeros(t.sizes(), t.dtype(), t.device()); }
Tensor ones(Shape sizes, DType dtype, Device device) { return full(std::move(sizes), 1.0, dtype, device); }
Tensor onesLike(const Tensor& t) { return ones(t.sizes(), t.dtype(), t.device()); }

Tensor full(Shape sizes, double value, DType dtype, Device device) {
  detail::OpScope opScope("full");
  Tensor t = empty(std::move(sizes), dtype, device);
  t.fill_(value);
  return t;
}

Tensor scalarTensor(double value, DType dtype) { return full({}, value, dtype); }

Tensor empty(Shape sizes, const TensorOptions& options) {
  return detail::applyOptions(empty(std::move(sizes), options.dtype(), options.device()), options);
}
Tensor zeros(Shape sizes, const TensorOptions& options) {
  return detail::applyOptions(zeros(std::move(sizes), options.dtype(), options.device()), options);
}
Tensor ones(Shape sizes, const TensorOptions& options) {
  return detail::applyOptions(ones(std::move(sizes), options.dtype(), options.device()), options);
}
Tensor full(Shape sizes, double value, const TensorOptions& options) {
  return detail::applyOptions(full(std::move(sizes), value, options.dtype(), options.device()), options);
}
Tensor scalarTensor(double value, const TensorOptions& options) { return full({}, value, options); }
// arange fills on the cpu; applyOptions moves the result when options name another device.
Tensor arange(int64_t n, const TensorOptions& options) {
  return detail::applyOptions(arange(n, options.dtype()), options);
}
Tensor arange(double start, double end, double step, const TensorOptions& options) {
  return detail::applyOptions(arange(start, end, step, options.dtype()), options);
}

std::ostream& operator<<(std::ostream& out, const TensorOptions& options) {
  return out << "TensorOptions(dtype=" << options.dtype() << ", device=" << options.device()
             << ", requiresGrad=" << (options.requiresGrad() ? "true" : "false") << ")";
}

Tensor arange(int64_t n, DType dtype) {
  detail::OpScope opScope("arange");
  DT_CHECK_GE(n, 0, "arange: n must be non-negative");
  Tensor t = empty({n}, dtype);
  dispatchDType(dtype, [&]<typename T>() {
    T* p = static_cast<T*>(t.dataPtr());
    for (int64_t i = 0; i < n; ++i) p[i] = convertScalar<T>(static_cast<double>(i));
  });
  return t;
}

Tensor arange(double start, double end, double step, DType dtype) {
  detail::OpScope opScope("arange");
  DT_CHECK(step != 0.0, "arange: step must be non-zero");
  const int64_t n = std::max<int64_t>(0, static_cast<int64_t>(std::ceil((end - start) / step)));
  Tensor t = empty({n}, dtype);
  dispatchDType(dtype, [&]<typename T>() {
    T* p = static_cast<T*>(t.dataPtr());
    for (int64_t i = 0; i < n; ++i) p[i] = convertScalar<T>(start + static_cast<double>(i) * step);
  });
  return t;
}

namespace detail {

Tensor fromBytes(const void* data, Shape sizes, DType srcType, size_t count) {
  checkSizes(sizes, "fromVector");
  if (sizes.empty() && count != 1) {
    // Before {} meant 0-dim here, it meant "1-D of all the values"; say how to get that now.
    throw InvalidArgument(str("fromVector: shape [] is a 0-dim tensor and takes exactly 1 value, got ", count,
                              " values; call fromVector(values) without a shape for a 1-D tensor"));
  }
  if (static_cast<size_t>(shapeNumel(sizes)) != count) {
    throw InvalidArgument(str("fromVector: ", count, " values do not fill shape ", describeShape(sizes), ", which holds ",
                              shapeNumel(sizes)));
  }
  Tensor t = empty(std::move(sizes), srcType);
  if (count > 0) std::memcpy(t.dataPtr(), data, count * itemSize(srcType));
  return t;
}

Tensor applyOptions(Tensor fresh, const TensorOptions& options) {
  Tensor out = fresh.to(options.dtype()).to(options.device());
  if (options.requiresGrad()) out.setRequiresGrad(true);
  return out;
}

}  // namespace detail

// ---- fromBlob ----------------------------------------------------------------------------

namespace {

// DataPtr frees through a plain function and a context; the context owns the caller's deleter.
struct BlobOwner {
  BlobDeleter deleter;
};

void releaseBlob(void* context, void* data) noexcept {
  std::unique_ptr<BlobOwner> owner(static_cast<BlobOwner*>(context));
  // This runs in a destructor (the last Storage reference going away), so an exception
  // cannot propagate; letting it escape would terminate the process.
  try {
    owner->deleter(data);
  } catch (const std::exception& e) {
    logger("tensor")->error("fromBlob: the deleter for memory at {} threw and the exception was dropped: {}", data,
                            e.what());
  } catch (...) {
    logger("tensor")->error("fromBlob: the deleter for memory at {} threw a non-std exception; dropped", data);
  }
}

size_t dtypeAlignment(DType dtype) {
  return dispatchDType(dtype, []<typename T>() { return alignof(T); });
}

}  // namespace

Tensor fromBlob(void* data, Shape sizes, Shape strides, const TensorOptions& options, BlobDeleter deleter) {
  const char* op = "fromBlob";
  if (!options.device().isCpu()) {
    throw NotSupportedError(str("fromBlob: wrapping memory on ", options.device(),
                                " is not supported yet; only cpu memory can be wrapped (wrap it on the cpu and "
                                "call to(device), which copies)"));
  }
  checkSizes(sizes, op);
  if (strides.size() != sizes.size()) {
    throw InvalidArgument(str("fromBlob: strides ", describeShape(strides), " and sizes ", describeShape(sizes),
                              " differ in length"));
  }
  for (int64_t stride : strides) {
    if (stride < 0) throw InvalidArgument(str("fromBlob: negative stride in ", describeShape(strides)));
  }
  const int64_t numel = shapeNumel(sizes);
  if (data == nullptr && numel > 0) {
    throw InvalidArgument(str("fromBlob: data pointer is null but shape ", describeShape(sizes), " has ", numel,
                              " elements (null is allowed only for an empty tensor)"));
  }
  const DType dtype = options.dtype();
  const size_t alignment = dtypeAlignment(dtype);
  const auto address = reinterpret_cast<uintptr_t>(data);
  if (address % alignment != 0) {
    throw InvalidArgument(str("fromBlob: data pointer ", data, " is not aligned for ", dtype, " (needs ", alignment,
                              "-byte alignment, address % ", alignment, " = ", address % alignment,
                              "); copy the bytes into an aligned buffer or a tensor from empty()"));
  }
  // Checked here, before the memory is adopted: once it is, a failure would run the deleter.
  if (options.requiresGrad() && !isFloatingPoint(dtype)) {
    throw InvalidArgument(str("fromBlob: requiresGrad needs a floating point dtype, got ", dtype));
  }
  // One past the furthest element any index can reach: the bytes the Storage covers.
  int64_t span = numel > 0 ? 1 : 0;
  if (numel > 0) {
    for (size_t i = 0; i < sizes.size(); ++i) span += (sizes[i] - 1) * strides[i];
  }
  DataPtr owned = deleter ? DataPtr(data, new BlobOwner{std::move(deleter)}, &releaseBlob, Device::cpu())
                          : DataPtr(data, nullptr, nullptr, Device::cpu());
  Storage storage(std::move(owned), static_cast<size_t>(span) * itemSize(dtype));
  Tensor out(makeImpl(std::move(storage), std::move(sizes), std::move(strides), 0, dtype, nullptr));
  if (options.requiresGrad()) out.setRequiresGrad(true);
  return out;
}

Tensor fromBlob(void* data, Shape sizes, const TensorOptions& options, BlobDeleter deleter) {
  Shape strides = contiguousStrides(sizes);
  return fromBlob(data, std::move(sizes), std::move(strides), options, std::move(deleter));
}

Tensor fromBlob(void* data, Shape sizes, DType dtype, BlobDeleter deleter) {
  return fromBlob(data, std::move(sizes), TensorOptions().dtype(dtype), std::move(deleter));
}

Tensor fromBlob(void* data, Shape sizes, Shape strides, DType dtype, BlobDeleter deleter) {
  return fromBlob(data, std::move(sizes), std::move(strides), TensorOptions().dtype(dtype), std::move(deleter));
}

// ---- copy / conversion ------------------------------------------------------------------

namespace {

template <typename To, typename From>
void convertRun(char* dst, const char* src, int64_t ds, int64_t ss, int64_t n) {
  if (ds == static_cast<int64_t>(sizeof(To)) && ss == static_cast<int64_t>(sizeof(From))) {
    To* d = reinterpret_cast<To*>(dst);
    const From* s = reinterpret_cast<const From*>(src);
    if constexpr (std::is_same_v<To, From>) {
      std::memcpy(d, s, static_cast<size_t>(n) * sizeof(To));
    } else {
      for (int64_t i = 0; i < n; ++i) d[i] = convertScalar<To>(s[i]);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    From v;
    std::memcpy(&v, src + i * ss, sizeof(From));
    To w = convertScalar<To>(v);
    std::memcpy(dst + i * ds, &w, sizeof(To));
  }
}

// Broadcast src's strides to `shape` (0 for new or size-1 dims).
Shape broadcastStrides(const Tensor& src, const Shape& shape, const char* op) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  const int64_t sd = src.dim();
  if (sd > nd) {
    throw InvalidArgument(str(op, ": cannot broadcast ", src.describe(), " to shape ", describeShape(shape)));
  }
  Shape strides(static_cast<size_t>(nd), 0);
  for (int64_t i = 0; i < sd; ++i) {
    const int64_t d = nd - sd + i;
    const int64_t s = src.sizes()[static_cast<size_t>(i)];
    if (s == shape[static_cast<size_t>(d)]) {
      strides[static_cast<size_t>(d)] = src.strides()[static_cast<size_t>(i)];
    } else if (s != 1) {
      throw InvalidArgument(str(op, ": cannot broadcast ", src.describe(), " to shape ", describeShape(shape)));
    }
  }
  return strides;
}

}  // namespace

Tensor& Tensor::copy_(const Tensor& src) {
  detail::OpScope opScope("copy_", *this, src);
  const char* op = "copy_";
  if (gradModeEnabled() && (src.requiresGrad() || requiresGrad())) {
    detail::inplaceNeedsGrad(*this, {src}, op);
    {
      NoGradGuard noGrad;
      copy_(src);
    }
    // The gradient goes back to the source's device.
    detail::recordFn("CopyBackward", {src}, *this, nullptr,
                     [srcDevice = src.device()](const detail::BackwardContext& c) -> TensorList {
                       return {c.grads[0].to(srcDevice)};
                     });
    return *this;
  }
  const bool dstCuda = detail::onCuda(*this, op);
  const bool srcCuda = detail::onCuda(src, op);
  if (dstCuda || srcCuda) {
#if DT_HAVE_CUDA
    detail::cudaCopy(*this, src);
    bumpVersion();
#endif
    return *this;
  }
  Shape srcStrides = broadcastStrides(src, sizes(), op);
  if (numel() == 0) return *this;
  const DType dt = dtype(), st = src.dtype();
  const int64_t di = static_cast<int64_t>(itemSize(dt)), si = static_cast<int64_t>(itemSize(st));
  detail::ElementLoop<2> loop(sizes(), {static_cast<char*>(dataPtr()), static_cast<char*>(const_cast<void*>(src.dataPtr()))},
                              {strides().data(), srcStrides.data()}, {di, si});
  dispatchDType(dt, [&]<typename To>() {
    dispatchDType(st, [&]<typename From>() {
      parallelFor(0, loop.numel(), 1 << 16, [&](int64_t b, int64_t e) {
        loop.run(b, e, [&](char** p, const int64_t* s, int64_t n) { convertRun<To, From>(p[0], p[1], s[0], s[1], n); });
      });
    });
  });
  bumpVersion();
  return *this;
}

Tensor Tensor::contiguous() const {
  if (isContiguous()) return *this;
  return clone();
}

Tensor Tensor::to(DType target) const {
  if (dtype() == target) return *this;
  detail::OpScope opScope("to", *this);
  Tensor out = empty(sizes(), target, device());
  {
    NoGradGuard noGrad;
    out.copy_(*this);
  }
  detail::recordFn("ToBackward", {*this}, out, nullptr,
                   [](const detail::BackwardContext& c) -> TensorList { return {c.grads[0]}; });
  return out;
}

Tensor Tensor::to(Device target) const {
  if (device() == target) return *this;
  detail::OpScope opScope("to", *this);
  Tensor out = empty(sizes(), dtype(), target);
  {
    NoGradGuard noGrad;
    out.copy_(*this);
  }
  detail::recordFn("ToDeviceBackward", {*this}, out, nullptr,
                   [source = device()](const detail::BackwardContext& c) -> TensorList {
                     return {c.grads[0].to(source)};
                   });
  return out;
}

Tensor& Tensor::fill_(double value) {
  detail::OpScope opScope("fill_", *this);
  const bool onGpu = detail::onCuda(*this, "fill_");
  if (detail::inplaceNeedsGrad(*this, {}, "fill_")) {
    throw NotSupportedError(str("fill_ on ", describe(), " which has autograd history (", gradFn()->name(),
                                "); use zerosLike/full or detach() first"));
  }
  if (onGpu) {
#if DT_HAVE_CUDA
    cuda::fill(device(), dtype(), dataPtr(), cuda::makeGeometry(sizes(), {strides()}, "fill_"), value);
    bumpVersion();
#endif
    return *this;
  }
  dispatchDType(dtype(), [&]<typename T>() {
    const T v = convertScalar<T>(value);
    const int64_t item = static_cast<int64_t>(sizeof(T));
    detail::ElementLoop<1> loop(sizes(), {static_cast<char*>(dataPtr())}, {strides().data()}, {item});
    loop.run(0, loop.numel(), [&](char** p, const int64_t* s, int64_t n) {
      if (s[0] == item) {
        T* d = reinterpret_cast<T*>(p[0]);
        std::fill(d, d + n, v);
      } else {
        for (int64_t i = 0; i < n; ++i) std::memcpy(p[0] + i * s[0], &v, sizeof(T));
      }
    });
  });
  bumpVersion();
  return *this;
}

#if DT_HAVE_CUDA
void detail::cudaCopy(Tensor& dst, const Tensor& src) {
  NoGradGuard noGrad;
  const Shape srcStrides = broadcastStrides(src, dst.sizes(), "copy_");
  if (dst.numel() == 0) return;
  if (dst.device() == src.device()) {
    cuda::copy(dst.device(), dst.dtype(), dst.dataPtr(), src.dtype(), src.dataPtr(),
               cuda::makeGeometry(dst.sizes(), {dst.strides(), srcStrides}, "copy_"));
    return;
  }
  // Across devices only dense bytes move: convert and lay out on the source side, land in a
  // dense buffer on the destination side, then scatter into dst's strides there.
  Tensor staged = src;
  if (src.sizes() != dst.sizes() || src.dtype() != dst.dtype() || !src.isContiguous()) {
    staged = empty(dst.sizes(), dst.dtype(), src.device());
    staged.copy_(src);
  }
  Tensor landing = dst.isContiguous() ? dst : empty(dst.sizes(), dst.dtype(), dst.device());
  // On the current stream of the source's GPU (else the destination's), so the copy follows
  // the kernels that wrote the bytes. A host side is complete on return, as copy_ promises;
  // between two GPUs the destination's stream waits for the copy, and the copy for it.
  const Device side = src.device().isCuda() ? src.device() : dst.device();
  const cuda::Stream stream = cuda::currentStream(side);
  const bool betweenGpus = src.device().isCuda() && dst.device().isCuda();
  if (betweenGpus) {
    cuda::Event dstReady;
    dstReady.record(cuda::currentStream(dst.device()));
    dstReady.block(stream);
  }
  cuda::copyBytesAsync(landing.dataPtr(), dst.device(), staged.dataPtr(), src.device(), dst.nbytes(), stream);
  if (betweenGpus) {
    cuda::Event copied;
    copied.record(stream);
    copied.block(cuda::currentStream(dst.device()));
  } else {
    stream.synchronize();
  }
  if (!landing.isSameAs(dst)) dst.copy_(landing);
  // The host has just waited for this device: an earlier op's index check that failed is
  // raised here, at no extra wait (tensor/deferred_checks.h).
  if (!betweenGpus) detail::raiseDeferredChecks(side, false, "the next copy between the host and this device");
}
#endif

namespace detail {

void readScalars(const Tensor& t, DType as, void* out) {
  // A CUDA tensor is copied to the host by copy_ below, which waits for the device.
  (void)onCuda(t, "reading values");
  NoGradGuard noGrad;
  Tensor dst = Tensor(makeImpl(Storage(DataPtr(out, nullptr, nullptr, Device::cpu()), t.numel() * itemSize(as)),
                               t.sizes(), contiguousStrides(t.sizes()), 0, as, nullptr));
  dst.copy_(t);
}

}  // namespace detail

// ---- views -----------------------------------------------------------------------------------

namespace {

Tensor makeView(const Tensor& base, Shape sizes, Shape strides, int64_t offset) {
  TensorImpl* b = base.unsafeImpl();
  return Tensor(makeImpl(b->storage, std::move(sizes), std::move(strides), offset, b->dtype, b->version));
}

// Strides for viewing (sizes, strides) as newSizes without copying, or empty if impossible.
std::optional<Shape> computeViewStrides(const Shape& sizes, const Shape& strides, const Shape& newSizes) {
  if (sizes.empty()) return contiguousStrides(newSizes);
  const int64_t numel = shapeNumel(sizes);
  if (numel == 0) return contiguousStrides(newSizes);
  Shape newStrides(newSizes.size());
  int64_t viewD = static_cast<int64_t>(newSizes.size()) - 1;
  int64_t chunkBaseStride = strides.back();
  int64_t tensorNumel = 1, viewNumel = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    tensorNumel *= sizes[d];
    if (d == 0 || (sizes[d - 1] != 1 && strides[d - 1] != tensorNumel * chunkBaseStride)) {
      while (viewD >= 0 && (viewNumel < tensorNumel || newSizes[viewD] == 1)) {
        newStrides[viewD] = viewNumel * chunkBaseStride;
        viewNumel *= newSizes[viewD];
        --viewD;
      }
      if (viewNumel != tensorNumel) return std::nullopt;
      if (d > 0) {
        chunkBaseStride = strides[d - 1];
        tensorNumel = 1;
        viewNumel = 1;
      }
    }
  }
  if (viewD != -1) return std::nullopt;
  return newStrides;
}

Shape inferSize(Shape sizes, int64_t numel, const Tensor& t, const char* op) {
  int64_t known = 1;
  int64_t inferred = -1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == -1) {
      if (inferred >= 0) throw InvalidArgument(str(op, ": only one dimension can be -1 in ", describeShape(sizes)));
      inferred = static_cast<int64_t>(i);
    } else if (sizes[i] < 0) {
      throw InvalidArgument(str(op, ": invalid size in ", describeShape(sizes)));
    } else {
      known *= sizes[i];
    }
  }
  if (inferred >= 0) {
    if (known == 0 || numel % known != 0) {
      throw InvalidArgument(str(op, ": shape ", describeShape(sizes), " is invalid for input ", t.describe()));
    }
    sizes[static_cast<size_t>(inferred)] = numel / known;
  } else if (known != numel) {
    throw InvalidArgument(str(op, ": shape ", describeShape(sizes), " is invalid for input ", t.describe()));
  }
  return sizes;
}

}  // namespace

// View ops without autograd; the autograd-aware versions live in ops (they call these).
namespace detail {

Tensor viewNoGrad(const Tensor& t, Shape sizes) {
  sizes = inferSize(std::move(sizes), t.numel(), t, "view");
  auto strides = computeViewStrides(t.sizes(), t.strides(), sizes);
  if (!strides) {
    throw InvalidArgument(str("view: shape ", describeShape(sizes), " is incompatible with the strides ",
                              describeShape(t.strides()), " of ", t.describe(),
                              "; use reshape() (which copies) or contiguous() first"));
  }
  return makeView(t, std::move(sizes), std::move(*strides), t.storageOffset());
}

bool canView(const Tensor& t, const Shape& sizes) {
  Shape s = inferSize(sizes, t.numel(), t, "reshape");
  return computeViewStrides(t.sizes(), t.strides(), s).has_value();
}

Tensor asStridedNoGrad(const Tensor& t, Shape sizes, Shape strides, int64_t offset) {
  DT_CHECK_EQ(sizes.size(), strides.size(), "asStrided: sizes ", describeShape(sizes), " and strides ",
              describeShape(strides), " differ in length");
  checkSizes(sizes, "asStrided");
  if (offset < 0) offset = t.storageOffset();
  int64_t maxIndex = offset;
  bool emptyShape = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) emptyShape = true;
    if (strides[i] < 0) throw InvalidArgument(str("asStrided: negative stride in ", describeShape(strides)));
    maxIndex += (sizes[i] - 1) * strides[i];
  }
  const int64_t capacity = static_cast<int64_t>(t.storage().nbytes() / t.itemsize());
  if (!emptyShape && maxIndex >= capacity) {
    throw InvalidArgument(str("asStrided: sizes ", describeShape(sizes), " strides ", describeShape(strides),
                              " offset ", offset, " reach element ", maxIndex, " but the storage of ", t.describe(),
                              " holds ", capacity, " elements"));
  }
  return makeView(t, std::move(sizes), std::move(strides), offset);
}

Tensor sliceNoGrad(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step) {
  dim = wrapDim(dim, t.dim(), "slice");
  DT_CHECK_GT(step, 0, "slice: step must be positive");
  const int64_t size = t.sizes()[dim];
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = std::clamp<int64_t>(start, 0, size);
  end = std::clamp<int64_t>(end, start, size);
  Shape sizes = t.sizes(), strides = t.strides();
  sizes[dim] = (end - start + step - 1) / step;
  strides[dim] *= step;
  return makeView(t, std::move(sizes), std::move(strides), t.storageOffset() + start * t.strides()[dim]);
}

Tensor narrowNoGrad(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  dim = wrapDim(dim, t.dim(), "narrow");
  const int64_t size = t.sizes()[dim];
  if (start < 0) start += size;
  if (start < 0 || length < 0 || start + length > size) {
    throw InvalidArgument(str("narrow: start ", start, " length ", length, " out of range for dim ", dim,
                              " of size ", size, " in ", t.describe()));
  }
  Shape sizes = t.sizes();
  sizes[dim] = length;
  return makeView(t, std::move(sizes), t.strides(), t.storageOffset() + start * t.strides()[dim]);
}

Tensor selectNoGrad(const Tensor& t, int64_t dim, int64_t index) {
  dim = wrapDim(dim, t.dim(), "select");
  const int64_t size = t.sizes()[dim];
  if (index < -size || index >= size) {
    throw InvalidArgument(str("select: index ", index, " out of range for dim ", dim, " of size ", size, " in ",
                              t.describe()));
  }
  if (index < 0) index += size;
  Shape sizes = t.sizes(), strides = t.strides();
  const int64_t offset = t.storageOffset() + index * strides[dim];
  sizes.erase(sizes.begin() + dim);
  strides.erase(strides.begin() + dim);
  return makeView(t, std::move(sizes), std::move(strides), offset);
}

Tensor permuteNoGrad(const Tensor& t, const Shape& dims) {
  if (static_cast<int64_t>(dims.size()) != t.dim()) {
    throw InvalidArgument(str("permute: dims ", describeShape(dims), " do not match ", t.describe()));
  }
  Shape sizes(dims.size()), strides(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = wrapDim(dims[i], t.dim(), "permute");
    if (seen[d]) throw InvalidArgument(str("permute: repeated dim in ", describeShape(dims)));
    seen[d] = true;
    sizes[i] = t.sizes()[d];
    strides[i] = t.strides()[d];
  }
  return makeView(t, std::move(sizes), std::move(strides), t.storageOffset());
}

Tensor expandNoGrad(const Tensor& t, const Shape& target) {
  const int64_t nd = static_cast<int64_t>(target.size());
  if (nd < t.dim()) {
    throw InvalidArgument(str("expand: target shape ", describeShape(target), " has fewer dims than ", t.describe()));
  }
  Shape sizes(nd), strides(nd);
  for (int64_t i = nd - 1; i >= 0; --i) {
    const int64_t j = i - (nd - t.dim());
    int64_t want = target[i];
    if (j >= 0) {
      const int64_t have = t.sizes()[j];
      if (want == -1) want = have;
      if (have == want) {
        sizes[i] = have;
        strides[i] = t.strides()[j];
      } else if (have == 1) {
        sizes[i] = want;
        strides[i] = 0;
      } else {
        throw InvalidArgument(str("expand: cannot expand ", t.describe(), " to ", describeShape(target),
                                  " (dim ", i, ": ", have, " vs ", want, ")"));
      }
    } else {
      if (want < 0) throw InvalidArgument(str("expand: -1 not allowed for a new leading dim in ", describeShape(target)));
      sizes[i] = want;
      strides[i] = 0;
    }
  }
  return makeView(t, std::move(sizes), std::move(strides), t.storageOffset());
}

Tensor squeezeNoGrad(const Tensor& t, std::optional<int64_t> dim) {
  Shape sizes, strides;
  int64_t only = dim ? wrapDim(*dim, t.dim(), "squeeze") : -1;
  for (int64_t i = 0; i < t.dim(); ++i) {
    const bool drop = t.sizes()[i] == 1 && (only < 0 || only == i);
    if (!drop) {
      sizes.push_back(t.sizes()[i]);
      strides.push_back(t.strides()[i]);
    }
  }
  return makeView(t, std::move(sizes), std::move(strides), t.storageOffset());
}

Tensor unsqueezeNoGrad(const Tensor& t, int64_t dim) {
  dim = wrapDim(dim, t.dim() + 1, "unsqueeze");
  Shape sizes = t.sizes(), strides = t.strides();
  const int64_t stride = dim < t.dim() ? t.sizes()[dim] * t.strides()[dim] : 1;
  sizes.insert(sizes.begin() + dim, 1);
  strides.insert(strides.begin() + dim, stride);
  return makeView(t, std::move(sizes), std::move(strides), t.storageOffset());
}

Tensor shallowCopy(const Tensor& t) {
  return makeView(t, t.sizes(), t.strides(), t.storageOffset());
}

}  // namespace detail

// ---- printing ------------------------------------------------------------------------------------

namespace {

void printRecursive(std::ostream& out, const std::vector<double>& v, const Shape& sizes, size_t d, int64_t& pos,
                    bool isFloat) {
  if (d == sizes.size()) {
    const double x = v[static_cast<size_t>(pos++)];
    if (isFloat) {
      out << x;
    } else {
      out << static_cast<int64_t>(x);
    }
    return;
  }
  out << "[";
  const int64_t n = sizes[d];
  for (int64_t i = 0; i < n; ++i) {
    if (i) out << ", ";
    if (n > 12 && i == 6) {
      out << "...";
      // Skip the middle elements.
      int64_t per = 1;
      for (size_t k = d + 1; k < sizes.size(); ++k) per *= sizes[k];
      pos += per * (n - 12);
      i = n - 6 - 1;
      continue;
    }
    printRecursive(out, v, sizes, d + 1, pos, isFloat);
  }
  out << "]";
}

}  // namespace

std::string Tensor::toString() const {
  if (!defined()) return "tensor(undefined)";
  std::ostringstream out;
  out << "tensor(" << describe() << ") ";
  if (!device().isCpu()) {
#if DT_HAVE_CUDA
    if (cuda::deviceCount() == 0) return out.str() + "<not on cpu>";
#else
    return out.str() + "<not on cpu>";
#endif
  }
  std::vector<double> values = toVector<double>();
  int64_t pos = 0;
  printRecursive(out, values, sizes(), 0, pos, isFloatingPoint(dtype()));
  return out.str();
}

std::ostream& operator<<(std::ostream& out, const Tensor& t) { return out << t.toString(); }

}  // namespace dt
