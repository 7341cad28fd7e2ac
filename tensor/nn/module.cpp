#include "tensor/nn/module.h"

#include <cmath>
#include <set>
#include <utility>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/autograd.h"

namespace dt::nn {

// ---- module stack -------------------------------------------------------------------------------------------

namespace {
// Raw pointers: a module outlives the call operator that pushed it.
thread_local std::vector<const Module*> tModuleStack;

// The name `module` has among caller's children, or "<TypeName>" when it is not one of them.
std::string nameInCaller(const Module& caller, const Module& module) {
  for (const auto& [name, child] : caller.namedChildren()) {
    if (child.get() == &module) return name;
  }
  return str("<", module.typeName(), ">");
}
}  // namespace

ModuleScope::ModuleScope(const Module& module) { tModuleStack.push_back(&module); }
ModuleScope::~ModuleScope() { tModuleStack.pop_back(); }

ModulePath currentModulePath() {
  ModulePath out;
  for (size_t i = 0; i < tModuleStack.size(); ++i) {
    if (i > 0) {
      out.types += " > ";
      if (i > 1) out.path += ".";
      out.path += nameInCaller(*tModuleStack[i - 1], *tModuleStack[i]);
    }
    out.types += tModuleStack[i]->typeName();
  }
  return out;
}

Tensor Module::operator()(const Tensor& input) {
  ModuleScope scope(*this);
  if (forwardHooks_.empty()) return forward(input);
  // Copies: a hook may register or remove hooks (on this module too) while it runs.
  const std::vector<ForwardHookEntry> hooks = forwardHooks_;
  Tensor x = input;
  for (const auto& h : hooks) {
    if (!h.pre) continue;
    Tensor replaced = h.pre(*this, x);
    if (replaced.defined()) x = std::move(replaced);
  }
  Tensor out = forward(x);
  for (const auto& h : hooks) {
    if (!h.post) continue;
    Tensor replaced = h.post(*this, x, out);
    if (replaced.defined()) out = std::move(replaced);
  }
  return out;
}

int Module::registerForwardPreHook(ForwardPreHook hook) {
  forwardHooks_.push_back({++lastHookHandle_, std::move(hook), {}});
  return lastHookHandle_;
}

int Module::registerForwardHook(ForwardHook hook) {
  forwardHooks_.push_back({++lastHookHandle_, {}, std::move(hook)});
  return lastHookHandle_;
}

void Module::removeForwardHook(int handle) {
  std::erase_if(forwardHooks_, [&](const ForwardHookEntry& h) { return h.handle == handle; });
}

Tensor Module::forward(const Tensor&) {
  throw NotSupportedError(str(typeName(), " has no single-tensor forward()"));
}

void Module::checkName(const std::string& name) const {
  if (name.empty() || name.find('.') != std::string::npos) {
    throw InvalidArgument(str(typeName(), ": invalid name \"", name, "\" (non-empty, no '.')"));
  }
  auto taken = [&](const auto& list) {
    for (auto& [n, v] : list) {
      if (n == name) return true;
    }
    return false;
  };
  if (taken(params_) || taken(buffers_) || taken(children_)) {
    throw InvalidArgument(str(typeName(), ": name \"", name, "\" is already registered"));
  }
}

Tensor Module::registerParameter(const std::string& name, Tensor value, bool requiresGrad) {
  checkName(name);
  if (!value.defined()) throw InvalidArgument(str(typeName(), ": parameter \"", name, "\" is undefined"));
  if (requiresGrad) value.setRequiresGrad(true);
  value.setName(name);
  params_.emplace_back(name, value);
  return value;
}

Tensor Module::registerBuffer(const std::string& name, Tensor value) {
  checkName(name);
  buffers_.emplace_back(name, value);
  return value;
}

void Module::registerChild(const std::string& name, std::shared_ptr<Module> module) {
  checkName(name);
  if (!module) throw InvalidArgument(str(typeName(), ": submodule \"", name, "\" is null"));
  children_.emplace_back(name, std::move(module));
}

void Module::collect(const std::string& prefix, bool params, bool recurse, NamedTensors& out) const {
  for (auto& [n, t] : params ? params_ : buffers_) out.emplace_back(prefix + n, t);
  if (!recurse) return;
  for (auto& [n, c] : children_) c->collect(prefix + n + ".", params, true, out);
}

NamedTensors Module::namedParameters(bool recurse) const {
  NamedTensors out;
  collect("", true, recurse, out);
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : namedParameters(recurse)) out.push_back(t);
  return out;
}

NamedTensors Module::namedBuffers(bool recurse) const {
  NamedTensors out;
  collect("", false, recurse, out);
  return out;
}

std::shared_ptr<Module> Module::replaceChild(const std::string& name, std::shared_ptr<Module> module) {
  if (!module) throw InvalidArgument(str(typeName(), ": replacement for submodule \"", name, "\" is null"));
  for (auto& [n, c] : children_) {
    if (n != name) continue;
    std::shared_ptr<Module> old = std::exchange(c, std::move(module));
    try {
      childReplaced(name, c);
    } catch (...) {
      c = old;  // refused: the old child stays, as if never asked
      throw;
    }
    return old;
  }
  throw InvalidArgument(str(typeName(), ": no submodule named \"", name, "\" to replace"));
}

void Module::childReplaced(const std::string&, const std::shared_ptr<Module>&) {}

std::shared_ptr<Module> Module::child(const std::string& name) const {
  for (auto& [n, c] : children_) {
    if (n == name) return c;
  }
  throw InvalidArgument(str(typeName(), ": no submodule named \"", name, "\""));
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [n, c] : children_) c->train(on);
}

