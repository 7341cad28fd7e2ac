// Neural-network functions: softmax family, losses, embedding, layer norm,
// dropout, and joining/indexing ops.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/config.h"
#include "tensor/deferred_checks.h"
#include "tensor/internal/detail.h"
#include "tensor/internal/fast_kernels.h"
#include "tensor/internal/op_scope.h"
#include "tensor/internal/ops_internal.h"
#include "tensor/internal/row_math.h"
#include "tensor/parallel.h"

#if DT_HAVE_CUDA
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/kernels.h"
#include "tensor/cuda/stream.h"
#endif

namespace dt {

using namespace detail;

namespace {

#if DT_HAVE_CUDA
// Queues the range check of idx (contiguous int64 on a CUDA device) and registers it with the
// deferred checks (tensor/deferred_checks.h says when it is raised): no host wait here.
void deferIndexCheck(const Tensor& idx, int64_t limit, bool hasIgnore, int64_t ignore,
                     std::function<std::string(const IndexCheckResult&)> error) {
  if (idx.numel() == 0) return;
  const Device device = idx.device();
  struct State {
    DataPtr result;  // pinned host: the device copies {position, value} here
    cuda::Event done;
  };
  auto state = std::make_shared<State>();
  {
    cuda::DeviceGuard guard(device);  // a new pinned segment is a runtime call: on this device, never cuda:0
    state->result = cuda::pinnedHostAllocator().allocate(2 * sizeof(int64_t));
  }
  auto* result = static_cast<int64_t*>(state->result.get());
  cuda::checkIndicesAsync(device, idx.data<int64_t>(), idx.numel(), limit, hasIgnore, ignore, result);
  state->done.record(cuda::currentStream(device));
  DeferredChecks::Check check;
  check.device = device;
  check.finished = [state](bool wait) {
    if (wait) state->done.synchronize();
    return wait || state->done.query();
  };
  check.result = [state] {
    const auto* r = static_cast<const int64_t*>(state->result.get());
    return IndexCheckResult{r[0], r[1]};
  };
  check.error = std::move(error);
  deferredChecks().add(std::move(check));
}
#endif

// Moves dim to the end and returns a contiguous [rows, n] tensor in compute dtype.
Tensor lastDimRows(const Tensor& a, int64_t dim, DType ct) {
  NoGradGuard ng;
  Tensor p = a;
  if (dim != a.dim() - 1) p = detail::permuteNoGrad(a, [&] {
      Shape perm;
      for (int64_t i = 0; i < a.dim(); ++i) {
        if (i != dim) perm.push_back(i);
      }
      perm.push_back(dim);
      return perm;
    }());
  p = p.to(ct).contiguous();
  const int64_t n = a.dim() == 0 ? 1 : a.sizes()[dim];
  return detail::viewNoGrad(p, {n == 0 ? 0 : a.numel() / n, n});
}

// Inverse of lastDimRows: [rows, n] back to a's layout (a contiguous result).
Tensor fromLastDimRows(const Tensor& rows, const Tensor& like, int64_t dim) {
  NoGradGuard ng;
  if (like.dim() == 0) return rows.reshape({});
  Shape permuted;
  for (int64_t i = 0; i < like.dim(); ++i) {
    if (i != dim) permuted.push_back(like.sizes()[i]);
  }
  permuted.push_back(like.sizes()[dim]);
  Tensor p = detail::viewNoGrad(rows, permuted);
  if (dim == like.dim() - 1) return p;
  Shape inverse(static_cast<size_t>(like.dim()));
  int64_t k = 0;
  for (int64_t i = 0; i < like.dim(); ++i) {
    if (i != dim) inverse[i] = k++;
  }
  inverse[dim] = like.dim() - 1;
  return detail::permuteNoGrad(p, inverse).contiguous();
}

template <typename T>
void softmaxRows(const T* x, T* y, int64_t rows, int64_t n, bool logMode) {
  if constexpr (std::is_same_v<T, float>) {
    parallelFor(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
      fast::softmaxRows(x + b * n, y + b * n, e - b, n, logMode);
    });
    return;
  }
  parallelFor(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * n;
      T* yr = y + r * n;
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < n; ++j) mx = xr[j] > mx ? xr[j] : mx;
      if (std::isinf(mx) && mx < 0) mx = 0;  // all -inf row: avoid inf - inf
      double s = 0;
      for (int64_t j = 0; j < n; ++j) s += std::exp(static_cast<double>(xr[j] - mx));
      if (logMode) {
        // Subtract the max first (exact for nearby values), then log(sum): no cancellation at large magnitudes.
        const T logSum = static_cast<T>(std::log(s));
        for (int64_t j = 0; j < n; ++j) yr[j] = (xr[j] - mx) - logSum;
      } else {
        const double inv = 1.0 / s;
        for (int64_t j = 0; j < n; ++j) yr[j] = static_cast<T>(std::exp(static_cast<double>(xr[j] - mx)) * inv);
      }
    }
  });
}

