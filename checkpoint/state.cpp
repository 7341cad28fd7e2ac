#include "checkpoint/state.h"

#include <map>
#include <set>
#include <utility>

#include "checkpoint/nested_state.h"
#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/autograd.h"

namespace dt {
namespace {

std::string joinName(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

StateTensorInfo require(const StateSource& source, const std::optional<StateTensorInfo>& info,
                               const std::string& name) {
  if (!info) {
    throw InvalidArgument(str(source.describe(), " has no tensor \"", name, "\" (it holds ", source.tensors().size(),
                              " tensors); was it written for another model or optimizer?"));
  }
  return *info;
}

void requireShape(const StateSource& source, const StateTensorInfo& info, const Shape& shape) {
  if (info.shape != shape) {
    throw InvalidArgument(str(source.describe(), ": tensor \"", info.name, "\" is ", describeShape(info.shape),
                              " there but ", describeShape(shape), " here; was it written for another model?"));
  }
}

// Every parameter and buffer, replicated, filled in place.
class ModulePart final : public StateProvider {
 public:
  explicit ModulePart(nn::Module& module) : module_(module) {}

  std::vector<StateTensor> collect() override {
    std::vector<StateTensor> out;
    for (const auto& [name, t] : module_.stateDict()) out.push_back({name, Placement::Replicated, t.sizes(), 0, t});
    return out;
  }

  void restore(const StateSource& source, const std::string& prefix, const RestoreContext&) override {
    std::vector<std::string> expected;
    for (auto& [name, t] : module_.stateDict()) {
      expected.push_back(joinName(prefix, name));
      Tensor target = t;
      restoreTensor(source, expected.back(), t.sizes(), 0, target);
    }
    requireNoOthers(source, prefix, expected, "model");
  }

 private:
  nn::Module& module_;
};

// The optimizer's per-parameter state "state.<i>.<name>", renamed "<parameter>.<name>" and
// placed like the parameter (the step counters are replicated scalars).
class OptimizerPart final : public StateProvider {
 public:
  OptimizerPart(optim::Optimizer& optimizer, ParameterMap parameters)
      : optimizer_(optimizer), parameters_(std::move(parameters)) {}

  std::vector<StateTensor> collect() override {
    std::vector<StateTensor> out;
    const auto& params = optimizer_.params();
    for (const auto& [key, t] : optimizer_.stateDict()) {
      const auto [index, state] = parseKey(key);
      const ParameterLayout& layout = parameters_.of(params[index], index);
      const std::string name = layout.name + "." + state;
      if (t.sizes() != params[index].sizes()) {  // a scalar such as AdamW's step
        out.push_back({name, Placement::Replicated, t.sizes(), 0, t});
      } else if (!layout.savedByAnotherRank) {
        out.push_back({name, layout.placement, layout.shape, layout.offset, heldElements(t, layout), layout.stride,
                       layout.repeats});
      }
    }
    return out;
  }

  void restore(const StateSource& source, const std::string& prefix, const RestoreContext&) override {
    const auto& params = optimizer_.params();
    // The source's state names per parameter name ("<parameter>.<state>", states have no dot).
    std::map<std::string, std::vector<StateTensorInfo>> byParameter;
    const std::string head = prefix.empty() ? "" : prefix + ".";
    for (const auto& info : source.tensors()) {
      if (!info.name.starts_with(head)) continue;
      const std::string rest = info.name.substr(head.size());
      const auto dot = rest.rfind('.');
      if (dot == std::string::npos) continue;
      byParameter[rest.substr(0, dot)].push_back(info);
    }
    // The state the optimizer holds now is restored in place; new state is made here (or
    // taken from the source's own memory) and handed over without another copy.
    std::map<std::string, Tensor> live;
    for (auto& [key, t] : optimizer_.stateDict()) live.emplace(key, t);
    NamedTensors state;
    size_t used = 0;
    NoGradGuard noGrad;
    for (size_t i = 0; i < params.size(); ++i) {
      const ParameterLayout& layout = parameters_.of(params[i], i);
      auto it = byParameter.find(layout.name);
      if (it == byParameter.end()) continue;  // no state yet for this parameter (never stepped)
      ++used;
      for (const StateTensorInfo& info : it->second) {
        const std::string stateName = info.name.substr(head.size() + layout.name.size() + 1);
        const std::string key = str("state.", i, ".", stateName);
        Tensor value;
        if (info.shape == layout.shape) {
          value = reusable(live, key, params[i]);
          // Adopting the source's memory needs the parameter to be the whole tensor.
          const bool whole = heldElements(params[i], layout).numel() == params[i].numel() && layout.repeats == 1;
          const bool global = shapeNumel(layout.shape) == params[i].numel();
          if (!value.defined() && whole && global) value = adopted(source, info.name, params[i]);
          if (value.defined() && !whole) value.zero_();
          if (!value.defined()) value = zerosLike(params[i]);  // padding beyond the held elements stays zero
          Tensor held = heldElements(value, layout);
          readRuns(source, info.name, layout.placement == Placement::Sharded ? layout.offset : 0, layout.stride,
                   layout.repeats, held);
        } else if (info.placement == Placement::Replicated && info.shape.empty()) {
          const Tensor scalar = zeros({}, info.dtype);  // a scalar: the step count
          value = reusable(live, key, scalar);
          if (!value.defined()) value = scalar;
          source.read(info.name, 0, value);
        } else {
          requireShape(source, info, layout.shape);
        }
        state.emplace_back(key, value);
      }
    }
    if (used != byParameter.size()) {
      std::set<std::string> known;
      for (size_t i = 0; i < params.size(); ++i) known.insert(parameters_.of(params[i], i).name);
      for (const auto& [name, infos] : byParameter) {
        if (!known.count(name)) {
          throw InvalidArgument(str(source.describe(), " holds optimizer state for parameter \"", name,
                                    "\", which this optimizer does not update; was it written for another model?"));
        }
      }
    }
    optimizer_.adoptStateDict(std::move(state));
  }

 private:
  // The optimizer's own tensor for `key` when it can take the restored values in place
  // (shaped, typed and placed as `like`).
  static Tensor reusable(const std::map<std::string, Tensor>& live, const std::string& key, const Tensor& like) {
    auto it = live.find(key);
    if (it == live.end()) return {};
    const Tensor& t = it->second;
    const bool fits = t.sizes() == like.sizes() && t.dtype() == like.dtype() && t.device() == like.device() &&
                      t.isContiguous();
    return fits ? t : Tensor();
  }
  // The source's own memory for tensor `name`, when it fits the parameter (dtype, device).
  static Tensor adopted(const StateSource& source, const std::string& name, const Tensor& param) {
    Tensor t = source.adoptable(name);
    if (!t.defined() || t.dtype() != param.dtype() || t.device() != param.device() || !t.isContiguous()) return {};
    return t.view(param.sizes());
  }

  static std::pair<size_t, std::string> parseKey(const std::string& key) {
    const auto parts = split(key, '.');
    if (parts.size() != 3 || parts[0] != "state") {
      throw InvalidArgument(str("TrainingState: optimizer state key \"", key, "\" is not state.<index>.<name>"));
    }
    return {std::stoul(std::string(parts[1])), std::string(parts[2])};
  }

  optim::Optimizer& optimizer_;
  ParameterMap parameters_;
};

class GeneratorPart final : public StateProvider {
 public:
  explicit GeneratorPart(Generator& generator) : generator_(generator) {}

  std::vector<StateTensor> collect() override {
    const auto w = generator_.state().toWords();
    Tensor words = fromVector<int64_t>({static_cast<int64_t>(w[0]), static_cast<int64_t>(w[1]),
                                        static_cast<int64_t>(w[2]), static_cast<int64_t>(w[3])});
    return {{"", Placement::PerRank, {4}, 0, words}};
  }

  void restore(const StateSource& source, const std::string& prefix, const RestoreContext& context) override {
    const StateTensorInfo info = require(source, source.find(prefix), prefix);
    if (info.placement != Placement::PerRank || info.shape != Shape{4} || info.dtype != DType::Int64) {
      throw InvalidArgument(str(source.describe(), ": \"", prefix, "\" is ", placementName(info.placement), " ",
                                toString(info.dtype), describeShape(info.shape),
                                ", not a per-rank generator state (int64 [4])"));
    }
    if (source.worldSize() != context.worldSize) {
      if (context.notes) {
        context.notes->push_back(str("\"", prefix, "\": written by ", source.worldSize(), " rank(s), restored by ",
                                     context.worldSize, ": each rank's stream stays where it was (not the saved one)"));
      }
      return;
    }
    Tensor words = zeros({4}, DType::Int64);
    source.read(prefix, 0, words, context.rank);
    const auto w = words.toVector<int64_t>();
    generator_.setState(GeneratorState::fromWords({static_cast<uint64_t>(w[0]), static_cast<uint64_t>(w[1]),
                                                   static_cast<uint64_t>(w[2]), static_cast<uint64_t>(w[3])},
                                                  str(source.describe(), " ", prefix, " of rank ", context.rank)));
  }

 private:
  Generator& generator_;
};

class TensorPart final : public StateProvider {
 public:
  TensorPart(Tensor tensor, Placement placement, Shape shape, int64_t offset)
      : tensor_(std::move(tensor)), placement_(placement), shape_(std::move(shape)), offset_(offset) {}

  std::vector<StateTensor> collect() override { return {{"", placement_, shape_, offset_, tensor_}}; }

  void restore(const StateSource& source, const std::string& prefix, const RestoreContext& context) override {
    restoreTensor(source, prefix, shape_, placement_ == Placement::Sharded ? offset_ : 0, tensor_, context.rank);
  }

 private:
  Tensor tensor_;
  Placement placement_;
  Shape shape_;
  int64_t offset_;
};

}  // namespace

void readRuns(const StateSource& source, const std::string& name, int64_t offset, int64_t stride, int64_t repeats,
              Tensor& dst) {
  if (repeats <= 1) {
    source.read(name, offset, dst);
    return;
  }
  if (dst.numel() % repeats != 0) {
    throw InvalidArgument(str("TrainingState: \"", name, "\": ", dst.numel(), " elements held are not ", repeats,
                              " equal runs"));
  }
  NoGradGuard noGrad;
  Tensor flat = dst.isContiguous() ? dst.view({-1}) : empty({dst.numel()}, dst.dtype(), dst.device());
  const int64_t run = dst.numel() / repeats;
  for (int64_t i = 0; i < repeats; ++i) {
    Tensor slice = flat.narrow(0, i * run, run);
    source.read(name, offset + i * stride, slice);
  }
  if (!dst.isContiguous()) dst.copy_(flat.view(dst.sizes()));
}

void restoreRuns(const StateSource& source, const std::string& name, const Shape& globalShape, int64_t offset,
                 int64_t stride, int64_t repeats, Tensor& dst) {
  const StateTensorInfo info = require(source, source.find(name), name);
  requireShape(source, info, globalShape);
  NoGradGuard noGrad;
  readRuns(source, name, offset, stride, repeats, dst);
  dst.bumpVersion();
}

void restoreTensor(const StateSource& source, const std::string& name, const Shape& globalShape, int64_t offset,
                   Tensor& dst, int rank) {
  const StateTensorInfo info = require(source, source.find(name), name);
  requireShape(source, info, globalShape);
  NoGradGuard noGrad;
  source.read(name, offset, dst, rank);
  dst.bumpVersion();
}

void requireNoOthers(const StateSource& source, const std::string& prefix, const std::vector<std::string>& expected,
                     const std::string& what) {
  const std::set<std::string> known(expected.begin(), expected.end());
  const std::string head = prefix.empty() ? "" : prefix + ".";
  for (const auto& info : source.tensors()) {
    if (info.name.starts_with(head) && !known.count(info.name)) {
      throw InvalidArgument(str(source.describe(), " holds \"", info.name, "\", which this ", what,
                                " does not have; was it written for another model?"));
    }
  }
}

const char* placementName(Placement placement) {
  switch (placement) {
    case Placement::Replicated: return "replicated";
    case Placement::Sharded: return "sharded";
    case Placement::PerRank: return "per_rank";
  }
  return "?";
}

Placement placementFromName(const std::string& name, const std::string& what) {
  for (Placement p : {Placement::Replicated, Placement::Sharded, Placement::PerRank}) {
    if (name == placementName(p)) return p;
  }
  throw InvalidArgument(str(what, ": placement \"", name, "\" is not one of replicated, sharded, per_rank"));
}

void ParameterMap::add(const Tensor& parameter, ParameterLayout layout) {
  if (!parameter.defined()) throw InvalidArgument(str("ParameterMap: parameter \"", layout.name, "\" is undefined"));
  if (layout.shape.empty() && layout.placement == Placement::Replicated) layout.shape = parameter.sizes();
  layouts_[parameter.id()] = std::move(layout);
}

const ParameterLayout& ParameterMap::of(const Tensor& parameter, size_t index) const {
  auto it = layouts_.find(parameter.id());
  if (it == layouts_.end()) {
    throw InvalidArgument(str("TrainingState: the optimizer's parameter ", index, " (", parameter.describe(),
                              ") is not in the ParameterMap given with it (", layouts_.size(),
                              " parameters); build the optimizer on the parameters of the model or wrapper that "
                              "made the map"));
  }
  return it->second;
}

ParameterMap ParameterMap::replicated(const nn::Module& module) {
  ParameterMap map;
  for (const auto& [name, p] : module.namedParameters()) {
    map.add(p, {name, Placement::Replicated, p.sizes(), 0, -1});
  }
  return map;
}

Tensor heldElements(const Tensor& tensor, const ParameterLayout& layout) {
  const int64_t count = layout.count < 0 ? tensor.numel() : layout.count;
  if (count == tensor.numel()) return tensor;
  if (count > tensor.numel()) {
    throw InvalidArgument(str("TrainingState: parameter \"", layout.name, "\" holds ", count, " elements in a tensor of ",
                              tensor.numel(), " (", tensor.describe(), ")"));
  }
  if (!tensor.isContiguous()) {
    throw InvalidArgument(str("TrainingState: parameter \"", layout.name, "\" (", tensor.describe(),
                              ") is not contiguous; its held elements must be a view"));
  }
  if (tensor.dim() >= 1 && tensor.sizes()[0] > 0) {
    const int64_t row = tensor.numel() / tensor.sizes()[0];
    if (row > 0 && count % row == 0) return tensor.narrow(0, 0, count / row);
  }
  return tensor.view({-1}).narrow(0, 0, count);
}

TrainingState::TrainingState(int rank, int worldSize) : rank_(rank), worldSize_(worldSize) {
  if (worldSize < 1 || rank < 0 || rank >= worldSize) {
    throw InvalidArgument(str("TrainingState: rank ", rank, " of world size ", worldSize, " is impossible"));
  }
}

TrainingState& TrainingState::add(const std::string& prefix, std::shared_ptr<StateProvider> part) {
  if (!part) throw InvalidArgument(str("TrainingState: part \"", prefix, "\" is null"));
  for (const auto& [p, existing] : parts_) {
    if (p == prefix) throw InvalidArgument(str("TrainingState: a part named \"", prefix, "\" was added already"));
  }
  parts_.emplace_back(prefix, std::move(part));
  return *this;
}

std::shared_ptr<StateProvider> moduleState(nn::Module& module) { return std::make_shared<ModulePart>(module); }

TrainingState& TrainingState::addModule(const std::string& prefix, nn::Module& module) {
  return add(prefix, moduleState(module));
}

std::shared_ptr<StateProvider> optimizerState(optim::Optimizer& optimizer, ParameterMap parameters) {
  return std::make_shared<OptimizerPart>(optimizer, std::move(parameters));
}

TrainingState& TrainingState::addOptimizer(const std::string& prefix, optim::Optimizer& optimizer,
                                           ParameterMap parameters) {
  return add(prefix, optimizerState(optimizer, std::move(parameters)));
}

TrainingState& TrainingState::addGenerator(const std::string& name, Generator& generator) {
  return add(name, std::make_shared<GeneratorPart>(generator));
}

TrainingState& TrainingState::addTensor(const std::string& name, Tensor tensor, Placement placement, Shape globalShape,
                                        int64_t offset) {
  if (!tensor.defined()) throw InvalidArgument(str("TrainingState::addTensor: \"", name, "\" is undefined"));
  if (placement != Placement::Sharded) globalShape = tensor.sizes();
  return add(name, std::make_shared<TensorPart>(std::move(tensor), placement, std::move(globalShape), offset));
}

std::vector<StateTensor> TrainingState::collect() const {
  std::vector<StateTensor> out;
  std::map<std::string, Placement> seen;
  for (const auto& [prefix, part] : parts_) {
    for (StateTensor& t : part->collect()) {
      t.name = t.name.empty() ? prefix : joinName(prefix, t.name);
      // Several pieces of one sharded tensor may come from one rank (nestedState's runs).
      if (auto [it, fresh] = seen.emplace(t.name, t.placement);
          !fresh && (it->second != Placement::Sharded || t.placement != Placement::Sharded)) {
        throw InvalidArgument(str("TrainingState: two tensors are named \"", t.name, "\""));
      }
      const int64_t global = shapeNumel(t.shape);
      const int64_t held = t.local.defined() ? t.local.numel() : 0;
      const bool strided = t.repeats > 1;
      const int64_t run = strided ? held / t.repeats : held;
      const bool runsFit = !strided || (held % t.repeats == 0 && t.stride >= run);
      const int64_t end = t.offset + (strided ? (t.repeats - 1) * t.stride : 0) + run;
      if (!t.local.defined() || (t.placement != Placement::Sharded && (held != global || strided)) ||
          (t.placement == Placement::Sharded && (t.offset < 0 || !runsFit || end > global))) {
        throw InvalidArgument(str("TrainingState: tensor \"", t.name, "\" (", placementName(t.placement), ", ",
                                  t.local.defined() ? t.local.describe() : std::string("undefined"), " at offset ",
                                  t.offset, strided ? str(" in ", t.repeats, " runs every ", t.stride) : std::string(),
                                  ") does not fit its global shape ", describeShape(t.shape)));
      }
      out.push_back(std::move(t));
    }
  }
  return out;
}

void TrainingState::restore(const StateSource& source) {
  notes_.clear();
  const RestoreContext context{rank_, worldSize_, &notes_};
  for (const auto& [prefix, part] : parts_) part->restore(source, prefix, context);
  step = source.step();
  metadata = source.metadata();
}

}  // namespace dt
