// Internal: strided element loops shared by copy and the op kernels.
//
// An ElementLoop walks a broadcast shape for N operands, each with its own byte
// strides (0 where broadcast). Dims are coalesced where memory allows so the
// common contiguous case becomes one flat run. run(begin, end, fn) visits the
// linear range [begin, end) in runs: fn(char** ptrs, const int64_t* strides, n)
// where ptrs point at the first element of each operand and strides are the
// per-operand byte steps within the run. Ranges make it splittable across threads.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace dt::detail {

template <int N>
class ElementLoop {
 public:
  // operands[i]: base byte pointer; strides[i]: element strides (size = shape.size());
  // itemsizes[i]: bytes per element.
  ElementLoop(const Shape& shape, std::array<char*, N> bases, std::array<const int64_t*, N> strides,
              std::array<int64_t, N> itemsizes)
      : bases_(bases) {
    const int64_t nd = static_cast<int64_t>(shape.size());
    numel_ = 1;
    // Innermost first.
    for (int64_t d = nd - 1; d >= 0; --d) {
      numel_ *= shape[d];
      if (shape[d] == 1) continue;
      std::array<int64_t, N> st{};
      for (int i = 0; i < N; ++i) st[i] = strides[i][d] * itemsizes[i];
      if (!sizes_.empty()) {
        bool merge = true;
        for (int i = 0; i < N; ++i) {
          if (st[i] != strides_.back()[i] * sizes_.back()) merge = false;
        }
        if (merge) {
          sizes_.back() *= shape[d];
          continue;
        }
      }
      sizes_.push_back(shape[d]);
      strides_.push_back(st);
    }
    if (sizes_.empty()) {
      sizes_.push_back(1);
      strides_.push_back(std::array<int64_t, N>{});
    }
  }

  int64_t numel() const { return numel_; }
  // True when every operand advances by exactly its itemsize in one flat run.
  bool isFlat(std::array<int64_t, N> itemsizes) const {
    if (sizes_.size() != 1) return false;
    for (int i = 0; i < N; ++i)
      if (strides_[0][i] != itemsizes[i]) return false;
    return true;
  }

  template <typename Fn>
  void run(int64_t begin, int64_t end, Fn&& fn) const {
    if (begin >= end) return;
    const size_t nd = sizes_.size();
    std::vector<int64_t> idx(nd, 0);
    std::array<char*, N> ptrs = bases_;
    int64_t rem = begin;
    for (size_t d = 0; d < nd; ++d) {
      idx[d] = rem % sizes_[d];
      rem /= sizes_[d];
      for (int i = 0; i < N; ++i) ptrs[i] += idx[d] * strides_[d][i];
    }
    int64_t pos = begin;
    while (pos < end) {
      const int64_t n = std::min(sizes_[0] - idx[0], end - pos);
      std::array<char*, N> runPtrs = ptrs;
      fn(runPtrs.data(), strides_[0].data(), n);
      pos += n;
      if (pos >= end) break;
      // The run ended at the end of the inner dim: rewind it and carry outward.
      for (int i = 0; i < N; ++i) ptrs[i] -= idx[0] * strides_[0][i];
      idx[0] = 0;
      size_t d = 1;
      for (; d < nd; ++d) {
        ++idx[d];
        for (int i = 0; i < N; ++i) ptrs[i] += strides_[d][i];
        if (idx[d] < sizes_[d]) break;
        for (int i = 0; i < N; ++i) ptrs[i] -= sizes_[d] * strides_[d][i];
        idx[d] = 0;
      }
    }
  }

 private:
  std::array<char*, N> bases_;
  std::vector<int64_t> sizes_;
  std::vector<std::array<int64_t, N>> strides_;
  int64_t numel_ = 1;
};

}  // namespace dt::detail