Tensor softmaxForward(const Tensor& a, int64_t dim, bool logMode) {
  const char* op = logMode ? "logSoftmax" : "softmax";
  const bool onGpu = onCuda(a, op);
  requireFloat(a, op);
  dim = wrapDim(dim, a.dim(), op);
  const DType ct = computeType(a.dtype());
  Tensor rows = lastDimRows(a, dim, ct);
  Tensor out = emptyLike(rows);
  if (onGpu) {
#if DT_HAVE_CUDA
    cuda::softmaxRows(a.device(), ct, out.dataPtr(), rows.dataPtr(), rows.sizes()[0], rows.sizes()[1],
                      logMode);
#endif
  } else if (ct == DType::Float32) {
    softmaxRows(rows.data<float>(), out.data<float>(), rows.sizes()[0], rows.sizes()[1], logMode);
  } else {
    softmaxRows(rows.data<double>(), out.data<double>(), rows.sizes()[0], rows.sizes()[1], logMode);
  }
  NoGradGuard ng;
  return fromLastDimRows(out, a, dim).to(a.dtype());
}

}  // namespace

Tensor softmax(const Tensor& a, int64_t dim) {
  detail::OpScope opScope("softmax", a);
  Tensor out = softmaxForward(a, dim, false);
  const int64_t d = a.dim() == 0 ? 0 : wrapDim(dim, a.dim(), "softmax");
  recordFn(
      "SoftmaxBackward", {a}, out, [&] { return std::vector<SavedTensor>{SavedTensor(out, true)}; },
      [d](const BackwardContext& c) -> TensorList {
        const Tensor& y = c.saved[0];
        const Tensor& g = c.grads[0];
        if (y.dim() == 0) return {zerosLike(g)};
        if (y.device().isCpu() && y.dtype() == DType::Float32 && d == y.dim() - 1 && y.isContiguous()) {
          // One pass per row instead of four tensor ops.
          const Tensor gc = g.to(DType::Float32).contiguous();
          Tensor gx = emptyLike(y);
          const int64_t n = y.sizes()[d], rows = n == 0 ? 0 : y.numel() / n;
          const float *gp = gc.data<float>(), *yp = y.data<float>();
          float* op = gx.data<float>();
          parallelFor(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
            fast::softmaxBackwardRows(gp + b * n, yp + b * n, op + b * n, e - b, n);
          });
          return {gx};
        }
        return {mul(y, sub(g, sum(mul(g, y), {d}, true)))};
      });
  return out;
}

Tensor logSoftmax(const Tensor& a, int64_t dim) {
  detail::OpScope opScope("logSoftmax", a);
  Tensor out = softmaxForward(a, dim, true);
  const int64_t d = a.dim() == 0 ? 0 : wrapDim(dim, a.dim(), "logSoftmax");
  recordFn(
      "LogSoftmaxBackward", {a}, out, [&] { return std::vector<SavedTensor>{SavedTensor(out, true)}; },
      [d](const BackwardContext& c) -> TensorList {
        const Tensor& y = c.saved[0];
        const Tensor& g = c.grads[0];
        if (y.dim() == 0) return {zerosLike(g)};
        return {sub(g, mul(exp(y), sum(g, {d}, true)))};
      });
  return out;
}

// ---- cross entropy ---------------------------------------------------------------------------------

namespace {

template <typename T>
void crossEntropyForward(const T* lsm, const int64_t* target, int64_t n, int64_t c, const CrossEntropyOptions& o,
                         double* losses, int64_t& valid) {
  valid = 0;
  const double eps = o.labelSmoothing;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = target[i];
    if (t == o.ignoreIndex) {
      losses[i] = 0;
      continue;
    }
    if (t < 0 || t >= c) throw InvalidArgument(crossEntropyTargetError(t, i, c, o.ignoreIndex));
    ++valid;
    losses[i] = smoothedNll(lsm + i * c, t, c, eps);
  }
}