void Module::zeroGrad(bool setToNone) {
  std::vector<Tensor> params = parameters();
  zeroGrads(params, setToNone);
}

void Module::to(Device device) {
  convertInPlace([device](const Tensor& t) { return t.device() != device ? t.detach().to(device) : Tensor(); });
}

void Module::to(DType dtype) {
  convertInPlace([dtype](const Tensor& t) {
    return isFloatingPoint(t.dtype()) && t.dtype() != dtype ? t.detach().to(dtype) : Tensor();
  });
}

void Module::convertInPlace(const std::function<Tensor(const Tensor&)>& convert) {
  // Every copy is made before any tensor is repointed, so a failed copy (no
  // such device, out of memory) leaves the whole module as it was.
  std::vector<Tensor> tensors;
  for (const auto& [name, p] : namedParameters()) {
    tensors.push_back(p);
    if (Tensor g = p.grad(); g.defined()) tensors.push_back(g);
  }
  for (const auto& [name, b] : namedBuffers()) tensors.push_back(b);
  std::vector<std::pair<Tensor, Tensor>> moves;
  {
    NoGradGuard noGrad;
    for (const Tensor& t : tensors) {
      if (Tensor converted = convert(t); converted.defined()) moves.emplace_back(t, std::move(converted));
    }
  }
  // Like PyTorch's param.data = param.data.to(...): the TensorImpl (and
  // its autograd metadata) stays, its memory is the copy's.
  for (auto& [t, moved] : moves) {
    TensorImpl& impl = *t.unsafeImpl();
    const TensorImpl& from = *moved.unsafeImpl();
    impl.storage = from.storage;
    impl.strides = from.strides;
    impl.offset = from.offset;
    impl.dtype = from.dtype;
    impl.refreshGeometry();
    impl.version->value.fetch_add(1, std::memory_order_relaxed);
  }
}

NamedTensors Module::stateDict() const {
  NamedTensors out = namedParameters();
  for (auto& b : namedBuffers()) out.push_back(b);
  return out;
}

void Module::loadStateDict(const NamedTensors& state, bool strict) {
  NamedTensors mine = stateDict();
  std::set<std::string> used;
  std::vector<std::string> missing;
  for (auto& [name, t] : mine) {
    const Tensor* src = nullptr;
    for (auto& [n, v] : state) {
      if (n == name) {
        src = &v;
        break;
      }
    }
    if (src == nullptr) {
      missing.push_back(name);
      continue;
    }
    used.insert(name);
    if (src->sizes() != t.sizes()) {
      throw InvalidArgument(str("loadStateDict: \"", name, "\" has shape ", describeShape(src->sizes()), " in the state dict but ",
                                describeShape(t.sizes()), " in the module"));
    }
    NoGradGuard ng;
    Tensor dst = t;
    dst.copy_(*src);
  }
  std::vector<std::string> unexpected;
  for (auto& [n, v] : state) {
    if (!used.count(n)) unexpected.push_back(n);
  }
  if (strict && (!missing.empty() || !unexpected.empty())) {
    throw InvalidArgument(str("loadStateDict: keys do not match. Missing: [", join(missing, ", "), "]. Unexpected: [",
                              join(unexpected, ", "), "]"));
  }
}

void Module::save(const std::filesystem::path& path) const {
  saveSafetensors(path, stateDict(), {{"format", "pt"}, {"producer", "dtrain"}});
}

void Module::load(const std::filesystem::path& path, bool strict) { loadStateDict(loadSafetensors(path).tensors, strict); }

// ---- layers ------------------------------------------------------------------------------------------------

Linear::Linear(int64_t in, int64_t out, bool hasBias, Generator& generator) {
  if (in <= 0 || out <= 0) throw InvalidArgument(str("Linear: sizes must be positive, got in=", in, " out=", out));
  // kaiming_uniform(a = sqrt(5)): gain = sqrt(2 / (1 + 5)), bound = gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in).
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  Tensor w = empty({out, in});
  uniform_(w, -bound, bound, generator);
  weight = registerParameter("weight", w);
  if (hasBias) {
    Tensor b = empty({out});
    uniform_(b, -bound, bound, generator);
    bias = registerParameter("bias", b);
  }
}

Tensor Linear::forward(const Tensor& x) { return linear(x, weight, bias); }

LayerNorm::LayerNorm(std::vector<int64_t> normalizedShape, double eps, bool elementwiseAffine)
    : shape_(std::move(normalizedShape)), eps_(eps) {
  if (elementwiseAffine) {
    weight = registerParameter("weight", ones(shape_));
    bias = registerParameter("bias", zeros(shape_));
  }
}

Tensor LayerNorm::forward(const Tensor& x) { return layerNorm(x, shape_, weight, bias, eps_); }

Embedding::Embedding(int64_t num, int64_t dim, Generator& generator) {
  if (num <= 0 || dim <= 0) throw InvalidArgument(str("Embedding: sizes must be positive, got ", num, " x ", dim));
  weight = registerParameter("weight", randn({num, dim}, generator));
}

Sequential::Sequential(std::vector<std::shared_ptr<Module>> modules) {
  for (auto& m : modules) pushBack(std::move(m));
}

void Sequential::pushBack(std::shared_ptr<Module> module) {
  registerChild(std::to_string(namedChildren().size()), std::move(module));
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  for (auto& [n, m] : namedChildren()) h = (*m)(h);
  return h;
}

}  // namespace dt::nn
