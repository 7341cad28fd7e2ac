// The caching allocator's core (tensor/cuda/caching_allocator.h) over a fake
// raw memory backed by malloc with a fixed capacity: runs in every build.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "tensor/cuda/caching_allocator.h"
#include "tests/testing/testing.h"

namespace dt::cuda {
namespace {

constexpr size_t KiB = size_t{1} << 10;
constexpr size_t MiB = size_t{1} << 20;
constexpr StreamId kStreamA = 0;  // the default stream's id
constexpr StreamId kStreamB = 0xb0;
constexpr StreamId kStreamC = 0xc0;

// A marker whose completion the test decides; wait() completes it (as a
// synchronisation would) and is counted.
struct MarkerState {
  StreamId stream = 0;
  bool done = false;
  bool fail = false;  // done() throws, as a device error would
  int waits = 0;
};

class FakeMarker final : public UseMarker {
 public:
  explicit FakeMarker(std::shared_ptr<MarkerState> state) : state_(std::move(state)) {}
  bool done() override {
    if (state_->fail) throw BackendError("fake marker failure");
    return state_->done;
  }
  void wait() override {
    ++state_->waits;
    state_->done = true;
  }

 private:
  std::shared_ptr<MarkerState> state_;
};

class FakeRaw final : public RawMemory {
 public:
  explicit FakeRaw(size_t capacity) : capacity_(capacity) {}
  ~FakeRaw() override { EXPECT_TRUE(segments_.empty()) << segments_.size() << " segments never freed"; }

  void* allocateSegment(size_t bytes) override {
    ++allocateCalls;
    if (failWith != nullptr) throw BackendError(failWith);
    if (bytes > capacity_ - used_) return nullptr;
    void* p = std::malloc(bytes);
    if (p == nullptr) return nullptr;
    used_ += bytes;
    segments_[p] = bytes;
    return p;
  }
  void freeSegment(void* ptr, size_t bytes) override {
    const auto it = segments_.find(ptr);
    ASSERT_NE(it, segments_.end()) << "freed a segment never allocated";
    EXPECT_EQ(it->second, bytes);
    segments_.erase(it);
    used_ -= bytes;
    ++freeCalls;
    std::free(ptr);
  }
  DeviceMemory deviceMemory() override { return {capacity_ - used_, capacity_}; }
  std::unique_ptr<UseMarker> recordUse(StreamId stream) override {
    auto state = std::make_shared<MarkerState>();
    state->stream = stream;
    markers.push_back(state);
    return std::make_unique<FakeMarker>(state);
  }

  size_t used() const { return used_; }
  size_t liveSegments() const { return segments_.size(); }

  int allocateCalls = 0;
  int freeCalls = 0;
  const char* failWith = nullptr;
  std::vector<std::shared_ptr<MarkerState>> markers;

