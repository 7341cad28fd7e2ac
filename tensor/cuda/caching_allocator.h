// The caching allocator's device-independent core: a cache of memory
// segments carved into blocks, per stream, over a raw memory interface.
// tensor/cuda wraps it around cudaMalloc (one cache per GPU) and around
// cudaHostAlloc (pinned host memory), the CPU allocator (tensor/storage.cpp)
// around mmap; tests wrap it around malloc. It is compiled in every build (no
// CUDA header) so its logic is tested everywhere.
//
// Contract:
//  * Why cache: cudaMalloc and cudaFree are slow and cudaFree synchronises
//    the device, while a training step asks for the same sizes every
//    iteration. A freed block therefore stays reserved and serves the next
//    request that fits.
//  * Sizes: requests round up to 512 bytes. Requests of 1 MiB and less come
//    from the small pool, carved out of 2 MiB segments; larger ones from the
//    large pool: a request under 10 MiB gets a 20 MiB segment (so that medium
//    tensors share one raw allocation), a bigger one a segment rounded up to
//    2 MiB (Options::shareMediumSegments off: every large request gets a
//    segment of its own size rounded up to 2 MiB). A cached block larger than
//    the request is split when the rest is worth keeping (512 bytes in the
//    small pool, more than 1 MiB in the large one); freed neighbours in a
//    segment merge again.
//  * Options::boundReservedByLivePeak: before a new segment would take the
//    reserved bytes past the most ever allocated at once (since construction
//    or emptyCache()), segments with no live block are freed first.
//  * Streams: each block belongs to the stream it was allocated on and is
//    reused only for requests on that stream, so work queued on one stream
//    never races a new owner on another without an explicit wait. The best
//    fit (smallest cached block that fits, lowest address on a tie) wins.
//  * recordStream(ptr, stream): the block is also used by work on another
//    stream. When it is freed the cache asks RawMemory for a UseMarker per
//    such stream and keeps the block out of reuse until every marker is done;
//    markers are polled at the start of each allocate().
//  * Out of memory: when RawMemory has no room, the cache waits for the
//    pending markers, frees every idle whole segment and tries once more;
//    then it throws dt::BackendError saying the cache's name, the bytes
//    asked, allocated, reserved, free on the device and its total, with a
//    hint (emptyCache, a smaller batch).
//  * Zero bytes gives nullptr and counts nothing; free(nullptr) is a no-op.
//    Freeing or recording a pointer that is not a live block of this cache
//    throws InvalidArgument naming the pointer and the cache.
//  * emptyCache() waits (blocking the host) for pending markers, then
//    returns every segment with no live block to RawMemory.
//  * Ownership: the cache owns its segments and frees them all when
//    destroyed; it must outlive every pointer it handed out. RawMemory must
//    outlive the cache.
//  * Thread-safe: one mutex per cache, held during RawMemory calls (which
//    therefore must not call back into the cache).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "tensor/device.h"
#include "tensor/memory_stats.h"

namespace dt::cuda {

// An opaque stream identity (a cudaStream_t's value; 0 is the default stream).
using StreamId = uintptr_t;

// Completes when the work queued on a stream up to its creation has finished.
class UseMarker {
 public:
  virtual ~UseMarker() = default;
  // Never blocks.
  virtual bool done() = 0;
  // Blocks the host until done.
  virtual void wait() = 0;
};

// The raw memory a BlockCache carves up.
class RawMemory {
 public:
  virtual ~RawMemory() = default;
  // nullptr when the device has no room for `bytes` (that is not an error:
  // the cache frees what it holds and retries); throws dt::Error for any
  // other failure.
  virtual void* allocateSegment(size_t bytes) = 0;
  virtual void freeSegment(void* ptr, size_t bytes) = 0;
  struct DeviceMemory {
    size_t free = 0;
    size_t total = 0;
  };
  // What the device has free and in total now (for the out-of-memory message).
  virtual DeviceMemory deviceMemory() = 0;
  // A marker for the work queued on `stream` so far.
  virtual std::unique_ptr<UseMarker> recordUse(StreamId stream) = 0;
};

struct CacheStats {
  size_t allocatedBytes = 0;       // live blocks (rounded sizes)
  size_t peakAllocatedBytes = 0;   // since construction or resetPeakStats()
  size_t totalAllocatedBytes = 0;  // every block ever handed out
  size_t requestedBytes = 0;       // live blocks as asked, before rounding
  size_t reservedBytes = 0;        // all segments held
  size_t peakReservedBytes = 0;
  size_t pendingBytes = 0;         // freed blocks waiting for other streams' markers
  uint64_t allocations = 0;
  uint64_t frees = 0;
  uint64_t cacheHits = 0;           // allocations served by a cached block, no RawMemory call
  uint64_t segmentAllocations = 0;  // successful RawMemory::allocateSegment calls
  uint64_t segmentFrees = 0;
  uint64_t allocationRetries = 0;  // RawMemory had no room and the cache freed its idle segments
  uint64_t outOfMemoryErrors = 0;
};

enum class BlockState {
  Live,            // handed out
  AwaitingStreams, // freed, held until the recorded streams' markers are done
  Cached,          // free for the next request on its stream
};
const char* blockStateName(BlockState state);  // "live", "awaiting streams", "cached"

struct CacheBlockInfo {
  uintptr_t address = 0;
  size_t bytes = 0;
  size_t requestedBytes = 0;  // 0 unless live
  BlockState state = BlockState::Cached;
  std::string op;  // the profiled op that allocated it (live blocks made while a profiler recorded)
};

struct CacheSegmentInfo {
  uintptr_t address = 0;
  size_t bytes = 0;
  StreamId stream = 0;
  bool smallPool = false;
  std::vector<CacheBlockInfo> blocks;  // in address order, covering the segment
};

struct CacheSnapshot {
  std::string name;
  std::vector<CacheSegmentInfo> segments;  // in address order
};

class BlockCache {
 public:
  static constexpr size_t kMinBlockSize = 512;
  static constexpr size_t kSmallSize = size_t{1} << 20;
  static constexpr size_t kSmallSegment = size_t{2} << 20;
  static constexpr size_t kMinLargeAlloc = size_t{10} << 20;
  static constexpr size_t kLargeSegment = size_t{20} << 20;
  static constexpr size_t kRoundLarge = size_t{2} << 20;

