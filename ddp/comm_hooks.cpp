#include "ddp/comm_hooks.h"

#include <exception>
#include <memory>
#include <utility>

#include "common/config.h"
#include "common/errors.h"
#include "common/strings.h"

#if DT_HAVE_CUDA
#include "tensor/cuda/stream.h"
#endif

namespace dt {
namespace {

#if DT_HAVE_CUDA
class CudaStreamMark final : public detail::StreamMark {
 public:
  explicit CudaStreamMark(Device device) : device_(device) { event_.record(cuda::currentStream(device)); }
  void blockCurrentStream() override { event_.block(cuda::currentStream(device_)); }
  void synchronize() override { event_.synchronize(); }

 private:
  Device device_;
  cuda::Event event_;
};
#endif

std::shared_ptr<detail::StreamMark> markCurrentStream(Device device) {
#if DT_HAVE_CUDA
  return std::make_shared<CudaStreamMark>(device);
#else
  throw NotSupportedError(str("compression hook: a collective on ", device.str(),
                              " reported a device wait, but this build has no CUDA"));
#endif
}

CommHook compressHook(DType wireType) {
  return [wireType](ProcessGroup& group, GradBucket& bucket) -> WorkPtr {
    if (bucket.buffer.dtype() == wireType) return group.allreduce(bucket.buffer);
    return detail::compressedAllreduce(
        bucket.buffer, wireType, [&group](const Tensor& t) { return group.allreduce(t); },
        markCurrentStream);
  };
}

}  // namespace

WorkPtr detail::compressedAllreduce(const Tensor& buffer, DType wireType,
                                    const std::function<WorkPtr(const Tensor&)>& allreduce, const MarkStream& mark) {
  Tensor compressed = buffer.to(wireType);
  WorkPtr reduce = allreduce(compressed);
  // The caller's Work completes only after the cast back, so that waiting
  // on it means "the buffer holds the result".
  const std::string description = str(reduce->description(), " + ", toString(wireType), " decompress");
  auto done = std::make_shared<Work>(description);
  Tensor target = buffer;
  if (reduce->hasDeviceWait()) {
    // On the device: the stream waits for the collective, then casts back,
    // before anything the caller queues next (the optimizer) reads the
    // buffer. Nothing here blocks the host.
    try {
      reduce->wait();
      target.copy_(compressed);
    } catch (...) {
      return Work::failed(description, std::current_exception());
    }
    std::shared_ptr<StreamMark> castBack = mark(buffer.device());
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
