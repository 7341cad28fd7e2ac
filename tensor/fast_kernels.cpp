// The vectorisable float32 loops of tensor/internal/fast_kernels.h.
//
// How they vectorise: every reduction keeps kLanes independent partial results in a small
// array (a float sum cannot be reordered by the compiler on its own, but lanes written out
// by hand can), and exp/erf are branch-free polynomials with the exponent set through the
// float's bits, so each loop body is straight-line code over whole vectors. The public
// functions carry DT_MULTIVERSION: GCC compiles each for AVX-512F, AVX2 and plain x86-64, and
// an ifunc resolver picks one by the CPU's features when the library loads (feature names, not
// "arch=" names: those match exact CPU models, and a virtual CPU often reports none of them).
#include "tensor/internal/fast_kernels.h"

#include "common/sanitizers.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(DT_ADDRESS_SANITIZER) && \
    !defined(DT_THREAD_SANITIZER)
#define DT_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DT_MULTIVERSION
#endif

// The polynomials are written as a * b + c; let the AVX2/AVX-512 clones fuse them (FMA).
#if defined(__clang__)
#pragma clang fp contract(fast)
#else
#pragma GCC optimize("fp-contract=fast")
#endif

namespace dt::detail::fast {
namespace {

constexpr int kLanes = 16;

// The helpers must be inlined into every clone: GCC inlines a function into one compiled for
// another -march only when it is always_inline, and an out-of-line call per element would
// undo the vectorisation.
#define DT_INLINE __attribute__((always_inline)) inline

// exp(x) for x <= 88 (larger inputs give exp(88)); 0 below -87.3 (where float32 denormals
// begin) and for -inf. Cephes' expf: n = round(x / ln 2), r = x - n ln 2 (in two parts), a
// degree-6 polynomial for exp(r) on [-ln2/2, ln2/2], then 2^n through the exponent bits.
// Within 2 ulp.
DT_INLINE float expPoly(float input) {
  const float x = input < -87.3f ? -87.3f : (input > 88.0f ? 88.0f : input);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r2 + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return input < -87.3f ? 0.0f : e * std::bit_cast<float>(bits);
}

// For z >= 0 and ez = exp(-z^2): 1 - erf(z) (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7).
DT_INLINE float erfcPoly(float z, float ez) {
  const float t = 1.0f / (1.0f + 0.3275911f * z);
  float p = 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  return p * t * ez;
}

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

// Phi(x), the standard normal CDF, and exp(-x^2 / 2) (which phi(x) and 1 - erf share).
DT_INLINE float normalCdf(float x, float& gauss) {
  gauss = expPoly(-0.5f * x * x);
  const float tail = 0.5f * erfcPoly(std::fabs(x) * kInvSqrt2, gauss);  // Phi(-|x|), no cancellation
  return x < 0.0f ? tail : 1.0f - tail;
}

DT_INLINE float rowMax(const float* x, int64_t n) {
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = -INFINITY;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] = x[j + l] > lanes[l] ? x[j + l] : lanes[l];
  }
  float m = -INFINITY;
  for (int l = 0; l < kLanes; ++l) m = lanes[l] > m ? lanes[l] : m;
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// y[j] = exp(x[j] - shift); returns the sum of y (in lanes, then added up).
DT_INLINE float expShiftSum(const float* x, float* y, int64_t n, float shift) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float e = expPoly(x[j + l] - shift);
      y[j + l] = e;
      lanes[l] += e;
    }
  }
  float s = 0.0f;
  for (; j < n; ++j) {
    y[j] = expPoly(x[j] - shift);
    s += y[j];
  }
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  return s;
}

DT_INLINE float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[j + l] * b[j + l];
  }
  float s = 0.0f;
  for (; j < n; ++j) s += a[j] * b[j];
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  return s;
}

DT_INLINE float sum(const float* a, int64_t n) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[j + l];
  }
  float s = 0.0f;
  for (; j < n; ++j) s += a[j];
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  return s;
}

}  // namespace

DT_MULTIVERSION void geluForward(const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float gauss;
    y[i] = x[i] * normalCdf(x[i], gauss);
  }
}

DT_MULTIVERSION void geluBackward(const float* __restrict g, const float* __restrict x, float* __restrict gx,
                                  int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float gauss;
    const float cdf = normalCdf(x[i], gauss);
    gx[i] = g[i] * (cdf + x[i] * kInvSqrt2Pi * gauss);
  }
}

DT_MULTIVERSION void softmaxRows(const float* x, float* y, int64_t rows, int64_t n, bool logMode) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    float m = rowMax(xr, n);
    if (std::isinf(m) && m < 0) m = 0;  // an all -inf row: avoid inf - inf
    if (logMode) {
      // exp into y as scratch, then y = (x - max) - log(sum): no cancellation at large magnitudes.
      const float logSum = std::log(expShiftSum(xr, yr, n, m));
      for (int64_t j = 0; j < n; ++j) yr[j] = (xr[j] - m) - logSum;
    } else {
      const float inv = 1.0f / expShiftSum(xr, yr, n, m);
      for (int64_t j = 0; j < n; ++j) yr[j] *= inv;
    }
  }
}

