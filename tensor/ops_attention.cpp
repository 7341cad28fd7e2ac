// Scaled dot-product attention on the CPU: one fused forward and one fused backward per head.
//
// Per head (query rows i, key rows j): S = scale * Q K^T, P = softmax(S) over the keys a row may
// see (j <= i when causal), optional dropout on P, O = P V. Saved for backward: Q, K, V and P
// (and the dropout mask); the backward computes dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(P
// * dP)), dQ = scale * dS K, dK = scale * dS^T Q, each with BLAS. Why fused: the unfused chain
// (bmm, mask, softmax, dropout, bmm, and transposes to and from [B, H, T, d]) materialises the
// score matrix several times and copies every head twice; here each head's scores exist once.
// Causal heads are cut into row blocks of kBlock rows, and each block's gemms only span the
// keys up to its last row, so about 60% of the square is computed at T = 128 (float32; bf16
// operands take larger blocks, kBlockBf16).
//
// Under bf16 autocast with autocastAttention() (tensor/autocast.h) the gemms take bf16 operands
// (Q, K, V, the probabilities, dO and dS, rounded once each) with float32 accumulation on
// oneDNN, where bf16 runs natively; scores, softmax, dropout, dS and the outputs stay float32.
// The operand type is chosen at forward and kept by the backward; the saved Q, K, V are bf16.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "tensor/autocast.h"
#include "tensor/internal/detail.h"
#include "tensor/internal/fast_kernels.h"
#include "tensor/internal/gemm.h"
#include "tensor/internal/op_scope.h"
#include "tensor/internal/ops_internal.h"
#include "tensor/parallel.h"

namespace dt {

using namespace detail;

namespace {

constexpr int64_t kBlock = 32;
// With bf16 operands each product is a oneDNN call of about 10 us of fixed cost (its packing,
// the primitive lookup), as much as a 32-row block's arithmetic: rows are taken 128 at a time
// (the whole square at T = 128), computing the masked part too, which measured faster than 32
// (median 18.2 against 24.3 ms for the attention core's step at B16-H4-C256-T128, six runs each).
constexpr int64_t kBlockBf16 = 128;
template <typename O>
constexpr int64_t causalBlock() {
  return std::is_same_v<O, BFloat16> ? kBlockBf16 : kBlock;
}

// Where one operand's heads live: head (b, h) starts at base + b * batchStride + h * headStride,
// its rows rowStride apart, each row contiguous. Strides in elements.
template <typename T>
struct Heads {
  T* base = nullptr;
  int64_t batchStride = 0;
  int64_t headStride = 0;
  int64_t rowStride = 0;
  T* at(int64_t b, int64_t h) const { return base + b * batchStride + h * headStride; }
};

struct Shape4 {
  int64_t batch, heads, lenQ, lenK, dimQK, dimV;
};

// C = alpha op(A) op(B) + beta C with operands of type O and results of type T: float32 by the
// matrix product's rule (tensor/matmul_backend.cpp: OpenBLAS at these sizes, where the per-call
// cost is what matters, unless OpenBLAS runs kernels older than the CPU), float64 straight to
// OpenBLAS, bf16 operands to oneDNN's bf16 kernels (float32 accumulation, primitives cached per
// shape by tensor/onednn_matmul.cpp).
template <typename O, typename T>
void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, T alpha, const O* a, int64_t lda, const O* b,
          int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const CBLAS_TRANSPOSE ta = transA ? CblasTrans : CblasNoTrans, tb = transB ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<O, BFloat16>) {
    static_assert(std::is_same_v<T, float>, "bf16 operands accumulate in float32");
    cpuGemmOn(GemmEngine::OneDnn, GemmProblem{.inType = DType::BFloat16, .outType = DType::Float32, .transA = transA,
                                              .transB = transB, .m = m, .n = n, .k = k, .a = a, .lda = lda, .b = b,
                                              .ldb = ldb, .c = c, .ldc = ldc, .alpha = alpha, .beta = beta});
  } else if constexpr (std::is_same_v<T, float>) {
    cpuGemm(GemmProblem{.transA = transA, .transB = transB, .m = m, .n = n, .k = k, .a = a, .lda = lda, .b = b,
                        .ldb = ldb, .c = c, .ldc = ldc, .alpha = alpha, .beta = beta});
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a,
                static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
  }
}