 private:
  size_t capacity_;
  size_t used_ = 0;
  std::map<void*, size_t> segments_;
};

uintptr_t addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// The one segment that contains p.
CacheSegmentInfo segmentOf(const BlockCache& cache, const void* p) {
  for (const CacheSegmentInfo& s : cache.snapshot().segments) {
    if (addr(p) >= s.address && addr(p) < s.address + s.bytes) return s;
  }
  ADD_FAILURE() << "no segment holds " << p;
  return {};
}

TEST(CachingAllocator, RoundsRequestsAndPicksSegmentSizes) {
  EXPECT_EQ(BlockCache::roundSize(1), 512u);
  EXPECT_EQ(BlockCache::roundSize(512), 512u);
  EXPECT_EQ(BlockCache::roundSize(513), 1024u);
  EXPECT_EQ(BlockCache::segmentSize(512), 2 * MiB);
  EXPECT_EQ(BlockCache::segmentSize(MiB), 2 * MiB);
  EXPECT_EQ(BlockCache::segmentSize(MiB + 512), 20 * MiB);
  EXPECT_EQ(BlockCache::segmentSize(10 * MiB), 10 * MiB);
  EXPECT_EQ(BlockCache::segmentSize(11 * MiB), 12 * MiB);
  testing::expectThrowsWith<InvalidArgument>([] { BlockCache::roundSize(std::numeric_limits<size_t>::max()); },
                                             {"18446744073709551615 bytes", "cannot be rounded"});
}

TEST(CachingAllocator, ReusesAFreedBlockWithoutRawAllocation) {
  FakeRaw raw(64 * MiB);
  BlockCache cache("fake:0", raw);
  void* a = cache.allocate(1000, kStreamA);
  ASSERT_NE(a, nullptr);
  std::memset(a, 0x5a, 1000);  // the memory is really there
  cache.free(a);
  void* b = cache.allocate(900, kStreamA);
  EXPECT_EQ(b, a);
  EXPECT_EQ(raw.allocateCalls, 1);
  const CacheStats s = cache.stats();
  EXPECT_EQ(s.cacheHits, 1u);
  EXPECT_EQ(s.segmentAllocations, 1u);
  EXPECT_EQ(s.allocations, 2u);
  EXPECT_EQ(s.frees, 1u);
  EXPECT_EQ(s.allocatedBytes, 1024u);
  EXPECT_EQ(s.requestedBytes, 900u);
  EXPECT_EQ(s.reservedBytes, 2 * MiB);
  cache.free(b);
}

TEST(CachingAllocator, SplitsSegmentsAndMergesFreedNeighbours) {
  FakeRaw raw(64 * MiB);
  BlockCache cache("fake:0", raw);
  void* a = cache.allocate(1000, kStreamA);
  void* b = cache.allocate(1000, kStreamA);
  void* c = cache.allocate(5000, kStreamA);
  EXPECT_EQ(addr(b), addr(a) + 1024);
  EXPECT_EQ(addr(c), addr(b) + 1024);
  EXPECT_EQ(raw.allocateCalls, 1);

  CacheSegmentInfo seg = segmentOf(cache, a);
  EXPECT_EQ(seg.bytes, 2 * MiB);
  EXPECT_TRUE(seg.smallPool);
  ASSERT_EQ(seg.blocks.size(), 4u);
  EXPECT_EQ(seg.blocks[0].bytes, 1024u);
  EXPECT_EQ(seg.blocks[0].requestedBytes, 1000u);
  EXPECT_EQ(seg.blocks[0].state, BlockState::Live);
  EXPECT_EQ(seg.blocks[2].bytes, 5120u);
  EXPECT_EQ(seg.blocks[3].bytes, 2 * MiB - 7168);
  EXPECT_EQ(seg.blocks[3].state, BlockState::Cached);

  // a and c freed: c merges with the tail, a stays alone next to live b.
  cache.free(a);
  cache.free(c);
  seg = segmentOf(cache, a);
  ASSERT_EQ(seg.blocks.size(), 3u);
  EXPECT_EQ(seg.blocks[0].state, BlockState::Cached);
  EXPECT_EQ(seg.blocks[1].state, BlockState::Live);
  EXPECT_EQ(seg.blocks[2].bytes, 2 * MiB - 2048);
  // Best fit: a 1 KiB request takes the 1 KiB hole, not the big tail.
  void* d = cache.allocate(1024, kStreamA);
  EXPECT_EQ(d, a);
  cache.free(d);

  // Freeing b joins both sides: the segment is one cached block again.
  cache.free(b);
  seg = segmentOf(cache, a);
  ASSERT_EQ(seg.blocks.size(), 1u);
  EXPECT_EQ(seg.blocks[0].bytes, 2 * MiB);
  EXPECT_EQ(seg.blocks[0].state, BlockState::Cached);
  // A whole-segment request now fits the merged block.
  void* whole = cache.allocate(MiB, kStreamA);
  EXPECT_EQ(whole, a);
  EXPECT_EQ(raw.allocateCalls, 1);
  cache.free(whole);
}

TEST(CachingAllocator, SmallAndLargePoolsStayApart) {
  FakeRaw raw(256 * MiB);
  BlockCache cache("fake:0", raw);
  void* small = cache.allocate(MiB, kStreamA);
  // Before the medium request: afterwards, its 20 MiB segment's rest would serve this one.
  void* big = cache.allocate(11 * MiB, kStreamA);
  void* medium = cache.allocate(MiB + 1, kStreamA);
  EXPECT_TRUE(segmentOf(cache, small).smallPool);
  EXPECT_EQ(segmentOf(cache, small).bytes, 2 * MiB);
  EXPECT_FALSE(segmentOf(cache, medium).smallPool);
  EXPECT_EQ(segmentOf(cache, medium).bytes, 20 * MiB);
  EXPECT_EQ(segmentOf(cache, big).bytes, 12 * MiB);
  // The big block's 1 MiB remainder is too small to split off in the large pool.
  EXPECT_EQ(segmentOf(cache, big).blocks.size(), 1u);
  EXPECT_EQ(cache.stats().allocatedBytes, MiB + (MiB + 512) + 12 * MiB);
  EXPECT_EQ(cache.stats().reservedBytes, 34 * MiB);

  // A freed small block never serves a large request, nor the reverse.
  cache.free(small);
  void* medium2 = cache.allocate(MiB + 1, kStreamA);
  EXPECT_NE(segmentOf(cache, medium2).address, segmentOf(cache, small).address);
  EXPECT_EQ(segmentOf(cache, medium2).address, segmentOf(cache, medium).address);  // the 20 MiB segment's rest
  cache.free(medium);
  cache.free(medium2);
  void* small2 = cache.allocate(4 * KiB, kStreamA);
  EXPECT_TRUE(segmentOf(cache, small2).smallPool);
  EXPECT_EQ(small2, small);
  EXPECT_EQ(raw.allocateCalls, 3);
  cache.free(small2);
  cache.free(big);
}

TEST(CachingAllocator, BlocksAreReusedOnlyOnTheirStream) {
  FakeRaw raw(64 * MiB);
  BlockCache cache("fake:0", raw);
  void* onA = cache.allocate(4096, kStreamA);
  cache.free(onA);
  void* onB = cache.allocate(4096, kStreamB);
  EXPECT_NE(segmentOf(cache, onB).address, segmentOf(cache, onA).address);
  EXPECT_EQ(segmentOf(cache, onB).stream, kStreamB);
  EXPECT_EQ(raw.allocateCalls, 2);
  void* againA = cache.allocate(4096, kStreamA);
  EXPECT_EQ(againA, onA);
  EXPECT_EQ(cache.stats().cacheHits, 1u);
  cache.free(onB);
  cache.free(againA);
}

TEST(CachingAllocator, RecordStreamHoldsAFreedBlockUntilTheMarkerIsDone) {
  FakeRaw raw(64 * MiB);
  BlockCache cache("fake:0", raw);
  void* a = cache.allocate(8192, kStreamA);
  // Recording the block's own stream adds nothing: its work is ordered anyway.
  cache.recordStream(a, kStreamA);
  // Any address inside the block counts (a view at an offset).
  cache.recordStream(static_cast<char*>(a) + 100, kStreamB);
  cache.recordStream(a, kStreamB);  // twice on one stream: one marker
  cache.recordStream(a, kStreamC);
  cache.free(a);
  ASSERT_EQ(raw.markers.size(), 2u);
  EXPECT_EQ(raw.markers[0]->stream, kStreamB);
  EXPECT_EQ(raw.markers[1]->stream, kStreamC);
  EXPECT_EQ(cache.stats().pendingBytes, 8192u);
  EXPECT_EQ(segmentOf(cache, a).blocks[0].state, BlockState::AwaitingStreams);
  EXPECT_EQ(cache.stats().allocatedBytes, 0u);

  void* b = cache.allocate(8192, kStreamA);
  EXPECT_NE(b, a) << "reused while stream B may still use it";
  raw.markers[0]->done = true;
  void* c = cache.allocate(8192, kStreamA);
  EXPECT_NE(c, a) << "reused while stream C may still use it";
  raw.markers[1]->done = true;
  void* d = cache.allocate(8192, kStreamA);
  EXPECT_EQ(d, a);
  EXPECT_EQ(cache.stats().pendingBytes, 0u);
  EXPECT_EQ(raw.markers[0]->waits + raw.markers[1]->waits, 0) << "polling must never block";

  // The uses were the old owner's: the new one frees without markers.
  cache.free(d);
  EXPECT_EQ(raw.markers.size(), 2u);
  cache.free(b);
  cache.free(c);
}

TEST(CachingAllocator, AMarkerThatFailsKeepsItsBlockPending) {
  FakeRaw raw(64 * MiB);
  BlockCache cache("fake:0", raw);
  void* a = cache.allocate(4096, kStreamA);
  void* other = cache.allocate(4096, kStreamA);
  cache.recordStream(other, kStreamC);
  cache.recordStream(a, kStreamB);
  cache.free(other);
  cache.free(a);
  ASSERT_EQ(raw.markers.size(), 2u);
  raw.markers[1]->fail = true;  // a's marker
  testing::expectThrowsWith<BackendError>([&] { cache.allocate(4096, kStreamA); }, {"fake marker failure"});
  EXPECT_EQ(segmentOf(cache, a).blocks[0].state, BlockState::AwaitingStreams);
  EXPECT_EQ(segmentOf(cache, a).blocks[1].state, BlockState::AwaitingStreams);
  EXPECT_EQ(cache.stats().pendingBytes, 8192u);
  raw.markers[1]->fail = false;
  raw.markers[0]->done = true;
  raw.markers[1]->done = true;
  void* b = cache.allocate(4096, kStreamA);
  EXPECT_EQ(b, a);
  EXPECT_EQ(cache.stats().pendingBytes, 0u);
  cache.free(b);
}

TEST(CachingAllocator, EmptyCacheReturnsIdleSegmentsAndWaitsForPendingOnes) {
  FakeRaw raw(256 * MiB);
  BlockCache cache("fake:0", raw);
  void* keep = cache.allocate(100, kStreamA);
  void* idle = cache.allocate(30 * MiB, kStreamA);
  void* pending = cache.allocate(12 * MiB, kStreamA);
  void* partly = cache.allocate(MiB + 1, kStreamA);  // its 20 MiB segment stays: `keep2` lives in it
  void* keep2 = cache.allocate(MiB + 1, kStreamA);
  ASSERT_EQ(segmentOf(cache, partly).address, segmentOf(cache, keep2).address);
  cache.recordStream(pending, kStreamB);
  cache.free(idle);
  cache.free(pending);
  cache.free(partly);
  EXPECT_EQ(cache.stats().reservedBytes, 2 * MiB + 30 * MiB + 12 * MiB + 20 * MiB);

  cache.emptyCache();
  ASSERT_EQ(raw.markers.size(), 1u);
  EXPECT_EQ(raw.markers[0]->waits, 1);
  EXPECT_EQ(raw.freeCalls, 2);
  EXPECT_EQ(raw.liveSegments(), 2u);
  const CacheStats s = cache.stats();
  EXPECT_EQ(s.reservedBytes, 22 * MiB);
  EXPECT_EQ(s.segmentFrees, 2u);
  EXPECT_EQ(s.pendingBytes, 0u);
  EXPECT_EQ(raw.used(), 22 * MiB);
  cache.free(keep);
  cache.free(keep2);
  cache.emptyCache();
  EXPECT_EQ(cache.stats().reservedBytes, 0u);
  EXPECT_EQ(raw.liveSegments(), 0u);
  EXPECT_TRUE(cache.snapshot().segments.empty());
}

TEST(CachingAllocator, StatisticsPeakAndReset) {
  FakeRaw raw(256 * MiB);
  BlockCache cache("fake:0", raw);
  void* a = cache.allocate(12 * MiB, kStreamA);
  void* b = cache.allocate(1000, kStreamA);
  cache.free(a);
  CacheStats s = cache.stats();
  EXPECT_EQ(s.allocatedBytes, 1024u);
  EXPECT_EQ(s.peakAllocatedBytes, 12 * MiB + 1024);
  EXPECT_EQ(s.totalAllocatedBytes, 12 * MiB + 1024);
  EXPECT_EQ(s.reservedBytes, 14 * MiB);
  EXPECT_EQ(s.peakReservedBytes, 14 * MiB);

  cache.emptyCache();
  cache.resetPeakStats();
  s = cache.stats();
  EXPECT_EQ(s.peakAllocatedBytes, 1024u);
  EXPECT_EQ(s.peakReservedBytes, 2 * MiB);
  void* c = cache.allocate(2000, kStreamA);
  s = cache.stats();
  EXPECT_EQ(s.peakAllocatedBytes, 1024u + 2048u);
  EXPECT_EQ(s.totalAllocatedBytes, 12 * MiB + 1024 + 2048);
  EXPECT_EQ(s.allocations, 3u);
  EXPECT_EQ(s.frees, 1u);
  EXPECT_EQ(s.cacheHits, 1u);  // c came out of b's segment
  EXPECT_EQ(s.segmentAllocations, 2u);

  // The shared MemoryStats/MemorySnapshot view lists every live block, largest first.
  const MemoryStats m = cache.memoryStats(Device::cuda(3));
  EXPECT_EQ(m.device, Device::cuda(3));
  EXPECT_EQ(m.allocatedBytes, 3072u);
  EXPECT_EQ(m.peakAllocatedBytes, 3072u);
  EXPECT_EQ(m.reservedBytes, 2 * MiB);
  EXPECT_EQ(m.allocations, 3u);
  EXPECT_EQ(m.frees, 1u);
  EXPECT_EQ(m.largestLiveBlocks, (std::vector<size_t>{2048, 1024}));
  const MemorySnapshot snap = cache.memorySnapshot(Device::cuda(3));
  ASSERT_EQ(snap.blocks.size(), 2u);
  EXPECT_EQ(snap.blocks[0].address, c);
  EXPECT_EQ(snap.blocks[0].bytes, 2048u);
  EXPECT_EQ(snap.blocks[1].address, b);
  EXPECT_EQ(snap.unlistedBlocks, 0u);
  cache.free(b);
  cache.free(c);
}

TEST(CachingAllocator, SnapshotDescribesSegmentsBlocksAndStreams) {
  FakeRaw raw(256 * MiB);
  BlockCache cache("fake:0", raw);
  void* a = cache.allocate(3000, kStreamB);
  void* big = cache.allocate(12 * MiB, kStreamA);
  const CacheSnapshot snap = cache.snapshot();
  EXPECT_EQ(snap.name, "fake:0");
  ASSERT_EQ(snap.segments.size(), 2u);
  EXPECT_LT(snap.segments[0].address, snap.segments[1].address);
  size_t listed = 0;
  for (const CacheSegmentInfo& seg : snap.segments) {
    listed += seg.bytes;
    size_t covered = 0;
    uintptr_t next = seg.address;
    for (const CacheBlockInfo& block : seg.blocks) {
      EXPECT_EQ(block.address, next) << "blocks must tile their segment";
      next += block.bytes;
      covered += block.bytes;
    }
    EXPECT_EQ(covered, seg.bytes);
    if (seg.address == addr(a)) {
      EXPECT_EQ(seg.stream, kStreamB);
      EXPECT_TRUE(seg.smallPool);
      EXPECT_EQ(seg.blocks[0].requestedBytes, 3000u);
      EXPECT_STREQ(blockStateName(seg.blocks[0].state), "live");
      EXPECT_STREQ(blockStateName(seg.blocks[1].state), "cached");
    } else {
      EXPECT_EQ(seg.address, addr(big));
      EXPECT_EQ(seg.stream, kStreamA);
      EXPECT_FALSE(seg.smallPool);
    }
  }
  EXPECT_EQ(listed, cache.stats().reservedBytes);
  cache.free(a);
  cache.free(big);
}

TEST(CachingAllocator, RetriesAfterFreeingCachedSegmentsThenReportsOutOfMemory) {
  FakeRaw raw(24 * MiB);
  BlockCache cache("fake:0", raw);
  void* live = cache.allocate(100, kStreamA);
  void* cached = cache.allocate(12 * MiB, kStreamA);
  cache.free(cached);
  // 2 + 12 MiB held; 16 MiB more fits only once the cached 12 MiB go back.
  void* big = cache.allocate(16 * MiB, kStreamA);
  ASSERT_NE(big, nullptr);
  CacheStats s = cache.stats();
  EXPECT_EQ(s.allocationRetries, 1u);
  EXPECT_EQ(s.segmentFrees, 1u);
  EXPECT_EQ(s.reservedBytes, 18 * MiB);

  const std::string message = testing::expectThrowsWith<BackendError>(
      [&] { cache.allocate(30 * MiB, kStreamA); },
      {"out of memory on fake:0", "tried to allocate 30.00 MiB (31457280 bytes)", "16.00 MiB allocated",
       "18.00 MiB reserved", "6.00 MiB free of 24.00 MiB total", "dt::cuda::emptyCache()", "smaller batch"});
  EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
  s = cache.stats();
  EXPECT_EQ(s.outOfMemoryErrors, 1u);
  EXPECT_EQ(s.allocationRetries, 2u);
  EXPECT_EQ(s.allocations, 3u);
  // The cache still works after the error.
  cache.free(big);
  void* again = cache.allocate(16 * MiB, kStreamA);
  EXPECT_EQ(again, big);
  cache.free(again);
  cache.free(live);
}

TEST(CachingAllocator, RetryTakesABlockWhoseStreamsFinished) {
  FakeRaw raw(14 * MiB);
  BlockCache cache("fake:0", raw);
  void* a = cache.allocate(12 * MiB, kStreamA);
  cache.recordStream(a, kStreamB);
  cache.free(a);
  // The device is full; rather than fail, the cache waits for stream B and reuses the block.
  void* b = cache.allocate(12 * MiB, kStreamA);
  EXPECT_EQ(b, a);
  ASSERT_EQ(raw.markers.size(), 1u);
  EXPECT_EQ(raw.markers[0]->waits, 1);
  EXPECT_EQ(cache.stats().cacheHits, 1u);
  EXPECT_EQ(cache.stats().segmentFrees, 0u);
  cache.free(b);
}

TEST(CachingAllocator, ZeroBytesAndBadInput) {
  FakeRaw raw(64 * MiB);
  BlockCache cache("fake:0", raw);
  EXPECT_EQ(cache.allocate(0, kStreamA), nullptr);
  cache.free(nullptr);
  EXPECT_EQ(cache.stats().allocations, 0u);
  EXPECT_EQ(cache.stats().frees, 0u);
  EXPECT_EQ(raw.allocateCalls, 0);

  int onTheStack = 0;
  testing::expectThrowsWith<InvalidArgument>([&] { cache.free(&onTheStack); },
                                             {"fake:0", "not a live block", "freed twice"});
  void* a = cache.allocate(64, kStreamA);
  cache.free(a);
  testing::expectThrowsWith<InvalidArgument>([&] { cache.free(a); }, {"fake:0", "not a live block"});
  testing::expectThrowsWith<InvalidArgument>([&] { cache.recordStream(a, kStreamB); },
                                             {"fake:0", "recordStream", "not inside a live block"});
  EXPECT_FALSE(cache.owns(a));
  testing::expectThrowsWith<BackendError>([&] { cache.allocate(std::numeric_limits<size_t>::max(), kStreamA); },
                                          {"out of memory on fake:0", "18446744073709551615 bytes"});
  EXPECT_EQ(cache.stats().frees, 1u);
}

TEST(CachingAllocator, ARawFailureOtherThanNoRoomPropagates) {
  FakeRaw raw(64 * MiB);
  BlockCache cache("fake:0", raw);
  raw.failWith = "fake driver error";
  testing::expectThrowsWith<BackendError>([&] { cache.allocate(100, kStreamA); }, {"fake driver error"});
  EXPECT_EQ(cache.stats().allocationRetries, 0u);
  raw.failWith = nullptr;
  void* a = cache.allocate(100, kStreamA);
  EXPECT_TRUE(cache.owns(static_cast<char*>(a) + 99));
  cache.free(a);
}

TEST(CachingAllocator, DestroyingTheCacheFreesEverySegment) {
  FakeRaw raw(64 * MiB);
  {
    BlockCache cache("fake:0", raw);
    cache.free(cache.allocate(100, kStreamA));
    cache.allocate(12 * MiB, kStreamB);  // still live at destruction: the cache owns its segments
    EXPECT_EQ(raw.liveSegments(), 2u);
  }
  EXPECT_EQ(raw.liveSegments(), 0u);
  EXPECT_EQ(raw.used(), 0u);
}

TEST(CachingAllocator, ThreadsAllocateAndFreeWithoutOverlap) {
  FakeRaw raw(512 * MiB);
  BlockCache cache("fake:0", raw);
  constexpr int kThreads = 4;
  constexpr int kRounds = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&cache, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::uniform_int_distribution<size_t> size(1, 3 * MiB);
      std::vector<std::pair<unsigned char*, size_t>> held;
      const StreamId stream = t % 2 == 0 ? kStreamA : kStreamB;
      for (int i = 0; i < kRounds; ++i) {
        if (held.size() < 8 && (held.empty() || rng() % 2 == 0)) {
          const size_t n = rng() % 4 == 0 ? size(rng) : size(rng) % (64 * KiB) + 1;
          auto* p = static_cast<unsigned char*>(cache.allocate(n, stream));
          std::memset(p, t + 1, n);
          held.emplace_back(p, n);
        } else {
          const size_t k = rng() % held.size();
          auto [p, n] = held[k];
          // Another owner writing into this block would show here.
          ASSERT_EQ(p[0], t + 1);
          ASSERT_EQ(p[n - 1], t + 1);
          cache.free(p);
          held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
        }
      }
      for (auto [p, n] : held) cache.free(p);
    });
  }
  for (std::thread& thread : threads) thread.join();
  const CacheStats s = cache.stats();
  EXPECT_EQ(s.allocatedBytes, 0u);
  EXPECT_EQ(s.allocations, s.frees);
  EXPECT_GT(s.cacheHits, s.allocations / 2) << "steady-state sizes should come from the cache";
  for (const CacheSegmentInfo& seg : cache.snapshot().segments) {
    EXPECT_EQ(seg.blocks.size(), 1u) << "every segment should have merged back into one block";
  }
  cache.emptyCache();
  EXPECT_EQ(raw.used(), 0u);
}

