// The fp16/bf16 compression hook's ordering (ddp/comm_hooks.h): on a device whose collectives
// complete on a stream it must queue the cast back on the caller's stream at the call (not on a
// callback thread's stream later) and hand back a Work whose wait() orders the waiter's stream.
// The CPU tests run the hook's steps with CPU tensors and a fake stream mark; the GPU test runs
// the real hook under a StreamGuard and skips with the reason without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/errors.h"
#include "ddp/comm_hooks.h"
#include "process_group/process_group.h"
#include "process_group/work.h"
#include "store/hash_store.h"
#include "tensor/tensor.h"
#include "tests/testing/testing.h"
#if DT_HAVE_CUDA
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/stream.h"
#endif

namespace dt {
namespace {

using namespace std::chrono_literals;

struct FakeMark final : detail::StreamMark {
  explicit FakeMark(std::vector<std::string>& log) : log(log) {}
  void blockCurrentStream() override { log.push_back("block on mark"); }
  void synchronize() override { log.push_back("host waits for mark"); }
  std::vector<std::string>& log;
};

// A collective on a "device": it doubles the compressed values at once (as if queued on the
// stream), completes when the test says so, and has a device wait like an NCCL Work.
struct FakeDevice {
  std::vector<std::string> log;
  WorkPtr reduce = std::make_shared<Work>("allreduce #1 (test)");
  std::thread::id markedOn;

  std::function<WorkPtr(const Tensor&)> allreduce(bool deviceWait) {
    return [this, deviceWait](const Tensor& t) {
      log.push_back("allreduce " + std::string(toString(t.dtype())));
      Tensor w = t;
      w.mul_(2.0);
      if (deviceWait) reduce->setDeviceWait([this] { log.push_back("stream waits for allreduce"); });
      return reduce;
    };
  }
  detail::MarkStream mark() {
    return [this](Device) {
      markedOn = std::this_thread::get_id();
      log.push_back("mark");
      return std::make_shared<FakeMark>(log);
    };
  }
};

TEST(CompressHook, OnADeviceTheCastBackIsQueuedAtTheCallOnTheCallersStream) {
  FakeDevice dev;
  Tensor buffer = fromVector<float>({1.5f, -2.25f, 3.0f});
  WorkPtr done = detail::compressedAllreduce(buffer, DType::BFloat16, dev.allreduce(true), dev.mark());
  // The stream waited for the collective, then the cast back ran, then the mark: all on this
  // thread, before the hook returned, in stream order.
  EXPECT_EQ(dev.log, (std::vector<std::string>{"allreduce bfloat16", "stream waits for allreduce", "mark"}));
  EXPECT_EQ(dev.markedOn, std::this_thread::get_id());
  EXPECT_EQ(buffer.toVector<float>(), (std::vector<float>{3.0f, -4.5f, 6.0f}));
  EXPECT_TRUE(done->hasDeviceWait());
  EXPECT_FALSE(done->isCompleted());
  done->wait();  // does not block the host: the waiting stream waits for the mark
  EXPECT_EQ(dev.log.back(), "block on mark");
  Work::markCompleted(dev.reduce);
  done->wait(10s);  // the host: done once the cast back has run
  EXPECT_TRUE(done->isSuccess());
  EXPECT_NE(std::find(dev.log.begin(), dev.log.end(), "host waits for mark"), dev.log.end());
  EXPECT_NE(done->description().find("bfloat16 decompress"), std::string::npos);
}

TEST(CompressHook, OnADeviceAFailureOfTheCollectiveFailsTheHooksWork) {
  FakeDevice later;
  Tensor buffer = fromVector<float>({1.0f, 2.0f});
  WorkPtr done = detail::compressedAllreduce(buffer, DType::Float16, later.allreduce(true), later.mark());
  Work::markFailed(later.reduce, std::make_exception_ptr(BackendError("allreduce #1 failed: ncclRemoteError")));
  testing::expectThrowsWith<BackendError>([&] { done->wait(10s); }, {"ncclRemoteError"});

  FakeDevice already;
  Work::markFailed(already.reduce, std::make_exception_ptr(BackendError("allreduce #1: the group is broken")));
  WorkPtr failed = detail::compressedAllreduce(buffer, DType::Float16, already.allreduce(true), already.mark());
  testing::expectThrowsWith<BackendError>([&] { failed->wait(); }, {"the group is broken"});
  EXPECT_EQ(std::find(already.log.begin(), already.log.end(), "mark"), already.log.end());
}

TEST(CompressHook, OnTheHostTheCastBackRunsAfterTheCollectiveCompleted) {
  FakeDevice host;
  Tensor buffer = fromVector<float>({1.0f, 2.0f});
  WorkPtr done = detail::compressedAllreduce(buffer, DType::Float16, host.allreduce(false), host.mark());
  EXPECT_FALSE(done->hasDeviceWait());
  EXPECT_EQ(buffer.toVector<float>(), (std::vector<float>{1.0f, 2.0f})) << "cast back before the op completed";
  Work::markCompleted(host.reduce);
  done->wait(10s);
  EXPECT_EQ(buffer.toVector<float>(), (std::vector<float>{2.0f, 4.0f}));
  EXPECT_EQ(host.log, (std::vector<std::string>{"allreduce float16"}));  // no stream marks on the host
}

#if DT_HAVE_NCCL
// The real hook on a GPU under a StreamGuard: the cast back must be ordered on that stream, so a
// kernel queued there right after the hook sees the reduced, decompressed values.
TEST(CompressHook, OnAGpuUnderAStreamGuardTheNextKernelSeesTheResult) {
  if (cuda::deviceCount() == 0) GTEST_SKIP() << "needs a CUDA device: " << cuda::unavailableReason();
  const Device gpu = Device::cuda(0);
  dt::setCurrentDevice(gpu);
  ProcessGroupOptions o;
  o.backend = "nccl";
  o.timeout = 60s;
  auto pg = ProcessGroup::create(std::make_shared<HashStore>(), 0, 1, o);
  const cuda::Stream user = cuda::Stream::create(gpu);
  cuda::StreamGuard guard(user);
  constexpr int64_t n = int64_t{1} << 22;
  GradBucket bucket;
  bucket.count = 1;
  bucket.buffer = full({n}, 1.25, DType::Float32, gpu);  // exact in float16
  WorkPtr done = fp16CompressHook()(*pg, bucket);
  EXPECT_TRUE(done->hasDeviceWait());
  done->wait();           // device side only
  bucket.buffer.mul_(2.0);  // queued on `user` behind the cast back
  const std::vector<float> host = bucket.buffer.toVector<float>();
  int wrong = 0;
  for (int64_t i = 0; i < n; i += 997) wrong += host[static_cast<size_t>(i)] != 2.5f;
  EXPECT_EQ(wrong, 0) << "the cast back raced the next kernel on the caller's stream";
  done->wait(60s);
  EXPECT_TRUE(done->isSuccess());
  pg->destroy();
}
#endif

}  // namespace
}  // namespace dt
