#include "checkpoint/nested_state.h"

#include <algorithm>
#include <utility>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/autograd.h"

namespace dt {
namespace {

// The inner part's view of a source holding global tensors: each mapped tensor at its local
// shape, its local elements read from their runs in the global tensor.
class NestedSource final : public StateSource {
 public:
  NestedSource(const StateSource& base, const OuterPlacementOf& outer, std::string prefix)
      : base_(base), outer_(outer), head_(prefix.empty() ? "" : prefix + ".") {}

  std::string describe() const override { return base_.describe(); }
  int64_t step() const override { return base_.step(); }
  int worldSize() const override { return base_.worldSize(); }
  const std::map<std::string, std::string>& metadata() const override { return base_.metadata(); }

  std::vector<StateTensorInfo> tensors() const override {
    std::vector<StateTensorInfo> out = base_.tensors();
    for (StateTensorInfo& info : out) localize(info);
    return out;
  }
  std::optional<StateTensorInfo> find(const std::string& name) const override {
    std::optional<StateTensorInfo> info = base_.find(name);
    if (info) localize(*info);
    return info;
  }
  void read(const std::string& name, int64_t offset, Tensor& dst, int rank) const override {
    const std::optional<OuterPlacement> outer = outerOf(name);
    const std::optional<StateTensorInfo> info = base_.find(name);
    if (!outer || outer->layout.placement != Placement::Sharded || !info || info->shape != outer->layout.shape) {
      base_.read(name, offset, dst, rank);
      return;
    }
    NoGradGuard noGrad;
    Tensor flat = dst.isContiguous() ? dst.view({-1}) : empty({dst.numel()}, dst.dtype(), dst.device());
    int64_t at = 0;
    for (const GlobalRuns& runs : globalRunsOf(outer->layout, shapeNumel(outer->localShape), offset, dst.numel())) {
      Tensor slice = flat.narrow(0, at, runs.count);
      readRuns(base_, name, runs.offset, runs.stride, runs.repeats, slice);
      at += runs.count;
    }
    if (!dst.isContiguous()) dst.copy_(flat.view(dst.sizes()));
  }
  Tensor adoptable(const std::string& name) const override {
    const std::optional<OuterPlacement> outer = outerOf(name);
    return outer && outer->layout.placement == Placement::Sharded ? Tensor() : base_.adoptable(name);
  }

 private:
  std::optional<OuterPlacement> outerOf(const std::string& name) const {
    if (!name.starts_with(head_)) return std::nullopt;
    return outer_(name.substr(head_.size()));
  }
  // A global tensor of the mapped shape shows as its local shape (written whole by one process
  // or in pieces alike). Another shape stays as it is: an optimizer's step count under the
  // parameter's name, or a tensor of another model, which the inner part names as a mismatch.
  void localize(StateTensorInfo& info) const {
    const std::optional<OuterPlacement> outer = outerOf(info.name);
    if (!outer || outer->layout.placement != Placement::Sharded || info.placement == Placement::PerRank ||
        info.shape != outer->layout.shape) {
      return;
    }
    info.shape = outer->localShape;
  }

  const StateSource& base_;
  const OuterPlacementOf& outer_;
  std::string head_;
};

class NestedPart final : public StateProvider {
 public:
  NestedPart(std::shared_ptr<StateProvider> inner, OuterPlacementOf outer)
      : inner_(std::move(inner)), outer_(std::move(outer)) {}

  std::vector<StateTensor> collect() override {
    std::vector<StateTensor> out;
    for (StateTensor& t : inner_->collect()) {
      const std::optional<OuterPlacement> outer = outer_(t.name);
      if (!outer || t.placement == Placement::PerRank) {
        out.push_back(std::move(t));
        continue;
      }
      const ParameterLayout& global = outer->layout;
      if (global.placement != Placement::Sharded) {
        if (t.placement == Placement::Sharded && !outer->writesShards) continue;
        out.push_back(std::move(t));
        continue;
      }
      if (t.shape != outer->localShape) {  // not the tensor's elements (an optimizer's step count)
        out.push_back(std::move(t));
        continue;
      }
      if (t.placement == Placement::Replicated && !outer->writesReplicated) continue;
      if (t.repeats > 1) {
        throw NotSupportedError(str("nestedState: \"", t.name, "\" is a strided shard (", t.repeats,
                                    " runs) of its local tensor, which cannot be placed inside another layout"));
      }
      if (!t.local.isContiguous()) {
        throw InvalidArgument(str("nestedState: \"", t.name, "\" (", t.local.describe(), ") is not contiguous"));
      }
      const int64_t begin = t.placement == Placement::Sharded ? t.offset : 0;
      const Tensor flat = t.local.view({-1});
      int64_t at = 0;
      for (const GlobalRuns& runs : globalRunsOf(global, shapeNumel(outer->localShape), begin, flat.numel())) {
        out.push_back({t.name, Placement::Sharded, global.shape, runs.offset, flat.narrow(0, at, runs.count), runs.stride,
                       runs.repeats});
        at += runs.count;
      }
    }
    return out;
  }

  void restore(const StateSource& source, const std::string& prefix, const RestoreContext& context) override {
    const NestedSource nested(source, outer_, prefix);
    inner_->restore(nested, prefix, context);
  }

 private:
  std::shared_ptr<StateProvider> inner_;
  OuterPlacementOf outer_;
};

}  // namespace

std::vector<GlobalRuns> globalRunsOf(const ParameterLayout& layout, int64_t localNumel, int64_t begin, int64_t count) {
  const int64_t repeats = std::max<int64_t>(layout.repeats, 1);
  if (begin < 0 || count < 0 || begin + count > localNumel || localNumel % repeats != 0) {
    throw InvalidArgument(str("nestedState: elements [", begin, ", ", begin + count, ") of \"", layout.name, "\" (",
                              localNumel, " elements held here in ", repeats, " runs) do not fit"));
  }
  std::vector<GlobalRuns> out;
  if (count == 0) return out;
  if (repeats == 1) return {{layout.offset + begin, 0, 1, count}};
  const int64_t run = localNumel / repeats;
  const auto globalAt = [&](int64_t local) { return layout.offset + (local / run) * layout.stride + local % run; };
  int64_t at = begin;
  const int64_t end = begin + count;
  if (at % run != 0 || end - at < run) {  // the part of the run it starts in
    const int64_t n = std::min(run - at % run, end - at);
    out.push_back({globalAt(at), 0, 1, n});
    at += n;
  }
  if (const int64_t whole = (end - at) / run; whole > 0) {  // whole runs, at a run's start
    out.push_back({globalAt(at), whole > 1 ? layout.stride : 0, whole, whole * run});
    at += whole * run;
  }
  if (at < end) out.push_back({globalAt(at), 0, 1, end - at});  // the part of the run it ends in
  return out;
}

std::shared_ptr<StateProvider> nestedState(std::shared_ptr<StateProvider> inner, OuterPlacementOf outer) {
  if (!inner || !outer) throw InvalidArgument("nestedState: the inner part and the placement function must be set");
  return std::make_shared<NestedPart>(std::move(inner), std::move(outer));
}

}  // namespace dt