template <typename T>
void softmaxRowInPlace(T* row, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    fast::softmaxRows(row, row, 1, n, false);
  } else {
    T m = row[0];
    for (int64_t j = 1; j < n; ++j) m = row[j] > m ? row[j] : m;
    T s = 0;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = std::exp(row[j] - m);
      s += row[j];
    }
    for (int64_t j = 0; j < n; ++j) row[j] /= s;
  }
}

// ds = p * (ds - sum(p * ds)) over a row's first n entries.
template <typename T>
void softmaxGradRowInPlace(const T* p, T* ds, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    fast::softmaxBackwardRows(ds, p, ds, 1, n);
  } else {
    T s = 0;
    for (int64_t j = 0; j < n; ++j) s += p[j] * ds[j];
    for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (ds[j] - s);
  }
}

// T: the scores' and outputs' type (float32, or float64); O: the gemm operands' (T, or bf16).
template <typename T, typename O = T>
struct Problem {
  Shape4 shape;
  T scale;
  bool causal;
  double dropoutP;
  Heads<const O> q, k, v;
  T* probs;             // [batch * heads, lenQ, lenK]: the softmax, zero where masked
  const uint8_t* keep;  // same shape, 1 = kept; null without dropout
};

// Keys row i sees, and how far the gemms of row block [r0, r0 + rows) reach.
inline int64_t visible(bool causal, int64_t i, int64_t lenK) { return causal ? i + 1 : lenK; }

// n values of src (through the dropout mask `keep` with its scale, when given) as gemm operands
// of type O: src itself where it already is that and needs no mask, else written to dst.
template <typename O, typename T>
const O* asOperand(const T* src, const uint8_t* keep, T dropScale, int64_t n, O* dst) {
  if constexpr (std::is_same_v<O, T>) {
    if (keep == nullptr) return src;
  }
  if (keep != nullptr) {
    for (int64_t e = 0; e < n; ++e) dst[e] = convertScalar<O>(keep[e] ? src[e] * dropScale : T(0));
  } else {
    for (int64_t e = 0; e < n; ++e) dst[e] = convertScalar<O>(src[e]);
  }
  return dst;
}

template <typename T, typename O>
void forwardHeads(const Problem<T, O>& pr, const Heads<T>& out) {
  const Shape4 s = pr.shape;
  const int64_t square = s.lenQ * s.lenK;
  const int64_t block = pr.causal ? causalBlock<O>() : std::max<int64_t>(1, s.lenQ);
  const T dropScale = static_cast<T>(pr.dropoutP > 0 ? 1.0 / (1.0 - pr.dropoutP) : 1.0);
  constexpr bool kConvert = !std::is_same_v<O, T>;
  parallelFor(0, s.batch * s.heads, 1, [&](int64_t lo, int64_t hi) {
    // A block's probabilities as V's multiplier: masked and scaled, or converted to O.
    std::vector<O> mixerRows(pr.keep || kConvert ? static_cast<size_t>(block * s.lenK) : 0);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / s.heads, h = bh % s.heads;
      const O* Q = pr.q.at(b, h);
      const O* K = pr.k.at(b, h);
      const O* V = pr.v.at(b, h);
      T* Out = out.at(b, h);
      T* P = pr.probs + bh * square;
      for (int64_t r0 = 0; r0 < s.lenQ; r0 += block) {
        const int64_t rows = std::min(block, s.lenQ - r0);
        const int64_t cols = pr.causal ? r0 + rows : s.lenK;
        T* Pb = P + r0 * s.lenK;
        gemm<O, T>(false, true, rows, cols, s.dimQK, pr.scale, Q + r0 * pr.q.rowStride, pr.q.rowStride, K,
                   pr.k.rowStride, T(0), Pb, s.lenK);
        for (int64_t i = 0; i < rows; ++i) {
          T* row = Pb + i * s.lenK;
          const int64_t n = visible(pr.causal, r0 + i, s.lenK);
          softmaxRowInPlace(row, n);
          std::fill(row + n, row + s.lenK, T(0));
        }
        const O* mixer = asOperand(Pb, pr.keep ? pr.keep + bh * square + r0 * s.lenK : nullptr, dropScale,
                                   rows * s.lenK, mixerRows.data());
        gemm<O, T>(false, false, rows, s.dimV, cols, T(1), mixer, s.lenK, V, pr.v.rowStride, T(0),
                   Out + r0 * out.rowStride, out.rowStride);
      }
    }
  });
}

