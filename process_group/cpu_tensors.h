// Helpers for CPU backends (gloo, shm): input checks, signatures for
// fingerprints, and staging of tensor lists into contiguous buffers.
//
// Contract: pure helpers, thread-safe for distinct tensors.
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

std::vector<TensorSignature> signatures(const std::vector<Tensor>& tensors);

struct Staged {
  std::vector<Tensor> buffers;
  std::vector<std::vector<Tensor>> members;  // empty or missing: buffers[i] is the user's tensor
  void copyBack();
};

Staged stage(const std::vector<Tensor>& tensors);
// The same, taking the list over when it can serve as is (no allocation).
Staged stage(std::vector<Tensor>&& tensors);
// Always copies: one flat buffer per dtype, nothing to copy back (reduce's
// non-root ranks, whose tensors must stay unchanged).
Staged stageCopy(const std::vector<Tensor>& tensors);

// The checks every CPU backend makes at the call, returning the op's
// fingerprint. A bad value is the caller's problem and reads so, in one line
// without internals: "[rank 0/2 pg=default gloo] reduce #1 (not issued): root
// 2 is not a rank of the group (size 2)" (no "#n" when the caller did not
// number the op). `who` is "rank 1/4 pg=default shm", `size` the group's,
// `seq` the op's number from its options (0: unnumbered).
struct CpuCallSite {
  std::string_view who;  // the backend's own text (outlives the call): no string built per op
  const char* backend;
  int rank;
  int size;
  uint64_t seq = 0;
};
[[noreturn]] void rejectCall(const CpuCallSite& at, const char* op, const std::string& detail);
CollectiveFingerprint checkAllreduce(const CpuCallSite& at, const std::vector<Tensor>& tensors, const AllreduceOptions& o);
CollectiveFingerprint checkBroadcast(const CpuCallSite& at, const std::vector<Tensor>& tensors, const BroadcastOptions& o);
CollectiveFingerprint checkAllgather(const CpuCallSite& at, const std::vector<Tensor>& outputs, const Tensor& input);
CollectiveFingerprint checkReduceScatter(const CpuCallSite& at, const Tensor& output, const std::vector<Tensor>& inputs,
                                         const ReduceScatterOptions& o);
CollectiveFingerprint checkReduce(const CpuCallSite& at, const std::vector<Tensor>& tensors, const ReduceOptions& o);
CollectiveFingerprint checkAllToAll(const CpuCallSite& at, const std::vector<Tensor>& outputs,
                                    const std::vector<Tensor>& inputs);
// outputs: `size` tensors of the input's shape on the root, none elsewhere.
CollectiveFingerprint checkGather(const CpuCallSite& at, const std::vector<Tensor>& outputs, const Tensor& input,
                                  const GatherOptions& o);
CollectiveFingerprint checkScatter(const CpuCallSite& at, const Tensor& output, const std::vector<Tensor>& inputs,
                                   const ScatterOptions& o);
// output (allgather) / input (reduceScatter): `size` times the other's elements, same dtype.
CollectiveFingerprint checkAllgatherIntoTensor(const CpuCallSite& at, const Tensor& output, const Tensor& input);
CollectiveFingerprint checkReduceScatterTensor(const CpuCallSite& at, const Tensor& output, const Tensor& input,
                                               const ReduceScatterOptions& o);
// Rows (along dim 0) per rank of allToAllSingle, resolved from the split sizes.
struct AllToAllSplits {
  std::vector<int64_t> sendRows;
  std::vector<int64_t> recvRows;
  size_t rowBytes = 0;  // bytes of one row (the trailing dimensions)
};
CollectiveFingerprint checkAllToAllSingle(const CpuCallSite& at, const Tensor& output, const Tensor& input,
                                          const std::vector<int64_t>& outputSplits,
                                          const std::vector<int64_t>& inputSplits, AllToAllSplits& splits);
// `size` contiguous blocks of a flat buffer, each shaped like `block`
// (views: writing them writes `flat`). `flat` must be contiguous.
std::vector<Tensor> blocksOf(const Tensor& flat, int size, const Shape& block);
// Copies results[i] into targets[i] where they are different tensors (a
// backend that worked in a contiguous stand-in for a strided target).
void copyBackInto(const std::vector<Tensor>& targets, const std::vector<Tensor>& results);
// Views of `t` along dim 0, rows[r] rows each (t contiguous).
std::vector<Tensor> rowsOf(const Tensor& t, const std::vector<int64_t>& rows);
// send/recv: one dtype, a peer that is another rank of the group.
void checkPointToPoint(const CpuCallSite& at, const char* op, const std::vector<Tensor>& tensors, int peer);

}  // namespace dt
