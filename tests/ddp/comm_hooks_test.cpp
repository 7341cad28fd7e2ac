// The fp16/bf16 compression hook's ordering (ddp/comm_hooks.h): on a device whose collectives
// complete on a stream it must leave the caller's stream (backward's) free: the wait for the
// collective and the cast back go to a side stream, and only the returned Work's wait() orders
// the waiter's stream after them. The CPU tests run the hook's steps with CPU tensors and fake
// streams (a name per stream, a queue for the side stream); the GPU tests run the real hook and
// skip with the reason without a device.
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

// The stream the calling thread has current, by name: "caller" unless the fake side stream runs.
thread_local std::string currentStream = "caller";

// A collective on a "device": its result is in the compressed buffer at once (the device did the
// work; it doubles the values), while its Work, the host's view, completes when the test says so.
// Its device wait, like an NCCL Work's, orders whichever stream is current.
struct FakeDevice : detail::SideStream {
  struct Mark final : detail::StreamMark {
    explicit Mark(FakeDevice& dev) : dev(dev) {}
    void blockCurrentStream() override { dev.log.push_back(currentStream + " waits for the side stream's mark"); }
    void synchronize() override {
      dev.drain();
      dev.log.push_back("host waits for the side stream's mark");
    }
    FakeDevice& dev;
  };

  std::vector<std::string> log;
  WorkPtr reduce = std::make_shared<Work>("allreduce #1 (test)");
  std::vector<std::function<void()>> sideQueue;  // queued on the side stream, not yet run
  std::vector<Tensor> usedOnSide;

  std::function<WorkPtr(const Tensor&)> allreduce(bool deviceWait) {
    return [this, deviceWait](const Tensor& t) {
      log.push_back(currentStream + " queues allreduce " + std::string(toString(t.dtype())));
      Tensor w = t;
      w.mul_(2.0);
      if (deviceWait) reduce->setDeviceWait([this] { log.push_back(currentStream + " waits for the allreduce"); });
      return reduce;
    };
  }
  // What the side stream runs is queued and runs when the test lets it (drain), as a stream
  // runs its work later than the host queued it.
  std::shared_ptr<detail::StreamMark> run(Device, const std::vector<Tensor>& uses,
                                          const std::function<void()>& work) override {
    log.push_back("side stream waits for the caller's stream");
    usedOnSide.insert(usedOnSide.end(), uses.begin(), uses.end());
    sideQueue.push_back(work);
    return std::make_shared<Mark>(*this);
  }
  void drain() {
    currentStream = "side";
    for (auto& work : sideQueue) work();
    sideQueue.clear();
    currentStream = "caller";
  }
};

bool contains(const std::vector<std::string>& log, const std::string& line) {
  return std::find(log.begin(), log.end(), line) != log.end();
}

TEST(CompressHook, OnADeviceTheHookAndTheCallersWaitReturnBeforeTheReductionCompletes) {
  FakeDevice dev;
  Tensor buffer = fromVector<float>({1.5f, -2.25f, 3.0f});
  WorkPtr done = detail::compressedAllreduce(buffer, DType::BFloat16, dev.allreduce(true), dev);
  // The hook returned with the reduction still running, and nothing was queued on the caller's
  // stream behind it: backward's next kernels do not wait for this bucket's communication.
  EXPECT_FALSE(dev.reduce->isCompleted());
  EXPECT_FALSE(done->isCompleted());
  EXPECT_EQ(dev.log, (std::vector<std::string>{"caller queues allreduce bfloat16",
                                               "side stream waits for the caller's stream"}));
  EXPECT_EQ(dev.sideQueue.size(), 1u);
  ASSERT_EQ(dev.usedOnSide.size(), 2u);  // the bucket's buffer and the compressed one, for the allocator
  EXPECT_TRUE(dev.usedOnSide[0].storage().isSameAs(buffer.storage()));
  EXPECT_EQ(dev.usedOnSide[1].dtype(), DType::BFloat16);
  // The caller orders its stream through the returned Work: at once, on the device only.
  EXPECT_TRUE(done->hasDeviceWait());
  done->wait();
  EXPECT_EQ(dev.log.back(), "caller waits for the side stream's mark");
  EXPECT_FALSE(dev.reduce->isCompleted());
  // The side stream runs: it waits for the collective, then casts back.
  dev.drain();
  EXPECT_EQ(dev.log.back(), "side waits for the allreduce");
  EXPECT_FALSE(contains(dev.log, "caller waits for the allreduce"));
  EXPECT_EQ(buffer.toVector<float>(), (std::vector<float>{3.0f, -4.5f, 6.0f}));
  EXPECT_FALSE(done->isCompleted()) << "done on the host before the collective's Work";
  Work::markCompleted(dev.reduce);
  done->wait(10s);  // the host: done once the side stream passed the cast back
  EXPECT_TRUE(done->isSuccess());
  EXPECT_TRUE(contains(dev.log, "host waits for the side stream's mark"));
  EXPECT_NE(done->description().find("bfloat16 decompress"), std::string::npos);
}

