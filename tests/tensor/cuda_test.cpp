// CUDA storage: runs on a GPU machine; elsewhere checks the error a user gets.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/errors.h"
#include "tensor/device.h"
#include "tensor/storage.h"
#include "tests/testing/testing.h"

#if DT_HAVE_CUDA
#include "tensor/cuda/cuda.h"
#endif

namespace dt {
namespace {

#if DT_HAVE_CUDA
TEST(CudaStorage, WithoutDeviceAllocationNamesDeviceAndReason) {
  if (cuda::deviceCount() > 0) GTEST_SKIP() << "this machine has a CUDA device; see FillAndCopyBack";
  const std::string reason = cuda::unavailableReason();
  EXPECT_FALSE(reason.empty());
  testing::expectThrowsWith<NotSupportedError>([] { Storage(1024, Device::cuda(0)); }, {"cuda:0", reason});
}

TEST(CudaStorage, FillAndCopyBack) {
  if (cuda::deviceCount() == 0) GTEST_SKIP() << "needs a CUDA device: " << cuda::unavailableReason();
  constexpr size_t n = 1 << 20;
  Storage storage(n * sizeof(float), Device::cuda(0));
  ASSERT_TRUE(storage.defined());
  cuda::fillFloat32(storage.data(), Device::cuda(0), n, 2.5f);
  std::vector<float> host(n, 0.0f);
  cuda::copyBytes(host.data(), Device::cpu(), storage.data(), Device::cuda(0), n * sizeof(float));
  for (size_t i = 0; i < n; i += 4099) ASSERT_EQ(host[i], 2.5f) << "at " << i;
  EXPECT_EQ(host[n - 1], 2.5f);
  testing::expectThrowsWith<InvalidArgument>(
      [] { Storage(16, Device::cuda(cuda::deviceCount())); }, {"does not exist"});
}

TEST(CudaCachingAllocatorWithoutDevice, EveryEntryPointSaysWhy) {
  if (cuda::deviceCount() > 0) GTEST_SKIP() << "this machine has a CUDA device; the other CudaCachingAllocator tests run";
  const std::string reason = cuda::unavailableReason();
  testing::expectThrowsWith<NotSupportedError>([] { memoryStats(Device::cuda(0)); }, {"cuda:0", reason});
  testing::expectThrowsWith<NotSupportedError>([] { cuda::cacheSnapshot(Device::cuda(0)); }, {"cuda:0", reason});
  testing::expectThrowsWith<NotSupportedError>([] { cuda::pinnedHostAllocator().allocate(4096); },
                                               {"pinned host memory", reason});
  std::vector<float> host(4);
  testing::expectThrowsWith<NotSupportedError>(
      [&] {
        cuda::copyBytesAsync(host.data(), Device::cpu(), host.data(), Device::cuda(0), 16, cuda::Stream());
      },
      {"cuda:0", reason});
  // Nothing was ever cached: emptying is a no-op, not an error.
  cuda::emptyCache();
  testing::expectThrowsWith<InvalidArgument>([] { cuda::recordStream(Storage(), cuda::Stream()); }, {"undefined"});
  // CPU to CPU needs no device.
  std::vector<float> src{1, 2, 3, 4};
  cuda::copyBytesAsync(host.data(), Device::cpu(), src.data(), Device::cpu(), 16, cuda::Stream());
  EXPECT_EQ(host, src);
}

class CudaCachingAllocator : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::deviceCount() == 0) GTEST_SKIP() << "needs a CUDA device: " << cuda::unavailableReason();
  }
  static constexpr size_t MiB = size_t{1} << 20;
  const Device gpu = Device::cuda(0);
};

TEST_F(CudaCachingAllocator, AFreedBlockIsReusedFromTheCache) {
  const cuda::CacheStats before = cuda::cacheStats(gpu);
  void* first = nullptr;
  {
    Storage a(3 * MiB + 5, gpu);
    first = a.data();
    ASSERT_NE(first, nullptr);
    EXPECT_GE(memoryStats(gpu).allocatedBytes, 3 * MiB + 512);
  }
  Storage b(3 * MiB + 5, gpu);
  EXPECT_EQ(b.data(), first);
  const cuda::CacheStats after = cuda::cacheStats(gpu);
  EXPECT_EQ(after.allocations - before.allocations, 2u);
  EXPECT_EQ(after.frees - before.frees, 1u);
  EXPECT_GE(after.cacheHits - before.cacheHits, 1u);
  EXPECT_LE(after.segmentAllocations - before.segmentAllocations, 1u);
  // The block holds real device memory.
  cuda::fillFloat32(b.data(), gpu, 1024, 7.0f);
  std::vector<float> host(1024);
  cuda::copyBytes(host.data(), Device::cpu(), b.data(), gpu, host.size() * sizeof(float));
  EXPECT_EQ(host[1023], 7.0f);
}

