// Internal: the float32 CPU loops a transformer spends its non-gemm time in (GELU, softmax and
// log-softmax rows, layer norm, the cross-entropy gradient), written so that GCC vectorises them.
//
// Why: the generic element loops call std::exp / std::erf in double one element at a time
// (about 5 ns an element); a GPT step pushes tens of millions of elements through them. These
// use branch-free polynomial exp and erf in float32 (exp: within 2 ulp over the float range;
// erf: absolute error below 1.5e-7, under float32 rounding of 1 + erf), so the compiler emits
// AVX-512 or AVX2 code. Each function is compiled for several instruction sets
// (target_clones) and the best one the CPU supports is picked when the library loads; the
// default clone is plain SSE2, so the library still runs everywhere.
//
// Float64 keeps the exact std:: functions (gradcheck's finite differences need them). All
// pointers are contiguous rows; none alias unless stated. No allocation, no threads: callers
// split rows with parallelFor.
#pragma once

#include <cstdint>

namespace dt::detail::fast {

// y = x * Phi(x) (exact-erf GELU, as PyTorch's default).
void geluForward(const float* x, float* y, int64_t n);
// gx = g * (Phi(x) + x * phi(x)).
void geluBackward(const float* g, const float* x, float* gx, int64_t n);

// rows x n, row-major: y = softmax or log-softmax of each row (max subtracted first).
void softmaxRows(const float* x, float* y, int64_t rows, int64_t n, bool logMode);
// Softmax backward from the saved output y: gx = y * (g - sum(g * y)) per row.
void softmaxBackwardRows(const float* g, const float* y, float* gx, int64_t rows, int64_t n);
// y = scale * (exp(x) - shift): one cross-entropy gradient row from its log-probabilities
// (scale = the row's gradient, shift = the label-smoothing share; the target's -(1 - eps) is
// the caller's).
void expScaled(const float* x, float* y, int64_t n, float scale, float shift);

// Layer norm over rows of d: mean and 1/std per row into meanOut/rstdOut (double, as the
// saved tensors are), y = (x - mean) * rstd * w + b (w, b may be null).
void layerNormForward(const float* x, const float* w, const float* b, float* y, double* meanOut, double* rstdOut,
                      int64_t rows, int64_t d, double eps);
// gx (may be null) for the rows; gw/gb (may be null) accumulate (+=) over the rows, in double.
void layerNormBackward(const float* x, const float* w, const float* g, const double* mean, const double* rstd,
                       int64_t rows, int64_t d, float* gx, double* gw, double* gb);

// out[j] = sum over the rows of g[i, j] (a bias gradient), summed in float32 over blocks of
// rows and the blocks' sums in float64.
void columnSums(const float* g, int64_t rows, int64_t cols, float* out);

}  // namespace dt::detail::fast
