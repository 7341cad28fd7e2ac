#include "tensor/cuda/caching_allocator.h"

#include <algorithm>
#include <limits>
#include <tuple>
#include <utility>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/profiler.h"

namespace dt::cuda {

const char* blockStateName(BlockState state) {
  switch (state) {
    case BlockState::Live: return "live";
    case BlockState::AwaitingStreams: return "awaiting streams";
    case BlockState::Cached: return "cached";
  }
  return "?";
}

bool BlockCache::BySize::operator()(const Block* a, const Block* b) const {
  return std::tie(a->stream, a->size, a->address) < std::tie(b->stream, b->size, b->address);
}

BlockCache::BlockCache(std::string name, RawMemory& raw, Options options)
    : name_(std::move(name)), raw_(raw), options_(options) {}

BlockCache::~BlockCache() {
  for (auto& [address, segment] : segments_) {
    try {
      raw_.freeSegment(reinterpret_cast<void*>(address), segment->size);
    } catch (const std::exception&) {
      // Nothing to report to at destruction; the memory goes back with the process.
    }
    for (Block* b = segment->head; b != nullptr;) delete std::exchange(b, b->next);
  }
}

size_t BlockCache::roundSize(size_t bytes) {
  if (bytes > std::numeric_limits<size_t>::max() - kRoundLarge) {
    throw InvalidArgument(str("caching allocator: a request of ", bytes, " bytes cannot be rounded to a block size"));
  }
  if (bytes == 0) return kMinBlockSize;
  return (bytes + kMinBlockSize - 1) / kMinBlockSize * kMinBlockSize;
}

size_t BlockCache::segmentSize(size_t rounded, bool shareMediumSegments) {
  if (rounded <= kSmallSize) return kSmallSegment;
  if (rounded < kMinLargeAlloc && shareMediumSegments) return kLargeSegment;
  return (rounded + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

void* BlockCache::allocate(size_t bytes, StreamId stream) {
  if (bytes == 0) return nullptr;
  std::lock_guard lock(mu_);
  // No device has this much; saying so beats an overflow in the rounding.
  if (bytes > std::numeric_limits<size_t>::max() - kRoundLarge) throwOutOfMemory(bytes);
  processPending(/*wait=*/false);
  const size_t size = roundSize(bytes);
  const bool small = size <= kSmallSize;
  Block* block = takeCached(size, stream);
  if (block == nullptr) {
    const size_t segment = segmentSize(size, options_.shareMediumSegments);
    if (options_.boundReservedByLivePeak) {
      const size_t bound = std::max(livePeak_, stats_.allocatedBytes + segment);
      if (stats_.reservedBytes + segment > bound) releaseIdleSegments(bound - segment);
    }
    void* raw = raw_.allocateSegment(segment);
    if (raw == nullptr) {
      // Memory this cache holds idle may be what the device lacks: blocks
      // waiting for other streams first (one of them may fit), then every
      // idle segment, so that the raw allocator can place a bigger one.
      ++stats_.allocationRetries;
      processPending(/*wait=*/true);
      block = takeCached(size, stream);
      if (block == nullptr) {
        releaseIdleSegments();
        raw = raw_.allocateSegment(segment);
        if (raw == nullptr) throwOutOfMemory(bytes);
      }
    }
    if (block == nullptr) {
      auto seg = std::make_unique<Segment>();
      seg->address = reinterpret_cast<uintptr_t>(raw);
      seg->size = segment;
      block = new Block;
      block->address = seg->address;
      block->size = segment;
      block->stream = stream;
      block->small = small;
      block->segment = seg.get();
      seg->head = block;
      segments_.emplace(seg->address, std::move(seg));
      ++stats_.segmentAllocations;
      stats_.reservedBytes += segment;
      stats_.peakReservedBytes = std::max(stats_.peakReservedBytes, stats_.reservedBytes);
    } else {
      ++stats_.cacheHits;
    }
  } else {
    ++stats_.cacheHits;
  }
  splitIfWorth(block, size);
  block->state = BlockState::Live;
  block->requested = bytes;
  block->op = profiler::recording() ? profiler::currentOp() : nullptr;
  live_.emplace(block->address, block);
  ++stats_.allocations;
  stats_.allocatedBytes += block->size;
  stats_.totalAllocatedBytes += block->size;
  stats_.requestedBytes += bytes;
  stats_.peakAllocatedBytes = std::max(stats_.peakAllocatedBytes, stats_.allocatedBytes);
  livePeak_ = std::max(livePeak_, stats_.allocatedBytes);
  return reinterpret_cast<void*>(block->address);
}

BlockCache::Block* BlockCache::takeCached(size_t size, StreamId stream) {
  Pool& pool = poolFor(size <= kSmallSize);
  Block key;
  key.stream = stream;
  key.size = size;
  const auto it = pool.lower_bound(&key);
  if (it == pool.end() || (*it)->stream != stream) return nullptr;
  Block* block = *it;
  pool.erase(it);
  return block;
}

void BlockCache::splitIfWorth(Block* block, size_t size) {
  const size_t rest = block->size - size;
  // A large-pool remainder of 1 MiB or less could only ever serve small
  // requests, which never look in the large pool: keep it inside the block.
  const bool worth = block->small ? rest >= kMinBlockSize : rest > kSmallSize;
  if (!worth) return;
  auto* remainder = new Block;
  remainder->address = block->address + size;
  remainder->size = rest;
  remainder->stream = block->stream;
  remainder->small = block->small;
  remainder->segment = block->segment;
  remainder->prev = block;
  remainder->next = block->next;
  if (block->next != nullptr) block->next->prev = remainder;
  block->next = remainder;
  block->size = size;
  // The block was cached, so its neighbours are not: nothing to merge.
  poolFor(remainder->small).insert(remainder);
}

void BlockCache::free(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard lock(mu_);
  const auto it = live_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == live_.end()) {
    throw InvalidArgument(str("caching allocator ", name_, ": free of ", ptr,
                              ", which is not a live block here (freed twice, or allocated elsewhere)"));
  }
  Block* block = it->second;
  live_.erase(it);
  ++stats_.frees;
  stats_.allocatedBytes -= block->size;
  stats_.requestedBytes -= block->requested;
  block->requested = 0;
  block->op = nullptr;
  if (block->uses.empty()) {
    cache(block);
    return;
  }
  block->state = BlockState::AwaitingStreams;
  stats_.pendingBytes += block->size;
  // Listed as pending only once every marker exists: were a marker missing,
  // the block could be reused while that stream still works on it. A failed
  // recordUse leaves it out of reuse for good (still reserved, shown as
  // awaiting streams), which wastes memory but never corrupts it.
  for (StreamId use : block->uses) block->markers.push_back(raw_.recordUse(use));
  block->uses.clear();
  pending_.push_back(block);
}

void BlockCache::cache(Block* block) {
  block->state = BlockState::Cached;
  block->uses.clear();
  block->markers.clear();
  Pool& pool = poolFor(block->small);
  if (Block* prev = block->prev; prev != nullptr && prev->state == BlockState::Cached) {
    pool.erase(prev);  // before its size (part of the pool's key) changes
    prev->size += block->size;
    prev->next = block->next;
    if (block->next != nullptr) block->next->prev = prev;
    delete block;
    block = prev;
  }
  if (Block* next = block->next; next != nullptr && next->state == BlockState::Cached) {
    pool.erase(next);
    block->size += next->size;
    block->next = next->next;
    if (next->next != nullptr) next->next->prev = block;
    delete next;
  }
  pool.insert(block);
}

void BlockCache::processPending(bool wait) {
  std::vector<Block*> still;
  for (size_t i = 0; i < pending_.size(); ++i) {
    Block* block = pending_[i];
    // One marker at a time, so that a marker that throws (a device error)
    // leaves every list intact: the block stays pending, never half-released.
    try {
      auto& markers = block->markers;
      for (auto it = markers.begin(); it != markers.end();) {
        if (wait) (*it)->wait();
        it = wait || (*it)->done() ? markers.erase(it) : it + 1;
      }
    } catch (...) {
      still.insert(still.end(), pending_.begin() + static_cast<std::ptrdiff_t>(i), pending_.end());
      pending_ = std::move(still);
      throw;
    }
    if (block->markers.empty()) {
      stats_.pendingBytes -= block->size;
      cache(block);
    } else {
      still.push_back(block);
    }
  }
  pending_ = std::move(still);
}

void BlockCache::releaseIdleSegments(size_t downTo) {
  for (auto it = segments_.begin(); it != segments_.end() && stats_.reservedBytes > downTo;) {
    Block* head = it->second->head;
    if (head->state != BlockState::Cached || head->next != nullptr) {
      ++it;
      continue;
    }
    const size_t size = it->second->size;
    // The raw call first: if it throws, the books still match the memory.
    raw_.freeSegment(reinterpret_cast<void*>(it->first), size);
    poolFor(head->small).erase(head);
    delete head;
    stats_.reservedBytes -= size;
    ++stats_.segmentFrees;
    it = segments_.erase(it);
  }
}

void BlockCache::throwOutOfMemory(size_t asked) {
  ++stats_.outOfMemoryErrors;
  std::string device;
  try {
    const RawMemory::DeviceMemory memory = raw_.deviceMemory();
    device = str("the device has ", formatBytes(memory.free), " free of ", formatBytes(memory.total), " total");
  } catch (const std::exception& e) {
    device = str("the device's free memory is unknown (", e.what(), ")");
  }
  throw BackendError(str("out of memory on ", name_, ": tried to allocate ", formatBytes(asked), " (", asked,
                         " bytes); ", formatBytes(stats_.allocatedBytes), " allocated by tensors, ",
                         formatBytes(stats_.reservedBytes), " reserved by the caching allocator (",
                         formatBytes(stats_.reservedBytes - stats_.allocatedBytes - stats_.pendingBytes),
                         " of it cached idle, ", formatBytes(stats_.pendingBytes),
                         " awaiting other streams); ", device,
                         ". Free tensors you no longer need, call ", options_.emptyCacheCall,
                         " to give cached memory back to other processes, or use a smaller batch"));
}

BlockCache::Block* BlockCache::liveBlockAt(const void* ptr) const {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  auto it = live_.upper_bound(address);
  if (it == live_.begin()) return nullptr;
  --it;
  Block* block = it->second;
  return address < block->address + block->size ? block : nullptr;
}

void BlockCache::recordStream(const void* ptr, StreamId stream) {
  std::lock_guard lock(mu_);
  Block* block = liveBlockAt(ptr);
  if (block == nullptr) {
    throw InvalidArgument(str("caching allocator ", name_, ": recordStream of ", ptr,
                              ", which is not inside a live block here"));
  }
  // Work on the allocating stream is ordered with the next allocation anyway.
  if (stream == block->stream) return;
  if (std::find(block->uses.begin(), block->uses.end(), stream) == block->uses.end()) block->uses.push_back(stream);
}

bool BlockCache::owns(const void* ptr) const {
  std::lock_guard lock(mu_);
  return liveBlockAt(ptr) != nullptr;
}

void BlockCache::emptyCache() {
  std::lock_guard lock(mu_);
  processPending(/*wait=*/true);
  releaseIdleSegments();
  livePeak_ = stats_.allocatedBytes;
}

CacheStats BlockCache::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void BlockCache::resetPeakStats() {
  std::lock_guard lock(mu_);
  stats_.peakAllocatedBytes = stats_.allocatedBytes;
  stats_.peakReservedBytes = stats_.reservedBytes;
}

CacheSnapshot BlockCache::snapshot() const {
  std::lock_guard lock(mu_);
  CacheSnapshot snap;
  snap.name = name_;
  for (const auto& [address, segment] : segments_) {
    CacheSegmentInfo info;
    info.address = address;
    info.bytes = segment->size;
    info.stream = segment->head->stream;
    info.smallPool = segment->head->small;
    for (const Block* b = segment->head; b != nullptr; b = b->next) {
      info.blocks.push_back({b->address, b->size, b->requested, b->state, b->op != nullptr ? b->op : ""});
    }
    snap.segments.push_back(std::move(info));
  }
  return snap;
}

MemorySnapshot BlockCache::memorySnapshot(Device device) const {
  MemorySnapshot snap;
  snap.device = device;
  {
    std::lock_guard lock(mu_);
    for (const auto& [address, b] : live_) {
      snap.blocks.push_back({reinterpret_cast<const void*>(address), b->size, b->op != nullptr ? b->op : ""});
    }
  }
  std::stable_sort(snap.blocks.begin(), snap.blocks.end(),
                   [](const MemoryBlock& a, const MemoryBlock& b) { return a.bytes > b.bytes; });
  return snap;
}

MemoryStats BlockCache::memoryStats(Device device) const {
  const CacheStats s = stats();
  MemoryStats out;
  out.device = device;
  out.allocatedBytes = s.allocatedBytes;
  out.peakAllocatedBytes = s.peakAllocatedBytes;
  out.totalAllocatedBytes = s.totalAllocatedBytes;
  out.reservedBytes = s.reservedBytes;
  out.allocations = s.allocations;
  out.frees = s.frees;
  for (const MemoryBlock& block : memorySnapshot(device).blocks) {
    if (out.largestLiveBlocks.size() == 8) break;
    out.largestLiveBlocks.push_back(block.bytes);
  }
  return out;
}

}  // namespace dt::cuda