TEST_F(CudaCachingAllocator, MemoryStatsSnapshotAndPeak) {
  resetPeakMemoryStats(gpu);
  const MemoryStats base = memoryStats(gpu);
  EXPECT_EQ(base.device, gpu);
  void* bigAt = nullptr;
  {
    Storage big(64 * MiB, gpu);
    bigAt = big.data();
    const MemoryStats during = memoryStats(gpu);
    EXPECT_EQ(during.allocatedBytes, base.allocatedBytes + 64 * MiB);
    EXPECT_GE(during.reservedBytes, during.allocatedBytes);
    ASSERT_FALSE(during.largestLiveBlocks.empty());
    EXPECT_EQ(during.largestLiveBlocks[0], 64 * MiB);
    const MemorySnapshot snap = memorySnapshot(gpu);
    ASSERT_FALSE(snap.blocks.empty());
    EXPECT_EQ(snap.blocks[0].address, bigAt);
    bool inSegments = false;
    for (const cuda::CacheSegmentInfo& seg : cuda::cacheSnapshot(gpu).segments) {
      for (const cuda::CacheBlockInfo& block : seg.blocks) {
        if (block.address == reinterpret_cast<uintptr_t>(bigAt)) {
          inSegments = true;
          EXPECT_EQ(block.state, cuda::BlockState::Live);
          EXPECT_EQ(block.requestedBytes, 64 * MiB);
        }
      }
    }
    EXPECT_TRUE(inSegments);
  }
  const MemoryStats after = memoryStats(gpu);
  EXPECT_EQ(after.allocatedBytes, base.allocatedBytes);
  EXPECT_EQ(after.peakAllocatedBytes, base.allocatedBytes + 64 * MiB);
  EXPECT_EQ(after.frees - base.frees, 1u);
  resetPeakMemoryStats(gpu);
  EXPECT_EQ(memoryStats(gpu).peakAllocatedBytes, after.allocatedBytes);
  EXPECT_NE(memorySummary(gpu).find("cuda:0"), std::string::npos);
}

TEST_F(CudaCachingAllocator, EmptyCacheGivesIdleSegmentsBack) {
  { Storage big(128 * MiB, gpu); }
  const size_t reserved = memoryStats(gpu).reservedBytes;
  EXPECT_GE(reserved, 128 * MiB);
  cuda::emptyCache();
  EXPECT_LE(memoryStats(gpu).reservedBytes, reserved - 128 * MiB);
  Storage again(128 * MiB, gpu);  // and the allocator keeps working
  EXPECT_NE(again.data(), nullptr);
}

TEST_F(CudaCachingAllocator, OutOfMemorySaysWhatWasAskedAndWhatIsHeld) {
  const size_t absurd = size_t{1} << 50;  // 1 PiB
  const std::string message = testing::expectThrowsWith<BackendError>(
      [&] { Storage(absurd, gpu); },
      {"out of memory on cuda:0", "(1125899906842624 bytes)", "allocated by tensors", "reserved by the caching",
       "free of", "emptyCache()", "smaller batch"});
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  EXPECT_GE(cuda::cacheStats(gpu).outOfMemoryErrors, 1u);
  Storage fine(MiB, gpu);  // the error left the allocator usable
  EXPECT_NE(fine.data(), nullptr);
}

TEST_F(CudaCachingAllocator, BlocksStayOnTheirStream) {
  const cuda::Stream side = cuda::Stream::create(gpu);
  void* onSide = nullptr;
  {
    cuda::StreamGuard guard(side);
    Storage a(4096, gpu);
    onSide = a.data();
  }
  Storage onDefault(4096, gpu);
  EXPECT_NE(onDefault.data(), onSide);
  for (const cuda::CacheSegmentInfo& seg : cuda::cacheSnapshot(gpu).segments) {
    const auto at = reinterpret_cast<uintptr_t>(onSide);
    if (at >= seg.address && at < seg.address + seg.bytes) {
      EXPECT_EQ(seg.stream, reinterpret_cast<uintptr_t>(side.handle()));
    }
  }
  cuda::StreamGuard guard(side);
  Storage backOnSide(4096, gpu);
  EXPECT_EQ(backOnSide.data(), onSide);
}

TEST_F(CudaCachingAllocator, RecordStreamHoldsTheBlockUntilTheStreamFinished) {
  const cuda::Stream side = cuda::Stream::create(gpu);
  constexpr size_t n = 8 * MiB;
  void* first = nullptr;
  {
    Storage a(n, gpu);
    first = a.data();
    Storage pinned(cuda::pinnedHostAllocator().allocate(n), n);
    cuda::copyBytesAsync(pinned.data(), Device::cpu(), a.data(), gpu, n, side);
    cuda::recordStream(a, side);
  }
  // Until an allocation polls the marker, the freed block waits for `side`.
  bool awaiting = false;
  for (const cuda::CacheSegmentInfo& seg : cuda::cacheSnapshot(gpu).segments) {
    for (const cuda::CacheBlockInfo& block : seg.blocks) {
      if (block.address == reinterpret_cast<uintptr_t>(first)) {
        awaiting = block.state == cuda::BlockState::AwaitingStreams;
      }
    }
  }
  EXPECT_TRUE(awaiting);
  side.synchronize();
  Storage b(n, gpu);
  EXPECT_EQ(b.data(), first) << "once the stream finished, the block is reused";

  Storage pageable(64, Device::cpu());
  testing::expectThrowsWith<InvalidArgument>([&] { cuda::recordStream(pageable, side); },
                                             {"not pinned memory", "pinnedHostAllocator"});
  if (cuda::deviceCount() > 1) {
    testing::expectThrowsWith<InvalidArgument>(
        [&] { cuda::recordStream(b, cuda::Stream::defaultFor(Device::cuda(1))); }, {"cuda:0", "cuda:1"});
  }
}

