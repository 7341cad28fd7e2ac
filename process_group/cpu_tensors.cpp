#include "process_group/cpu_tensors.h"

#include <algorithm>

#include "collectives/coalesce.h"
#include "collectives/reduce_kernels.h"
#include "common/check.h"
#include "common/errors.h"
#include "common/strings.h"

namespace dt {
namespace {

// Tensors grouped by dtype, dtypes in first-seen order.
std::vector<std::pair<DType, std::vector<Tensor>>> byDType(const std::vector<Tensor>& tensors) {
  std::vector<std::pair<DType, std::vector<Tensor>>> groups;
  for (const auto& t : tensors) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == t.dtype(); });
    if (it == groups.end()) {
      groups.emplace_back(t.dtype(), std::vector<Tensor>{t});
    } else {
      it->second.push_back(t);
    }
  }
  return groups;
}

}  // namespace

void checkCpu(const Tensor& t, const char* op, const std::string& who, const char* backend) {
  DT_CHECK(t.defined(), "[", who, "] ", op, ": undefined tensor");
  if (!t.device().isCpu()) {
    throw InvalidArgument(str("[", who, "] ", op, ": the ", backend, " backend takes CPU tensors, got ", t.describe(),
                              " on ", t.device().str(), "; use the nccl backend for CUDA tensors"));
  }
}

std::vector<TensorSignature> signatures(const std::vector<Tensor>& tensors) {
  std::vector<TensorSignature> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back({t.dtype(), t.sizes()});
  return out;
}

void Staged::copyBack() {
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (!members[i].empty()) unflattenInto(buffers[i], members[i]);
  }
}

Staged stage(const std::vector<Tensor>& tensors) {
  Staged staged;
  if (tensors.size() == 1 && tensors[0].isContiguous()) {
    staged.buffers.push_back(tensors[0]);
    staged.members.emplace_back();
    return staged;
  }
  for (auto& [dtype, members] : byDType(tensors)) {
    staged.buffers.push_back(flattenTensors(members));
    staged.members.push_back(std::move(members));
  }
  return staged;
}

Staged stageCopy(const std::vector<Tensor>& tensors) {
  Staged staged;
  for (auto& [dtype, members] : byDType(tensors)) {
    staged.buffers.push_back(flattenTensors(members));
    staged.members.emplace_back();
  }
  return staged;
}

namespace {

void checkRoot(const CpuCallSite& at, const char* op, int root) {
  DT_CHECK(root >= 0 && root < at.size, "[", at.who, "] ", op, ": root ", root, " is not a rank of the group (size ",
           at.size, ")");
}

void checkList(const CpuCallSite& at, const char* op, const std::vector<Tensor>& tensors) {
  DT_CHECK(!tensors.empty(), "[", at.who, "] ", op, ": empty tensor list");
  for (const auto& t : tensors) checkCpu(t, op, at.who, at.backend);
}

}  // namespace

CollectiveFingerprint checkAllreduce(const CpuCallSite& at, const std::vector<Tensor>& tensors, const AllreduceOptions& o) {
  checkList(at, "allreduce", tensors);
  reduceFunction(tensors[0].dtype(), o.reduceOp);  // rejects bool + avg now, not on the worker
  CollectiveFingerprint fp;
  fp.tensors = signatures(tensors);
  fp.reduceOp = o.reduceOp;
  return fp;
}

CollectiveFingerprint checkBroadcast(const CpuCallSite& at, const std::vector<Tensor>& tensors, const BroadcastOptions& o) {
  checkList(at, "broadcast", tensors);
  checkRoot(at, "broadcast", o.root);
  CollectiveFingerprint fp;
  fp.tensors = signatures(tensors);
  fp.root = o.root;
  return fp;
}

CollectiveFingerprint checkAllgather(const CpuCallSite& at, const std::vector<Tensor>& outputs, const Tensor& input) {
  checkCpu(input, "allgather", at.who, at.backend);
  DT_CHECK_EQ(static_cast<int>(outputs.size()), at.size, "[", at.who, "] allgather: one output tensor per rank");
  for (const auto& o : outputs) {
    checkCpu(o, "allgather", at.who, at.backend);
    DT_CHECK(o.dtype() == input.dtype() && o.sizes() == input.sizes(), "[", at.who, "] allgather: output ",
             o.describe(), " does not match input ", input.describe());
  }
  CollectiveFingerprint fp;
  fp.tensors = {{input.dtype(), input.sizes()}};
  return fp;
}

CollectiveFingerprint checkReduceScatter(const CpuCallSite& at, const Tensor& output, const std::vector<Tensor>& inputs,
                                         const ReduceScatterOptions& o) {
  checkCpu(output, "reduceScatter", at.who, at.backend);
  DT_CHECK_EQ(static_cast<int>(inputs.size()), at.size, "[", at.who, "] reduceScatter: one input tensor per rank");
  for (const auto& in : inputs) {
    checkCpu(in, "reduceScatter", at.who, at.backend);
    DT_CHECK(in.dtype() == output.dtype() && in.sizes() == output.sizes(), "[", at.who, "] reduceScatter: input ",
             in.describe(), " does not match output ", output.describe());
  }
  reduceFunction(output.dtype(), o.reduceOp);
  CollectiveFingerprint fp;
  fp.tensors = {{output.dtype(), output.sizes()}};
  fp.reduceOp = o.reduceOp;
  return fp;
}

CollectiveFingerprint checkReduce(const CpuCallSite& at, const std::vector<Tensor>& tensors, const ReduceOptions& o) {
  checkList(at, "reduce", tensors);
  checkRoot(at, "reduce", o.root);
  reduceFunction(tensors[0].dtype(), o.reduceOp);
  CollectiveFingerprint fp;
  fp.tensors = signatures(tensors);
  fp.reduceOp = o.reduceOp;
  fp.root = o.root;
  return fp;
}

CollectiveFingerprint checkAllToAll(const CpuCallSite& at, const std::vector<Tensor>& outputs,
                                    const std::vector<Tensor>& inputs) {
  DT_CHECK_EQ(static_cast<int>(inputs.size()), at.size, "[", at.who, "] allToAll: one input tensor per rank");
  DT_CHECK_EQ(static_cast<int>(outputs.size()), at.size, "[", at.who, "] allToAll: one output tensor per rank");
  for (const auto& t : inputs) {
    checkCpu(t, "allToAll", at.who, at.backend);
    DT_CHECK(t.dtype() == inputs[0].dtype(), "[", at.who, "] allToAll: inputs must share one dtype");
  }
  for (const auto& t : outputs) {
    checkCpu(t, "allToAll", at.who, at.backend);
    DT_CHECK(t.dtype() == inputs[0].dtype(), "[", at.who, "] allToAll: output ", t.describe(),
             " has another dtype than input ", inputs[0].describe());
  }
  CollectiveFingerprint fp;
  fp.tensors = signatures(inputs);
  return fp;
}

void checkPointToPoint(const CpuCallSite& at, const char* op, const std::vector<Tensor>& tensors, int peer) {
  checkList(at, op, tensors);
  for (const auto& t : tensors) {
    DT_CHECK(t.dtype() == tensors[0].dtype(), "[", at.who, "] ", op, ": tensors must share one dtype");
  }
  DT_CHECK(peer >= 0 && peer < at.size && peer != at.rank, "[", at.who, "] ", op, ": peer rank ", peer,
           " must be another rank of the group (size ", at.size, ")");
}

}  // namespace dt
