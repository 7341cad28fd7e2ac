// Reductions: sum/mean (accumulating loops, no transposing copies), max/min/argmax.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/check.h"
#include "common/config.h"
#include "tensor/internal/detail.h"
#include "tensor/internal/loop.h"
#include "tensor/internal/op_scope.h"
#include "tensor/internal/ops_internal.h"
#include "tensor/internal/row_math.h"
#include "tensor/parallel.h"

#if DT_HAVE_CUDA
#include "tensor/cuda/kernels.h"
#endif

namespace dt {

using namespace detail;

namespace detail {

std::vector<int64_t> normalizeDims(const std::vector<int64_t>& dims, int64_t ndim, const char* op) {
  std::vector<int64_t> out;
  for (int64_t d : dims) {
    const int64_t w = wrapDim(d, ndim, op);
    if (std::find(out.begin(), out.end(), w) != out.end()) {
      throw InvalidArgument(str(op, ": dim ", d, " appears twice in ", describeShape(dims)));
    }
    out.push_back(w);
  }
  return out;
}

Shape reducedShape(const Shape& sizes, const std::vector<bool>& reduce, bool keepdim) {
  Shape out;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (!reduce[i]) {
      out.push_back(sizes[i]);
    } else if (keepdim) {
      out.push_back(1);
    }
  }
  return out;
}

}  // namespace detail

namespace {

std::vector<bool> reduceMask(const Tensor& a, const std::vector<int64_t>& dims, const char* op) {
  std::vector<bool> mask(static_cast<size_t>(a.dim()), dims.empty());
  for (int64_t d : normalizeDims(dims, a.dim(), op)) {
    if (a.dim() > 0) mask[static_cast<size_t>(d)] = true;
  }
  return mask;
}

template <typename T>
using AccType = std::conditional_t<std::is_floating_point_v<T>, double, int64_t>;

// Sum over masked dims of a (compute type ct) into a fresh tensor of keepdim shape.
Tensor sumKernel(const Tensor& a, const std::vector<bool>& mask, DType ct) {
  NoGradGuard noGrad;
  Shape keepShape = reducedShape(a.sizes(), mask, true);
  Tensor out = zeros(keepShape, ct);
  const Tensor A = a.to(ct);
  // Output strides broadcast over reduced dims (0), so one strided loop accumulates.
  Shape os(static_cast<size_t>(a.dim()));
  for (int64_t i = 0; i < a.dim(); ++i) os[i] = mask[i] ? 0 : out.strides()[i];
  const int64_t isz = static_cast<int64_t>(itemSize(ct));
  detail::ElementLoop<2> loop(a.sizes(),
                              {static_cast<char*>(out.dataPtr()), static_cast<char*>(const_cast<void*>(A.dataPtr()))},
                              {os.data(), A.strides().data()}, {isz, isz});
  dispatchDType(ct, [&]<typename T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, int64_t> ||
                  std::is_same_v<T, int32_t>) {
      loop.run(0, loop.numel(), [&](char** p, const int64_t* s, int64_t n) {
        if (s[0] == 0) {
          AccType<T> acc = 0;
          if (s[1] == isz) {
            const T* x = reinterpret_cast<const T*>(p[1]);
            for (int64_t i = 0; i < n; ++i) acc += x[i];
          } else {
            for (int64_t i = 0; i < n; ++i) acc += *reinterpret_cast<const T*>(p[1] + i * s[1]);
          }
          *reinterpret_cast<T*>(p[0]) += static_cast<T>(acc);
        } else if (s[0] == isz && s[1] == isz) {
          T* o = reinterpret_cast<T*>(p[0]);
          const T* x = reinterpret_cast<const T*>(p[1]);
          for (int64_t i = 0; i < n; ++i) o[i] += x[i];
        } else {
          for (int64_t i = 0; i < n; ++i) {
            *reinterpret_cast<T*>(p[0] + i * s[0]) += *reinterpret_cast<const T*>(p[1] + i * s[1]);
          }
        }
      });
    } else {
      throw InvalidArgument(str("sum: unsupported compute dtype ", ct));
    }
  });
  return out;
}

#if DT_HAVE_CUDA
// The CUDA sum: reduced dims moved last and made contiguous, then one block per output element.
Tensor cudaSumKernel(const Tensor& a, const std::vector<bool>& mask, DType ct) {
  NoGradGuard noGrad;
  Shape perm;
  int64_t n = 1;
  for (int64_t i = 0; i < a.dim(); ++i) {
    if (!mask[i]) perm.push_back(i);
  }
  for (int64_t i = 0; i < a.dim(); ++i) {
    if (mask[i]) {
      perm.push_back(i);
      n *= a.sizes()[i];
    }
  }
  Tensor out = empty(reducedShape(a.sizes(), mask, true), ct, a.device());
  if (n == 0) {
    out.fill_(0.0);
    return out;
  }
  const Tensor rows = detail::permuteNoGrad(a, perm).to(ct).contiguous();
  cuda::sumRows(a.device(), ct, out.dataPtr(), rows.dataPtr(), out.numel(), n);
  return out;
}
#endif

