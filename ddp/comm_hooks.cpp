#include "ddp/comm_hooks.h"

#include <exception>
#include <memory>
#include <utility>

#include "common/strings.h"

namespace dt {
namespace {

CommHook compressHook(DType wireType) {
  return [wireType](ProcessGroup& group, GradBucket& bucket) -> WorkPtr {
    if (bucket.buffer.dtype() == wireType) return group.allreduce(bucket.buffer);
    Tensor compressed = bucket.buffer.to(wireType);
    WorkPtr reduce = group.allreduce(compressed);
    // The caller's Work completes only after the cast back, so that waiting
    // on it means "the buffer holds the result".
    auto done = std::make_shared<Work>(str(reduce->description(), " + ", toString(wireType), " decompress"));
    Tensor buffer = bucket.buffer;
    reduce->then([done, buffer, compressed](Work& work) mutable {
      if (std::exception_ptr error = work.exception()) {
        done->markFailed(error);
        return;
      }
      try {
        buffer.copy_(compressed);
        done->markCompleted();
      } catch (...) {
        done->markFailed(std::current_exception());
      }
    });
    return done;
  };
}

}  // namespace

CommHook allreduceHook() {
  return [](ProcessGroup& group, GradBucket& bucket) { return group.allreduce(bucket.buffer); };
}

CommHook fp16CompressHook() { return compressHook(DType::Float16); }
CommHook bf16CompressHook() { return compressHook(DType::BFloat16); }

}  // namespace dt