template <typename T, typename O>
void backwardHeads(const Problem<T, O>& pr, const Heads<const O>& gradOut, const Heads<T>& dq, const Heads<T>& dk,
                   const Heads<T>& dv) {
  const Shape4 s = pr.shape;
  const int64_t square = s.lenQ * s.lenK;
  const int64_t block = pr.causal ? causalBlock<O>() : std::max<int64_t>(1, std::max(s.lenQ, s.lenK));
  const T dropScale = static_cast<T>(pr.dropoutP > 0 ? 1.0 / (1.0 - pr.dropoutP) : 1.0);
  constexpr bool kConvert = !std::is_same_v<O, T>;
  parallelFor(0, s.batch * s.heads, 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> ds(static_cast<size_t>(square));
    std::vector<O> mixerSquare(pr.keep || kConvert ? static_cast<size_t>(square) : 0);
    std::vector<O> dsOperand(kConvert ? static_cast<size_t>(square) : 0);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / s.heads, h = bh % s.heads;
      const O* Q = pr.q.at(b, h);
      const O* K = pr.k.at(b, h);
      const O* V = pr.v.at(b, h);
      const O* G = gradOut.at(b, h);
      const T* P = pr.probs + bh * square;
      const uint8_t* keep = pr.keep ? pr.keep + bh * square : nullptr;
      // What multiplied V in forward, in the operand type.
      const O* mixer = asOperand(P, keep, dropScale, square, mixerSquare.data());
      T* dS = ds.data();
      // dS as the operand of dQ's and dK's products: dS itself, or its rows converted per block.
      const O* dSo = nullptr;
      if constexpr (kConvert) {
        dSo = dsOperand.data();
      } else {
        dSo = dS;
      }
      for (int64_t r0 = 0; r0 < s.lenQ; r0 += block) {
        const int64_t rows = std::min(block, s.lenQ - r0);
        const int64_t cols = pr.causal ? r0 + rows : s.lenK;
        // dS rows: dO V^T, through the dropout mask, through the softmax.
        T* dSb = dS + r0 * s.lenK;
        gemm<O, T>(false, true, rows, cols, s.dimV, T(1), G + r0 * gradOut.rowStride, gradOut.rowStride, V,
                   pr.v.rowStride, T(0), dSb, s.lenK);
        for (int64_t i = 0; i < rows; ++i) {
          T* row = dSb + i * s.lenK;
          const int64_t n = visible(pr.causal, r0 + i, s.lenK);
          if (keep) {
            const uint8_t* kr = keep + (r0 + i) * s.lenK;
            for (int64_t j = 0; j < n; ++j) row[j] = kr[j] ? row[j] * dropScale : T(0);
          }
          softmaxGradRowInPlace(P + (r0 + i) * s.lenK, row, n);
          std::fill(row + n, row + s.lenK, T(0));
        }
        if constexpr (kConvert) {
          asOperand(dSb, nullptr, T(1), rows * s.lenK, dsOperand.data() + r0 * s.lenK);
        }
        // dQ rows = scale * dS K over the keys this block saw.
        gemm<O, T>(false, false, rows, s.dimQK, cols, pr.scale, dSo + r0 * s.lenK, s.lenK, K, pr.k.rowStride, T(0),
                   dq.at(b, h) + r0 * dq.rowStride, dq.rowStride);
      }
      // Key/value rows [c0, c0 + block) are seen by query rows c0 and later (causal) or all.
      for (int64_t c0 = 0; c0 < s.lenK; c0 += block) {
        const int64_t keys = std::min(block, s.lenK - c0);
        const int64_t first = pr.causal ? c0 : 0;
        const int64_t queries = s.lenQ - first;
        gemm<O, T>(true, false, keys, s.dimV, queries, T(1), mixer + first * s.lenK + c0, s.lenK,
                   G + first * gradOut.rowStride, gradOut.rowStride, T(0), dv.at(b, h) + c0 * dv.rowStride,
                   dv.rowStride);
        gemm<O, T>(true, false, keys, s.dimQK, queries, pr.scale, dSo + first * s.lenK + c0, s.lenK,
                   Q + first * pr.q.rowStride, pr.q.rowStride, T(0), dk.at(b, h) + c0 * dk.rowStride, dk.rowStride);
      }
    }
  });
}

