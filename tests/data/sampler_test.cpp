// DistributedSampler: disjoint shards that cover the data, a new order each epoch shared by
// every rank, padding or dropping the short last batch, and the same global batches whatever
// the world size.
#include <algorithm>
#include <numeric>
#include <set>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "data/sampler.h"
#include "tensor/generator.h"
#include "tests/testing/testing.h"

namespace dt::data {
namespace {

using testing::expectThrowsWith;

TEST(DistributedSampler, ShardsAreDisjointAndCoverTheDataset) {
  const int world = 4;
  std::vector<int64_t> all;
  for (int rank = 0; rank < world; ++rank) {
    DistributedSampler s(96, world, rank, {.batchSize = 6, .seed = 3});
    EXPECT_EQ(s.batchesPerEpoch(), 4);
    const auto mine = s.rankIndices(0);
    EXPECT_EQ(mine.size(), 24u);
    all.insert(all.end(), mine.begin(), mine.end());
  }
  std::sort(all.begin(), all.end());
  std::vector<int64_t> expected(96);
  std::iota(expected.begin(), expected.end(), int64_t{0});
  EXPECT_EQ(all, expected) << "every example exactly once";
}

// An elastic job keeps its global batch when a rank leaves: the survivors split each global
// batch as evenly as they can, and step k holds the same examples at every world size.
TEST(DistributedSampler, AGlobalBatchSplitsUnevenlyAndKeepsItsExamples) {
  const int64_t global = 8;
  DistributedSampler one(50, 1, 0, {.globalBatchSize = global, .seed = 4});
  for (int world : {2, 3, 4, 5}) {
    std::vector<DistributedSampler> ranks;
    for (int r = 0; r < world; ++r) ranks.emplace_back(50, world, r, DistributedSamplerOptions{.globalBatchSize = global, .seed = 4});
    EXPECT_EQ(ranks[0].batchesPerEpoch(), one.batchesPerEpoch());
    int64_t total = 0;
    for (int r = 0; r < world; ++r) {
      total += ranks[static_cast<size_t>(r)].localBatchSize();
      EXPECT_LE(ranks[0].localBatchSize() - ranks[static_cast<size_t>(r)].localBatchSize(), 1) << "world " << world;
    }
    EXPECT_EQ(total, global) << "world " << world;
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      for (int64_t b = 0; b < one.batchesPerEpoch(); ++b) {
        std::vector<int64_t> together;
        for (const auto& s : ranks) {
          const auto mine = s.batchIndices(epoch, b);
          EXPECT_EQ(static_cast<int64_t>(mine.size()), s.localBatchSize());
          together.insert(together.end(), mine.begin(), mine.end());
        }
        auto expected = one.batchIndices(epoch, b);
        std::sort(together.begin(), together.end());
        std::sort(expected.begin(), expected.end());
        EXPECT_EQ(together, expected) << "world " << world << " epoch " << epoch << " batch " << b;
      }
    }
  }
  // Where the world size divides it, the global batch reads exactly as batchSize per rank.
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(DistributedSampler(50, 4, r, {.globalBatchSize = 8, .seed = 4}).rankIndices(1),
              DistributedSampler(50, 4, r, {.batchSize = 2, .seed = 4}).rankIndices(1));
  }
  expectThrowsWith<InvalidArgument>([] { DistributedSampler(50, 4, 0, {.globalBatchSize = 3}); },
                                    {"global batch size 3", "world size 4"});
}

TEST(DistributedSampler, ReshufflesEachEpochFromTheSharedSeed) {
  DistributedSampler a(1000, 2, 0, {.batchSize = 10, .seed = 7});
  DistributedSampler b(1000, 2, 1, {.batchSize = 10, .seed = 7});
  DistributedSampler other(1000, 2, 0, {.batchSize = 10, .seed = 8});
  EXPECT_EQ(a.permutation(0), b.permutation(0)) << "every rank computes the same order";
  EXPECT_NE(a.permutation(0), a.permutation(1)) << "a new order each epoch";
  EXPECT_NE(a.permutation(0), other.permutation(0)) << "the seed matters";
  EXPECT_EQ(a.permutation(5), a.permutation(5)) << "an epoch's order depends only on (seed, epoch)";
  auto sorted = a.permutation(1);
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[static_cast<size_t>(i)], i);

  DistributedSampler ordered(10, 1, 0, {.batchSize = 5, .shuffle = false});
  EXPECT_EQ(ordered.rankIndices(3), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

TEST(DistributedSampler, PadsTheShortLastBatchWithTheEpochsFirstIndices) {
  // 10 examples, 2 ranks x 3: two global batches of 6, the second padded with 2 repeats.
  std::vector<int64_t> seen;
  for (int rank = 0; rank < 2; ++rank) {
    DistributedSampler s(10, 2, rank, {.batchSize = 3, .shuffle = false});
    EXPECT_EQ(s.batchesPerEpoch(), 2);
    EXPECT_EQ(s.samplesPerEpoch(), 12);
    const auto mine = s.rankIndices(0);
    EXPECT_EQ(mine.size(), 6u);
    seen.insert(seen.end(), mine.begin(), mine.end());
  }
  // Rank 0 takes positions 0,2,4,.. and rank 1 takes 1,3,5,..; positions 10 and 11 wrap to 0 and 1.
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 2, 4, 6, 8, 0, 1, 3, 5, 7, 9, 1}));
}

