#include "process_group/cpu_tensors.h"

#include <algorithm>

#include "collectives/coalesce.h"
#include "collectives/reduce_kernels.h"
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

std::vector<TensorSignature> signatures(const std::vector<Tensor>& tensors) {
  std::vector<TensorSignature> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back({t.dtype(), t.sizes()});
  return out;
}

void Staged::copyBack() {
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (i < members.size() && !members[i].empty()) unflattenInto(buffers[i], members[i]);
  }
}

Staged stage(std::vector<Tensor>&& tensors) {
  if (tensors.size() == 1 && tensors[0].isContiguous()) {
    Staged staged;
    staged.buffers = std::move(tensors);
    return staged;
  }
  return stage(static_cast<const std::vector<Tensor>&>(tensors));
}

Staged stage(const std::vector<Tensor>& tensors) {
  Staged staged;
  if (tensors.size() == 1 && tensors[0].isContiguous()) {
    staged.buffers.push_back(tensors[0]);
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

[[noreturn]] void rejectCall(const CpuCallSite& at, const char* op, const std::string& detail) {
  if (at.seq != 0) throw InvalidArgument(str("[", at.who, "] ", op, " #", at.seq, " (not issued): ", detail));
  throw InvalidArgument(str("[", at.who, "] ", op, ": ", detail));
}

namespace {

void checkTensor(const CpuCallSite& at, const char* op, const Tensor& t, const char* what) {
  if (!t.defined()) rejectCall(at, op, str(what, " is an undefined tensor"));
  if (!t.device().isCpu()) {
    rejectCall(at, op, str("the ", at.backend, " backend takes CPU tensors, got ", what, " ", t.describe(), " on ",
                           t.device().str(), "; use the nccl backend for CUDA tensors"));
  }
}

void checkRoot(const CpuCallSite& at, const char* op, int root) {
  if (root < 0 || root >= at.size) rejectCall(at, op, str("root ", root, " is not a rank of the group (size ", at.size, ")"));
}

void checkList(const CpuCallSite& at, const char* op, const std::vector<Tensor>& tensors) {
  if (tensors.empty()) rejectCall(at, op, "empty tensor list");
  for (const auto& t : tensors) checkTensor(at, op, t, "a tensor");
}

void checkReduceOp(const CpuCallSite& at, const char* op, DType dtype, ReduceOp reduceOp) {
  try {
    reduceFunction(dtype, reduceOp);
  } catch (const Error& e) {
    rejectCall(at, op, e.what());
  }
}

void checkCount(const CpuCallSite& at, const char* op, const std::vector<Tensor>& tensors, const char* what) {
  if (static_cast<int>(tensors.size()) != at.size) {
    rejectCall(at, op, str("one ", what, " tensor per rank: got ", tensors.size(), " for a group of size ", at.size));
  }
}

// Every tensor of `list` has the dtype and shape of `like`.
void checkAllLike(const CpuCallSite& at, const char* op, const std::vector<Tensor>& list, const Tensor& like,
                  const char* listName, const char* likeName) {
  for (size_t i = 0; i < list.size(); ++i) {
    checkTensor(at, op, list[i], listName);
    if (list[i].dtype() != like.dtype() || list[i].sizes() != like.sizes()) {
      rejectCall(at, op, str(listName, " ", i, " ", list[i].describe(), " does not match ", likeName, " ",
                             like.describe()));
    }
  }
}

// `big` holds `size` blocks of `small`'s dtype and element count.
void checkBlocks(const CpuCallSite& at, const char* op, const Tensor& big, const Tensor& small, const char* bigName,
                 const char* smallName) {
  checkTensor(at, op, big, bigName);
  checkTensor(at, op, small, smallName);
  if (big.dtype() != small.dtype() || big.numel() != small.numel() * at.size) {
    rejectCall(at, op, str(bigName, " ", big.describe(), " must hold ", at.size, " x ", small.numel(), " ",
                           toString(small.dtype()), " elements (group size x ", smallName, " ", small.describe(), ")"));
  }
}

CollectiveFingerprint fingerprintOf(std::vector<TensorSignature> tensors, std::optional<ReduceOp> reduceOp = std::nullopt,
                                    std::optional<int> root = std::nullopt) {
  CollectiveFingerprint fp;
  fp.tensors = std::move(tensors);
  fp.reduceOp = reduceOp;
  fp.root = root;
  return fp;
}

// Rows per rank from split sizes (empty: equal splits of `rows`).
std::vector<int64_t> resolveSplits(const CpuCallSite& at, const std::vector<int64_t>& splits, int64_t rows,
                                   const char* what) {
  if (splits.empty()) {
    if (rows % at.size != 0) {
      rejectCall(at, "allToAllSingle", str(what, " has ", rows, " rows along dim 0, which ", at.size,
                                           " ranks cannot share equally; pass split sizes"));
    }
    return std::vector<int64_t>(static_cast<size_t>(at.size), rows / at.size);
  }
  if (static_cast<int>(splits.size()) != at.size) {
    rejectCall(at, "allToAllSingle", str(what, " split sizes list ", splits.size(), " entries for a group of size ", at.size));
  }
  int64_t total = 0;
  for (int64_t s : splits) {
    if (s < 0) rejectCall(at, "allToAllSingle", str(what, " split sizes [", join(splits, ", "), "] has a negative entry"));
    total += s;
  }
  if (total != rows) {
    rejectCall(at, "allToAllSingle", str(what, " split sizes [", join(splits, ", "), "] add up to ", total, " rows, but the ",
                                         what, " has ", rows, " along dim 0"));
  }
  return splits;
}

}  // namespace

CollectiveFingerprint checkAllreduce(const CpuCallSite& at, const std::vector<Tensor>& tensors, const AllreduceOptions& o) {
  checkList(at, "allreduce", tensors);
  checkReduceOp(at, "allreduce", tensors[0].dtype(), o.reduceOp);  // now, not on the worker
  return fingerprintOf(signatures(tensors), o.reduceOp);
}

CollectiveFingerprint checkBroadcast(const CpuCallSite& at, const std::vector<Tensor>& tensors, const BroadcastOptions& o) {
  checkList(at, "broadcast", tensors);
  checkRoot(at, "broadcast", o.root);
  return fingerprintOf(signatures(tensors), std::nullopt, o.root);
}

CollectiveFingerprint checkAllgather(const CpuCallSite& at, const std::vector<Tensor>& outputs, const Tensor& input) {
  checkTensor(at, "allgather", input, "the input");
  checkCount(at, "allgather", outputs, "output");
  checkAllLike(at, "allgather", outputs, input, "output", "input");
  return fingerprintOf({{input.dtype(), input.sizes()}});
}

CollectiveFingerprint checkReduceScatter(const CpuCallSite& at, const Tensor& output, const std::vector<Tensor>& inputs,
                                         const ReduceScatterOptions& o) {
  checkTensor(at, "reduceScatter", output, "the output");
  checkCount(at, "reduceScatter", inputs, "input");
  checkAllLike(at, "reduceScatter", inputs, output, "input", "output");
  checkReduceOp(at, "reduceScatter", output.dtype(), o.reduceOp);
  return fingerprintOf({{output.dtype(), output.sizes()}}, o.reduceOp);
}

CollectiveFingerprint checkReduce(const CpuCallSite& at, const std::vector<Tensor>& tensors, const ReduceOptions& o) {
  checkList(at, "reduce", tensors);
  checkRoot(at, "reduce", o.root);
  checkReduceOp(at, "reduce", tensors[0].dtype(), o.reduceOp);
  return fingerprintOf(signatures(tensors), o.reduceOp, o.root);
}

CollectiveFingerprint checkAllToAll(const CpuCallSite& at, const std::vector<Tensor>& outputs,
                                    const std::vector<Tensor>& inputs) {
  checkCount(at, "allToAll", inputs, "input");
  checkCount(at, "allToAll", outputs, "output");
  for (const auto& t : inputs) {
    checkTensor(at, "allToAll", t, "an input");
    if (t.dtype() != inputs[0].dtype()) rejectCall(at, "allToAll", "inputs must share one dtype");
  }
  for (const auto& t : outputs) {
    checkTensor(at, "allToAll", t, "an output");
    if (t.dtype() != inputs[0].dtype()) {
      rejectCall(at, "allToAll", str("output ", t.describe(), " has another dtype than input ", inputs[0].describe()));
    }
  }
  return fingerprintOf(signatures(inputs));
}

CollectiveFingerprint checkGather(const CpuCallSite& at, const std::vector<Tensor>& outputs, const Tensor& input,
                                  const GatherOptions& o) {
  checkRoot(at, "gather", o.root);
  checkTensor(at, "gather", input, "the input");
  if (at.rank == o.root) {
    checkCount(at, "gather", outputs, "output");
    checkAllLike(at, "gather", outputs, input, "output", "input");
  } else if (!outputs.empty()) {
    rejectCall(at, "gather", str("only the root (rank ", o.root, ") passes outputs; this rank passed ", outputs.size()));
  }
  return fingerprintOf({{input.dtype(), input.sizes()}}, std::nullopt, o.root);
}

CollectiveFingerprint checkScatter(const CpuCallSite& at, const Tensor& output, const std::vector<Tensor>& inputs,
                                   const ScatterOptions& o) {
  checkRoot(at, "scatter", o.root);
  checkTensor(at, "scatter", output, "the output");
  if (at.rank == o.root) {
    checkCount(at, "scatter", inputs, "input");
    checkAllLike(at, "scatter", inputs, output, "input", "output");
  } else if (!inputs.empty()) {
    rejectCall(at, "scatter", str("only the root (rank ", o.root, ") passes inputs; this rank passed ", inputs.size()));
  }
  return fingerprintOf({{output.dtype(), output.sizes()}}, std::nullopt, o.root);
}

CollectiveFingerprint checkAllgatherIntoTensor(const CpuCallSite& at, const Tensor& output, const Tensor& input) {
  checkBlocks(at, "allgatherIntoTensor", output, input, "output", "input");
  return fingerprintOf({{input.dtype(), input.sizes()}});
}

CollectiveFingerprint checkReduceScatterTensor(const CpuCallSite& at, const Tensor& output, const Tensor& input,
                                               const ReduceScatterOptions& o) {
  checkBlocks(at, "reduceScatterTensor", input, output, "input", "output");
  checkReduceOp(at, "reduceScatterTensor", output.dtype(), o.reduceOp);
  return fingerprintOf({{output.dtype(), output.sizes()}}, o.reduceOp);
}

CollectiveFingerprint checkAllToAllSingle(const CpuCallSite& at, const Tensor& output, const Tensor& input,
                                          const std::vector<int64_t>& outputSplits,
                                          const std::vector<int64_t>& inputSplits, AllToAllSplits& splits) {
  const char* op = "allToAllSingle";
  checkTensor(at, op, input, "the input");
  checkTensor(at, op, output, "the output");
  if (input.dim() == 0 || output.dim() == 0) rejectCall(at, op, "input and output need a dim 0 to split along");
  const Shape rowIn(input.sizes().begin() + 1, input.sizes().end());
  const Shape rowOut(output.sizes().begin() + 1, output.sizes().end());
  if (input.dtype() != output.dtype() || rowIn != rowOut) {
    rejectCall(at, op, str("output ", output.describe(), " and input ", input.describe(),
                           " need one dtype and the same sizes after dim 0"));
  }
  splits.sendRows = resolveSplits(at, inputSplits, input.size(0), "input");
  splits.recvRows = resolveSplits(at, outputSplits, output.size(0), "output");
  splits.rowBytes = static_cast<size_t>(shapeNumel(rowIn)) * itemSize(input.dtype());
  return fingerprintOf({{input.dtype(), input.sizes()}});
}

void checkPointToPoint(const CpuCallSite& at, const char* op, const std::vector<Tensor>& tensors, int peer) {
  checkList(at, op, tensors);
  for (const auto& t : tensors) {
    if (t.dtype() != tensors[0].dtype()) rejectCall(at, op, "tensors must share one dtype");
  }
  if (peer < 0 || peer >= at.size || peer == at.rank) {
    rejectCall(at, op, str("peer rank ", peer, " must be another rank of the group (size ", at.size, ")"));
  }
}

std::vector<Tensor> blocksOf(const Tensor& flat, int size, const Shape& block) {
  const int64_t n = shapeNumel(block);
  const Tensor all = flat.view({flat.numel()});
  std::vector<Tensor> blocks;
  blocks.reserve(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) blocks.push_back(all.narrow(0, r * n, n).view(block));
  return blocks;
}

void copyBackInto(const std::vector<Tensor>& targets, const std::vector<Tensor>& results) {
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i].isSameAs(results[i])) continue;
    Tensor target = targets[i];
    target.copy_(results[i]);
  }
}

std::vector<Tensor> rowsOf(const Tensor& t, const std::vector<int64_t>& rows) {
  std::vector<Tensor> parts;
  parts.reserve(rows.size());
  int64_t offset = 0;
  for (int64_t n : rows) {
    parts.push_back(t.narrow(0, offset, n));
    offset += n;
  }
  return parts;
}

}  // namespace dt