template <typename T>
void crossEntropyBackward(const T* lsm, const int64_t* target, const double* gscale, int64_t n, int64_t c,
                          const CrossEntropyOptions& o, T* out) {
  const double eps = o.labelSmoothing;
  const double smooth = eps / static_cast<double>(c);
  parallelFor(0, n, std::max<int64_t>(1, 16384 / std::max<int64_t>(c, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      T* orow = out + i * c;
      const int64_t t = target[i];
      if (t == o.ignoreIndex) {
        std::fill(orow, orow + c, T(0));
        continue;
      }
      const T* row = lsm + i * c;
      const double g = gscale[i];
      if constexpr (std::is_same_v<T, float>) {
        fast::expScaled(row, orow, c, static_cast<float>(g), static_cast<float>(smooth));
      } else {
        for (int64_t j = 0; j < c; ++j) {
          orow[j] = static_cast<T>(g * (std::exp(static_cast<double>(row[j])) - smooth));
        }
      }
      orow[t] = static_cast<T>(static_cast<double>(orow[t]) - g * (1.0 - eps));
    }
  });
}

}  // namespace

Tensor crossEntropy(const Tensor& logits, const Tensor& target, const CrossEntropyOptions& options) {
  detail::OpScope opScope("crossEntropy", logits, target);
  const char* op = "crossEntropy";
  requireSameDevice(logits, target, op);
  const bool onGpu = onCuda(logits, op);
  requireFloat(logits, op);
  if (target.dtype() != DType::Int64 && target.dtype() != DType::Int32) {
    throw InvalidArgument(str("crossEntropy: target must hold class indices (int64/int32), got ", target.describe()));
  }
  if (options.labelSmoothing < 0 || options.labelSmoothing > 1) {
    throw InvalidArgument(str("crossEntropy: labelSmoothing must be in [0, 1], got ", options.labelSmoothing));
  }
  const bool single = logits.dim() == 1;
  if (!(logits.dim() == 2 || single) || target.dim() != (single ? 0 : 1) ||
      (!single && target.sizes()[0] != logits.sizes()[0])) {
    throw InvalidArgument(str("crossEntropy: logits ", logits.describe(), " and target ", target.describe(),
                              " do not match (expected [N, C] and [N], or [C] and [])"));
  }
  const int64_t n = single ? 1 : logits.sizes()[0];
  const int64_t c = logits.sizes()[single ? 0 : 1];
  const DType ct = computeType(logits.dtype());
  Tensor lsm, tgt;
  {
    NoGradGuard ng;
    Tensor rows = single ? logits.reshape({1, c}) : logits;
    rows = rows.to(ct).contiguous();
    lsm = emptyLike(rows);
    tgt = target.to(DType::Int64).contiguous();
    if (onGpu) {
#if DT_HAVE_CUDA
      cuda::softmaxRows(logits.device(), ct, lsm.dataPtr(), rows.dataPtr(), n, c, true);
#endif
    } else if (ct == DType::Float32) {
      softmaxRows(rows.data<float>(), lsm.data<float>(), n, c, true);
    } else {
      softmaxRows(rows.data<double>(), lsm.data<double>(), n, c, true);
    }
  }
  std::vector<double> losses;
  int64_t valid = 0;
  Tensor validT;  // on CUDA: the count of counted rows, a float64 scalar on the device
  Tensor out;
  if (onGpu) {
#if DT_HAVE_CUDA
    // Nothing is read back: the target check is deferred (tensor/deferred_checks.h: raised at
    // the next host read on this device or the next optimizer step), a bad target's row gives
    // loss 0 and is not counted meanwhile, and the mean divides by a count kept on the device.
    NoGradGuard ng;
    Tensor lossT = empty({n}, DType::Float64, logits.device());
    Tensor countedT = empty({n}, DType::Float64, logits.device());
    deferIndexCheck(tgt, c, true, options.ignoreIndex,
                    [c, ignoreIndex = options.ignoreIndex](const IndexCheckResult& r) {
                      return crossEntropyTargetError(r.value, r.position, c, ignoreIndex);
                    });
    cuda::crossEntropyForward(logits.device(), ct, lossT.data<double>(), countedT.data<double>(), lsm.dataPtr(),
                              tgt.data<int64_t>(), n, c, options.ignoreIndex, options.labelSmoothing);
    if (options.reduction == Reduction::None) {
      out = lossT.reshape(single ? Shape{} : Shape{n}).to(logits.dtype());
    } else {
      Tensor total = sum(lossT);
      if (options.reduction == Reduction::Mean) {
        validT = sum(countedT);
        total = div(total, validT);  // NaN when all are ignored, like PyTorch
      }
      out = total.to(logits.dtype());
    }
#endif
  } else {
    losses.resize(static_cast<size_t>(n));
    dispatchDType(ct, [&]<typename T>() {
      if constexpr (std::is_floating_point_v<T>) {
        crossEntropyForward(static_cast<const T*>(lsm.dataPtr()), tgt.data<int64_t>(), n, c, options,
                            losses.data(), valid);
      }
    });
    if (options.reduction == Reduction::None) {
      out = fromVector<double>(losses, single ? Shape{} : Shape{n}).to(logits.dtype());
    } else {
      double total = 0;
      for (double l : losses) total += l;
      if (options.reduction == Reduction::Mean)
        total /= static_cast<double>(valid);  // NaN when all ignored, like PyTorch
      out = scalarTensor(total, logits.dtype());
    }
  }
  const Reduction reduction = options.reduction;
  recordFn(
      "CrossEntropyBackward", {logits}, out, [&] { return std::vector<SavedTensor>{SavedTensor(lsm), SavedTensor(tgt)}; },
      [options, n, c, valid, validT, reduction, single](const BackwardContext& ctx) -> TensorList {
        const Tensor& l = ctx.saved[0];
        const Tensor& t = ctx.saved[1];
        Tensor g = ctx.grads[0].to(DType::Float64).contiguous();
        if (!l.device().isCpu()) {
          Tensor out2 = emptyLike(l);
#if DT_HAVE_CUDA
          cuda::crossEntropyBackward(l.device(), l.dtype(), out2.dataPtr(), l.dataPtr(), t.data<int64_t>(),
                                     g.data<double>(), reduction == Reduction::None,
                                     validT.defined() ? validT.data<double>() : nullptr, n, c,
                                     options.ignoreIndex, options.labelSmoothing);
#endif
          return {single ? out2.reshape({c}) : out2};
        }
        std::vector<double> scale(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
          if (reduction == Reduction::None) {
            scale[i] = g.data<double>()[single ? 0 : i];
          } else {
            scale[i] = g.data<double>()[0] / (reduction == Reduction::Mean ? static_cast<double>(valid) : 1.0);
          }
        }
        Tensor out2 = emptyLike(l);
        dispatchDType(l.dtype(), [&]<typename T>() {
          if constexpr (std::is_floating_point_v<T>) {
            crossEntropyBackward(static_cast<const T*>(l.dataPtr()), t.data<int64_t>(), scale.data(), n, c, options,
                                 static_cast<T*>(out2.dataPtr()));
          }
        });
        return {single ? out2.reshape({c}) : out2};
      });
  return out;
}

