// Seeded random number generator for tensor initialisation and dropout.
//
// Contract: a Generator is a deterministic stream (same seed, same calls ->
// same numbers on every platform: a 64-bit PCG-style counter hashed with
// splitmix64, normals by Box-Muller). Not thread-safe: use one per thread or
// lock around it. defaultGenerator() is process-wide (seed 0 until manualSeed);
// callers that share it across threads must serialise.
// state()/setState() capture and restore the whole stream position (seed,
// counter and the cached second Box-Muller normal), so a checkpoint can resume
// a stream exactly; toWords()/fromWords() pack it as four 64-bit words for
// saving in a tensor file.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace dt {

// Everything a Generator's future output depends on.
struct GeneratorState {
  uint64_t seed = 0;
  uint64_t counter = 0;
  bool hasSpareNormal = false;
  double spareNormal = 0.0;

  bool operator==(const GeneratorState&) const = default;
  // {seed, counter, hasSpareNormal (0/1), bits of spareNormal}.
  std::array<uint64_t, 4> toWords() const;
  // Throws InvalidArgument when words[2] is neither 0 nor 1 (what names the source).
  static GeneratorState fromWords(const std::array<uint64_t, 4>& words, const std::string& what = "generator state");
};

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

  GeneratorState state() const { return {seed_, counter_, hasSpareNormal_, spareNormal_}; }
  void setState(const GeneratorState& state) {
    seed_ = state.seed;
    counter_ = state.counter;
    hasSpareNormal_ = state.hasSpareNormal;
    spareNormal_ = state.hasSpareNormal ? state.spareNormal : 0.0;
  }

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
