// The training state: one definition of everything a run needs to continue (model, optimizer
// state, random-number streams, step, sampler position and the user's own values), used both
// for checkpoints (checkpoint/checkpoint_dir.h) and for sending the state to another process
// (checkpoint/transfer.h: a byte buffer, or a broadcast over a process group).
//
//   dt::TrainingState state(group->rank(), group->size());
//   state.addModule("model", *model);                                 // replicated tensors
//   state.addOptimizer("optim", optimizer, dt::ParameterMap::replicated(*model));
//   state.addGenerator("rng", dropoutRng);                            // one stream per rank
//   state.step = step;
//   state.metadata["epoch"] = std::to_string(epoch);
//   checkpoints.save(state, *group);            ...   checkpoints.load(ref, state, group.get());
//
// Vocabulary:
//  * A StateTensor is one tensor of the state as this rank holds it: its name, its global
//    shape and how it is placed. Replicated: every rank holds the same whole tensor (one copy
//    is saved). Sharded: each rank holds a different run of elements of the tensor flattened
//    in row-major order (`offset`, `local.numel()`), and the runs of all ranks cover it: a
//    dim-0 shard is the run of its rows. A strided shard (`repeats` > 1: a tensor-parallel
//    block of a later dimension, or of each part of a fused q/k/v projection) is `repeats`
//    equal runs, the i-th starting at offset + i * stride, held one after another. PerRank: each rank holds its own value of the same
//    shape (random-number streams); all ranks' values are saved.
//  * A StateProvider is one part of the state (a module, an optimizer, a sharded model):
//    collect() lists its tensors as views of the live state, without copies; restore()
//    fills the live state from a StateSource in place, reading only the elements this rank
//    holds now, whatever the placement and world size the source was written with: this is
//    where a checkpoint written at world 4 is resharded for world 2 or 3.
//  * A StateSource answers "which tensors, which global shapes, and elements [a, b) of this
//    one": a checkpoint on disk, bytes received from another process, tensors broadcast.
//  * A ParameterMap says, for each parameter tensor an optimizer updates, which global
//    parameter (name, shape) it is and which of its elements it holds (a sharded wrapper's
//    shard holds a run; a replicated model's parameter holds all). The optimizer's state
//    tensors are placed like their parameter.
//
// Contract:
//  * Names are "<prefix>.<name inside the part>" (the module's parameter paths, the
//    optimizer's "<parameter>.<state>" such as "optim.h.0.attn.c_attn.weight.exp_avg") and
//    must be unique, except that one rank may hold several Sharded pieces of one tensor
//    (nestedState's runs, checkpoint/nested_state.h); collect() throws InvalidArgument naming
//    any other duplicate.
//  * restore() is strict: a tensor the live state needs that the source lacks, or whose
//    global shape differs, throws InvalidArgument naming the tensor, both shapes and the
//    source; so does a source tensor under a module's prefix that the module does not have.
//    A part whose state cannot be carried over exactly (a random stream written by another
//    world size) leaves it as it is and says so in notes().
//  * The objects added (module, optimizer, generator) are held by reference and must outlive
//    the TrainingState. Not thread-safe; collect/restore run on the calling thread and do no
//    communication (saving and loading, in checkpoint_dir.h, are the collectives).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "tensor/generator.h"
#include "tensor/nn/module.h"
#include "tensor/optim/optim.h"
#include "tensor/tensor.h"