Tensor mseLoss(const Tensor& input, const Tensor& target, Reduction reduction) {
  detail::OpScope opScope("mseLoss", input, target);
  if (input.sizes() != target.sizes()) {
    throw InvalidArgument(str("mseLoss: input ", input.describe(), " and target ", target.describe(), " differ in shape"));
  }
  Tensor d = sub(input, target);
  Tensor sq = mul(d, d);
  if (reduction == Reduction::None) return sq;
  if (reduction == Reduction::Sum) return sum(sq);
  return mean(sq);
}

// ---- embedding -------------------------------------------------------------------------------------------

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  detail::OpScope opScope("embedding", weight, indices);
  requireSameDevice(weight, indices, "embedding");
  const bool onGpu = onCuda(weight, "embedding");
  if (weight.dim() != 2) throw InvalidArgument(str("embedding: weight must be 2-D, got ", weight.describe()));
  if (indices.dtype() != DType::Int64 && indices.dtype() != DType::Int32) {
    throw InvalidArgument(str("embedding: indices must be int64/int32, got ", indices.describe()));
  }
  const int64_t num = weight.sizes()[0], dim = weight.sizes()[1];
  Tensor idx;
  Tensor w;
  {
    NoGradGuard ng;
    idx = indices.to(DType::Int64).contiguous();
    w = weight.contiguous();
  }
  auto outOfRange = [&](int64_t value) {
    return InvalidArgument(embeddingIndexError(value, -1, weight.describe(), num));
  };
  Shape outShape = indices.sizes();
  outShape.push_back(dim);
  Tensor out = empty(outShape, weight.dtype(), weight.device());
  if (onGpu) {
#if DT_HAVE_CUDA
    // The range check is deferred (tensor/deferred_checks.h: raised at the next host read on
    // this device or the next optimizer step); meanwhile a bad index gathers a zero row.
    deferIndexCheck(idx, num, false, 0, [weightText = weight.describe(), num](const IndexCheckResult& r) {
      return embeddingIndexError(r.value, r.position, weightText, num);
    });
    cuda::gatherRows(weight.device(), weight.itemsize(), out.dataPtr(), w.dataPtr(), idx.data<int64_t>(),
                     idx.numel(), dim, num);
#endif
  } else {
    const int64_t* ip = idx.data<int64_t>();
    for (int64_t i = 0; i < idx.numel(); ++i) {
      if (ip[i] < 0 || ip[i] >= num) throw outOfRange(ip[i]);
    }
    const size_t rowBytes = static_cast<size_t>(dim) * weight.itemsize();
    const char* src = static_cast<const char*>(w.dataPtr());
    char* dst = static_cast<char*>(out.dataPtr());
    for (int64_t i = 0; i < idx.numel(); ++i)
      std::memcpy(dst + i * rowBytes, src + ip[i] * rowBytes, rowBytes);
  }
  recordFn(
      "EmbeddingBackward", {weight}, out, [&] { return std::vector<SavedTensor>{SavedTensor(idx)}; },
      [num, dim](const BackwardContext& c) -> TensorList {
        const Tensor& ind = c.saved[0];
        if (!c.grads[0].device().isCpu()) {
          Tensor g = c.grads[0].to(DType::Float64).contiguous();
          Tensor gw = zeros({num, dim}, DType::Float64, g.device());
#if DT_HAVE_CUDA
          cuda::scatterAddRows(g.device(), gw.data<double>(), g.data<double>(), ind.data<int64_t>(),
                               ind.numel(), dim, num);
#endif
          return {gw};
        }
        // On the cpu the rows are summed in the gradient's compute type (PyTorch sums in the
        // weight's dtype too): a float32 model pays no float64 round trip of the whole gradient.
        const DType ct = computeType(c.grads[0].dtype());
        Tensor g = c.grads[0].to(ct).contiguous();
        Tensor gw = zeros({num, dim}, ct);
        const int64_t* p = ind.data<int64_t>();
        dispatchDType(ct, [&]<typename T>() {
          if constexpr (std::is_floating_point_v<T>) {
            const T* gp = g.data<T>();
            T* wp = gw.data<T>();
            for (int64_t i = 0; i < ind.numel(); ++i) {
              T* dst = wp + p[i] * dim;
              const T* src = gp + i * dim;
              for (int64_t j = 0; j < dim; ++j) dst[j] += src[j];
            }
          }
        });
        return {gw};
      });
  return out;
}