DType sumType(DType t) {
  if (t == DType::Bool || t == DType::Int32) return DType::Int64;
  return t;
}

Tensor sumImpl(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim, bool allDims) {
  const bool onGpu = onCuda(a, "sum");
  std::vector<bool> mask = allDims ? std::vector<bool>(static_cast<size_t>(a.dim()), true) : reduceMask(a, dims, "sum");
  const DType rt = sumType(a.dtype());
  const DType ct = computeType(rt);
  Tensor out;
  if (onGpu) {
#if DT_HAVE_CUDA
    out = cudaSumKernel(a, mask, ct);
#endif
  } else {
    out = sumKernel(a, mask, ct);
  }
  Shape finalShape = reducedShape(a.sizes(), mask, keepdim);
  if (!keepdim) out = detail::viewNoGrad(out, finalShape);
  if (rt != ct) {
    NoGradGuard noGrad;
    out = out.to(rt);
  }
  const Shape inShape = a.sizes();
  recordFn("SumBackward", {a}, out, nullptr, [inShape, mask, keepdim](const BackwardContext& c) -> TensorList {
    Tensor g = c.grads[0];
    if (!keepdim) g = detail::viewNoGrad(g.contiguous(), reducedShape(inShape, mask, true));
    return {detail::expandNoGrad(g, inShape)};
  });
  return out;
}

}  // namespace

Tensor sum(const Tensor& a) {
  detail::OpScope opScope("sum", a);
  return sumImpl(a, {}, false, true);
}
Tensor sum(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  detail::OpScope opScope("sum", a);
  return sumImpl(a, dims, keepdim, dims.empty());
}

Tensor mean(const Tensor& a) { return mean(a, {}, false); }

Tensor mean(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  detail::OpScope opScope("mean", a);
  requireFloat(a, "mean");
  std::vector<bool> mask = dims.empty() ? std::vector<bool>(static_cast<size_t>(a.dim()), true) : reduceMask(a, dims, "mean");
  int64_t count = 1;
  for (int64_t i = 0; i < a.dim(); ++i) {
    if (mask[i]) count *= a.sizes()[i];
  }
  return div(sum(a, dims, keepdim), static_cast<double>(count));
}

namespace {

// [outer, r] view with the reduced dim last, made contiguous (max/argmax are not on hot paths).
struct RowView {
  Tensor rows;  // [M, R] contiguous, compute dtype
  Shape outShape;
  Shape keepShape;
  int64_t r;
};

RowView rowsFor(const Tensor& a, int64_t dim, const char* op) {
  NoGradGuard noGrad;
  (void)onCuda(a, op);  // the gate only: the views below work on any device
  RowView v;
  if (a.dim() == 0) {
    v.rows = a.to(computeType(a.dtype())).reshape({1, 1});
    v.r = 1;
    return v;
  }
  dim = wrapDim(dim, a.dim(), op);
  if (a.sizes()[dim] == 0) throw InvalidArgument(str(op, ": cannot reduce over empty dim ", dim, " of ", a.describe()));
  Shape perm;
  for (int64_t i = 0; i < a.dim(); ++i) {
    if (i != dim) perm.push_back(i);
  }
  perm.push_back(dim);
  Tensor p = detail::permuteNoGrad(a, perm).to(computeType(a.dtype() == DType::Bool ? DType::Int64 : a.dtype()));
  p = p.contiguous();
  v.r = a.sizes()[dim];
  v.rows = detail::viewNoGrad(p, {a.numel() / v.r, v.r});
  std::vector<bool> mask(static_cast<size_t>(a.dim()), false);
  mask[dim] = true;
  v.outShape = reducedShape(a.sizes(), mask, false);
  v.keepShape = reducedShape(a.sizes(), mask, true);
  return v;
}

// values and int64 indices of the max (isMax) or min along rows; NaN wins like PyTorch.
std::pair<Tensor, Tensor> rowExtreme(const RowView& v, bool isMax) {
  const int64_t m = v.rows.sizes()[0], r = v.r;
  Tensor vals = empty({m}, v.rows.dtype(), v.rows.device());
  Tensor idx = empty({m}, DType::Int64, v.rows.device());
  if (!v.rows.device().isCpu()) {
#if DT_HAVE_CUDA
    cuda::extremeRows(v.rows.device(), v.rows.dtype(), vals.dataPtr(), idx.data<int64_t>(), v.rows.dataPtr(),
                      m, r, isMax);
#endif
    return {vals, idx};
  }
  int64_t* ip = idx.data<int64_t>();
  dispatchDType(v.rows.dtype(), [&]<typename T>() {
    if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
      throw InvalidArgument("max: internal dtype error");
    } else {
      const T* x = static_cast<const T*>(v.rows.dataPtr());
      T* vp = static_cast<T*>(vals.dataPtr());
      for (int64_t i = 0; i < m; ++i) {
        ip[i] = extremeIndex(x + i * r, r, isMax, vp[i]);
      }
    }
  });
  return {vals, idx};
}