// One draw per visible score, in (head, row, key) order, from the caller's generator.
Tensor dropoutKeepMask(const Shape4& s, bool causal, double p, Generator& generator) {
  Tensor keep = zeros({s.batch * s.heads, s.lenQ, s.lenK}, DType::Bool);
  auto* kp = static_cast<uint8_t*>(keep.dataPtr());
  for (int64_t bh = 0; bh < s.batch * s.heads; ++bh) {
    for (int64_t i = 0; i < s.lenQ; ++i) {
      uint8_t* row = kp + (bh * s.lenQ + i) * s.lenK;
      const int64_t n = visible(causal, i, s.lenK);
      for (int64_t j = 0; j < n; ++j) row[j] = generator.nextDouble() >= p ? 1 : 0;
    }
  }
  return keep;
}

template <typename T>
Heads<const T> constHeads(const Heads<T>& h) {
  return {h.base, h.batchStride, h.headStride, h.rowStride};
}

void checkOptions(const AttentionOptions& o, const char* op) {
  if (o.dropoutP < 0 || o.dropoutP >= 1) {
    throw InvalidArgument(str(op, ": dropout probability must be in [0, 1), got ", o.dropoutP));
  }
  if (o.scale && !(*o.scale > 0)) throw InvalidArgument(str(op, ": scale must be positive, got ", *o.scale));
}

// The operands as [N, T, D] (inner stride 1, leading dims folded into one stride) in the
// compute dtype, copied only when their strides do not allow it.
Tensor asHeads(const Tensor& t, DType ct) {
  NoGradGuard ng;
  Tensor c = t.to(ct);
  const Shape folded{c.numel() / std::max<int64_t>(1, c.sizes()[c.dim() - 2] * c.sizes()[c.dim() - 1]),
                     c.sizes()[c.dim() - 2], c.sizes()[c.dim() - 1]};
  if (c.strides().back() != 1 || !canView(c, folded)) c = c.contiguous();
  return viewNoGrad(c, folded);
}

template <typename T>
Heads<T> headsOf(const Tensor& t3) {  // t3: [N, T, D] with unit inner stride
  return {static_cast<T*>(const_cast<void*>(t3.dataPtr())), t3.strides()[0], 0, t3.strides()[1]};
}

// The gemm operands' dtype for inputs of dtype `in` computing in `ct`: bf16 inside an enabled
// autocast scope with autocastAttention(), for float32 or bf16 inputs, where bf16 products run
// natively (gemmOperandType: float32 elsewhere, after its one log line); else ct.
DType attentionOperandType(DType in, DType ct) {
  if (ct != DType::Float32 || (in != DType::Float32 && in != DType::BFloat16)) return ct;
  if (!autocastDType() || !autocastAttention()) return ct;
  return gemmOperandType(DType::BFloat16, DType::Float32);
}

// fn.template operator()<T, O>() with T the scores' type and O the operands' (Problem).
template <typename Fn>
void dispatchAttention(DType ct, DType ot, Fn&& fn) {
  if (ct == DType::Float64) {
    fn.template operator()<double, double>();
  } else if (ot == DType::BFloat16) {
    fn.template operator()<float, BFloat16>();
  } else {
    fn.template operator()<float, float>();
  }
}

}  // namespace