// ---- layer norm ---------------------------------------------------------------------------------------------

namespace {

template <typename T>
void layerNormForward(const T* x, const T* w, const T* b, T* y, double* meanOut, double* rstdOut, int64_t rows,
                      int64_t d, double eps) {
  parallelFor(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* xr = x + r * d;
      double s = 0;
      for (int64_t j = 0; j < d; ++j) s += static_cast<double>(xr[j]);
      const double mu = s / static_cast<double>(d);
      double v = 0;
      for (int64_t j = 0; j < d; ++j) {
        const double t = static_cast<double>(xr[j]) - mu;
        v += t * t;
      }
      const double rstd = 1.0 / std::sqrt(v / static_cast<double>(d) + eps);
      meanOut[r] = mu;
      rstdOut[r] = rstd;
      T* yr = y + r * d;
      for (int64_t j = 0; j < d; ++j) {
        double t = (static_cast<double>(xr[j]) - mu) * rstd;
        if (w != nullptr) t *= static_cast<double>(w[j]);
        if (b != nullptr) t += static_cast<double>(b[j]);
        yr[j] = static_cast<T>(t);
      }
    }
  });
}

template <typename T>
void layerNormBackward(const T* x, const T* w, const T* g, const double* meanIn, const double* rstdIn, int64_t rows,
                       int64_t d, T* gx, double* gw, double* gb) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    const T* gr = g + r * d;
    const double mu = meanIn[r], rstd = rstdIn[r];
    double sumG = 0, sumGX = 0;
    for (int64_t j = 0; j < d; ++j) {
      const double xhat = (static_cast<double>(xr[j]) - mu) * rstd;
      const double gh = static_cast<double>(gr[j]) * (w ? static_cast<double>(w[j]) : 1.0);
      sumG += gh;
      sumGX += gh * xhat;
      if (gw) gw[j] += static_cast<double>(gr[j]) * xhat;
      if (gb) gb[j] += static_cast<double>(gr[j]);
    }
    if (gx) {
      T* o = gx + r * d;
      const double invD = 1.0 / static_cast<double>(d);
      for (int64_t j = 0; j < d; ++j) {
        const double xhat = (static_cast<double>(xr[j]) - mu) * rstd;
        const double gh = static_cast<double>(gr[j]) * (w ? static_cast<double>(w[j]) : 1.0);
        o[j] = static_cast<T>(rstd * (gh - sumG * invD - xhat * sumGX * invD));
      }
    }
  }
}

}  // namespace

