// Communication hooks: how DDP reduces one bucket of gradients.
//
// Contract:
//  * A hook is called on the thread running backward, once per bucket per
//    synchronised backward, in bucket order (the same on every rank), as soon
//    as the bucket is full. It must start the reduction and return without
//    waiting for it: the returned Work completes once `bucket.buffer` holds
//    the reduced gradients. A hook that throws makes that backward() throw.
//  * bucket.buffer arrives holding this rank's gradients already divided by
//    the world size, so a plain sum over ranks yields the average (what the
//    built-in hooks do). The hook may replace values in place only; the
//    buffer's size, dtype and storage must stay (gradients alias it when
//    gradientAsBucketView is on).
//  * Work completion callbacks (Work::then) run on the backend's thread: a
//    hook that post-processes the result there must only touch its bucket.
//  * Every rank must register the same hook: the hook's collectives are part
//    of the collective sequence that ranks must agree on.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "process_group/process_group.h"
#include "tensor/tensor.h"

namespace dt {

struct GradBucket {
  size_t index = 0;  // 0 = the first bucket launched
  size_t count = 0;  // buckets in this model
  // Flat, contiguous, one dtype and device: the gradients of `parameters`
  // back to back, pre-divided by the world size.
  Tensor buffer;
  std::vector<Tensor> parameters;
  std::vector<std::string> parameterNames;  // module paths
  bool isLast() const { return index + 1 == count; }
};

using CommHook = std::function<WorkPtr(ProcessGroup& group, GradBucket& bucket)>;

// The default: allreduce(sum) of the buffer in place.
CommHook allreduceHook();
// Cast the buffer to float16 (or bfloat16), allreduce that, cast the result
// back into the buffer: half the bytes on the wire, float16's 11 (bfloat16's
// 8) significant bits in the result. Buckets already in 16 bits are reduced
// as they are.
//  * On a GPU (the allreduce's Work has a device wait, work.h) the hook queues
//    the cast on the caller's current stream and returns: the wait for the
//    collective and the cast back are queued on a side stream of the device
//    (one per device and process, non-blocking), never on the caller's, so
//    backward's next kernels run while the bucket is on the wire. The
//    returned Work's wait() orders the waiting stream after the cast back;
//    wait(timeout), isCompleted() and then() report it done once the cast
//    back has run. The compressed buffer and the bucket's buffer are
//    recorded as used on the side stream (cuda::recordStream), so neither's
//    memory is reused before the cast back has read or written it.
//  * On the CPU the cast back runs on a callback thread once the allreduce
//    completed, and the returned Work completes after it.
CommHook fp16CompressHook();
CommHook bf16CompressHook();

namespace detail {

// The compression hook's steps apart from CUDA, for tests: `allreduce`
// stands for the group's, `side` for the side stream of the hook's device.
class StreamMark {
 public:
  virtual ~StreamMark() = default;
  // The waiting thread's current stream waits for the mark (device side).
  virtual void blockCurrentStream() = 0;
  // The host waits until the stream has passed the mark.
  virtual void synchronize() = 0;
};

class SideStream {
 public:
  virtual ~SideStream() = default;
  // Queues `work` on the side stream of `device`, behind what the calling
  // thread's current stream has queued so far (a device-side wait of the
  // side stream; the current stream waits for nothing): `work` runs on this
  // thread with the side stream current, so its kernels and the device waits
  // it calls land there. `uses` are recorded as used on the side stream.
  // Returns a mark of the side stream behind `work`. (The CUDA one runs
  // `work` before it returns; a test's may keep it for later.)
  virtual std::shared_ptr<StreamMark> run(Device device, const std::vector<Tensor>& uses,
                                          const std::function<void()>& work) = 0;
};

WorkPtr compressedAllreduce(const Tensor& buffer, DType wireType,
                            const std::function<WorkPtr(const Tensor&)>& allreduce, SideStream& side);

}  // namespace detail

}  // namespace dt
