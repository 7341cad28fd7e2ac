// Tensor's view and copy members. With autograd on, views record a node so
// gradients flow back to the base (see ops_views in ops.cpp).
#include "common/check.h"
#include "common/strings.h"
#include "tensor/detail.h"
#include "tensor/tensor.h"

namespace dt {

Tensor Tensor::clone() const {
  Tensor out = empty(sizes(), dtype(), device());
  out.copy_(*this);
  return out;
}

Tensor Tensor::view(Shape newSizes) const { return detail::viewNoGrad(*this, std::move(newSizes)); }

Tensor Tensor::reshape(Shape newSizes) const {
  if (detail::canView(*this, newSizes)) return view(std::move(newSizes));
  return clone().view(std::move(newSizes));
}

Tensor Tensor::flatten(int64_t startDim, int64_t endDim) const {
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
  return detail::narrowNoGrad(*this, d, start, length);
}
Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  return detail::sliceNoGrad(*this, d, start, end, step);
}
Tensor Tensor::select(int64_t d, int64_t index) const { return detail::selectNoGrad(*this, d, index); }

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  d0 = wrapDim(d0, dim(), "transpose");
  d1 = wrapDim(d1, dim(), "transpose");
  Shape perm(static_cast<size_t>(dim()));
  for (int64_t i = 0; i < dim(); ++i) perm[i] = i;
  std::swap(perm[d0], perm[d1]);
  return permute(std::move(perm));
}

Tensor Tensor::t() const {
  DT_CHECK_LE(dim(), 2, "t(): expects a tensor with <= 2 dims, got ", describe());
  if (dim() < 2) return *this;
  return transpose(0, 1);
}

Tensor Tensor::permute(Shape dims) const { return detail::permuteNoGrad(*this, dims); }
Tensor Tensor::expand(Shape target) const { return detail::expandNoGrad(*this, target); }
Tensor Tensor::squeeze() const { return detail::squeezeNoGrad(*this, std::nullopt); }
Tensor Tensor::squeeze(int64_t d) const { return detail::squeezeNoGrad(*this, d); }
Tensor Tensor::unsqueeze(int64_t d) const { return detail::unsqueezeNoGrad(*this, d); }
Tensor Tensor::asStrided(Shape newSizes, Shape newStrides, int64_t offset) const {
  return detail::asStridedNoGrad(*this, std::move(newSizes), std::move(newStrides), offset);
}

}  // namespace dt