Tensor layerNorm(const Tensor& x, const std::vector<int64_t>& normalizedShape, const Tensor& weight, const Tensor& bias,
                 double eps) {
  detail::OpScope opScope("layerNorm", x, weight, bias);
  const char* op = "layerNorm";
  const bool onGpu = onCuda(x, op);
  if (weight.defined()) requireSameDevice(x, weight, op);
  if (bias.defined()) requireSameDevice(x, bias, op);
  requireFloat(x, op);
  const int64_t k = static_cast<int64_t>(normalizedShape.size());
  bool ok = k >= 1 && k <= x.dim();
  for (int64_t i = 0; ok && i < k; ++i) ok = x.sizes()[x.dim() - k + i] == normalizedShape[i];
  if (!ok) {
    throw InvalidArgument(str("layerNorm: normalized shape ", describeShape(normalizedShape),
                              " does not match the trailing dims of input ", x.describe()));
  }
  if (weight.defined() && weight.sizes() != normalizedShape) {
    throw InvalidArgument(str("layerNorm: weight ", weight.describe(), " does not match ", describeShape(normalizedShape)));
  }
  if (bias.defined() && bias.sizes() != normalizedShape) {
    throw InvalidArgument(str("layerNorm: bias ", bias.describe(), " does not match ", describeShape(normalizedShape)));
  }
  const int64_t d = shapeNumel(normalizedShape);
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  const DType ct = computeType(x.dtype());
  Tensor xc, wc, bc;
  {
    NoGradGuard ng;
    xc = x.to(ct).contiguous();
    if (weight.defined()) wc = weight.to(ct).contiguous();
    if (bias.defined()) bc = bias.to(ct).contiguous();
  }
  Tensor y = empty(x.sizes(), ct, x.device());
  Tensor meanT = empty({rows}, DType::Float64, x.device()), rstdT = empty({rows}, DType::Float64, x.device());
  if (onGpu) {
#if DT_HAVE_CUDA
    cuda::layerNormForward(x.device(), ct, y.dataPtr(), meanT.data<double>(), rstdT.data<double>(),
                           xc.dataPtr(), wc.defined() ? wc.dataPtr() : nullptr,
                           bc.defined() ? bc.dataPtr() : nullptr, rows, d, eps);
#endif
  } else if (ct == DType::Float32) {
    const float* xp = xc.data<float>();
    const float* wp = wc.defined() ? wc.data<float>() : nullptr;
    const float* bp = bc.defined() ? bc.data<float>() : nullptr;
    float* yp = y.data<float>();
    double *mp = meanT.data<double>(), *rp = rstdT.data<double>();
    parallelFor(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t lo, int64_t hi) {
      fast::layerNormForward(xp + lo * d, wp, bp, yp + lo * d, mp + lo, rp + lo, hi - lo, d, eps);
    });
  } else {
    dispatchDType(ct, [&]<typename T>() {
      if constexpr (std::is_floating_point_v<T>) {
        layerNormForward<T>(
            static_cast<const T*>(xc.dataPtr()), wc.defined() ? static_cast<const T*>(wc.dataPtr()) : nullptr,
            bc.defined() ? static_cast<const T*>(bc.dataPtr()) : nullptr, static_cast<T*>(y.dataPtr()),
            meanT.data<double>(), rstdT.data<double>(), rows, d, eps);
      }
    });
  }
  if (ct != x.dtype()) {
    NoGradGuard ng;
    y = y.to(x.dtype());
  }
  const bool hasW = weight.defined(), hasB = bias.defined();
  recordFn(
      "LayerNormBackward", {x, weight, bias}, y,
      [&] {
        return std::vector<SavedTensor>{SavedTensor(xc), SavedTensor(wc), SavedTensor(meanT), SavedTensor(rstdT)};
      },
      [rows, d, hasW, hasB, ct](const BackwardContext& c) -> TensorList {
        const Tensor &xs = c.saved[0], &ws = c.saved[1], &mu = c.saved[2], &rs = c.saved[3];
        Tensor g = c.grads[0].to(ct).contiguous();
        Tensor gx = c.needs[0] ? emptyLike(xs) : Tensor();
        const Device dev = xs.device();
        Tensor gw = hasW && c.needs[1] ? zeros({d}, DType::Float64, dev) : Tensor();
        Tensor gb = hasB && c.needs[2] ? zeros({d}, DType::Float64, dev) : Tensor();
        if (!dev.isCpu()) {
#if DT_HAVE_CUDA
          cuda::layerNormBackward(
              dev, ct, gx.defined() ? gx.dataPtr() : nullptr, gw.defined() ? gw.data<double>() : nullptr,
              gb.defined() ? gb.data<double>() : nullptr, xs.dataPtr(), hasW ? ws.dataPtr() : nullptr,
              g.dataPtr(), mu.data<double>(), rs.data<double>(), rows, d);
#endif
        } else if (ct == DType::Float32) {
          // Rows split across threads; each chunk sums its weight/bias gradients apart, then
          // the chunks' sums are added in chunk order (the same result for a thread count).
          const float* xp = xs.data<float>();
          const float* wp = hasW ? ws.data<float>() : nullptr;
          const float* gp = g.data<float>();
          float* gxp = gx.defined() ? gx.data<float>() : nullptr;
          const double *mp = mu.data<double>(), *rp = rs.data<double>();
          const int64_t grain = std::max<int64_t>(64, 16384 / std::max<int64_t>(d, 1));
          const int64_t chunks = (rows + grain - 1) / grain;
          std::vector<double> partW(gw.defined() ? static_cast<size_t>(chunks * d) : 0);
          std::vector<double> partB(gb.defined() ? static_cast<size_t>(chunks * d) : 0);
          parallelFor(0, chunks, 1, [&](int64_t c0, int64_t c1) {
            for (int64_t ch = c0; ch < c1; ++ch) {
              const int64_t lo = ch * grain, hi = std::min(rows, lo + grain);
              fast::layerNormBackward(xp + lo * d, wp, gp + lo * d, mp + lo, rp + lo, hi - lo, d,
                                      gxp ? gxp + lo * d : nullptr, gw.defined() ? partW.data() + ch * d : nullptr,
                                      gb.defined() ? partB.data() + ch * d : nullptr);
            }
          });
          for (int64_t ch = 0; ch < chunks; ++ch) {
            for (int64_t j = 0; j < d; ++j) {
              if (gw.defined()) gw.data<double>()[j] += partW[ch * d + j];
              if (gb.defined()) gb.data<double>()[j] += partB[ch * d + j];
            }
          }
        } else {
          dispatchDType(ct, [&]<typename T>() {
            if constexpr (std::is_floating_point_v<T>) {
              layerNormBackward<T>(
                  static_cast<const T*>(xs.dataPtr()), hasW ? static_cast<const T*>(ws.dataPtr()) : nullptr,
                  static_cast<const T*>(g.dataPtr()), mu.data<double>(), rs.data<double>(), rows, d,
                  gx.defined() ? static_cast<T*>(gx.dataPtr()) : nullptr,
                  gw.defined() ? gw.data<double>() : nullptr, gb.defined() ? gb.data<double>() : nullptr);
            }
          });
        }
        const Shape wshape = hasW ? ws.sizes() : Shape{d};
        if (gw.defined()) gw = gw.reshape(wshape);
        if (gb.defined()) gb = gb.reshape(wshape);
        return {gx, gw, gb};
      },
      // Its weight gradients are column sums: a zero-bubble schedule gains nothing by deferring
      // them and would keep the input and the output gradient until their W (docs/parallel.md).
      WeightGrads::WithInputs);
  return y;
}

