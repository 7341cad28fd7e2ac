// nn::Module: named parameters, buffers and submodules; train/eval; state dicts.
//
// Contract:
//  * Names are registered once per module; namedParameters() lists a module's
//    own parameters in registration order, then each child's (depth first, in
//    registration order), as PyTorch does: "0.weight", "0.bias", "1.weight".
//    DDP buckets parameters in this order, so it is stable.
//  * A registered tensor is shared: the module and the caller hold handles to
//    the same TensorImpl. loadStateDict copies values in place (parameters
//    keep their identity, hooks and optimizer references stay valid).
//  * Modules are not thread-safe; forward on one module from several threads
//    is fine only if no one mutates it concurrently.
//  * State dicts save/load as safetensors (tensor/nn/safetensors.h).
//  * Module path: module(x) (operator()) runs forward with the module pushed
//    on this thread's module stack, so ops know which module they ran in
//    (currentModulePath(), used by anomaly mode). forward(x) called directly
//    skips that, as PyTorch's module.forward(x) skips its hooks; a module whose
//    forward takes other arguments puts a ModuleScope in its own call operator.
//  * Forward hooks (what a wrapper that acts per submodule uses: the sharded
//    wrapper gathers a unit's parameters before its forward and frees them
//    after): the call operator runs the pre-hooks before forward, in
//    registration order, each of which may replace the input by returning a
//    defined tensor, then forward, then the post-hooks, each of which may
//    replace the output. A hook that throws ends the call with its exception
//    (later hooks do not run). Hooks registered or removed while hooks run take
//    effect from the next call. forward(x) called directly runs none.
//  * Replacing a child (what applies a parallel plan to a model as it is):
//    replaceChild(name, module) puts `module` in the place of the child
//    registered as `name`, so registration order, and with it every other
//    parameter's name and position, stays; the replacement's own parameters
//    appear under the same prefix. A module that keeps typed handles to its
//    children learns of it through childReplaced() (nn's GPT blocks do, and call
//    their children through Module, so any module with the same forward fits).
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tensor/generator.h"
#include "tensor/nn/safetensors.h"
#include "tensor/ops.h"

namespace dt::nn {

class Module;

// RAII: `module` is on this thread's module stack (innermost last) until destroyed.
class ModuleScope {
 public:
  explicit ModuleScope(const Module& module);
  ~ModuleScope();
  ModuleScope(const ModuleScope&) = delete;
  ModuleScope& operator=(const ModuleScope&) = delete;
};

struct ModulePath {
  // Each module's name in the module that called it, as namedParameters()
  // spells it ("net.block.inner"; a module that is not a registered child of
  // its caller shows as "<TypeName>"); "" for the outermost module alone.
  std::string path;
  // The modules' types, outermost first ("Model > Net > Block > Inner").
  std::string types;
  bool empty() const { return types.empty(); }
};
// The modules whose call operator is running on this thread; empty outside any.
ModulePath currentModulePath();

class Module : public std::enable_shared_from_this<Module> {
 public:
  Module() = default;
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Single-tensor forward; modules with other signatures add their own.
  virtual Tensor forward(const Tensor& input);
  // forward(input) inside a ModuleScope, with the forward hooks (see the contract above).
  Tensor operator()(const Tensor& input);

  // Returned tensors replace the input (pre) or the output (post) when defined.
  using ForwardPreHook = std::function<Tensor(Module& module, const Tensor& input)>;
  using ForwardHook = std::function<Tensor(Module& module, const Tensor& input, const Tensor& output)>;
  // Handles for removeForwardHook (unique per module).
  int registerForwardPreHook(ForwardPreHook hook);
  int registerForwardHook(ForwardHook hook);
  void removeForwardHook(int handle);
  virtual std::string typeName() const { return "Module"; }

  // Puts `module` where the child `name` was (same place in the registration order) and returns
  // the old child. InvalidArgument if there is no such child or module is null.
  std::shared_ptr<Module> replaceChild(const std::string& name, std::shared_ptr<Module> module);

  NamedTensors namedParameters(bool recurse = true) const;
  std::vector<Tensor> parameters(bool recurse = true) const;
  NamedTensors namedBuffers(bool recurse = true) const;
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& namedChildren() const { return children_; }
  std::shared_ptr<Module> child(const std::string& name) const;

