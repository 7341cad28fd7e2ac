// The toy training step of the elastic tests (tests/elastic, tests/launcher/elastic_worker.cpp):
// each step's global batch is kToyGlobalBatch examples; rank r of W sums the values of positions
// r, r+W, ... (the same examples at any world size), the ranks add their shares, and every rank
// adds the sum to its state. The state after N steps is known exactly, so a lost, repeated or
// half-applied step shows. Header-only, no dependencies.
#pragma once

#include <cstdint>

namespace dt::testing {

constexpr int64_t kToyGlobalBatch = 12;

inline double toyValue(int64_t example) { return static_cast<double>(example % 7 + 1); }

// Rank `rank` of `world`'s share of step `step`'s global batch.
inline double toyShare(int64_t step, int rank, int world) {
  double sum = 0;
  for (int64_t i = rank; i < kToyGlobalBatch; i += world) sum += toyValue(step * kToyGlobalBatch + i);
  return sum;
}

// What every rank's state must end as after `steps` steps: each step's whole global batch, once.
inline double toyState(int64_t steps) {
  double x = 0;
  for (int64_t step = 0; step < steps; ++step) x += toyShare(step, 0, 1);
  return x;
}

}  // namespace dt::testing
