// Matrix products through OpenBLAS or oneDNN on the cpu (tensor/internal/gemm.h routes them) and
// cuBLAS on CUDA. Transposed operands become CblasTrans / CUBLAS_OP_T or oneDNN's transposed
// strides (no copies); only operands whose strides BLAS cannot express are copied.
#include <cblas.h>

#include <cstring>
#include <optional>

#include "common/check.h"
#include "common/config.h"
#include "tensor/autocast.h"
#include "tensor/internal/detail.h"
#include "tensor/internal/fast_kernels.h"
#include "tensor/internal/gemm.h"
#include "tensor/internal/op_scope.h"
#include "tensor/internal/ops_internal.h"
#include "tensor/parallel.h"

#if DT_HAVE_CUDA
#include "tensor/cuda/kernels.h"
#endif

namespace dt {

using namespace detail;

namespace {

struct BlasOperand {
  Tensor keep;  // holds the data alive (a copy when the view was not BLAS-expressible)
  const void* data;
  CBLAS_TRANSPOSE trans;
  int ld;
};

// How BLAS reads a 2-D [rows, cols] view: row-major as is, or as the transpose of a row-major matrix.
BlasOperand blasOperand(const Tensor& t) {
  const int64_t rows = t.sizes()[0], cols = t.sizes()[1];
  const int64_t s0 = t.strides()[0], s1 = t.strides()[1];
  if ((s1 == 1 || cols <= 1) && s0 >= std::max<int64_t>(1, cols)) {
    return {t, t.dataPtr(), CblasNoTrans, static_cast<int>(std::max<int64_t>(1, s0))};
  }
  if ((s0 == 1 || rows <= 1) && s1 >= std::max<int64_t>(1, rows)) {
    return {t, t.dataPtr(), CblasTrans, static_cast<int>(std::max<int64_t>(1, s1))};
  }
  Tensor c = t.contiguous();
  return {c, c.dataPtr(), CblasNoTrans, static_cast<int>(std::max<int64_t>(1, cols))};
}

// out[m, n] (contiguous rows, any leading dim) = alpha * a[m, k] . b[k, n] + beta * out, plus
// `bias` (n floats, cpu float32 out with beta 0 only) on every row.
void gemm(const Tensor& a, const Tensor& b, Tensor& out, double alpha, double beta, const float* bias = nullptr) {
  const int64_t m = a.sizes()[0], k = a.sizes()[1], n = b.sizes()[1];
  if (m == 0 || n == 0) return;
  DT_INTERNAL_CHECK(out.strides()[1] == 1 || n == 1, "gemm output must have unit column stride");
  DT_INTERNAL_CHECK(bias == nullptr || (out.device().isCpu() && out.dtype() == DType::Float32 && beta == 0.0),
                    "gemm: a bias needs a cpu float32 output and beta 0");
  if (k == 0) {
    if (bias != nullptr) {
      float* o = out.data<float>();
      for (int64_t r = 0; r < m; ++r) std::memcpy(o + r * out.strides()[0], bias, static_cast<size_t>(n) * sizeof(float));
      out.bumpVersion();
    } else if (beta == 0.0) {
      out.zero_();
    } else {
      NoGradGuard ng;
      mul_(out, beta);
    }
    return;
  }
  BlasOperand A = blasOperand(a), B = blasOperand(b);
  const int ldc = static_cast<int>(std::max<int64_t>(out.strides()[0], std::max<int64_t>(1, n)));
  if (!out.device().isCpu()) {
#if DT_HAVE_CUDA
    cuda::gemm(out.device(), out.dtype(), A.trans == CblasTrans, B.trans == CblasTrans, m, n, k, alpha,
               A.data, A.ld, B.data, B.ld, beta, out.dataPtr(), ldc);
    out.bumpVersion();
#endif
    return;
  }
  cpuGemm(GemmProblem{.inType = a.dtype(), .outType = out.dtype(), .transA = A.trans == CblasTrans,
                      .transB = B.trans == CblasTrans, .m = m, .n = n, .k = k, .a = A.data, .lda = A.ld,
                      .b = B.data, .ldb = B.ld, .c = out.dataPtr(), .ldc = ldc, .alpha = alpha, .beta = beta,
                      .bias = bias});
  out.bumpVersion();
}

// The dtype a product's operands are converted to: bfloat16 ones stay bfloat16 on the cpu where
// oneDNN runs them natively (float32 accumulation and output); otherwise the compute type.
DType operandType(const Tensor& a, DType computeType) {
  return a.device().isCpu() ? gemmOperandType(a.dtype(), computeType) : computeType;
}

DType gemmType(const Tensor& a, const Tensor& b, const char* op) {
  requireSameDevice(a, b, op);
  (void)onCuda(a, op);  // the gate: gemm() dispatches on the output's device
  if (a.dtype() != b.dtype()) {
    throw InvalidArgument(str(op, ": dtypes differ: ", a.describe(), " and ", b.describe()));
  }
  if (a.dtype() == DType::Float64) return DType::Float64;
  if (a.dtype() == DType::Float32 || a.dtype() == DType::Float16 || a.dtype() == DType::BFloat16) return DType::Float32;
  throw InvalidArgument(str(op, ": dtype ", a.dtype(), " is not supported (float32, float64, float16, bfloat16); got ",
                            a.describe(), " and ", b.describe()));
}

// Under an autocast scope (tensor/autocast.h), for cpu float32/bfloat16 operands: the type the
// operands are converted to (bfloat16, or float32 where bf16 products do not run natively);
// the result is float32. nullopt: the op's usual types.
std::optional<DType> autocastOperands(const Tensor& a, const Tensor& b) {
  const std::optional<DType> ac = autocastDType();
  if (!ac || !a.device().isCpu() || !b.device().isCpu()) return std::nullopt;
  auto castable = [](DType t) { return t == DType::Float32 || t == DType::BFloat16; };
  if (!castable(a.dtype()) || !castable(b.dtype())) return std::nullopt;
  return gemmOperandType(*ac, DType::Float32);
}

Tensor castNoGrad(const Tensor& t, std::optional<DType> cast) {
  if (!cast || t.dtype() == *cast) return t;
  NoGradGuard noGrad;
  return t.to(*cast);
}

Tensor mmNoGrad(const Tensor& a, const Tensor& b, std::optional<DType> cast = std::nullopt) {
  NoGradGuard noGrad;
  if (cast) {
    Tensor out = empty({a.sizes()[0], b.sizes()[1]}, DType::Float32, a.device());
    gemm(a.to(*cast), b.to(*cast), out, 1.0, 0.0);
    return out;
  }
  const DType ct = gemmType(a, b, "mm");
  const DType it = operandType(a, ct);
  Tensor out = empty({a.sizes()[0], b.sizes()[1]}, ct, a.device());
  gemm(a.to(it), b.to(it), out, 1.0, 0.0);
  return out.to(a.dtype());
}

}  // namespace

Tensor mm(const Tensor& a, const Tensor& b) {
  detail::OpScope opScope("mm", a, b);
  if (a.dim() != 2 || b.dim() != 2 || a.sizes()[1] != b.sizes()[0]) {
    throw InvalidArgument(str("mm: shapes ", a.describe(), " and ", b.describe(), " cannot be multiplied (expected [n, k] x [k, m])"));
  }
  // Under autocast the converted operands are what backward multiplies with: saved as such.
  const std::optional<DType> cast = autocastOperands(a, b);
  const Tensor A = castNoGrad(a, cast), B = castNoGrad(b, cast);
  Tensor out = mmNoGrad(A, B, cast);
  recordFn(
      "MmBackward", {a, b}, out, [&] { return std::vector<SavedTensor>{SavedTensor(A), SavedTensor(B)}; },
      [cast](const BackwardContext& c) -> TensorList {
        const Tensor& g = c.grads[0];
        return {c.needs[0] ? mmNoGrad(g, c.saved[1].t(), cast) : Tensor(),
                c.needs[1] ? mmNoGrad(c.saved[0].t(), g, cast) : Tensor()};
      });
  return out;
}

namespace {

// Each operand's matrices share one layout (a tensor's strides are the same in every batch
// entry), so the first matrix's transpose flag and leading dim hold for all; an operand BLAS
// cannot read as it is gets one contiguous copy.
std::pair<Tensor, BlasOperand> batchLayout(const Tensor& t) {
  Tensor first = detail::selectNoGrad(t, 0, 0);
  BlasOperand op = blasOperand(first);
  if (op.data == first.dataPtr()) return {t, op};
  Tensor dense = t.contiguous();
  return {dense, blasOperand(detail::selectNoGrad(dense, 0, 0))};
}

// One call for the whole batch: oneDNN runs it as one batched primitive, OpenBLAS as a loop.
void bmmCpu(const Tensor& a, const Tensor& b, Tensor& out) {
  const int64_t batch = a.sizes()[0], m = a.sizes()[1], k = a.sizes()[2], n = b.sizes()[2];
  if (batch == 0 || m == 0 || n == 0) return;
  if (k == 0) {
    out.zero_();
    return;
  }
  const auto [A, la] = batchLayout(a);
  const auto [B, lb] = batchLayout(b);
  const int64_t ldc = std::max<int64_t>(out.strides()[1], std::max<int64_t>(1, n));
  cpuGemm(GemmProblem{.inType = A.dtype(), .outType = out.dtype(), .transA = la.trans == CblasTrans,
                      .transB = lb.trans == CblasTrans, .batch = batch, .m = m, .n = n, .k = k, .a = la.data,
                      .lda = la.ld, .strideA = A.strides()[0], .b = lb.data, .ldb = lb.ld, .strideB = B.strides()[0],
                      .c = out.dataPtr(), .ldc = ldc, .strideC = out.strides()[0]});
  out.bumpVersion();
}

#if DT_HAVE_CUDA
// One cuBLAS call for the whole batch, with batchLayout's operands.
void bmmCuda(const Tensor& a, const Tensor& b, Tensor& out) {
  const int64_t batch = a.sizes()[0], m = a.sizes()[1], k = a.sizes()[2], n = b.sizes()[2];
  if (batch == 0 || m == 0 || n == 0) return;
  if (k == 0) {
    out.zero_();
    return;
  }
  const auto [A, la] = batchLayout(a);
  const auto [B, lb] = batchLayout(b);
  const int64_t ldc = std::max<int64_t>(out.strides()[1], std::max<int64_t>(1, n));
  cuda::gemmStridedBatched(out.device(), out.dtype(), la.trans == CblasTrans, lb.trans == CblasTrans, m, n, k,
                           1.0, A.dataPtr(), la.ld, A.strides()[0], B.dataPtr(), lb.ld, B.strides()[0], 0.0,
                           out.dataPtr(), ldc, out.strides()[0], batch);
  out.bumpVersion();
}
#endif

Tensor bmmNoGrad(const Tensor& a, const Tensor& b, std::optional<DType> cast = std::nullopt) {
  NoGradGuard noGrad;
  if (cast) {  // autocast: cpu only, float32 result
    Tensor out = empty({a.sizes()[0], a.sizes()[1], b.sizes()[2]}, DType::Float32, a.device());
    bmmCpu(a.to(*cast), b.to(*cast), out);
    return out;
  }
  const DType ct = gemmType(a, b, "bmm");
  const DType it = operandType(a, ct);
  const Tensor A = a.to(it), B = b.to(it);
  const int64_t batch = a.sizes()[0];
  Tensor out = empty({batch, a.sizes()[1], b.sizes()[2]}, ct, a.device());
  if (!out.device().isCpu()) {
#if DT_HAVE_CUDA
    bmmCuda(A, B, out);
#endif
    return out.to(a.dtype());
  }
  bmmCpu(A, B, out);
  return out.to(a.dtype());
}
}  // namespace

Tensor bmm(const Tensor& a, const Tensor& b) {
  detail::OpScope opScope("bmm", a, b);
  if (a.dim() != 3 || b.dim() != 3 || a.sizes()[0] != b.sizes()[0] || a.sizes()[2] != b.sizes()[1]) {
    throw InvalidArgument(str("bmm: shapes ", a.describe(), " and ", b.describe(),
                              " cannot be multiplied (expected [B, n, k] x [B, k, m])"));
  }
  const std::optional<DType> cast = autocastOperands(a, b);
  const Tensor A = castNoGrad(a, cast), B = castNoGrad(b, cast);
  Tensor out = bmmNoGrad(A, B, cast);
  recordFn(
      "BmmBackward", {a, b}, out, [&] { return std::vector<SavedTensor>{SavedTensor(A), SavedTensor(B)}; },
      [cast](const BackwardContext& c) -> TensorList {
        const Tensor& g = c.grads[0];
        return {c.needs[0] ? bmmNoGrad(g, detail::permuteNoGrad(c.saved[1], {0, 2, 1}), cast) : Tensor(),
                c.needs[1] ? bmmNoGrad(detail::permuteNoGrad(c.saved[0], {0, 2, 1}), g, cast) : Tensor()};
      });
  return out;
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  detail::OpScope opScope("matmul", a, b);
  const int64_t da = a.dim(), db = b.dim();
  if (da == 0 || db == 0) {
    throw InvalidArgument(str("matmul: both arguments need at least 1 dim, got ", a.describe(), " and ", b.describe()));
  }
  auto mismatch = [&] {
    return InvalidArgument(str("matmul: shapes ", a.describe(), " and ", b.describe(), " cannot be multiplied"));
  };
  if (a.sizes()[da - 1] != b.sizes()[db == 1 ? 0 : db - 2]) throw mismatch();
  if (da == 1 && db == 1) return mm(a.unsqueeze(0), b.unsqueeze(1)).reshape({});
  if (da == 2 && db == 1) return mm(a, b.unsqueeze(1)).squeeze(1);
  if (da == 1 && db == 2) return mm(a.unsqueeze(0), b).squeeze(0);
  if (da == 2 && db == 2) return mm(a, b);
  if (da >= 3 && db <= 2) {
    // Fold the batch into rows: one big gemm.
    Shape outShape(a.sizes().begin(), a.sizes().end() - 1);
    Tensor bm = db == 1 ? b.unsqueeze(1) : b;
    Tensor r = mm(a.reshape({-1, a.sizes()[da - 1]}), bm);
    if (db == 2) outShape.push_back(b.sizes()[1]);
    return r.reshape(outShape);
  }
  // General batched case with broadcast batch dims.
  Tensor A = da == 1 ? a.unsqueeze(0) : a;
  Tensor B = db == 1 ? b.unsqueeze(1) : b;
  const Shape batchA(A.sizes().begin(), A.sizes().end() - 2), batchB(B.sizes().begin(), B.sizes().end() - 2);
  const Shape batch = broadcastShapes(batchA, batchB, "matmul");
  const int64_t n = A.sizes()[A.dim() - 2], k = A.sizes()[A.dim() - 1], m = B.sizes()[B.dim() - 1];
  Shape ea = batch, eb = batch;
  ea.insert(ea.end(), {n, k});
  eb.insert(eb.end(), {k, m});
  const int64_t nb = shapeNumel(batch);
  Tensor r = bmm(A.expand(ea).reshape({nb, n, k}), B.expand(eb).reshape({nb, k, m}));
  Shape outShape = batch;
  if (da > 1) outShape.push_back(n);
  if (db > 1) outShape.push_back(m);
  return r.reshape(outShape);
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  detail::OpScope opScope("linear", x, weight, bias);
  const char* op = "linear";
  requireSameDevice(x, weight, op);
  if (bias.defined()) requireSameDevice(x, bias, op);
  if (weight.dim() != 2 || x.dim() < 1 || x.sizes().back() != weight.sizes()[1]) {
    throw InvalidArgument(str("linear: input ", x.describe(), " does not match weight ", weight.describe(),
                              " (expected input [*, ", weight.dim() == 2 ? weight.sizes()[1] : -1, "])"));
  }
  const int64_t in = weight.sizes()[1], outF = weight.sizes()[0];
  if (bias.defined() && (bias.dim() != 1 || bias.sizes()[0] != outF)) {
    throw InvalidArgument(str("linear: bias ", bias.describe(), " does not match weight ", weight.describe()));
  }
  // Under autocast: bf16 (or float32) operands, float32 result, the bias added in float32.
  const std::optional<DType> cast = autocastOperands(x, weight);
  const DType ct = cast ? DType::Float32 : gemmType(x, weight, op);
  if (bias.defined() && cast && !isFloatingPoint(bias.dtype())) {
    throw InvalidArgument(str("linear: bias ", bias.describe(), " is not floating point"));
  }
  if (bias.defined() && !cast && bias.dtype() != x.dtype()) {
    throw InvalidArgument(str("linear: bias ", bias.describe(), " and input ", x.describe(), " differ in dtype"));
  }
  const int64_t rows = x.numel() / std::max<int64_t>(in, 1);
  std::optional<NoGradGuard> noGrad(std::in_place);
  Tensor x2 = detail::canView(x, {rows, in}) ? detail::viewNoGrad(x, {rows, in}) : detail::viewNoGrad(x.contiguous(), {rows, in});
  // ct: the output's and gradients' compute type; it: the gemm operands' (bfloat16 on oneDNN).
  const DType it = cast ? *cast : operandType(x, ct);
  x2 = x2.to(it);
  const Tensor w = weight.to(it);
  Tensor out = empty({rows, outF}, ct, x.device());
  double beta = 0.0;
  Tensor b;
  const float* biasRow = nullptr;
  if (bias.defined()) {
    b = bias.to(ct).contiguous();
    if (out.device().isCpu() && ct == DType::Float32) {
      biasRow = b.data<float>();  // in the product's epilogue (oneDNN) or written first (OpenBLAS)
    } else if (out.device().isCpu()) {
      // Bias rows first, then the gemm accumulates onto them (beta = 1): no separate add pass.
      const size_t rowBytes = static_cast<size_t>(outF) * itemSize(ct);
      char* dst = static_cast<char*>(out.dataPtr());
      for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * rowBytes, b.dataPtr(), rowBytes);
      beta = 1.0;
    } else {
      out.copy_(b);
      beta = 1.0;
    }
  }
  gemm(x2, w.t(), out, 1.0, beta, biasRow);
  Shape outShape(x.sizes().begin(), x.sizes().end() - 1);
  outShape.push_back(outF);
  Tensor result = detail::viewNoGrad(out, outShape);
  if (!cast && result.dtype() != x.dtype()) result = result.to(x.dtype());
  noGrad.reset();
  const Shape xShape = x.sizes();
  const bool hasBias = bias.defined();
  recordFn(
      "LinearBackward", {x, weight, bias}, result,
      [&] { return std::vector<SavedTensor>{SavedTensor(x2), SavedTensor(w)}; },
      [xShape, rows, outF, ct, it, hasBias](const BackwardContext& c) -> TensorList {
        Tensor g = c.grads[0];
        if (g.dtype() != ct) g = g.to(ct);
        Tensor g2 = detail::canView(g, {rows, outF}) ? detail::viewNoGrad(g, {rows, outF})
                                                       : detail::viewNoGrad(g.contiguous(), {rows, outF});
        // The bias gradient sums g in the compute type; the two products take `it` operands.
        const Tensor gOp = it == ct ? g2 : g2.to(it);
        const Tensor& xs = c.saved[0];
        const Tensor& ws = c.saved[1];
        Tensor gx, gw, gb;
        if (c.needs[0]) {
          gx = empty({rows, ws.sizes()[1]}, ct, ws.device());
          gemm(gOp, ws, gx, 1.0, 0.0);  // [rows, out] . [out, in]
          gx = detail::viewNoGrad(gx, xShape);
        }
        if (c.needs[1]) {
          gw = empty(ws.sizes(), ct, ws.device());
          gemm(gOp.t(), xs, gw, 1.0, 0.0);  // [out, rows] . [rows, in]
        }
        if (hasBias && c.needs[2]) {
          if (g2.device().isCpu() && ct == DType::Float32 && g2.isContiguous()) {
            gb = empty({outF}, ct);
            fast::columnSums(g2.data<float>(), rows, outF, gb.data<float>());
          } else {
            gb = sum(g2, {0}, false);
          }
        }
        return {gx, gw, gb};
      });
  return result;
}

}  // namespace dt