namespace dt {

enum class Placement : uint8_t { Replicated, Sharded, PerRank };
// "replicated", "sharded", "per_rank" and back (InvalidArgument naming `what` otherwise).
const char* placementName(Placement placement);
Placement placementFromName(const std::string& name, const std::string& what);

struct StateTensor {
  std::string name;
  Placement placement = Placement::Replicated;
  Shape shape;         // the global shape (PerRank: the shape of each rank's value)
  int64_t offset = 0;  // Sharded: the first element, row-major over `shape`, that `local` holds
  Tensor local;        // the elements this rank holds (any device; saved as a host copy)
  // Sharded: local holds `repeats` runs of local.numel() / repeats elements, run i from
  // offset + i * stride (repeats 1: one run; stride unused).
  int64_t stride = 0;
  int64_t repeats = 1;
};

struct StateTensorInfo {
  std::string name;
  Placement placement = Placement::Replicated;
  Shape shape;
  DType dtype = DType::Float32;
};

class StateSource {
 public:
  virtual ~StateSource() = default;
  // For messages: "checkpoint /ck/step-00000500.json", "state received from rank 0".
  virtual std::string describe() const = 0;
  virtual int64_t step() const = 0;
  // The world size of the run that wrote it.
  virtual int worldSize() const = 0;
  virtual const std::map<std::string, std::string>& metadata() const = 0;
  virtual std::vector<StateTensorInfo> tensors() const = 0;
  virtual std::optional<StateTensorInfo> find(const std::string& name) const = 0;
  // Elements [offset, offset + dst.numel()) of tensor `name` (row-major over its global
  // shape; PerRank: of rank `rank`'s value) into dst, converting dtype and device as
  // copy_ does. InvalidArgument names the tensor and the range when the source lacks it.
  virtual void read(const std::string& name, int64_t offset, Tensor& dst, int rank = 0) const = 0;
  // The whole tensor `name` (its global shape) when the source holds it in host memory of its
  // own that nothing else uses (bytes just received), so that a part creating a new tensor
  // for it may keep that memory instead of allocating and copying; an undefined Tensor
  // otherwise (read() instead). Sources backed by files return undefined.
  virtual Tensor adoptable(const std::string& /*name*/) const { return {}; }
};

// Where restore() runs: this rank's place in the group the state is restored for.
struct RestoreContext {
  int rank = 0;
  int worldSize = 1;
  std::vector<std::string>* notes = nullptr;  // restore() appends what it could not carry over exactly
};

class StateProvider {
 public:
  virtual ~StateProvider() = default;
  // This part's tensors, named inside the part (no prefix): views of the live state.
  virtual std::vector<StateTensor> collect() = 0;
  // Fills the live state from `source`, where this part's tensors are named "<prefix>.<name>".
  virtual void restore(const StateSource& source, const std::string& prefix, const RestoreContext& context) = 0;
};

struct ParameterLayout {
  std::string name;                             // the model's parameter path ("h.0.attn.c_attn.weight")
  Placement placement = Placement::Replicated;  // Replicated or Sharded
  Shape shape;                                  // the global parameter's shape
  int64_t offset = 0;                           // Sharded: the first element held
  int64_t count = -1;  // elements held (-1: the whole tensor); the tensor may hold padding after them
  // A strided shard (StateTensor's stride and repeats): the whole tensor holds `repeats` runs.
  int64_t stride = 0;
  int64_t repeats = 1;
  // Another rank holds the same elements and saves them (a data-parallel replica of a
  // tensor-parallel shard): this rank's copy is left out of collect(); restore reads as usual.
  bool savedByAnotherRank = false;
};

class ParameterMap {
 public:
  void add(const Tensor& parameter, ParameterLayout layout);
  // InvalidArgument naming `index` (the optimizer's numbering) when the tensor is not mapped.
  const ParameterLayout& of(const Tensor& parameter, size_t index) const;
  size_t size() const { return layouts_.size(); }
  // Every parameter of `module` as a whole, replicated tensor named by its path.
  static ParameterMap replicated(const nn::Module& module);

 private:
  std::unordered_map<const void*, ParameterLayout> layouts_;
};

// The part addModule() adds: every parameter and buffer of `module`, replicated.
std::shared_ptr<StateProvider> moduleState(nn::Module& module);

// What parts do in restore(): `name` must be in the source with `globalShape` (InvalidArgument
// naming the tensor, both shapes and the source otherwise); its elements from `offset` (rank's
// value, for a per-rank tensor) are copied into dst in place, bumping dst's version.
void restoreTensor(const StateSource& source, const std::string& name, const Shape& globalShape, int64_t offset,
                   Tensor& dst, int rank = 0);
// restoreTensor for a shard of `repeats` runs (readRuns), dst filled in place, its version bumped.
void restoreRuns(const StateSource& source, const std::string& name, const Shape& globalShape, int64_t offset,
                 int64_t stride, int64_t repeats, Tensor& dst);
// Elements of `name` into dst (any layout) as a shard of `repeats` runs holds them: run i of
// dst.numel() / repeats elements from offset + i * stride (repeats 1: source.read(name, offset)).
void readRuns(const StateSource& source, const std::string& name, int64_t offset, int64_t stride, int64_t repeats,
              Tensor& dst);
// InvalidArgument naming the first source tensor under "<prefix>." that `expected` lacks
// (`what`: "model", for the message).
void requireNoOthers(const StateSource& source, const std::string& prefix, const std::vector<std::string>& expected,
                     const std::string& what);

// The elements of `tensor` that `layout` says it holds, as a view: the tensor itself, or its
// first `count` elements (whole leading rows when they fit, else flat).
Tensor heldElements(const Tensor& tensor, const ParameterLayout& layout);

class TrainingState {
 public:
  explicit TrainingState(int rank = 0, int worldSize = 1);
  int rank() const { return rank_; }
  int worldSize() const { return worldSize_; }

  int64_t step = 0;
  // Sampler position, settings, anything the run wants back; saved as strings.
  std::map<std::string, std::string> metadata;

  // Every parameter and buffer of `module` (stateDict order), replicated.
  TrainingState& addModule(const std::string& prefix, nn::Module& module);
  // The optimizer's per-parameter state, placed as `parameters` places each parameter.
  TrainingState& addOptimizer(const std::string& prefix, optim::Optimizer& optimizer, ParameterMap parameters);
  // One stream per rank (int64 [4]: GeneratorState::toWords). Restored only from a source
  // written by the same world size (else the stream stays where it is, and notes() says so).
  TrainingState& addGenerator(const std::string& name, Generator& generator);
  // One tensor as it is (restored in place; Sharded needs `offset`).
  TrainingState& addTensor(const std::string& name, Tensor tensor, Placement placement = Placement::Replicated,
                           Shape globalShape = {}, int64_t offset = 0);
  TrainingState& add(const std::string& prefix, std::shared_ptr<StateProvider> part);

  // Every part's tensors with their full names, in the order the parts were added.
  std::vector<StateTensor> collect() const;
  // step and metadata from the source, then every part in order (see the contract).
  void restore(const StateSource& source);
  const std::vector<std::string>& notes() const { return notes_; }

 private:
  int rank_;
  int worldSize_;
  std::vector<std::pair<std::string, std::shared_ptr<StateProvider>>> parts_;
  std::vector<std::string> notes_;
};

}  // namespace dt
