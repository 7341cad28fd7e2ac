// A part's state whose tensors are themselves pieces of larger ones: a data-parallel sharded
// wrapper (ZeRO, the fully sharded wrapper) over a tensor-parallel model sees each parameter as
// the whole of its TP shard, while the checkpoint must hold the global tensor, so that it loads
// at another (TP, DP) shape. `nestedState` maps the inner part's tensors into the global ones.
//
//   auto outer = [&](const std::string& name) { ... tensorParallelLayout of the parameter ... };
//   state.add("model", dt::nestedState(fsdp.modelState(), outer));
//   state.add("optim", dt::nestedState(dt::optimizerState(adam, fsdp.parameterMap()), outer));
//
// Mapping (collect): an inner tensor named N whose shape is the OuterPlacement's localShape is
// elements of the local tensor; the local tensor's elements sit in the global tensor as
// `layout` says (one run, or `repeats` equal runs every `stride` of a tensor-parallel block), so
// an inner run [a, a + n) of the local tensor becomes up to three Sharded pieces of the global
// tensor under the same name: the part of a run it starts in, the whole runs it covers (one
// strided piece), the part of a run it ends in. A checkpoint, encoded bytes and
// redistributeState carry several pieces of one name from one rank.
//  * Inner Replicated (the same on every rank of the inner group, e.g. ZeRO's parameters):
//    written as pieces by the rank whose OuterPlacement says writesReplicated (the inner
//    group's replica 0), dropped elsewhere. When the outer layout is Replicated it stays as
//    it is (one Replicated tensor).
//  * Inner Sharded (each rank of the inner group holds other elements): every rank's pieces,
//    unless the outer layout is Replicated (every outer rank holds the same local tensor) and
//    writesShards is false (outer ranks other than the first).
//  * Tensors without an OuterPlacement, or whose shape is not the localShape of a Sharded
//    layout (an optimizer's step count), pass through unchanged.
// Restore: the inner part reads from a source that shows each mapped tensor at its local shape
// and reads the local elements it asks for from their runs in the global tensor; names,
// strictness and errors are the inner part's.
//
// Contract: `outer` is called with the tensors' names inside the part (a model's parameter
// path; for an optimizer part "<parameter>.<state>", which `outer` may map by the parameter);
// it must answer the same on every call. Inner strided shards (repeats > 1) are refused with
// NotSupportedError naming the tensor. No communication beyond the inner part's own; not
// thread-safe; the inner part is shared.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/state.h"

namespace dt {

struct OuterPlacement {
  Shape localShape;        // the tensor as the inner part holds it (unused for a Replicated layout)
  ParameterLayout layout;  // where the local tensor's elements sit in the global tensor
  bool writesReplicated = true;  // inner Replicated tensors under a Sharded layout: this rank writes them
  bool writesShards = true;      // inner Sharded tensors under a Replicated layout: this rank writes its pieces
};

using OuterPlacementOf = std::function<std::optional<OuterPlacement>(const std::string& name)>;

std::shared_ptr<StateProvider> nestedState(std::shared_ptr<StateProvider> inner, OuterPlacementOf outer);

// The pieces of the global tensor that elements [begin, begin + count) of a local tensor placed
// by `layout` (offset, stride, repeats over `localNumel` elements) occupy, in local order: each
// as (global offset, stride, repeats, elements). For tests and the mapping above.
struct GlobalRuns {
  int64_t offset = 0;
  int64_t stride = 0;
  int64_t repeats = 1;
  int64_t count = 0;
};
std::vector<GlobalRuns> globalRunsOf(const ParameterLayout& layout, int64_t localNumel, int64_t begin, int64_t count);

// TrainingState::addOptimizer's part on its own, for wrapping.
std::shared_ptr<StateProvider> optimizerState(optim::Optimizer& optimizer, ParameterMap parameters);

}  // namespace dt
