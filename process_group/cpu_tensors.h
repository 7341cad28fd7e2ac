// Helpers for CPU backends (gloo, shm): input checks, signatures for
// fingerprints, and staging of tensor lists into contiguous buffers.
//
// Contract: pure helpers, thread-safe for distinct tensors.
//  * checkCpu throws InvalidArgument for an undefined or non-CPU tensor,
//    naming the op, the backend and the tensor.
//  * stage(tensors): a single contiguous tensor is used as is (the backend
//    works in place); otherwise one flat buffer per dtype (in first-seen
//    order), whose copyBack() writes the results into the original tensors.
#pragma once

#include <string>
#include <vector>

#include "collectives/fingerprint.h"
#include "collectives/options.h"
#include "tensor/tensor.h"

namespace dt {

void checkCpu(const Tensor& t, const char* op, const std::string& who, const char* backend);
std::vector<TensorSignature> signatures(const std::vector<Tensor>& tensors);

struct Staged {
  std::vector<Tensor> buffers;
  std::vector<std::vector<Tensor>> members;  // empty: buffers[i] is the user's tensor
  void copyBack();
};

Staged stage(const std::vector<Tensor>& tensors);
// Always copies: one flat buffer per dtype, nothing to copy back (reduce's
// non-root ranks, whose tensors must stay unchanged).
Staged stageCopy(const std::vector<Tensor>& tensors);

// The checks every CPU backend makes at the call (InvalidArgument naming the
// op, the group and the values), returning the op's fingerprint. `who` is
// "rank 1/4 pg=default shm", `size` the group's.
struct CpuCallSite {
  std::string who;
  const char* backend;
  int rank;
  int size;
};
CollectiveFingerprint checkAllreduce(const CpuCallSite& at, const std::vector<Tensor>& tensors, const AllreduceOptions& o);
CollectiveFingerprint checkBroadcast(const CpuCallSite& at, const std::vector<Tensor>& tensors, const BroadcastOptions& o);
CollectiveFingerprint checkAllgather(const CpuCallSite& at, const std::vector<Tensor>& outputs, const Tensor& input);
CollectiveFingerprint checkReduceScatter(const CpuCallSite& at, const Tensor& output, const std::vector<Tensor>& inputs,
                                         const ReduceScatterOptions& o);
CollectiveFingerprint checkReduce(const CpuCallSite& at, const std::vector<Tensor>& tensors, const ReduceOptions& o);
CollectiveFingerprint checkAllToAll(const CpuCallSite& at, const std::vector<Tensor>& outputs,
                                    const std::vector<Tensor>& inputs);
// send/recv: one dtype, a peer that is another rank of the group.
void checkPointToPoint(const CpuCallSite& at, const char* op, const std::vector<Tensor>& tensors, int peer);

}  // namespace dt
