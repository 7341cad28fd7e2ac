// Tensor's view and copy members. With autograd on, each view records a node
// whose backward maps the gradient back onto the base's geometry.
#include "common/check.h"
#include "common/strings.h"
#include "tensor/internal/detail.h"
#include "tensor/internal/ops_internal.h"
#include "tensor/tensor.h"
#include "tensor/internal/op_scope.h"

namespace dt {

using namespace detail;

namespace {

// Marks out as a differentiable view and records backward (g -> grad of base).
Tensor recordView(const char* name, const Tensor& base, Tensor out, BackwardFn fn) {
  if (autograd::needsGrad({&base})) {
    recordFn(name, {base}, out, nullptr, std::move(fn));
    out.unsafeImpl()->isView = true;
  }
  return out;
}

// Gradient of a strided view of base: zeros of base's shape with g written into the same view.
TensorList scatterIntoView(const Shape& inShape, DType dtype, const Tensor& g,
                           const std::function<Tensor(const Tensor&)>& makeView) {
  Tensor z = zeros(inShape, dtype, g.device());
  Tensor v = makeView(z);
  v.copy_(g);
  return {z};
}

}  // namespace

Tensor Tensor::clone() const {
  detail::OpScope opScope("clone", *this);
  Tensor out = empty(sizes(), dtype(), device());
  {
    NoGradGuard ng;
    out.copy_(*this);
  }
  recordFn("CloneBackward", {*this}, out, nullptr, [](const BackwardContext& c) -> TensorList { return {c.grads[0]}; });
  return out;
}

Tensor Tensor::view(Shape newSizes) const {
  detail::OpScope opScope("view", *this);
  Tensor out = viewNoGrad(*this, std::move(newSizes));
  const Shape in = sizes();
  return recordView("ViewBackward", *this, out, [in](const BackwardContext& c) -> TensorList {
    return {c.grads[0].reshape(in)};
  });
}

Tensor Tensor::reshape(Shape newSizes) const {
  detail::OpScope opScope("reshape", *this);
  if (canView(*this, newSizes)) return view(std::move(newSizes));
  return clone().view(std::move(newSizes));
}

Tensor Tensor::flatten(int64_t startDim, int64_t endDim) const {
  detail::OpScope opScope("flatten", *this);
  if (dim() == 0) return reshape({1});
  startDim = wrapDim(startDim, dim(), "flatten");
  endDim = wrapDim(endDim, dim(), "flatten");
  DT_CHECK_LE(startDim, endDim, "flatten: start dim after end dim");
  Shape s;
  for (int64_t i = 0; i < startDim; ++i) s.push_back(sizes()[i]);
  int64_t m = 1;
  for (int64_t i = startDim; i <= endDim; ++i) m *= sizes()[i];
  s.push_back(m);
  for (int64_t i = endDim + 1; i < dim(); ++i) s.push_back(sizes()[i]);
  return reshape(std::move(s));
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  detail::OpScope opScope("narrow", *this);
  Tensor out = narrowNoGrad(*this, d, start, length);
  const Shape in = sizes();
  const DType t = dtype();
  return recordView("NarrowBackward", *this, out, [in, t, d, start, length](const BackwardContext& c) -> TensorList {
    return scatterIntoView(in, t, c.grads[0], [&](const Tensor& z) { return narrowNoGrad(z, d, start, length); });
  });
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  detail::OpScope opScope("slice", *this);
  Tensor out = sliceNoGrad(*this, d, start, end, step);
  const Shape in = sizes();
  const DType t = dtype();
  return recordView("SliceBackward", *this, out, [in, t, d, start, end, step](const BackwardContext& c) -> TensorList {
    return scatterIntoView(in, t, c.grads[0], [&](const Tensor& z) { return sliceNoGrad(z, d, start, end, step); });
  });
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  detail::OpScope opScope("select", *this);
  Tensor out = selectNoGrad(*this, d, index);
  const Shape in = sizes();
  const DType t = dtype();
  return recordView("SelectBackward", *this, out, [in, t, d, index](const BackwardContext& c) -> TensorList {
    return scatterIntoView(in, t, c.grads[0], [&](const Tensor& z) { return selectNoGrad(z, d, index); });
  });
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  detail::OpScope opScope("transpose", *this);
  d0 = wrapDim(d0, dim(), "transpose");
  d1 = wrapDim(d1, dim(), "transpose");
  Shape perm(static_cast<size_t>(dim()));
  for (int64_t i = 0; i < dim(); ++i) perm[i] = i;
  if (dim() > 0) std::swap(perm[d0], perm[d1]);
  return permute(std::move(perm));
}

Tensor Tensor::t() const {
  detail::OpScope opScope("t", *this);
  DT_CHECK_LE(dim(), 2, "t(): expects a tensor with <= 2 dims, got ", describe());
  if (dim() < 2) return *this;
  return transpose(0, 1);
}

Tensor Tensor::permute(Shape dims) const {
  detail::OpScope opScope("permute", *this);
  Tensor out = permuteNoGrad(*this, dims);
  Shape inverse(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) inverse[wrapDim(dims[i], dim(), "permute")] = static_cast<int64_t>(i);
  return recordView("PermuteBackward", *this, out, [inverse](const BackwardContext& c) -> TensorList {
    return {permuteNoGrad(c.grads[0], inverse)};
  });
}

Tensor Tensor::expand(Shape target) const {
  detail::OpScope opScope("expand", *this);
  Tensor out = expandNoGrad(*this, target);
  // FnNode sums the gradient back to the input shape.
  return recordView("ExpandBackward", *this, out, [](const BackwardContext& c) -> TensorList { return {c.grads[0]}; });
}

Tensor Tensor::squeeze() const {
  detail::OpScope opScope("squeeze", *this);
  Tensor out = squeezeNoGrad(*this, std::nullopt);
  const Shape in = sizes();
  return recordView("SqueezeBackward", *this, out,
                    [in](const BackwardContext& c) -> TensorList { return {c.grads[0].reshape(in)}; });
}

Tensor Tensor::squeeze(int64_t d) const {
  detail::OpScope opScope("squeeze", *this);
  Tensor out = squeezeNoGrad(*this, d);
  const Shape in = sizes();
  return recordView("SqueezeBackward", *this, out,
                    [in](const BackwardContext& c) -> TensorList { return {c.grads[0].reshape(in)}; });
}

Tensor Tensor::unsqueeze(int64_t d) const {
  detail::OpScope opScope("unsqueeze", *this);
  Tensor out = unsqueezeNoGrad(*this, d);
  const Shape in = sizes();
  return recordView("UnsqueezeBackward", *this, out,
                    [in](const BackwardContext& c) -> TensorList { return {c.grads[0].reshape(in)}; });
}

Tensor Tensor::asStrided(Shape newSizes, Shape newStrides, int64_t offset) const {
  detail::OpScope opScope("asStrided", *this);
  Tensor out = asStridedNoGrad(*this, newSizes, newStrides, offset);
  const Shape inSizes = sizes(), inStrides = strides();
  const int64_t inOffset = storageOffset(), outOffset = out.storageOffset();
  const int64_t storageElems = static_cast<int64_t>(storage().nbytes() / itemsize());
  return recordView("AsStridedBackward", *this, out, [=](const BackwardContext& c) -> TensorList {
    // Accumulate into a buffer with the storage's geometry (elements hit several times by an
    // overlapping view get every contribution), then read the input's view. The scatter is serial
    // and runs on the host: a CUDA gradient goes there and back.
    Tensor buf = zeros({storageElems}, DType::Float64);
    Tensor g = c.grads[0].to(DType::Float64).to(Device::cpu()).contiguous();
    double* base = buf.data<double>();
    const double* gp = g.data<double>();
    const int64_t n = g.numel();
    std::vector<int64_t> idx(newSizes.size(), 0);
    for (int64_t i = 0; i < n; ++i) {
      int64_t off = outOffset;
      for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * newStrides[d];
      base[off] += gp[i];
      for (size_t d = idx.size(); d-- > 0;) {
        if (++idx[d] < newSizes[d]) break;
        idx[d] = 0;
      }
    }
    return {asStridedNoGrad(buf, inSizes, inStrides, inOffset).contiguous().to(c.grads[0].device())};
  });
}

}  // namespace dt
