#include "tensor/autograd/checkpoint.h"

#include <memory>
#include <utility>

#include "common/errors.h"
#include "common/strings.h"

namespace dt::autograd {
namespace {

// Holds what the recomputation needs: the inputs (saved with their versions), the function,
// and where the preserved generators stood when the first run began.
class CheckpointNode final : public Node {
 public:
  CheckpointNode(CheckpointFunction fn, const TensorList& inputs, const TensorList& outputs, CheckpointOptions options,
                 std::vector<GeneratorState> generatorStates)
      : fn_(std::move(fn)), options_(std::move(options)), generatorStates_(std::move(generatorStates)) {
    for (const Tensor& t : inputs) {
      saved_.emplace_back(t);
      inputRequiresGrad_.push_back(t.defined() && t.requiresGrad());
    }
    for (const Tensor& t : outputs) outputShapes_.push_back(t.defined() ? t.sizes() : Shape{});
  }

  std::string name() const override { return "CheckpointBackward"; }
  void releaseVariables() override {
    for (SavedTensor& s : saved_) s.reset();
    fn_ = nullptr;
  }

  TensorList apply(TensorList&& gradOutputs) override {
    if (!fn_) {
      throw InvalidArgument("CheckpointBackward: backward ran a second time through a checkpoint; its function and "
                            "inputs were freed by the first (use retainGraph=true on the first backward)");
    }
    TensorList inputs;
    for (size_t i = 0; i < saved_.size(); ++i) {
      Tensor x = saved_[i].unpack(*this);
      if (x.defined()) {
        x = x.detach();
        if (inputRequiresGrad_[i]) x.setRequiresGrad(true);
      }
      inputs.push_back(x);
    }
    TensorList outputs;
    {
      // The recomputation draws the numbers the first run drew; the streams then go back to
      // where backward found them.
      std::vector<GeneratorState> now;
      for (Generator* g : options_.preserveGenerators) now.push_back(g->state());
      for (size_t i = 0; i < generatorStates_.size(); ++i) options_.preserveGenerators[i]->setState(generatorStates_[i]);
      struct Restore {
        const CheckpointOptions& options;
        const std::vector<GeneratorState>& states;
        ~Restore() {
          for (size_t i = 0; i < states.size(); ++i) options.preserveGenerators[i]->setState(states[i]);
        }
      } restore{options_, now};
      EnableGradGuard grad;
      outputs = fn_(inputs);
    }
    if (outputs.size() != outputShapes_.size()) {
      throw InvalidArgument(str("CheckpointBackward: the recomputation returned ", outputs.size(),
                                " output(s) but the first run returned ", outputShapes_.size(),
                                "; a checkpointed function must compute the same outputs every time"));
    }
    TensorList roots, grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!outputs[i].defined() || !outputs[i].requiresGrad()) continue;
      if (outputs[i].sizes() != outputShapes_[i]) {
        throw InvalidArgument(str("CheckpointBackward: output ", i, " of the recomputation is ", outputs[i].describe(),
                                  " but the first run made ", describeShape(outputShapes_[i])));
      }
      roots.push_back(outputs[i]);
      grads.push_back(i < gradOutputs.size() && gradOutputs[i].defined() ? gradOutputs[i] : zerosLike(outputs[i]));
    }
    if (!roots.empty()) backward(roots, grads);
    TensorList result;
    for (size_t i = 0; i < inputs.size(); ++i) result.push_back(inputRequiresGrad_[i] ? inputs[i].grad() : Tensor());
    return result;
  }

 private:
  CheckpointFunction fn_;
  CheckpointOptions options_;
  std::vector<GeneratorState> generatorStates_;
  std::vector<SavedTensor> saved_;
  std::vector<bool> inputRequiresGrad_;
  std::vector<Shape> outputShapes_;
};

}  // namespace

TensorList checkpoint(CheckpointFunction fn, const TensorList& inputs, const CheckpointOptions& options) {
  if (!fn) throw InvalidArgument("checkpoint: the function is empty");
  if (!needsGrad(inputs)) return fn(inputs);
  std::vector<GeneratorState> states;
  for (Generator* g : options.preserveGenerators) {
    if (g == nullptr) throw InvalidArgument("checkpoint: preserveGenerators holds a null generator");
    states.push_back(g->state());
  }
  TensorList outputs;
  {
    NoGradGuard noGrad;
    outputs = fn(inputs);
  }
  // Outputs that are views of inputs (or inputs themselves) get their own handles, so that
  // giving them this node's history leaves the inputs' history alone.
  for (Tensor& out : outputs) {
    if (out.defined()) out = out.detach();
  }
  auto node = std::make_shared<CheckpointNode>(fn, inputs, outputs, options, std::move(states));
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].defined() || !isFloatingPoint(outputs[i].dtype())) {
      throw InvalidArgument(str("checkpoint: output ", i, " of the function is ",
                                outputs[i].defined() ? outputs[i].describe() : std::string("undefined"),
                                "; a checkpointed function returns only floating-point tensors (they carry the "
                                "gradient)"));
    }
  }
  recordNode(node, inputs, outputs);
  return outputs;
}

Tensor checkpoint(std::function<Tensor(const Tensor&)> fn, const Tensor& input, const CheckpointOptions& options) {
  if (!fn) throw InvalidArgument("checkpoint: the function is empty");
  TensorList out = checkpoint([fn = std::move(fn)](const TensorList& in) { return TensorList{fn(in.at(0))}; },
                              TensorList{input}, options);
  return out.at(0);
}

}  // namespace dt::autograd
