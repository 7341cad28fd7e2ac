#include "data/sampler.h"

#include <numeric>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/generator.h"

namespace dt::data {

DistributedSampler::DistributedSampler(int64_t datasetSize, int worldSize, int rank, DistributedSamplerOptions options)
    : datasetSize_(datasetSize), worldSize_(worldSize), rank_(rank), options_(options) {
  if (datasetSize_ < 1) throw InvalidArgument(str("DistributedSampler: dataset size ", datasetSize_, " must be positive"));
  if (worldSize_ < 1) throw InvalidArgument(str("DistributedSampler: world size ", worldSize_, " must be positive"));
  if (rank_ < 0 || rank_ >= worldSize_) {
    throw InvalidArgument(str("DistributedSampler: rank ", rank_, " outside [0, ", worldSize_, ")"));
  }
  if (options_.globalBatchSize < 0 || (options_.globalBatchSize > 0 && options_.globalBatchSize < worldSize_)) {
    throw InvalidArgument(str("DistributedSampler: global batch size ", options_.globalBatchSize, " must be at least the world size ",
                              worldSize_, " (every rank needs an example per step), or 0 for batchSize per rank"));
  }
  if (options_.globalBatchSize == 0 && options_.batchSize < 1) {
    throw InvalidArgument(str("DistributedSampler: batch size ", options_.batchSize, " must be positive"));
  }
  const int64_t global = globalBatch();
  batchesPerEpoch_ = options_.dropLast ? datasetSize_ / global : (datasetSize_ + global - 1) / global;
  if (batchesPerEpoch_ == 0) {
    throw InvalidArgument(str("DistributedSampler: with dropLast, a dataset of ", datasetSize_,
                              " examples has no full global batch of ", global, " (", worldSize_, " ranks",
                              options_.globalBatchSize > 0 ? std::string() : str(" x ", options_.batchSize),
                              "); use a smaller batch or pad (dropLast = false)"));
  }
}

std::vector<int64_t> DistributedSampler::permutation(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(datasetSize_));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (!options_.shuffle) return order;
  // A stream per (seed, epoch): epoch e never depends on how many numbers epoch e-1 used.
  Generator generator(options_.seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(epoch));
  for (int64_t i = datasetSize_ - 1; i > 0; --i) {  // Fisher-Yates
    const auto j = static_cast<int64_t>(generator.nextUint64() % static_cast<uint64_t>(i + 1));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

int64_t DistributedSampler::draw(int64_t step, int64_t position) const {
  // The stream's state is just the draw's number (counter-based): no draw depends on another.
  Generator generator;
  generator.setState({options_.seed, static_cast<uint64_t>(step * globalBatch() + position), false, 0.0});
  return static_cast<int64_t>(generator.nextUint64() % static_cast<uint64_t>(datasetSize_));
}

std::vector<int64_t> DistributedSampler::rankIndices(int64_t epoch) const {
  if (epoch < 0) throw InvalidArgument(str("DistributedSampler: epoch ", epoch, " must be non-negative"));
  const int64_t local = localBatchSize();
  const int64_t global = globalBatch();
  std::vector<int64_t> mine(static_cast<size_t>(batchesPerEpoch_ * local));
  if (options_.replacement) {
    for (int64_t b = 0; b < batchesPerEpoch_; ++b) {
      for (int64_t j = 0; j < local; ++j) mine[static_cast<size_t>(b * local + j)] = draw(epoch * batchesPerEpoch_ + b, rank_ + j * worldSize_);
    }
    return mine;
  }
  const std::vector<int64_t> order = permutation(epoch);
  for (int64_t b = 0; b < batchesPerEpoch_; ++b) {
    for (int64_t j = 0; j < local; ++j) {
      const int64_t position = b * global + rank_ + j * worldSize_;  // interleaved; past the end wraps (padding)
      mine[static_cast<size_t>(b * local + j)] = order[static_cast<size_t>(position % datasetSize_)];
    }
  }
  return mine;
}

std::vector<int64_t> DistributedSampler::batchIndices(int64_t epoch, int64_t batch) const {
  if (batch < 0 || batch >= batchesPerEpoch_) {
    throw InvalidArgument(str("DistributedSampler: batch ", batch, " outside [0, ", batchesPerEpoch_, ") of epoch ", epoch));
  }
  if (options_.replacement) {
    if (epoch < 0) throw InvalidArgument(str("DistributedSampler: epoch ", epoch, " must be non-negative"));
    std::vector<int64_t> mine;
    for (int64_t j = 0; j < localBatchSize(); ++j) mine.push_back(draw(epoch * batchesPerEpoch_ + batch, rank_ + j * worldSize_));
    return mine;
  }
  const std::vector<int64_t> all = rankIndices(epoch);
  const auto begin = all.begin() + batch * localBatchSize();
  return {begin, begin + localBatchSize()};
}

SamplerPosition DistributedSampler::positionAfter(int64_t steps) const {
  if (steps < 0) throw InvalidArgument(str("DistributedSampler: step count ", steps, " must be non-negative"));
  return {steps / batchesPerEpoch_, steps % batchesPerEpoch_};
}

int64_t DistributedSampler::stepsBefore(const SamplerPosition& position) const {
  if (position.epoch < 0 || position.batch < 0 || position.batch >= batchesPerEpoch_) {
    throw InvalidArgument(str("DistributedSampler: position (epoch ", position.epoch, ", batch ", position.batch,
                              ") is not valid with ", batchesPerEpoch_, " batches per epoch"));
  }
  return position.epoch * batchesPerEpoch_ + position.batch;
}

}  // namespace dt::data
