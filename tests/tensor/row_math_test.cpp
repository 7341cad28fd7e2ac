// tensor/internal/row_math.h: the combine rule the CUDA extreme reductions split a row with
// (detail::betterExtreme) gives exactly detail::extremeIndex's answer, whatever the order and
// tree shape of the fold: first NaN wins, ties keep the first index. Runs in every build; the
// CUDA kernels themselves are compared with the CPU in cuda_ops_test on a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "tensor/internal/row_math.h"

namespace dt::detail {
namespace {

template <typename T>
using Candidate = ExtremeCandidate<T>;

// What the kernels do: `threads` threads each fold a strided part of every one of `chunks`
// chunks, a tree combines the threads of a chunk, then the chunks' candidates are combined.
template <typename T>
Candidate<T> foldLikeTheKernels(const std::vector<T>& row, bool isMax, int64_t chunks, int threads) {
  const auto n = static_cast<int64_t>(row.size());
  const int64_t chunkLen = (n + chunks - 1) / chunks;
  std::vector<Candidate<T>> perChunk;
  for (int64_t begin = 0; begin < n; begin += chunkLen) {
    const int64_t end = std::min(n, begin + chunkLen);
    std::vector<Candidate<T>> perThread(static_cast<size_t>(threads), Candidate<T>{T(0), -1});
    for (int t = 0; t < threads; ++t) {
      for (int64_t j = begin + t; j < end; j += threads) {
        perThread[static_cast<size_t>(t)] =
            betterExtreme(perThread[static_cast<size_t>(t)], Candidate<T>{row[static_cast<size_t>(j)], j}, isMax);
      }
    }
    for (int step = threads / 2; step > 0; step /= 2) {  // threads: a power of two, as kThreads is
      for (int t = 0; t < step; ++t) {
        perThread[static_cast<size_t>(t)] =
            betterExtreme(perThread[static_cast<size_t>(t)], perThread[static_cast<size_t>(t + step)], isMax);
      }
    }
    perChunk.push_back(perThread[0]);
  }
  Candidate<T> best{T(0), -1};
  for (auto it = perChunk.rbegin(); it != perChunk.rend(); ++it) best = betterExtreme(*it, best, isMax);  // any order
  return best;
}

template <typename T>
void expectSameAsExtremeIndex(const std::vector<T>& row, const char* what) {
  for (bool isMax : {true, false}) {
    T value{};
    const int64_t want = extremeIndex(row.data(), static_cast<int64_t>(row.size()), isMax, value);
    for (int64_t chunks : {1, 2, 3, 7}) {
      for (int threads : {1, 4, 8}) {
        const Candidate<T> got = foldLikeTheKernels(row, isMax, chunks, threads);
        ASSERT_EQ(got.index, want) << what << (isMax ? " max" : " min") << ", " << chunks << " chunks, " << threads
                                   << " threads";
        if constexpr (std::is_floating_point_v<T>) {
          if (std::isnan(value)) {
            EXPECT_TRUE(std::isnan(got.value)) << what;
            continue;
          }
        }
        EXPECT_EQ(got.value, value) << what;
      }
    }
  }
}

TEST(RowMathExtreme, ATreeOfCombinesGivesTheSequentialAnswer) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  expectSameAsExtremeIndex<double>({3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 9, 7}, "ties of the max and the min");
  expectSameAsExtremeIndex<double>({1, 2, nan, 4, nan, 0}, "the first NaN wins");
  expectSameAsExtremeIndex<double>({nan, 2, 3}, "a NaN first");
  expectSameAsExtremeIndex<double>({0.0, -0.0, 0.0, -0.0}, "signed zeros compare equal: the first");
  expectSameAsExtremeIndex<double>({-std::numeric_limits<double>::infinity(), -1, std::numeric_limits<double>::infinity()},
                                   "infinities");
  expectSameAsExtremeIndex<int64_t>({5, 5, 5, 5, 5, 5, 5}, "all equal");
  expectSameAsExtremeIndex<int32_t>({7}, "one element");
}

TEST(RowMathExtreme, RandomRowsWithRepeatsAndNaNsAgree) {
  std::mt19937_64 gen(24);
  std::uniform_int_distribution<int> small(0, 9);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(gen() % 300);
    std::vector<float> row(static_cast<size_t>(n));
    for (float& v : row) v = static_cast<float>(small(gen));  // many repeats: ties everywhere
    if (trial % 3 == 0) row[gen() % row.size()] = std::numeric_limits<float>::quiet_NaN();
    if (trial % 5 == 0) row[gen() % row.size()] = std::numeric_limits<float>::quiet_NaN();
    expectSameAsExtremeIndex(row, "random row");
  }
}

}  // namespace
}  // namespace dt::detail