TEST(CompressHook, OnADeviceAFailureOfTheCollectiveFailsTheHooksWork) {
  FakeDevice later;
  Tensor buffer = fromVector<float>({1.0f, 2.0f});
  WorkPtr done = detail::compressedAllreduce(buffer, DType::Float16, later.allreduce(true), later);
  Work::markFailed(later.reduce, std::make_exception_ptr(BackendError("allreduce #1 failed: ncclRemoteError")));
  testing::expectThrowsWith<BackendError>([&] { done->wait(10s); }, {"ncclRemoteError"});

  // Already failed when the side stream's work is queued: the hook's Work fails at once.
  FakeDevice already;
  Work::markFailed(already.reduce, std::make_exception_ptr(BackendError("allreduce #1: the group is broken")));
  struct Eager final : detail::SideStream {
    std::shared_ptr<detail::StreamMark> run(Device, const std::vector<Tensor>&,
                                            const std::function<void()>& work) override {
      work();
      ADD_FAILURE() << "the side stream's work went on after the collective's failure";
      return nullptr;
    }
  } eager;
  WorkPtr failed = detail::compressedAllreduce(buffer, DType::Float16, already.allreduce(true), eager);
  testing::expectThrowsWith<BackendError>([&] { failed->wait(); }, {"the group is broken"});
}

TEST(CompressHook, OnTheHostTheCastBackRunsAfterTheCollectiveCompleted) {
  FakeDevice host;
  Tensor buffer = fromVector<float>({1.0f, 2.0f});
  WorkPtr done = detail::compressedAllreduce(buffer, DType::Float16, host.allreduce(false), host);
  EXPECT_FALSE(done->hasDeviceWait());
  EXPECT_FALSE(done->isCompleted());
  EXPECT_EQ(buffer.toVector<float>(), (std::vector<float>{1.0f, 2.0f})) << "cast back before the op completed";
  Work::markCompleted(host.reduce);
  done->wait(10s);
  EXPECT_EQ(buffer.toVector<float>(), (std::vector<float>{2.0f, 4.0f}));
  EXPECT_EQ(host.log, (std::vector<std::string>{"caller queues allreduce float16"}));  // no side stream on the host
}

#if DT_HAVE_NCCL
// The real hook on a GPU under a StreamGuard: the Work's wait() orders that stream after the
// side stream's cast back, so a kernel queued there right after it sees the reduced values.
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

// The overlap on two GPUs (threads as ranks): rank 1 joins the reduction only once rank 0 has
// seen a kernel it queued on its own stream after the hook run to the end. Were the wait for the
// collective queued on the caller's stream (backward's), that kernel would wait for rank 1 and
// rank 0 would give up at the deadline.
TEST(CompressHook, OnTwoGpusTheCallersStreamRunsOnWhileTheReductionWaitsForAPeer) {
  if (cuda::deviceCount() < 2) {
    GTEST_SKIP() << (cuda::deviceCount() == 0
                         ? "needs a CUDA device: " + cuda::unavailableReason()
                         : "needs 2 GPUs: NCCL 2.28 rejects two ranks on one GPU; this machine has 1");
  }
  auto store = std::make_shared<HashStore>();
  testing::runRanks(2, [&](int rank) {
    const Device gpu = Device::cuda(rank);
    dt::setCurrentDevice(gpu);
    ProcessGroupOptions o;
    o.backend = "nccl";
    o.timeout = 60s;
    auto pg = ProcessGroup::create(store, rank, 2, o);
    pg->allreduce(full({16}, 1.0, DType::Float32, gpu))->wait(60s);  // both communicators exist
    const cuda::Stream user = cuda::Stream::create(gpu);
    cuda::StreamGuard guard(user);
    GradBucket bucket;
    bucket.count = 1;
    bucket.buffer = full({int64_t{1} << 20}, 1.25, DType::Float32, gpu);  // exact in float16
    if (rank == 1) store->get("overlap/rank0-stream-ran", 60s);
    WorkPtr done = fp16CompressHook()(*pg, bucket);
    if (rank == 0) {
      Tensor next = full({1024}, 2.0, DType::Float32, gpu);
      next.mul_(3.0);  // backward's next kernel
      cuda::Event ran;
      ran.record(user);
      const auto deadline = std::chrono::steady_clock::now() + 30s;
      while (!ran.query() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
      EXPECT_TRUE(ran.query()) << "the caller's stream waited for the reduction (30 s without rank 1)";
      EXPECT_FALSE(done->isCompleted()) << "the reduction completed without rank 1";
      store->set("overlap/rank0-stream-ran", "1");
    }
    done->wait();  // device side: `user` waits for the cast back
    const std::vector<float> host = bucket.buffer.toVector<float>();
    EXPECT_EQ(host.front(), 2.5f);
    EXPECT_EQ(host.back(), 2.5f);
    done->wait(60s);
    EXPECT_TRUE(done->isSuccess());
    pg->destroy();
  });
}
#endif

}  // namespace
}  // namespace dt