// ---- dropout -----------------------------------------------------------------------------------------------------

Tensor dropout(const Tensor& x, double p, bool training, Generator& generator) {
  detail::OpScope opScope("dropout", x);
  if (p < 0 || p > 1) throw InvalidArgument(str("dropout: probability must be in [0, 1], got ", p));
  requireFloat(x, "dropout");
  if (!training || p == 0.0) return x;
  if (p == 1.0) return mul(x, zerosLike(x));
  Tensor mask = empty(x.sizes(), x.dtype(), x.device());
  {
    NoGradGuard ng;
    Tensor u = empty(x.sizes(), DType::Float32);
    float* up = u.data<float>();
    const float scale = static_cast<float>(1.0 / (1.0 - p));
    for (int64_t i = 0; i < u.numel(); ++i) up[i] = generator.nextDouble() >= p ? scale : 0.0f;
    mask.copy_(u);
  }
  return mul(x, mask);
}

// ---- cat / stack / indexSelect -------------------------------------------------------------------------------------

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  detail::OpScope opScope("cat", tensors);
  if (tensors.empty()) throw InvalidArgument("cat: expected a non-empty list of tensors");
  const Tensor& first = tensors[0];
  dim = wrapDim(dim, first.dim(), "cat");
  Shape outShape = first.sizes();
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    requireSameDevice(first, t, "cat");
    if (t.dtype() != first.dtype()) {
      throw InvalidArgument(str("cat: dtypes differ: tensor 0 is ", first.describe(), ", tensor ", i, " is ", t.describe()));
    }
    bool ok = t.dim() == first.dim();
    for (int64_t d = 0; ok && d < t.dim(); ++d) ok = d == dim || t.sizes()[d] == first.sizes()[d];
    if (!ok) {
      throw InvalidArgument(str("cat: tensor ", i, " ", t.describe(), " does not match tensor 0 ", first.describe(),
                                " outside dim ", dim));
    }
    total += t.sizes()[dim];
  }
  outShape[dim] = total;
  Tensor out = empty(outShape, first.dtype(), first.device());
  std::vector<int64_t> lengths;
  {
    NoGradGuard ng;
    int64_t offset = 0;
    for (const Tensor& t : tensors) {
      const int64_t len = t.sizes()[dim];
      lengths.push_back(len);
      if (len > 0) narrowNoGrad(out, dim, offset, len).copy_(t);
      offset += len;
    }
  }
  recordFn("CatBackward", tensors, out, nullptr, [dim, lengths](const BackwardContext& c) -> TensorList {
    TensorList grads;
    int64_t offset = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      grads.push_back(c.needs[i] ? narrowNoGrad(c.grads[0], dim, offset, lengths[i]) : Tensor());
      offset += lengths[i];
    }
    return grads;
  });
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  detail::OpScope opScope("stack", tensors);
  if (tensors.empty()) throw InvalidArgument("stack: expected a non-empty list of tensors");
  dim = wrapDim(dim, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> parts;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].sizes() != tensors[0].sizes()) {
      throw InvalidArgument(str("stack: tensor ", i, " ", tensors[i].describe(), " differs in shape from tensor 0 ",
                                tensors[0].describe()));
    }
    parts.push_back(tensors[i].unsqueeze(dim));
  }
  return cat(parts, dim);
}