DT_MULTIVERSION void softmaxBackwardRows(const float* g, const float* y, float* gx, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gr = g + r * n;
    const float* yr = y + r * n;
    float* o = gx + r * n;
    const float s = dot(gr, yr, n);
    for (int64_t j = 0; j < n; ++j) o[j] = yr[j] * (gr[j] - s);
  }
}

DT_MULTIVERSION void expScaled(const float* __restrict x, float* __restrict y, int64_t n, float scale, float shift) {
  for (int64_t j = 0; j < n; ++j) y[j] = scale * (expPoly(x[j]) - shift);
}

DT_MULTIVERSION void layerNormForward(const float* x, const float* w, const float* b, float* y, double* meanOut,
                                      double* rstdOut, int64_t rows, int64_t d, double eps) {
  const float invD = 1.0f / static_cast<float>(d);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float* yr = y + r * d;
    const float mu = sum(xr, d) * invD;
    float lanes[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= d; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float t = xr[j + l] - mu;
        lanes[l] += t * t;
      }
    }
    float var = 0.0f;
    for (; j < d; ++j) var += (xr[j] - mu) * (xr[j] - mu);
    for (int l = 0; l < kLanes; ++l) var += lanes[l];
    const float rstd = static_cast<float>(1.0 / std::sqrt(static_cast<double>(var * invD) + eps));
    meanOut[r] = mu;
    rstdOut[r] = rstd;
    if (w != nullptr && b != nullptr) {
      for (int64_t k = 0; k < d; ++k) yr[k] = (xr[k] - mu) * rstd * w[k] + b[k];
    } else if (w != nullptr) {
      for (int64_t k = 0; k < d; ++k) yr[k] = (xr[k] - mu) * rstd * w[k];
    } else if (b != nullptr) {
      for (int64_t k = 0; k < d; ++k) yr[k] = (xr[k] - mu) * rstd + b[k];
    } else {
      for (int64_t k = 0; k < d; ++k) yr[k] = (xr[k] - mu) * rstd;
    }
  }
}

DT_MULTIVERSION void layerNormBackward(const float* x, const float* w, const float* g, const double* mean,
                                       const double* rstd, int64_t rows, int64_t d, float* gx, double* gw,
                                       double* gb) {
  const float invD = 1.0f / static_cast<float>(d);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    const float* gr = g + r * d;
    const float mu = static_cast<float>(mean[r]);
    const float rs = static_cast<float>(rstd[r]);
    if (gw != nullptr) {
      for (int64_t j = 0; j < d; ++j) gw[j] += static_cast<double>(gr[j] * ((xr[j] - mu) * rs));
    }
    if (gb != nullptr) {
      for (int64_t j = 0; j < d; ++j) gb[j] += static_cast<double>(gr[j]);
    }
    if (gx == nullptr) continue;
    // gh = g * w; gx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat)).
    float sg[kLanes] = {}, sgx[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= d; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float gh = w != nullptr ? gr[j + l] * w[j + l] : gr[j + l];
        sg[l] += gh;
        sgx[l] += gh * ((xr[j + l] - mu) * rs);
      }
    }
    float sumG = 0.0f, sumGX = 0.0f;
    for (; j < d; ++j) {
      const float gh = w != nullptr ? gr[j] * w[j] : gr[j];
      sumG += gh;
      sumGX += gh * ((xr[j] - mu) * rs);
    }
    for (int l = 0; l < kLanes; ++l) {
      sumG += sg[l];
      sumGX += sgx[l];
    }
    const float a = sumG * invD, c = sumGX * invD;
    float* o = gx + r * d;
    for (int64_t k = 0; k < d; ++k) {
      const float gh = w != nullptr ? gr[k] * w[k] : gr[k];
      o[k] = rs * (gh - a - ((xr[k] - mu) * rs) * c);
    }
  }
}

DT_MULTIVERSION void columnSums(const float* g, int64_t rows, int64_t cols, float* out) {
  constexpr int64_t kRowBlock = 64;
  std::vector<double> total(static_cast<size_t>(cols), 0.0);
  std::vector<float> part(static_cast<size_t>(cols));
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    std::fill(part.begin(), part.end(), 0.0f);
    const int64_t r1 = std::min(rows, r0 + kRowBlock);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = g + r * cols;
      for (int64_t j = 0; j < cols; ++j) part[j] += row[j];
    }
    for (int64_t j = 0; j < cols; ++j) total[j] += static_cast<double>(part[j]);
  }
  for (int64_t j = 0; j < cols; ++j) out[j] = static_cast<float>(total[j]);
}

}  // namespace dt::detail::fast
