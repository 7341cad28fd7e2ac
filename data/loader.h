// PrefetchLoader: this rank's batches, gathered ahead of time on a background thread.
//
//   PrefetchLoader loader(dataset, sampler, {.prefetch = 4});
//   loader.start(position);                       // e.g. where a checkpoint left off
//   for (int64_t step = 0; step < steps; ++step) {
//     LoadedBatch b = loader.next();              // usually ready: no waiting
//     train(b.batch.inputs, b.batch.targets);
//   }
//
// Contract:
//  * One background thread per loader gathers batches in the sampler's order (epoch after
//    epoch, without end) into a queue of at most `prefetch` batches, so reading and converting
//    the data is off the training step's critical path. Once the queue is full the thread
//    sleeps until it is down to half, then refills it in one go (one wake-up per prefetch / 2
//    batches, not one per batch). Each LoadedBatch says which position it came from.
//  * start(position) (re)starts the stream there, dropping whatever was queued. next() before
//    any start() throws InvalidArgument.
//  * next() blocks until the next batch is ready. An exception thrown while gathering (by the
//    dataset) is rethrown by the next() that would have returned that batch; the stream then
//    stays failed until start() is called again.
//  * Threads: start(), next() and stats() are for one consumer thread. The destructor stops
//    and joins the background thread (it never outlives the loader). Holds the dataset.
//  * Not fork-safe while running: fork only before start() or after destruction.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "data/dataset.h"
#include "data/sampler.h"

namespace dt::data {

struct LoaderOptions {
  int prefetch = 8;  // batches gathered ahead (at least 1)
};

struct LoadedBatch {
  Batch batch;
  SamplerPosition position;  // the batch's own position (the next one follows it)
};

struct LoaderStats {
  int64_t batches = 0;       // returned by next()
  double waitMs = 0;         // time next() spent waiting for the background thread
  int64_t waits = 0;         // next() calls that found the queue empty
};

class PrefetchLoader {
 public:
  PrefetchLoader(std::shared_ptr<const Dataset> dataset, DistributedSampler sampler, LoaderOptions options = {});
  ~PrefetchLoader();
  PrefetchLoader(const PrefetchLoader&) = delete;
  PrefetchLoader& operator=(const PrefetchLoader&) = delete;

  void start(SamplerPosition position);
  LoadedBatch next();
  const DistributedSampler& sampler() const { return sampler_; }
  LoaderStats stats() const { return stats_; }

 private:
  void run();

  std::shared_ptr<const Dataset> dataset_;
  DistributedSampler sampler_;
  LoaderOptions options_;

  std::mutex mu_;
  std::condition_variable producerWake_;  // work, or room in the queue
  std::condition_variable consumerWake_;  // a batch or an error
  bool producerWaiting_ = false;
  bool consumerWaiting_ = false;
  size_t lowWater_ = 0;  // a waiting producer is woken when the queue is down to this
  std::deque<LoadedBatch> queue_;
  std::exception_ptr error_;
  SamplerPosition from_;
  uint64_t generation_ = 0;  // bumped by start(); the producer drops stale work
  bool started_ = false;
  bool stop_ = false;
  LoaderStats stats_;
  std::thread thread_;
};

}  // namespace dt::data
