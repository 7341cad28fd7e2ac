// Optimizers: SGD and AdamW with PyTorch's update rules.
//
// Contract: an optimizer holds handles to the parameters it updates (in the
// order given, usually module.parameters(), or group after group when built
// from ParamGroups: each group may set its own weight decay, so that biases,
// norms and embeddings are left undecayed; decayGroups() makes that split
// for a module). Indices in the state dict count parameters in that flat
// order. setLr() sets the rate of every group. step() reads each parameter's
// .grad (skipping parameters without one) and updates the values in place
// without autograd, bumping their version counters. Per-parameter state is
// created lazily on the first step. stateDict() holds that state as named
// tensors ("state.<index>.<name>", plus "state.<index>.step" for AdamW) so it
// saves with saveSafetensors; loadStateDict restores it (shapes must match).
// On CUDA, step() first waits for the index checks that ops (crossEntropy,
// embedding) left pending on its parameters' devices and throws the first
// failure before it changes anything (tensor/deferred_checks.h).
// Not thread-safe.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tensor/nn/safetensors.h"
#include "tensor/tensor.h"

namespace dt::nn {
class Module;
}

namespace dt::optim {

// Parameters that share hyper-parameters; an unset weightDecay takes the optimizer's.
struct ParamGroup {
  std::vector<Tensor> params;
  std::optional<double> weightDecay;
};

// Two groups for AdamW-style training, as GPT-2 and most transformer recipes do it: the
// weights of the module's nn::Linear layers with `weightDecay`, everything else (biases,
// LayerNorm weights, embeddings, a tied output layer that is an embedding) with none. Each
// parameter appears once, in namedParameters() order within its group.
std::vector<ParamGroup> decayGroups(const nn::Module& module, double weightDecay);

class Optimizer {
 public:
  explicit Optimizer(std::vector<Tensor> params);
  explicit Optimizer(std::vector<ParamGroup> groups);
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  void zeroGrad(bool setToNone = true);
  const std::vector<Tensor>& params() const { return params_; }
  const std::vector<ParamGroup>& groups() const { return groups_; }
  double lr() const { return lr_; }
  void setLr(double lr) { lr_ = lr; }

  NamedTensors stateDict() const;
  void loadStateDict(const NamedTensors& state);
  // As loadStateDict, but keeps the tensors given instead of copies (the caller hands them
  // over): each must already be on its parameter's device, and the step counts on the CPU.
  // A restore that made the tensors itself uses it to avoid a second copy of the state.
  void adoptStateDict(NamedTensors state);

 protected:
  Tensor& state(size_t param, const std::string& name);  // creates an undefined slot
  // loadStateDict's checks: the parameter index and state name of `key` for tensor t.
  std::pair<size_t, std::string> checkedStateKey(const std::string& key, const Tensor& t) const;
  bool hasState(size_t param, const std::string& name) const;
  // The group's weight decay for parameter `param`, or `fallback` (the options') when unset.
  double weightDecayOf(size_t param, double fallback) const;
  std::vector<ParamGroup> groups_;
  std::vector<size_t> groupOf_;  // param -> its group
  std::vector<Tensor> params_;
  std::vector<std::map<std::string, Tensor>> state_;
  double lr_ = 0.0;
};

struct SGDOptions {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  double weightDecay = 0.0;
  bool nesterov = false;
};

// g += wd * p; buf = momentum * buf + (1 - dampening) * g (buf = g on the first step);
// g = nesterov ? g + momentum * buf : buf; p -= lr * g.
class SGD : public Optimizer {
 public:
  SGD(std::vector<Tensor> params, SGDOptions options);
  SGD(std::vector<ParamGroup> groups, SGDOptions options);
  void step() override;
  const SGDOptions& options() const { return options_; }

 private:
  SGDOptions options_;
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weightDecay = 1e-2;
};

// p *= 1 - lr * wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
class AdamW : public Optimizer {
 public:
  AdamW(std::vector<Tensor> params, AdamWOptions options = {});
  AdamW(std::vector<ParamGroup> groups, AdamWOptions options = {});
  void step() override;
  const AdamWOptions& options() const { return options_; }

 private:
  AdamWOptions options_;
};

}  // namespace dt::optim