TEST_F(CudaCachingAllocator, PinnedMemoryAsyncCopyRoundTrip) {
  constexpr size_t n = 1 << 20;
  constexpr size_t bytes = n * sizeof(float);
  Storage src(cuda::pinnedHostAllocator().allocate(bytes), bytes);
  Storage dst(cuda::pinnedHostAllocator().allocate(bytes), bytes);
  auto* in = static_cast<float*>(src.data());
  for (size_t i = 0; i < n; ++i) in[i] = static_cast<float>(i % 1000) * 0.5f;
  std::memset(dst.data(), 0, bytes);
  Storage device(bytes, gpu);
  const cuda::Stream stream = cuda::Stream::create(gpu);
  cuda::copyBytesAsync(device.data(), gpu, src.data(), Device::cpu(), bytes, stream);
  cuda::copyBytesAsync(dst.data(), Device::cpu(), device.data(), gpu, bytes, stream);
  stream.synchronize();
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), bytes), 0);
  EXPECT_GE(cuda::pinnedCacheStats().allocatedBytes, 2 * bytes);

  // Pageable host memory: complete on return, no synchronisation needed.
  std::vector<float> back(n, -1.0f);
  cuda::copyBytesAsync(back.data(), Device::cpu(), device.data(), gpu, bytes, stream);
  EXPECT_EQ(std::memcmp(back.data(), src.data(), bytes), 0);

  // A freed pinned block waits for its copies before it is handed out again.
  void* srcAt = src.data();
  cuda::copyBytesAsync(device.data(), gpu, src.data(), Device::cpu(), bytes, stream);
  src = Storage();
  stream.synchronize();
  Storage reused(cuda::pinnedHostAllocator().allocate(bytes), bytes);
  EXPECT_EQ(reused.data(), srcAt);
  EXPECT_EQ(cuda::pinnedHostAllocator().stats(Device::cpu()).allocatedBytes,
            cuda::pinnedCacheStats().allocatedBytes);
}

// A rank that uses cuda:1 only, as rank 1 of a host does: CUDA calls on threads that never chose
// a device (a watchdog querying an event, a callback freeing a recorded tensor, a loader pinning
// memory) must not open a context on cuda:0, which costs GPU 0 memory in every rank. ctest runs
// each test in its own process, so nothing else has touched cuda:0 here.
TEST(CudaContexts, FreshThreadsWorkingForCuda1OpenNoContextOnCuda0) {
  if (cuda::deviceCount() < 2) {
    GTEST_SKIP() << "needs 2 GPUs (one to use, one to stay untouched): "
                 << (cuda::deviceCount() == 0 ? cuda::unavailableReason() : "this machine has 1");
  }
  ASSERT_FALSE(cuda::primaryContextActive(0)) << "cuda:0 had a context before the test started";
  const Device gpu = Device::cuda(1);
  dt::setCurrentDevice(gpu);
  ASSERT_TRUE(cuda::primaryContextActive(1));
  constexpr size_t n = 1 << 20;
  auto event = std::make_shared<cuda::Event>();
  const cuda::Stream side = cuda::Stream::create(gpu);
  Storage recorded(n, gpu);
  event->record(cuda::currentStream(gpu));
  cuda::recordStream(recorded, side);
  std::thread fresh([&] {
    EXPECT_EQ(cuda::currentDevice(), 0);  // as CUDA reports it on a thread that chose nothing
    event->query();
    event->synchronize();
    {
      cuda::DeviceGuard guard(gpu);
    }
    EXPECT_EQ(cuda::currentDevice(), 1) << "the guard left the thread on cuda:1 (cuda:0 has no context)";
  });
  fresh.join();
  std::thread another([&] {
    recorded = Storage();  // freed here: its use marker records an event on `side`
    event.reset();         // destroyed here
    Storage pinned(cuda::pinnedHostAllocator().allocate(n), n);
    Storage device(n, gpu);
    cuda::copyBytesAsync(pinned.data(), Device::cpu(), device.data(), gpu, n, side);
    side.synchronize();
    std::vector<char> host(n);
    cuda::copyBytes(host.data(), Device::cpu(), device.data(), gpu, n);
  });
  another.join();
  EXPECT_FALSE(cuda::primaryContextActive(0)) << "a CUDA call for cuda:1 opened a context on cuda:0";
}

#else
TEST(CudaStorage, CpuOnlyBuildRefusesCuda) {
  testing::expectThrowsWith<NotSupportedError>([] { Storage(16, Device::cuda(0)); }, {"cuda:0", "no GPU support"});
}
#endif

}  // namespace
}  // namespace dt