Tensor scaledDotProductAttention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& options,
                                 Generator& generator) {
  detail::OpScope opScope("scaledDotProductAttention", q, k, v);
  const char* op = "scaledDotProductAttention";
  requireSameDevice(q, k, op);
  requireSameDevice(q, v, op);
  requireCpu(q, op);
  requireFloat(q, op);
  checkOptions(options, op);
  if (q.dtype() != k.dtype() || q.dtype() != v.dtype()) {
    throw InvalidArgument(str(op, ": dtypes differ: query ", q.describe(), ", key ", k.describe(), ", value ",
                              v.describe()));
  }
  const bool ranksOk = q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim();
  bool batchOk = ranksOk;
  for (int64_t d = 0; batchOk && d < q.dim() - 2; ++d) batchOk = q.sizes()[d] == k.sizes()[d] && q.sizes()[d] == v.sizes()[d];
  if (!batchOk || q.sizes().back() != k.sizes().back() || k.sizes()[k.dim() - 2] != v.sizes()[v.dim() - 2]) {
    throw InvalidArgument(str(op, ": query ", q.describe(), ", key ", k.describe(), " and value ", v.describe(),
                              " do not fit (expected [*, Tq, D], [*, Tk, D] and [*, Tk, Dv] with the same batch dims)"));
  }
  Shape4 s{};
  s.lenQ = q.sizes()[q.dim() - 2];
  s.lenK = k.sizes()[k.dim() - 2];
  s.dimQK = q.sizes().back();
  s.dimV = v.sizes().back();
  s.heads = 1;
  s.batch = s.lenQ * s.dimQK == 0 ? 0 : q.numel() / (s.lenQ * s.dimQK);
  if (options.causal && s.lenQ != s.lenK) {
    throw InvalidArgument(str(op, ": a causal mask needs as many queries as keys, got query ", q.describe(),
                              " and key ", k.describe()));
  }
  const DType ct = computeType(q.dtype());
  const DType ot = attentionOperandType(q.dtype(), ct);
  Tensor Q = asHeads(q, ot), K = asHeads(k, ot), V = asHeads(v, ot);
  Shape outShape = q.sizes();
  outShape.back() = s.dimV;
  Tensor out = empty({s.batch, s.lenQ, s.dimV}, ct);
  Tensor probs = empty({s.batch, s.lenQ, s.lenK}, ct);
  const bool drop = options.training && options.dropoutP > 0;
  Tensor keep = drop ? dropoutKeepMask(s, options.causal, options.dropoutP, generator) : Tensor();
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(1, s.dimQK))));
  const double p = drop ? options.dropoutP : 0.0;
  const bool causal = options.causal;
  dispatchAttention(ct, ot, [&]<typename T, typename O>() {
    Problem<T, O> pr{s, static_cast<T>(scale), causal, p, constHeads(headsOf<O>(Q)), constHeads(headsOf<O>(K)),
                     constHeads(headsOf<O>(V)), probs.data<T>(),
                     drop ? static_cast<const uint8_t*>(keep.dataPtr()) : nullptr};
    forwardHeads(pr, headsOf<T>(out));
  });
  Tensor result;
  {
    NoGradGuard ng;
    result = viewNoGrad(out, outShape).to(q.dtype());
  }
  const Shape qs = q.sizes(), ks = k.sizes(), vs = v.sizes();
  recordFn(
      "ScaledDotProductAttentionBackward", {q, k, v}, result,
      [&] {
        return std::vector<SavedTensor>{SavedTensor(Q), SavedTensor(K), SavedTensor(V), SavedTensor(probs),
                                        SavedTensor(keep)};
      },
      [s, scale, causal, p, ct, ot, qs, ks, vs](const BackwardContext& c) -> TensorList {
        const Tensor &Qs = c.saved[0], &Ks = c.saved[1], &Vs = c.saved[2], &Ps = c.saved[3], &keepS = c.saved[4];
        Tensor g = asHeads(c.grads[0], ot);
        Tensor dq = empty({s.batch, s.lenQ, s.dimQK}, ct), dk = empty({s.batch, s.lenK, s.dimQK}, ct),
               dv = empty({s.batch, s.lenK, s.dimV}, ct);
        dispatchAttention(ct, ot, [&]<typename T, typename O>() {
          Problem<T, O> pr{s, static_cast<T>(scale), causal, p, constHeads(headsOf<O>(Qs)), constHeads(headsOf<O>(Ks)),
                           constHeads(headsOf<O>(Vs)), const_cast<T*>(Ps.data<T>()),
                           keepS.defined() ? static_cast<const uint8_t*>(keepS.dataPtr()) : nullptr};
          backwardHeads(pr, constHeads(headsOf<O>(g)), headsOf<T>(dq), headsOf<T>(dk), headsOf<T>(dv));
        });
        return {viewNoGrad(dq, qs), viewNoGrad(dk, ks), viewNoGrad(dv, vs)};
      });
  return result;
}