  struct Options {
    bool shareMediumSegments = true;      // see "Sizes" above
    bool boundReservedByLivePeak = false;  // see above
    // What the out-of-memory message tells the user to call to give cached memory back.
    const char* emptyCacheCall = "dt::cuda::emptyCache()";
  };
  // `name` appears in messages ("cuda:0", "pinned host memory").
  BlockCache(std::string name, RawMemory& raw, Options options);
  BlockCache(std::string name, RawMemory& raw) : BlockCache(std::move(name), raw, Options{}) {}
  ~BlockCache();
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  void* allocate(size_t bytes, StreamId stream);
  void free(void* ptr);
  // `ptr` may point anywhere inside a live block.
  void recordStream(const void* ptr, StreamId stream);
  // True when ptr points into a live block of this cache.
  bool owns(const void* ptr) const;
  void emptyCache();

  CacheStats stats() const;
  void resetPeakStats();
  CacheSnapshot snapshot() const;
  // The live blocks, largest first, in the shared MemoryStats/MemorySnapshot
  // form (memory_stats.h): every live block is listed.
  MemoryStats memoryStats(Device device) const;
  MemorySnapshot memorySnapshot(Device device) const;

  // The block size a request gets (512-byte multiple); throws InvalidArgument
  // when rounding would overflow.
  static size_t roundSize(size_t bytes);
  // The segment a request of `rounded` bytes is carved from.
  static size_t segmentSize(size_t rounded, bool shareMediumSegments = true);

 private:
  struct Segment;
  struct Block {
    uintptr_t address = 0;
    size_t size = 0;
    size_t requested = 0;
    StreamId stream = 0;
    bool small = false;
    BlockState state = BlockState::Cached;
    const char* op = nullptr;
    Block* prev = nullptr;  // neighbours inside the segment
    Block* next = nullptr;
    Segment* segment = nullptr;
    std::vector<StreamId> uses;  // other streams recorded while live
    std::vector<std::unique_ptr<UseMarker>> markers;
  };
  struct Segment {
    uintptr_t address = 0;
    size_t size = 0;
    Block* head = nullptr;
  };
  struct BySize {
    bool operator()(const Block* a, const Block* b) const;
  };
  using Pool = std::set<Block*, BySize>;

  Pool& poolFor(bool small) { return small ? smallPool_ : largePool_; }
  Block* takeCached(size_t size, StreamId stream);
  Block* newSegment(size_t size, StreamId stream);
  void splitIfWorth(Block* block, size_t size);
  void cache(Block* block);
  void processPending(bool wait);
  // Frees segments with no block in use until the reserved bytes are at most `downTo`.
  void releaseIdleSegments(size_t downTo = 0);
  [[noreturn]] void throwOutOfMemory(size_t asked);
  Block* liveBlockAt(const void* ptr) const;

  const std::string name_;
  RawMemory& raw_;
  const Options options_;
  size_t livePeak_ = 0;  // the most allocated since construction or emptyCache()
  mutable std::mutex mu_;
  Pool smallPool_;
  Pool largePool_;
  std::map<uintptr_t, Block*> live_;
  std::vector<Block*> pending_;
  std::map<uintptr_t, std::unique_ptr<Segment>> segments_;
  CacheStats stats_;
};

}  // namespace dt::cuda