Tensor indexSelect(const Tensor& a, int64_t dim, const Tensor& index) {
  detail::OpScope opScope("indexSelect", a, index);
  requireSameDevice(a, index, "indexSelect");
  if (index.dtype() != DType::Int64 && index.dtype() != DType::Int32) {
    throw InvalidArgument(str("indexSelect: index must be int64/int32, got ", index.describe()));
  }
  if (index.dim() > 1) throw InvalidArgument(str("indexSelect: index must be 1-D, got ", index.describe()));
  dim = wrapDim(dim, a.dim(), "indexSelect");
  Tensor idx;
  {
    NoGradGuard ng;
    // The indices drive host loops of row copies (each a kernel on CUDA): they are read on the cpu.
    (void)onCuda(a, "indexSelect");
    idx = index.to(DType::Int64).to(Device::cpu()).contiguous();
  }
  const int64_t size = a.dim() == 0 ? 1 : a.sizes()[dim];
  const int64_t* ip = idx.data<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    if (ip[i] < 0 || ip[i] >= size) {
      throw InvalidArgument(str("indexSelect: index ", ip[i], " out of range for dim ", dim, " of ", a.describe(),
                                " (size ", size, ")"));
    }
  }
  Shape outShape = a.sizes();
  if (a.dim() > 0) outShape[dim] = idx.numel();
  Tensor out = empty(outShape, a.dtype(), a.device());
  {
    NoGradGuard ng;
    for (int64_t i = 0; i < idx.numel(); ++i) {
      selectNoGrad(out, dim, i).copy_(selectNoGrad(a, dim, ip[i]));
    }
  }
  const Shape inShape = a.sizes();
  const DType dt = a.dtype();
  recordFn(
      "IndexSelectBackward", {a}, out, [&] { return std::vector<SavedTensor>{SavedTensor(idx)}; },
      [dim, inShape, dt](const BackwardContext& c) -> TensorList {
        Tensor gin = zeros(inShape, dt, c.grads[0].device());
        const int64_t* p = c.saved[0].data<int64_t>();
        for (int64_t i = 0; i < c.saved[0].numel(); ++i) {
          Tensor dst = selectNoGrad(gin, dim, p[i]);
          addInPlace(dst, selectNoGrad(c.grads[0], dim, i));
        }
        return {gin};
      });
  return out;
}

}  // namespace dt
