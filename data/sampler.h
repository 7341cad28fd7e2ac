// DistributedSampler: which examples each rank trains on, batch by batch.
//
// Contract:
//  * Every epoch the dataset's indices are shuffled with a permutation that depends only on
//    (seed, epoch), so every rank computes the same one without communicating, and a job that
//    resumes at (epoch, batch) sees exactly the batches it would have seen.
//  * The permutation is cut into global batches of worldSize x batchSize indices (or of
//    globalBatchSize, when set). Rank r's batch k holds the global batch's positions r, r + W,
//    r + 2W, ... (PyTorch's interleaving): the ranks' batches are disjoint, and their union is
//    the global batch whatever the world size, so 1, 2 or 4 ranks with the same global batch
//    train on the same examples per step. With globalBatchSize a world size that does not
//    divide it is fine: the ranks' batches differ by at most one example (localBatchSize()),
//    which is what an elastic job needs after losing a rank; weight each rank's loss by
//    localBatchSize() x W / globalBatch() to keep the gradient the mean over the global batch.
//  * The last global batch is usually short: dropLast drops it; otherwise it is padded with
//    the epoch's first indices (repeated, as PyTorch pads), so every rank has the same number
//    of full batches per epoch and no rank waits for another at the end of an epoch.
//  * shuffle = false keeps the dataset order (for evaluation; padding still applies).
//  * replacement = true draws every slot independently instead (for datasets of overlapping
//    windows of one text, where a permutation of millions of windows buys nothing): position
//    p of the global batch at step s = epoch x batchesPerEpoch + batch is draw s x G + p of a
//    counter-based stream of `seed` (Generator state {seed, s G + p}), modulo the dataset size.
//    Any world size with the same global batch draws the same examples, a position needs no
//    history, and an epoch is a nominal ceil(N / G) steps (examples may repeat or be missed).
//  * Pure and immutable: every method is const and thread-safe. Bad arguments throw
//    InvalidArgument naming the value.
#pragma once

#include <cstdint>
#include <vector>

namespace dt::data {

struct DistributedSamplerOptions {
  int64_t batchSize = 1;  // per rank (ignored when globalBatchSize is set)
  // Examples per step over all ranks, split as evenly as the world size allows; 0: batchSize
  // per rank.
  int64_t globalBatchSize = 0;
  bool shuffle = true;
  uint64_t seed = 0;      // must be the same on every rank
  bool dropLast = false;
  bool replacement = false;  // independent draws per slot (see the contract); shuffle is then ignored
};

// Where a job stands: the next batch to train on. Independent of the world size as long as
// the global batch (worldSize x batchSize) stays the same.
struct SamplerPosition {
  int64_t epoch = 0;
  int64_t batch = 0;  // within the epoch
  bool operator==(const SamplerPosition&) const = default;
};

class DistributedSampler {
 public:
  DistributedSampler(int64_t datasetSize, int worldSize, int rank, DistributedSamplerOptions options = {});

  int64_t datasetSize() const { return datasetSize_; }
  int worldSize() const { return worldSize_; }
  int rank() const { return rank_; }
  const DistributedSamplerOptions& options() const { return options_; }
  int64_t globalBatch() const {
    return options_.globalBatchSize > 0 ? options_.globalBatchSize : options_.batchSize * worldSize_;
  }
  // This rank's examples per batch: batchSize, or its share of globalBatchSize (positions r,
  // r + W, ... of each global batch: ceil((G - r) / W)).
  int64_t localBatchSize() const {
    return options_.globalBatchSize > 0 ? (options_.globalBatchSize - rank_ + worldSize_ - 1) / worldSize_
                                        : options_.batchSize;
  }
  int64_t batchesPerEpoch() const { return batchesPerEpoch_; }
  // Examples each epoch visits (after padding or dropping), over all ranks.
  int64_t samplesPerEpoch() const { return batchesPerEpoch_ * globalBatch(); }

  // The epoch's order of the whole dataset: a permutation of [0, datasetSize).
  std::vector<int64_t> permutation(int64_t epoch) const;
  // This rank's indices for the epoch, batch after batch (batchesPerEpoch x batchSize).
  std::vector<int64_t> rankIndices(int64_t epoch) const;  // replacement: the draws, computed
  // This rank's indices for one batch.
  std::vector<int64_t> batchIndices(int64_t epoch, int64_t batch) const;

  // The position after `steps` batches from the start (epoch = steps / batchesPerEpoch).
  SamplerPosition positionAfter(int64_t steps) const;
  int64_t stepsBefore(const SamplerPosition& position) const;

 private:
  int64_t datasetSize_;
  int worldSize_;
  int rank_;
  DistributedSamplerOptions options_;
  int64_t batchesPerEpoch_ = 0;
  // replacement: the example at position `position` of global batch number `step`.
  int64_t draw(int64_t step, int64_t position) const;
};

}  // namespace dt::data
