// Seeded random number generator for tensor initialisation and dropout.
//
// Contract: a Generator is a deterministic stream (same seed, same calls ->
// same numbers on every platform: a 64-bit PCG-style counter hashed with
// splitmix64, normals by Box-Muller). Not thread-safe: use one per thread or
// lock around it. defaultGenerator() is process-wide (seed 0 until manualSeed);
// callers that share it across threads must serialise.
#pragma once

#include <cstdint>

namespace dt {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) { manualSeed(seed); }
  void manualSeed(uint64_t seed) {
    seed_ = seed;
    counter_ = 0;
    hasSpareNormal_ = false;
  }
  uint64_t seed() const { return seed_; }
  uint64_t nextUint64();
  // Uniform in [0, 1) with 53 random bits.
  double nextDouble() { return static_cast<double>(nextUint64() >> 11) * 0x1.0p-53; }
  double nextNormal();

 private:
  uint64_t seed_ = 0;
  uint64_t counter_ = 0;
  bool hasSpareNormal_ = false;
  double spareNormal_ = 0.0;
};

Generator& defaultGenerator();
// Reseeds the default generator.
void manualSeed(uint64_t seed);

}  // namespace dt
