#include "data/loader.h"

#include <chrono>
#include <vector>

#include "common/errors.h"
#include "common/strings.h"
#include "common/thread_name.h"

namespace dt::data {

PrefetchLoader::PrefetchLoader(std::shared_ptr<const Dataset> dataset, DistributedSampler sampler, LoaderOptions options)
    : dataset_(std::move(dataset)), sampler_(sampler), options_(options) {
  if (!dataset_) throw InvalidArgument("PrefetchLoader: dataset is null");
  if (options_.prefetch < 1) throw InvalidArgument(str("PrefetchLoader: prefetch ", options_.prefetch, " must be at least 1"));
  lowWater_ = static_cast<size_t>(options_.prefetch / 2);
  if (sampler_.datasetSize() != dataset_->size()) {
    throw InvalidArgument(str("PrefetchLoader: the sampler was made for ", sampler_.datasetSize(),
                              " examples but the dataset (", dataset_->describe(), ") has ", dataset_->size()));
  }
  thread_ = std::thread([this] {
    setThreadName("dt-loader");
    run();
  });
}

PrefetchLoader::~PrefetchLoader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  producerWake_.notify_all();
  thread_.join();
}

void PrefetchLoader::start(SamplerPosition position) {
  sampler_.stepsBefore(position);  // validates it
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.clear();
    error_ = nullptr;
    from_ = position;
    ++generation_;
    started_ = true;
  }
  producerWake_.notify_all();
}

LoadedBatch PrefetchLoader::next() {
  std::unique_lock<std::mutex> lock(mu_);
  if (!started_) throw InvalidArgument("PrefetchLoader: next() before start()");
  if (queue_.empty() && !error_) {
    ++stats_.waits;
    const auto begin = std::chrono::steady_clock::now();
    consumerWaiting_ = true;
    consumerWake_.wait(lock, [&] { return !queue_.empty() || error_; });
    consumerWaiting_ = false;
    stats_.waitMs += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
  }
  if (queue_.empty()) std::rethrow_exception(error_);
  LoadedBatch batch = std::move(queue_.front());
  queue_.pop_front();
  ++stats_.batches;
  // Wake a producer waiting for room only at the low-water mark: it then refills the queue in
  // one burst, instead of being woken (a futex call and a context switch) for every batch.
  const bool wake = producerWaiting_ && queue_.size() <= lowWater_;
  lock.unlock();
  if (wake) producerWake_.notify_one();
  return batch;
}

void PrefetchLoader::run() {
  const size_t capacity = static_cast<size_t>(options_.prefetch);
  std::unique_lock<std::mutex> lock(mu_);
  auto waitForProducer = [&](const auto& ready) {
    producerWaiting_ = true;
    producerWake_.wait(lock, ready);
    producerWaiting_ = false;
  };
  for (;;) {
    waitForProducer([&] { return stop_ || (started_ && !error_ && queue_.size() < capacity); });
    if (stop_) return;
    // Work on one epoch at a time, outside the lock; a start() meanwhile makes it stale.
    const uint64_t generation = generation_;
    SamplerPosition position = from_;
    lock.unlock();
    std::vector<int64_t> indices;
    std::exception_ptr failure;
    try {
      // With replacement each batch is computed when it is gathered (an epoch of draws can be millions).
      if (!sampler_.options().replacement) indices = sampler_.rankIndices(position.epoch);
    } catch (...) {
      failure = std::current_exception();
    }
    lock.lock();
    while (!failure && !stop_ && generation == generation_ && position.batch < sampler_.batchesPerEpoch()) {
      waitForProducer([&] { return stop_ || generation != generation_ || queue_.size() < capacity; });
      if (stop_ || generation != generation_) break;
      lock.unlock();
      const int64_t b = sampler_.localBatchSize();
      LoadedBatch loaded;
      loaded.position = position;
      try {
        if (sampler_.options().replacement) {
          const std::vector<int64_t> drawn = sampler_.batchIndices(position.epoch, position.batch);
          loaded.batch = dataset_->get(drawn);
        } else {
          loaded.batch = dataset_->get(std::span<const int64_t>(indices.data() + position.batch * b, static_cast<size_t>(b)));
        }
      } catch (...) {
        failure = std::current_exception();
      }
      lock.lock();
      if (generation != generation_) break;  // restarted while gathering: drop it
      if (failure) break;
      queue_.push_back(std::move(loaded));
      ++position.batch;
      from_ = position.batch < sampler_.batchesPerEpoch() ? position : SamplerPosition{position.epoch + 1, 0};
      if (consumerWaiting_) consumerWake_.notify_one();
    }
    if (failure && generation == generation_) {
      error_ = failure;
      consumerWake_.notify_all();
    }
  }
}

}  // namespace dt::data