TEST(CachingAllocator, WithoutSharedMediumSegmentsEachLargeRequestGetsItsOwnSize) {
  FakeRaw raw(256 * MiB);
  BlockCache cache("fake:0", raw, {.shareMediumSegments = false, .emptyCacheCall = "dt::emptyCpuCache()"});
  void* a = cache.allocate(3 * MiB, kStreamA);
  EXPECT_EQ(segmentOf(cache, a).bytes, 4 * MiB);  // rounded to 2 MiB, not a 20 MiB segment
  void* small = cache.allocate(KiB, kStreamA);
  EXPECT_EQ(segmentOf(cache, small).bytes, 2 * MiB);  // the small pool is unchanged
  // The out-of-memory message names the call this cache's users have.
  testing::expectThrowsWith<BackendError>([&] { cache.allocate(300 * MiB, kStreamA); }, {"dt::emptyCpuCache()"});
  cache.free(a);
  cache.free(small);
}

TEST(CachingAllocator, BoundedByTheLivePeakIdleSegmentsGoBeforeANewOneIsMade) {
  FakeRaw raw(256 * MiB);
  BlockCache cache("fake:0", raw, {.shareMediumSegments = false, .boundReservedByLivePeak = true});
  std::vector<void*> first;
  for (int i = 0; i < 4; ++i) first.push_back(cache.allocate(4 * MiB, kStreamA));  // peak: 16 MiB live
  for (void* p : first) cache.free(p);
  EXPECT_EQ(cache.stats().reservedBytes, 16 * MiB);  // kept for reuse
  // A bigger request fits no cached block: idle segments go first, so reserved stays at the peak.
  void* big = cache.allocate(12 * MiB, kStreamA);
  EXPECT_EQ(cache.stats().reservedBytes, 16 * MiB);
  EXPECT_EQ(cache.stats().allocatedBytes, 12 * MiB);
  // Beyond the peak the cache grows (nothing idle is left to give back).
  void* more = cache.allocate(8 * MiB, kStreamA);
  EXPECT_EQ(cache.stats().reservedBytes, 20 * MiB);
  EXPECT_EQ(raw.used(), 20 * MiB);
  cache.free(big);
  cache.free(more);
  // emptyCache() starts the bound again from what is live: nothing, so nothing is kept idle.
  cache.emptyCache();
  void* again = cache.allocate(2 * MiB, kStreamA);
  cache.free(again);
  void* other = cache.allocate(6 * MiB, kStreamA);
  EXPECT_EQ(cache.stats().reservedBytes, 6 * MiB);
  cache.free(other);

  // Without the bound the same sequence keeps every idle segment.
  FakeRaw unboundedRaw(256 * MiB);
  BlockCache unbounded("fake:1", unboundedRaw, {.shareMediumSegments = false});
  void* x = unbounded.allocate(2 * MiB, kStreamA);
  unbounded.free(x);
  void* y = unbounded.allocate(6 * MiB, kStreamA);
  EXPECT_EQ(unbounded.stats().reservedBytes, 8 * MiB);
  unbounded.free(y);
}

}  // namespace
}  // namespace dt::cuda