TEST(DistributedSampler, DropLastKeepsOnlyFullGlobalBatches) {
  std::set<int64_t> seen;
  for (int rank = 0; rank < 2; ++rank) {
    DistributedSampler s(10, 2, rank, {.batchSize = 3, .seed = 1, .dropLast = true});
    EXPECT_EQ(s.batchesPerEpoch(), 1);
    const auto mine = s.rankIndices(2);
    EXPECT_EQ(mine.size(), 3u);
    seen.insert(mine.begin(), mine.end());
  }
  EXPECT_EQ(seen.size(), 6u) << "no repeats when dropping";
  expectThrowsWith<InvalidArgument>([] { DistributedSampler(5, 2, 0, {.batchSize = 3, .dropLast = true}); },
                                    {"dataset of 5 examples has no full global batch of 6", "2 ranks x 3"});
}

TEST(DistributedSampler, SameGlobalBatchGivesTheSameExamplesPerStepAtAnyWorldSize) {
  const int64_t n = 1000, global = 32;
  for (int64_t epoch : {0, 1}) {
    for (int64_t step = 0; step < 32; step += 5) {
      std::multiset<int64_t> reference;
      for (int world : {1, 2, 4, 8}) {
        std::multiset<int64_t> batch;
        for (int rank = 0; rank < world; ++rank) {
          DistributedSampler s(n, world, rank, {.batchSize = global / world, .seed = 11});
          const auto b = s.batchIndices(epoch, step);
          batch.insert(b.begin(), b.end());
        }
        if (world == 1) reference = batch;
        EXPECT_EQ(batch, reference) << "epoch " << epoch << " step " << step << " world " << world;
      }
    }
  }
}

// With replacement each slot is its own counter-based draw: slot p of step s is draw s G + p of
// the seed's stream, whatever the world size (even or not) and the epoch length.
TEST(DistributedSampler, WithReplacementEverySlotIsACounterBasedDraw) {
  const int64_t windows = 1'000'003, global = 8;
  auto drawAt = [&](uint64_t seed, int64_t step, int64_t slot) {
    Generator g;
    g.setState({seed, static_cast<uint64_t>(step * global + slot), false, 0.0});
    return static_cast<int64_t>(g.nextUint64() % static_cast<uint64_t>(windows));
  };
  for (int world : {1, 2, 3, 4}) {
    for (int rank = 0; rank < world; ++rank) {
      const DistributedSampler s(windows, world, rank, {.globalBatchSize = global, .seed = 5, .replacement = true});
      ASSERT_EQ(s.batchesPerEpoch(), (windows + global - 1) / global);
      for (int64_t step : {int64_t{0}, int64_t{77}, s.batchesPerEpoch() + 3}) {
        const SamplerPosition at = s.positionAfter(step);
        const auto mine = s.batchIndices(at.epoch, at.batch);
        ASSERT_EQ(static_cast<int64_t>(mine.size()), s.localBatchSize());
        for (size_t i = 0; i < mine.size(); ++i) {
          EXPECT_EQ(mine[i], drawAt(5, step, rank + static_cast<int64_t>(i) * world)) << "world " << world << " rank " << rank << " step " << step;
        }
      }
    }
  }
  const DistributedSampler s(windows, 1, 0, {.batchSize = 64, .seed = 5, .replacement = true});
  std::set<int64_t> distinct;
  for (int64_t step = 0; step < 10; ++step) {
    for (int64_t w : s.batchIndices(0, step)) distinct.insert(w);
  }
  EXPECT_GT(distinct.size(), 630u);  // random, not repeating
  const DistributedSampler small(20, 2, 1, {.batchSize = 3, .seed = 2, .replacement = true});
  const auto epoch = small.rankIndices(1);
  for (int64_t b = 0; b < small.batchesPerEpoch(); ++b) {
    EXPECT_EQ(std::vector<int64_t>(epoch.begin() + b * 3, epoch.begin() + b * 3 + 3), small.batchIndices(1, b));
  }
}

TEST(DistributedSampler, PositionsAndStepsConvert) {
  DistributedSampler s(100, 2, 1, {.batchSize = 10});
  EXPECT_EQ(s.batchesPerEpoch(), 5);
  EXPECT_EQ(s.positionAfter(0), (SamplerPosition{0, 0}));
  EXPECT_EQ(s.positionAfter(7), (SamplerPosition{1, 2}));
  EXPECT_EQ(s.stepsBefore({3, 4}), 19);
  expectThrowsWith<InvalidArgument>([&] { s.stepsBefore({0, 5}); }, {"batch 5", "5 batches per epoch"});
}

TEST(DistributedSampler, BadArgumentsAreNamed) {
  expectThrowsWith<InvalidArgument>([] { DistributedSampler(0, 1, 0); }, {"dataset size 0"});
  expectThrowsWith<InvalidArgument>([] { DistributedSampler(10, 0, 0); }, {"world size 0"});
  expectThrowsWith<InvalidArgument>([] { DistributedSampler(10, 2, 2); }, {"rank 2 outside [0, 2)"});
  expectThrowsWith<InvalidArgument>([] { DistributedSampler(10, 2, 0, {.batchSize = 0}); }, {"batch size 0"});
  DistributedSampler s(10, 1, 0, {.batchSize = 5});
  expectThrowsWith<InvalidArgument>([&] { s.batchIndices(0, 2); }, {"batch 2 outside [0, 2)"});
}

}  // namespace
}  // namespace dt::data
