// The NCCL backend's decisions, apart from NCCL and CUDA: when a watched op
// counts as done. NcclBackend implements the small interfaces below with its
// NCCL and CUDA calls; tests implement them with fakes, so the rules are
// checked in every build, with or without a GPU. No CUDA or NCCL header here.
//
// Thread safety: the functions keep no state; the interfaces are called on
// the calling thread only.
#pragma once

namespace dt::nccl {

// ---- one op: completed, aborted or still running -----------------------------------------------

// What the watcher of one launched op can ask.
class OpProbe {
 public:
  virtual ~OpProbe() = default;
  // The op's completion event has completed (never blocks).
  virtual bool eventCompleted() = 0;
  // An abort of the op's communicator has begun (the backend's flag, set
  // before ncclCommAbort is called, or the communicator's own).
  virtual bool aborted() = 0;
  // Throws when NCCL reports an asynchronous error on the communicator.
  virtual void throwIfAsyncError() = 0;
};

enum class OpState { Running, Completed, Aborted };

// One look at an op. ncclCommAbort makes the kernels still running exit
// early, so the completion event of an op cut short completes as well: an
// event is read first, and counts only when no abort had begun by the time
// it was seen (the abort state is read after it and wins; read before, an
// abort in between would pass for a success). An asynchronous error wins
// over completion too (then nothing can be assumed about the op's result).
OpState pollOp(OpProbe& probe);

}  // namespace dt::nccl