ValuesIndices extremeDim(const Tensor& a, int64_t dim, bool keepdim, bool isMax) {
  const char* op = isMax ? "max" : "min";
  RowView v = rowsFor(a, dim, op);
  auto [vals, idx] = rowExtreme(v, isMax);
  const Shape shape = a.dim() == 0 ? Shape{} : (keepdim ? v.keepShape : v.outShape);
  {
    NoGradGuard noGrad;
    vals = detail::viewNoGrad(vals, shape).to(a.dtype());
  }
  idx = detail::viewNoGrad(idx, shape);
  if (autograd::needsGrad({&a})) {
    const Shape inShape = a.sizes();
    const int64_t d = a.dim() == 0 ? 0 : wrapDim(dim, a.dim(), op);
    const Shape keepShape = a.dim() == 0 ? Shape{} : v.keepShape;
    Tensor idxSaved = idx;
    recordFn(
        isMax ? "MaxBackward" : "MinBackward", {a}, vals, [&] { return std::vector<SavedTensor>{SavedTensor(idxSaved)}; },
        [inShape, d, keepShape](const BackwardContext& c) -> TensorList {
          // Scatter the gradient to the chosen index of each row.
          Tensor g = c.grads[0].contiguous().to(DType::Float64);
          Tensor ind = c.saved[0].contiguous();
          Tensor out = zeros(inShape, DType::Float64, g.device());
          if (inShape.empty()) return {g.reshape({})};
          const int64_t r = inShape[d];
          int64_t inner = 1;
          for (size_t i = d + 1; i < inShape.size(); ++i) inner *= inShape[i];
          const int64_t outer = shapeNumel(inShape) / (r * inner);
          if (!g.device().isCpu()) {
#if DT_HAVE_CUDA
            cuda::scatterRows(g.device(), DType::Float64, out.dataPtr(), g.dataPtr(), ind.data<int64_t>(),
                              outer, r, inner);
#endif
            return {out};
          }
          const double* gp = g.data<double>();
          const int64_t* ip = ind.data<int64_t>();
          double* op2 = out.data<double>();
          for (int64_t o = 0; o < outer; ++o) {
            for (int64_t k = 0; k < inner; ++k) {
              const int64_t j = ip[o * inner + k];
              op2[(o * r + j) * inner + k] += gp[o * inner + k];
            }
          }
          return {out};
        });
  }
  return {vals, idx};
}

}  // namespace

ValuesIndices max(const Tensor& a, int64_t dim, bool keepdim) {
  detail::OpScope opScope("max", a);
  return extremeDim(a, dim, keepdim, true);
}
ValuesIndices min(const Tensor& a, int64_t dim, bool keepdim) {
  detail::OpScope opScope("min", a);
  return extremeDim(a, dim, keepdim, false);
}

Tensor max(const Tensor& a) {
  DT_CHECK_GT(a.numel(), 0, "max: empty tensor ", a.describe());
  return max(a.reshape({-1}), 0, false).values;
}
Tensor min(const Tensor& a) {
  DT_CHECK_GT(a.numel(), 0, "min: empty tensor ", a.describe());
  return min(a.reshape({-1}), 0, false).values;
}

Tensor amax(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  detail::OpScope opScope("amax", a);
  std::vector<int64_t> ds = dims.empty() ? std::vector<int64_t>{} : normalizeDims(dims, a.dim(), "amax");
  if (ds.empty()) {
    for (int64_t i = 0; i < a.dim(); ++i) ds.push_back(i);
  }
  std::sort(ds.rbegin(), ds.rend());
  Tensor out = a;
  for (int64_t d : ds) out = max(out, d, true).values;
  if (!keepdim) {
    for (int64_t d : ds) out = out.squeeze(d);
  }
  return out;
}

Tensor argmax(const Tensor& a, int64_t dim, bool keepdim) {
  NoGradGuard ng;
  return max(a, dim, keepdim).indices;
}
Tensor argmin(const Tensor& a, int64_t dim, bool keepdim) {
  NoGradGuard ng;
  return min(a, dim, keepdim).indices;
}
Tensor argmax(const Tensor& a) {
  NoGradGuard ng;
  return max(a.reshape({-1}), 0, false).indices;
}

namespace autograd {

Tensor sumToShape(const Tensor& grad, const Shape& shape) {
  if (grad.sizes() == shape) return grad;
  const int64_t lead = grad.dim() - static_cast<int64_t>(shape.size());
  if (lead < 0) {
    throw InvalidArgument(str("sumToShape: gradient ", grad.describe(), " has fewer dims than ", describeShape(shape)));
  }
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < grad.dim(); ++i) {
    if (i < lead || (shape[i - lead] == 1 && grad.sizes()[i] != 1)) dims.push_back(i);
  }
  Tensor s = dims.empty() ? grad : sum(grad, dims, true);
  return s.reshape(shape);
}

}  // namespace autograd

}  // namespace dt
