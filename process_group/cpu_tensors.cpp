#include "process_group/cpu_tensors.h"

#include <algorithm>

#include "collectives/coalesce.h"
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

}  // namespace dt