Tensor selfAttention(const Tensor& qkv, int64_t numHeads, const AttentionOptions& options, Generator& generator) {
  detail::OpScope opScope("selfAttention", qkv);
  const char* op = "selfAttention";
  requireCpu(qkv, op);
  requireFloat(qkv, op);
  checkOptions(options, op);
  if (qkv.dim() != 3 || numHeads < 1 || qkv.sizes()[2] % (3 * numHeads) != 0) {
    throw InvalidArgument(str(op, ": qkv ", qkv.describe(), " with ", numHeads,
                              " heads does not fit (expected [B, T, 3 * C] with C a multiple of the head count)"));
  }
  const int64_t batch = qkv.sizes()[0], len = qkv.sizes()[1], width = qkv.sizes()[2] / 3;
  const int64_t headDim = width / numHeads;
  Shape4 s{batch, numHeads, len, len, headDim, headDim};
  const DType ct = computeType(qkv.dtype());
  const DType ot = attentionOperandType(qkv.dtype(), ct);
  Tensor packed;
  {
    NoGradGuard ng;
    packed = qkv.to(ot).contiguous();
  }
  // q, k, v of head h: columns [h d, (h + 1) d) of the first, second and third third of a row.
  auto heads = [width, len, headDim]<typename T>(const Tensor& t, int64_t third) {
    return Heads<T>{static_cast<T*>(const_cast<void*>(t.dataPtr())) + third * width, len * 3 * width, headDim,
                    3 * width};
  };
  auto outHeads = [width, len, headDim]<typename T>(const Tensor& t) {
    return Heads<T>{static_cast<T*>(const_cast<void*>(t.dataPtr())), len * width, headDim, width};
  };
  Tensor out = empty({batch, len, width}, ct);
  Tensor probs = empty({batch * numHeads, len, len}, ct);
  const bool drop = options.training && options.dropoutP > 0;
  Tensor keep = drop ? dropoutKeepMask(s, options.causal, options.dropoutP, generator) : Tensor();
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(headDim)));
  const double p = drop ? options.dropoutP : 0.0;
  const bool causal = options.causal;
  dispatchAttention(ct, ot, [&]<typename T, typename O>() {
    Problem<T, O> pr{s, static_cast<T>(scale), causal, p, constHeads(heads.template operator()<O>(packed, 0)),
                     constHeads(heads.template operator()<O>(packed, 1)),
                     constHeads(heads.template operator()<O>(packed, 2)), probs.data<T>(),
                     drop ? static_cast<const uint8_t*>(keep.dataPtr()) : nullptr};
    forwardHeads(pr, outHeads.template operator()<T>(out));
  });
  Tensor result;
  {
    NoGradGuard ng;
    result = out.to(qkv.dtype());
  }
  recordFn(
      "SelfAttentionBackward", {qkv}, result,
      [&] { return std::vector<SavedTensor>{SavedTensor(packed), SavedTensor(probs), SavedTensor(keep)}; },
      [s, scale, causal, p, ct, ot, width, heads, outHeads](const BackwardContext& c) -> TensorList {
        const Tensor &packedS = c.saved[0], &Ps = c.saved[1], &keepS = c.saved[2];
        Tensor g;
        {
          NoGradGuard ng;
          g = c.grads[0].to(ot).contiguous();
        }
        Tensor dqkv = empty({s.batch, s.lenQ, 3 * width}, ct);
        dispatchAttention(ct, ot, [&]<typename T, typename O>() {
          Problem<T, O> pr{s, static_cast<T>(scale), causal, p, constHeads(heads.template operator()<O>(packedS, 0)),
                           constHeads(heads.template operator()<O>(packedS, 1)),
                           constHeads(heads.template operator()<O>(packedS, 2)), const_cast<T*>(Ps.data<T>()),
                           keepS.defined() ? static_cast<const uint8_t*>(keepS.dataPtr()) : nullptr};
          backwardHeads(pr, constHeads(outHeads.template operator()<O>(g)), heads.template operator()<T>(dqkv, 0),
                        heads.template operator()<T>(dqkv, 1), heads.template operator()<T>(dqkv, 2));
        });
        return {dqkv};
      });
  return result;
}

}  // namespace dt
