#include "ddp/comm_hooks.h"

#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "common/config.h"
#include "common/errors.h"
#include "common/strings.h"

#if DT_HAVE_CUDA
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/stream.h"
#endif

namespace dt {
namespace {

#if DT_HAVE_CUDA
class CudaStreamMark final : public detail::StreamMark {
 public:
  explicit CudaStreamMark(const cuda::Stream& stream) : device_(stream.device()) { event_.record(stream); }
  void blockCurrentStream() override { event_.block(cuda::currentStream(device_)); }
  void synchronize() override { event_.synchronize(); }

 private:
  Device device_;
  cuda::Event event_;
};

// The cast back's stream of each device: made on first use and kept (streams are never destroyed,
// stream.h). Non-blocking, so that it does not order itself with the legacy default stream that
// backward usually runs on: that implicit order would bring the lost overlap back.
cuda::Stream castBackStream(Device device) {
  static std::mutex mutex;
  static std::map<int, cuda::Stream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device.index);
  if (it == streams.end()) it = streams.emplace(device.index, cuda::Stream::create(device)).first;
  return it->second;
}

class CudaSideStream final : public detail::SideStream {
 public:
  std::shared_ptr<detail::StreamMark> run(Device device, const std::vector<Tensor>& uses,
                                          const std::function<void()>& work) override {
    const cuda::Stream side = castBackStream(device);
    {
      // The side stream starts behind the caller's queue so far (the cast to the wire type);
      // the event may be destroyed once the wait is queued (CUDA keeps what the wait needs).
      cuda::Event callerSoFar;
      callerSoFar.record(cuda::currentStream(device));
      callerSoFar.block(side);
    }
    {
      cuda::StreamGuard guard(side);
      work();
    }
    // The buffers were allocated on the caller's stream; when freed there, the caching allocator
    // must not hand them out again before the side stream has passed the cast back.
    for (const Tensor& t : uses) {
      if (t.numel() > 0) cuda::recordStream(t.storage(), side);
    }
    return std::make_shared<CudaStreamMark>(side);
  }
};
#else
class CudaSideStream final : public detail::SideStream {
 public:
  std::shared_ptr<detail::StreamMark> run(Device device, const std::vector<Tensor>&,
                                          const std::function<void()>&) override {
    throw NotSupportedError(str("compression hook: a collective on ", device.str(),
                                " reported a device wait, but this build has no CUDA"));
  }
};
#endif

CommHook compressHook(DType wireType) {
  return [wireType](ProcessGroup& group, GradBucket& bucket) -> WorkPtr {
    if (bucket.buffer.dtype() == wireType) return group.allreduce(bucket.buffer);
    // Touches CUDA only in run(), i.e. only for a collective with a device wait.
    static CudaSideStream side;
    return detail::compressedAllreduce(
        bucket.buffer, wireType, [&group](const Tensor& t) { return group.allreduce(t); }, side);
  };
}

}  // namespace

WorkPtr detail::compressedAllreduce(const Tensor& buffer, DType wireType,
                                    const std::function<WorkPtr(const Tensor&)>& allreduce, SideStream& side) {
  Tensor compressed = buffer.to(wireType);
  WorkPtr reduce = allreduce(compressed);
  // The caller's Work completes only after the cast back, so that waiting
  // on it means "the buffer holds the result".
  const std::string description = str(reduce->description(), " + ", toString(wireType), " decompress");
  auto done = std::make_shared<Work>(description);
  Tensor target = buffer;
  if (reduce->hasDeviceWait()) {
    // On the device: the side stream waits for the collective, then casts back. The caller's
    // stream (backward's) is ordered only when the caller waits on the returned Work (DDP does
    // at the end of backward): waiting here, on the caller's stream, made every later gradient
    // kernel wait for this bucket's communication. Nothing here blocks the host.
    std::shared_ptr<StreamMark> castBack;
    try {
      castBack = side.run(buffer.device(), {target, compressed}, [reduce, target, compressed]() mutable {
        reduce->wait();  // the current (side) stream waits; a failed collective throws here
        target.copy_(compressed);
      });
    } catch (...) {
      return Work::failed(description, std::current_exception());
    }
    done->setDeviceWait([castBack] { castBack->blockCurrentStream(); });
    reduce->then([done, castBack](Work& work) {
      if (std::exception_ptr error = work.exception()) {
        Work::markFailed(done, error);
        return;
      }
      try {
        castBack->synchronize();  // queued right behind the collective: a short wait
        Work::markCompleted(done);
      } catch (...) {
        Work::markFailed(done, std::current_exception());
      }
    });
    return done;
  }
  // On the host the copy is synchronous: it runs on a callback thread once the collective completed.
  reduce->then([done, target, compressed](Work& work) mutable {
    if (std::exception_ptr error = work.exception()) {
      Work::markFailed(done, error);
      return;
    }
    try {
      target.copy_(compressed);
      Work::markCompleted(done);
    } catch (...) {
      Work::markFailed(done, std::current_exception());
    }
  });
  return done;
}

CommHook allreduceHook() {
  return [](ProcessGroup& group, GradBucket& bucket) { return group.allreduce(bucket.buffer); };
}

CommHook fp16CompressHook() { return compressHook(DType::Float16); }
CommHook bf16CompressHook() { return compressHook(DType::BFloat16); }

}  // namespace dt
