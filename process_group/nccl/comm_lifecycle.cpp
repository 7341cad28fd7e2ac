#include "process_group/nccl/comm_lifecycle.h"

namespace dt::nccl {

OpState pollOp(OpProbe& probe) {
  const bool completed = probe.eventCompleted();
  if (probe.aborted()) return OpState::Aborted;
  probe.throwIfAsyncError();
  return completed ? OpState::Completed : OpState::Running;
}

}  // namespace dt::nccl
