#include "collectives/coalesce.h"

#include <cstring>

#include "common/check.h"
#include "common/strings.h"

namespace dt {
namespace {

void checkSameKind(const std::vector<Tensor>& tensors, const char* what) {
  for (size_t i = 1; i < tensors.size(); ++i) {
    DT_CHECK(tensors[i].dtype() == tensors[0].dtype() && tensors[i].device() == tensors[0].device(), what,
             ": tensor ", i, " is ", tensors[i].describe(), " on ", tensors[i].device().str(),
             " but tensor 0 is ", tensors[0].describe(), " on ", tensors[0].device().str(),
             "; all tensors of one call must share dtype and device");
  }
}

}  // namespace

int64_t totalNumel(const std::vector<Tensor>& tensors) {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  return total;
}

void copyToBytes(const Tensor& src, void* dst) {
  if (src.numel() == 0) return;
  if (src.isContiguous()) {
    std::memcpy(dst, src.dataPtr(), src.nbytes());
    return;
  }
  Tensor view = emptyStrided(src.sizes(), contiguousStrides(src.sizes()), src.dtype(), src.device());
  view.copy_(src);
  std::memcpy(dst, view.dataPtr(), src.nbytes());
}

void copyFromBytes(const void* src, Tensor& dst) {
  if (dst.numel() == 0) return;
  if (dst.isContiguous()) {
    std::memcpy(dst.dataPtr(), src, dst.nbytes());
    return;
  }
  Tensor tmp = empty(dst.sizes(), dst.dtype(), dst.device());
  std::memcpy(tmp.dataPtr(), src, dst.nbytes());
  dst.copy_(tmp);
}

Tensor flattenTensors(const std::vector<Tensor>& tensors) {
  DT_CHECK(!tensors.empty(), "flattenTensors: empty tensor list");
  checkSameKind(tensors, "flattenTensors");
  Tensor flat = empty({totalNumel(tensors)}, tensors[0].dtype(), tensors[0].device());
  auto* out = static_cast<char*>(flat.dataPtr());
  for (const auto& t : tensors) {
    copyToBytes(t, out);
    out += t.nbytes();
  }
  return flat;
}

void unflattenInto(const Tensor& flat, const std::vector<Tensor>& tensors) {
  if (tensors.empty()) return;
  checkSameKind(tensors, "unflattenInto");
  DT_CHECK(flat.dtype() == tensors[0].dtype(), "unflattenInto: flat buffer is ", flat.describe(),
           " but the tensors are ", toString(tensors[0].dtype()));
  DT_CHECK_EQ(flat.numel(), totalNumel(tensors), "unflattenInto: flat buffer size vs the tensors' total");
  Tensor src = flat.contiguous();
  const auto* in = static_cast<const char*>(src.dataPtr());
  for (auto t : tensors) {
    copyFromBytes(in, t);
    in += t.nbytes();
  }
}

}  // namespace dt
