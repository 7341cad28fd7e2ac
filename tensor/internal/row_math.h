// Internal: per-row math that the CPU loops (ops_*.cpp) and the CUDA kernels
// (tensor/cuda/*.cu) both run, so that the two devices agree by construction
// on the fine points (which NaN wins, how label smoothing weighs a row).
// Header-only; compiled as host code by g++ and as host+device code by nvcc.
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define DT_HOST_DEVICE __host__ __device__
#else
#define DT_HOST_DEVICE
#endif

namespace dt::detail {

// The index of the first max (isMax) or min of row[0..n), n >= 1, and its
// value in `value`; for floating types the first NaN wins, as in PyTorch.
template <typename T>
DT_HOST_DEVICE inline int64_t extremeIndex(const T* row, int64_t n, bool isMax, T& value) {
  int64_t best = 0;
  T bv = row[0];
  for (int64_t j = 1; j < n; ++j) {
    const T y = row[j];
    if constexpr (std::is_floating_point_v<T>) {
      if (bv != bv) break;
      if (y != y) {
        best = j;
        bv = y;
        break;
      }
    }
    if (isMax ? (y > bv) : (y < bv)) {
      bv = y;
      best = j;
    }
  }
  value = bv;
  return best;
}

// A candidate for a row's extreme: a value and its index in the row (index
// < 0: none yet). Plain aggregate, so that CUDA can keep it in shared memory.
template <typename T>
struct ExtremeCandidate {
  T value;
  int64_t index;
};

// The better of two candidates by extremeIndex's rule: a NaN beats every
// number (of two NaNs the lower index), a larger (isMax) or smaller value
// beats another, equal values keep the lower index. The rule is a total
// order on (NaN first, value, index), so folding a row's elements with it in
// any order or tree shape gives extremeIndex's answer: the CUDA kernels split
// one row across the threads and blocks of a reduction with it.
template <typename T>
DT_HOST_DEVICE inline ExtremeCandidate<T> betterExtreme(const ExtremeCandidate<T>& a, const ExtremeCandidate<T>& b,
                                                        bool isMax) {
  if (a.index < 0) return b;
  if (b.index < 0) return a;
  if constexpr (std::is_floating_point_v<T>) {
    const bool aNan = a.value != a.value, bNan = b.value != b.value;
    if (aNan || bNan) {
      if (aNan && bNan) return a.index < b.index ? a : b;
      return aNan ? a : b;
    }
  }
  if (isMax ? a.value > b.value : a.value < b.value) return a;
  if (isMax ? b.value > a.value : b.value < a.value) return b;
  return a.index < b.index ? a : b;
}

// The cross-entropy of one row of c log-probabilities against class t, with
// label smoothing eps: -(1 - eps) * row[t] - eps / c * sum(row).
template <typename T>
DT_HOST_DEVICE inline double smoothedNll(const T* row, int64_t t, int64_t c, double eps) {
  double loss = -(1.0 - eps) * static_cast<double>(row[t]);
  if (eps > 0) {
    double sum = 0;
    for (int64_t j = 0; j < c; ++j) sum += static_cast<double>(row[j]);
    loss -= eps / static_cast<double>(c) * sum;
  }
  return loss;
}

}  // namespace dt::detail
