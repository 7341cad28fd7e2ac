// PrefetchLoader: the sampler's batches in order across epochs, prepared ahead on its own
// thread (at most `prefetch`), restart at a position, errors delivered at the right batch, and
// a clean stop while the thread is busy or blocked.
#include <atomic>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "data/loader.h"
#include "tests/testing/testing.h"

namespace dt::data {
namespace {

using namespace std::chrono_literals;

// Example i is the single feature value i; the label is i % 10. Counts get() calls, can fail
// at one index, and can hold get() until released.
class CountingDataset : public Dataset {
 public:
  explicit CountingDataset(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  Batch get(std::span<const int64_t> indices) const override {
    calls.fetch_add(1);
    while (hold.load()) std::this_thread::sleep_for(1ms);
    Batch b;
    std::vector<float> x;
    std::vector<int64_t> y;
    for (int64_t i : indices) {
      if (i == failAt.load()) throw InvalidArgument("CountingDataset: example " + std::to_string(i) + " is unreadable");
      x.push_back(static_cast<float>(i));
      y.push_back(i % 10);
    }
    b.inputs = fromVector<float>(x).reshape({static_cast<int64_t>(indices.size()), 1});
    b.targets = fromVector<int64_t>(y);
    return b;
  }
  std::string describe() const override { return "counting"; }
  mutable std::atomic<int> calls{0};
  std::atomic<int64_t> failAt{-1};
  std::atomic<bool> hold{false};

 private:
  int64_t n_;
};

std::vector<int64_t> asIndices(const Batch& b) {
  std::vector<int64_t> out;
  for (float v : b.inputs.toVector<float>()) out.push_back(static_cast<int64_t>(v));
  return out;
}

// Waits (up to a generous deadline) for a condition the background thread makes true.
template <typename F>
bool eventually(F condition) {
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

TEST(PrefetchLoader, DeliversTheSamplersBatchesInOrderAcrossEpochs) {
  auto ds = std::make_shared<CountingDataset>(50);
  DistributedSampler sampler(50, 2, 1, {.batchSize = 4, .seed = 9});
  PrefetchLoader loader(ds, sampler, {.prefetch = 3});
  loader.start({0, 0});
  ASSERT_EQ(sampler.batchesPerEpoch(), 7);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    for (int64_t batch = 0; batch < 7; ++batch) {
      const LoadedBatch b = loader.next();
      EXPECT_EQ(b.position, (SamplerPosition{epoch, batch}));
      EXPECT_EQ(asIndices(b.batch), sampler.batchIndices(epoch, batch)) << "epoch " << epoch << " batch " << batch;
      EXPECT_EQ(b.batch.targets.sizes(), (Shape{4}));
    }
  }
  EXPECT_EQ(loader.stats().batches, 21);
}

TEST(PrefetchLoader, WithReplacementDeliversTheSamplersDraws) {
  auto ds = std::make_shared<CountingDataset>(50);
  DistributedSampler sampler(50, 2, 1, {.batchSize = 4, .seed = 9, .replacement = true});
  PrefetchLoader loader(ds, sampler, {.prefetch = 3});
  loader.start({1, 5});
  for (int64_t step = 12; step < 30; ++step) {
    const LoadedBatch b = loader.next();
    EXPECT_EQ(b.position, sampler.positionAfter(step));
    EXPECT_EQ(asIndices(b.batch), sampler.batchIndices(b.position.epoch, b.position.batch)) << "step " << step;
  }
}

TEST(PrefetchLoader, PreparesBatchesAheadButNoMoreThanPrefetchAndRefillsAtHalf) {
  auto ds = std::make_shared<CountingDataset>(1000);
  PrefetchLoader loader(ds, DistributedSampler(1000, 1, 0, {.batchSize = 10}), {.prefetch = 4});
  EXPECT_EQ(ds->calls.load(), 0) << "nothing is read before start()";
  loader.start({0, 0});
  ASSERT_TRUE(eventually([&] { return ds->calls.load() >= 4; })) << "the thread fills the queue without next()";
  std::this_thread::sleep_for(50ms);  // give an overeager producer the chance to overshoot
  EXPECT_EQ(ds->calls.load(), 4) << "the queue is bounded by prefetch";
  loader.next();
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(ds->calls.load(), 4) << "above the low-water mark (prefetch / 2) the thread sleeps on";
  loader.next();
  ASSERT_TRUE(eventually([&] { return ds->calls.load() >= 6; })) << "at half it refills the queue";
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(ds->calls.load(), 6);
  for (int i = 2; i < 30; ++i) EXPECT_EQ(loader.next().position.batch, i % 100);
}

TEST(PrefetchLoader, StartAtAPositionResumesTheSameStream) {
  auto ds = std::make_shared<CountingDataset>(40);
  DistributedSampler sampler(40, 4, 2, {.batchSize = 3, .seed = 5});
  PrefetchLoader uninterrupted(ds, sampler);
  uninterrupted.start({0, 0});
  std::vector<std::vector<int64_t>> expected;
  for (int i = 0; i < 10; ++i) expected.push_back(asIndices(uninterrupted.next().batch));

  PrefetchLoader resumed(ds, sampler);
  resumed.start({0, 0});
  resumed.next();                        // consumes one, others are queued
  resumed.start(sampler.positionAfter(6));  // as a restored checkpoint would
  for (int i = 6; i < 10; ++i) {
    const LoadedBatch b = resumed.next();
    EXPECT_EQ(b.position, sampler.positionAfter(i));
    EXPECT_EQ(asIndices(b.batch), expected[static_cast<size_t>(i)]);
  }
}

TEST(PrefetchLoader, ADatasetErrorArrivesWithItsBatchAndStartClearsIt) {
  auto ds = std::make_shared<CountingDataset>(30);
  DistributedSampler sampler(30, 1, 0, {.batchSize = 5, .shuffle = false});
  ds->failAt = 17;  // in batch 3
  PrefetchLoader loader(ds, sampler, {.prefetch = 2});
  loader.start({0, 0});
  for (int i = 0; i < 3; ++i) EXPECT_EQ(loader.next().position.batch, i) << "batches before the bad one arrive";
  testing::expectThrowsWith<InvalidArgument>([&] { loader.next(); }, {"example 17 is unreadable"});
  testing::expectThrowsWith<InvalidArgument>([&] { loader.next(); }, {"example 17"});  // stays failed
  ds->failAt = -1;
  loader.start({0, 3});
  EXPECT_EQ(asIndices(loader.next().batch), (std::vector<int64_t>{15, 16, 17, 18, 19}));
}

TEST(PrefetchLoader, NextBeforeStartAndBadArguments) {
  auto ds = std::make_shared<CountingDataset>(10);
  PrefetchLoader loader(ds, DistributedSampler(10, 1, 0, {.batchSize = 2}));
  testing::expectThrowsWith<InvalidArgument>([&] { loader.next(); }, {"next() before start()"});
  testing::expectThrowsWith<InvalidArgument>([&] { loader.start({0, 5}); }, {"batch 5"});
  testing::expectThrowsWith<InvalidArgument>([&] { PrefetchLoader(ds, DistributedSampler(11, 1, 0)); },
                                             {"made for 11 examples", "has 10"});
  testing::expectThrowsWith<InvalidArgument>([&] { PrefetchLoader(ds, DistributedSampler(10, 1, 0), {.prefetch = 0}); },
                                             {"prefetch 0"});
}

TEST(PrefetchLoader, DestructionStopsABlockedOrBusyThread) {
  auto ds = std::make_shared<CountingDataset>(100);
  {
    PrefetchLoader full(ds, DistributedSampler(100, 1, 0, {.batchSize = 1}), {.prefetch = 2});
    full.start({0, 0});
    ASSERT_TRUE(eventually([&] { return ds->calls.load() >= 2; }));  // now blocked on a full queue
  }
  ds->calls = 0;
  ds->hold = true;
  std::thread release;
  {
    PrefetchLoader busy(ds, DistributedSampler(100, 1, 0, {.batchSize = 1}));
    busy.start({0, 0});
    const bool inside = eventually([&] { return ds->calls.load() >= 1; });  // the thread is inside get()
    if (!inside) ds->hold = false;
    ASSERT_TRUE(inside);
    release = std::thread([&] {
      std::this_thread::sleep_for(10ms);
      ds->hold = false;
    });
  }  // the destructor waits for the get() in progress, then joins
  release.join();
  EXPECT_EQ(ds->calls.load(), 1) << "the stopped thread started no further batch";
}

}  // namespace
}  // namespace dt::data