  void train(bool on = true);
  void eval() { train(false); }
  bool isTraining() const { return training_; }
  // setToNone drops the gradient tensors (like PyTorch's default); otherwise zeroes them.
  void zeroGrad(bool setToNone = true);
  // Moves every parameter, buffer and gradient (recursively) to `device` in
  // place: each keeps its identity (handles held elsewhere see the new
  // device), so move a model before building its optimizer or DDP wrapper
  // only because those check devices when they start, not because handles
  // break. Not differentiable; a no-op for tensors already there.
  void to(Device device);
  // Converts every floating-point parameter, buffer and gradient (recursively) to `dtype` in
  // place, as to(Device) moves them (PyTorch's module.double()): integer buffers stay.
  void to(DType dtype);

  // Parameters then buffers, each in registration order.
  NamedTensors stateDict() const;
  // strict: every key must match a parameter/buffer and vice versa, shapes equal.
  void loadStateDict(const NamedTensors& state, bool strict = true);
  void save(const std::filesystem::path& path) const;
  void load(const std::filesystem::path& path, bool strict = true);

 protected:
  Tensor registerParameter(const std::string& name, Tensor value, bool requiresGrad = true);
  Tensor registerBuffer(const std::string& name, Tensor value);
  template <typename M>
  std::shared_ptr<M> registerModule(const std::string& name, std::shared_ptr<M> module) {
    registerChild(name, module);
    return module;
  }
  void registerChild(const std::string& name, std::shared_ptr<Module> module);
  // Called by replaceChild once `module` is registered as `name`: a module that keeps typed
  // handles to its children updates them here. Throwing refuses the replacement (the old child
  // is put back; update nothing before the last check).
  virtual void childReplaced(const std::string& name, const std::shared_ptr<Module>& module);

 private:
  // Repoints every parameter, buffer and gradient for which convert() gives a new tensor at
  // that tensor's memory, keeping each one's identity (to(Device), to(DType)).
  void convertInPlace(const std::function<Tensor(const Tensor&)>& convert);
  void collect(const std::string& prefix, bool params, bool recurse, NamedTensors& out) const;
  void checkName(const std::string& name) const;
  struct ForwardHookEntry {
    int handle;
    ForwardPreHook pre;
    ForwardHook post;
  };
  NamedTensors params_;
  NamedTensors buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  std::vector<ForwardHookEntry> forwardHooks_;
  int lastHookHandle_ = 0;
  bool training_ = true;
};

// y = x W^T + b, initialised like PyTorch: kaiming-uniform(a = sqrt(5)) for W,
// uniform(+-1/sqrt(in)) for b.
class Linear : public Module {
 public:
  Linear(int64_t in, int64_t out, bool bias = true, Generator& generator = defaultGenerator());
  Tensor forward(const Tensor& x) override;
  std::string typeName() const override { return "Linear"; }
  Tensor weight;
  Tensor bias;
};

class ReLU : public Module {
 public:
  Tensor forward(const Tensor& x) override { return relu(x); }
  std::string typeName() const override { return "ReLU"; }
};

class GELU : public Module {
 public:
  Tensor forward(const Tensor& x) override { return gelu(x); }
  std::string typeName() const override { return "GELU"; }
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(std::vector<int64_t> normalizedShape, double eps = 1e-5, bool elementwiseAffine = true);
  Tensor forward(const Tensor& x) override;
  std::string typeName() const override { return "LayerNorm"; }
  const std::vector<int64_t>& normalizedShape() const { return shape_; }
  double eps() const { return eps_; }
  Tensor weight;
  Tensor bias;

 private:
  std::vector<int64_t> shape_;
  double eps_;
};

// Rows initialised from N(0, 1) like PyTorch.
class Embedding : public Module {
 public:
  Embedding(int64_t num, int64_t dim, Generator& generator = defaultGenerator());
  Tensor forward(const Tensor& indices) override { return embedding(weight, indices); }
  std::string typeName() const override { return "Embedding"; }
  Tensor weight;
};

class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5, Generator& generator = defaultGenerator()) : p_(p), generator_(&generator) {}
  Tensor forward(const Tensor& x) override { return dropout(x, p_, isTraining(), *generator_); }
  std::string typeName() const override { return "Dropout"; }

 private:
  double p_;
  Generator* generator_;
};

// Children named "0", "1", ...; forward chains them.
class Sequential : public Module {
 public:
  Sequential() = default;
  explicit Sequential(std::vector<std::shared_ptr<Module>> modules);
  void pushBack(std::shared_ptr<Module> module);
  size_t size() const { return namedChildren().size(); }
  Tensor forward(const Tensor& x) override;
  std::string typeName() const override { return "Sequential"; }
};

}  // namespace dt::nn
