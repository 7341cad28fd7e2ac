#include "tensor/autograd/function.h"

#include <cxxabi.h>

#include <cstdlib>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/anomaly.h"
#include "tensor/internal/ops_internal.h"

namespace dt::autograd {

// The node a recorded custom function leaves in the graph: it owns the context
// and checks what the user's backward returns before the engine passes it on.
class FunctionNode final : public Node {
 public:
  FunctionNode(std::unique_ptr<FunctionContext> ctx, detail::FunctionBackward backward, const TensorList& inputs,
               const TensorList& outputs)
      : ctx_(std::move(ctx)), backward_(backward), name_(ctx_->functionName() + "Backward") {
    for (const Tensor& t : inputs) inputs_.push_back(Metadata::of(t));
    for (const Tensor& t : outputs) outputs_.push_back(Metadata::of(t));
  }

  std::string name() const override { return name_; }
  void releaseVariables() override {
    for (SavedTensor& s : ctx_->saved_) s.reset();
  }
  FunctionContext& context() { return *ctx_; }
  std::optional<TensorList> savedTensorsForReport() const override { return ctx_->savedTensors(); }

  // The split backward asks for some inputs' gradients at a time: backward sees only those as
  // needed (a backward that consults needsInputGrad skips the rest's work) and the others are
  // dropped whatever it returns.
  bool splitsGradients() const override { return true; }
  TensorList applySome(const TensorList& gradOutputs, const std::vector<bool>& which) override {
    const std::vector<bool> needed = ctx_->needsInputGrad_;
    struct Restore {
      FunctionContext& ctx;
      const std::vector<bool>& needed;
      ~Restore() { ctx.needsInputGrad_ = needed; }
    } restore{*ctx_, needed};
    for (size_t i = 0; i < needed.size(); ++i) ctx_->needsInputGrad_[i] = needed[i] && i < which.size() && which[i];
    TensorList grads = apply(TensorList(gradOutputs));
    for (size_t i = 0; i < grads.size(); ++i) {
      if (i >= which.size() || !which[i]) grads[i] = Tensor();
    }
    return grads;
  }

  TensorList apply(TensorList&& gradOutputs) override {
    if (ctx_->materializeGrads_) {
      for (size_t i = 0; i < gradOutputs.size() && i < outputs_.size(); ++i) {
        if (!gradOutputs[i].defined() && outputs_[i].defined) {
          gradOutputs[i] = zeros(outputs_[i].shape, TensorOptions().dtype(outputs_[i].dtype).device(outputs_[i].device));
        }
      }
    }
    TensorList grads = backward_(*ctx_, gradOutputs);
    const std::string& fn = ctx_->functionName();
    if (grads.size() != inputs_.size()) {
      throw InvalidArgument(str(fn, ".backward returned ", grads.size(), " gradient(s) but forward took ",
                                inputs_.size(), " tensor input(s); return one per tensor input, an undefined Tensor "
                                "for an input without a gradient"));
    }
    for (size_t i = 0; i < grads.size(); ++i) {
      Tensor& g = grads[i];
      if (!g.defined() || !inputs_[i].defined) continue;
      if (g.sizes() != inputs_[i].shape) {
        throw InvalidArgument(str(fn, ".backward: the gradient for tensor input ", i, " has shape ",
                                  describeShape(g.sizes()), " but input ", i, " has shape ",
                                  describeShape(inputs_[i].shape),
                                  " (sum over broadcast dims with autograd::sumToShape)"));
      }
      if (!nextEdges()[i].valid()) {
        g = Tensor();
      } else if (g.dtype() != inputs_[i].dtype) {
        g = g.to(inputs_[i].dtype);
      }
    }
    return grads;
  }

 private:
  struct Metadata {
    bool defined = false;
    Shape shape;
    DType dtype = DType::Float32;
    Device device = Device::cpu();
    static Metadata of(const Tensor& t) {
      if (!t.defined()) return {};
      return Metadata{true, t.sizes(), t.dtype(), t.device()};
    }
  };

  std::unique_ptr<FunctionContext> ctx_;
  detail::FunctionBackward backward_;
  std::string name_;
  std::vector<Metadata> inputs_;
  std::vector<Metadata> outputs_;
};

// ---- FunctionContext -------------------------------------------------------------------------

FunctionContext::FunctionContext(std::string functionName, std::vector<bool> needsInputGrad)
    : functionName_(std::move(functionName)), needsInputGrad_(std::move(needsInputGrad)) {}

void FunctionContext::saveForBackward(TensorList tensors) {
  if (owner_ != nullptr || !saved_.empty()) {
    throw InvalidArgument(str(functionName_, ": saveForBackward is for forward; forward has already returned"));
  }
  toSave_ = std::move(tensors);
}

bool FunctionContext::needsInputGrad(size_t tensorInput) const {
  if (tensorInput >= needsInputGrad_.size()) {
    throw InvalidArgument(str(functionName_, ": needsInputGrad(", tensorInput, ") but the function has ",
                              needsInputGrad_.size(), " tensor input(s)"));
  }
  return needsInputGrad_[tensorInput];
}

std::vector<std::string> FunctionContext::keys() const {
  std::vector<std::string> out;
  for (const auto& [key, value] : values_) out.push_back(key);
  return out;
}

TensorList FunctionContext::savedTensors() const {
  if (owner_ == nullptr) {
    throw InvalidArgument(str(functionName_, ": savedTensors() is for backward (forward has the tensors themselves; "
                                             "without an input that requires grad there is no backward)"));
  }
  TensorList out;
  out.reserve(saved_.size());
  for (const SavedTensor& s : saved_) out.push_back(s.unpack(*owner_));
  return out;
}

// ---- apply's second half -----------------------------------------------------------------------

namespace detail {

namespace {

// Index of the entry of `list` that is the same tensor as t, or -1.
int64_t indexOfSame(const TensorList& list, const Tensor& t) {
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].defined() && list[i].isSameAs(t)) return static_cast<int64_t>(i);
  }
  return -1;
}

bool containsSame(const TensorList& list, const Tensor& t) { return indexOfSame(list, t) >= 0; }

void checkMarks(const FunctionContext& ctx, const TensorList& dirty, const TensorList& nonDifferentiable,
                const TensorList& inputs, const TensorList& outputs) {
  const std::string& fn = ctx.functionName();
  for (const Tensor& t : dirty) {
    const int64_t input = indexOfSame(inputs, t);
    if (input < 0) {
      throw InvalidArgument(str(fn, ": markDirty(", t.defined() ? t.describe() : "undefined",
                                ") names a tensor that is not one of its tensor inputs"));
    }
    if (!containsSame(outputs, t)) {
      throw InvalidArgument(str(fn, ": tensor input ", input, " (", t.describe(),
                                ") is marked dirty but forward does not return it; an input modified in place must "
                                "be returned as an output"));
    }
  }
  for (const Tensor& t : nonDifferentiable) {
    if (!containsSame(outputs, t)) {
      throw InvalidArgument(str(fn, ": markNonDifferentiable(", t.defined() ? t.describe() : "undefined",
                                ") names a tensor that forward does not return"));
    }
  }
}

}  // namespace

void finishApply(std::unique_ptr<FunctionContext> ctx, const TensorList& inputs, TensorList& outputs,
                 FunctionBackward backward, bool recording) {
  const TensorList dirty = std::move(ctx->dirty_);
  const TensorList nonDifferentiable = std::move(ctx->nonDifferentiable_);
  checkMarks(*ctx, dirty, nonDifferentiable, inputs, outputs);
  // Anomaly mode names the forward op by the function's own name ("StableSoftplus"), as users wrote it.
  const std::string functionName = ctx->functionName();
  if (dt::detail::anomalyMayBeActive()) [[unlikely]] {
    std::vector<Tensor*> outputPointers;
    for (Tensor& t : outputs) outputPointers.push_back(&t);
    dt::detail::anomalyCheckForward(functionName, inputs, outputPointers);
  }
  // The built-in in-place ops' rules, with the function as the op (its forward has already run).
  for (const Tensor& t : dirty) dt::detail::inplaceNeedsGrad(t, inputs, functionName.c_str());
  // Bumped even when forward used in-place ops (which bump it too): writes
  // through data<T>() do not, and tensors saved elsewhere must notice.
  for (Tensor t : dirty) t.bumpVersion();

  if (!recording) return;

  auto node = std::make_shared<FunctionNode>(std::move(ctx), backward, inputs, outputs);
  if (dt::detail::anomalyMayBeActive()) [[unlikely]] {
    node->setAnomalyRecord(dt::detail::anomalyRecordFor(functionName, inputs));
  }
  // Edges first: a dirty input's current history is what its gradient flows into.
  auto& edges = node->nextEdges();
  edges.reserve(inputs.size());
  for (const Tensor& t : inputs) edges.push_back(edgeFor(t));
  node->setNumOutputs(static_cast<uint32_t>(outputs.size()));

  for (size_t i = 0; i < outputs.size(); ++i) {
    Tensor& out = outputs[i];
    if (!out.defined()) continue;
    const bool isDirty = containsSame(dirty, out);
    const bool differentiable = !containsSame(nonDifferentiable, out) && isFloatingPoint(out.dtype());
    const bool aliasesEarlierOutput = indexOfSame(outputs, out) != static_cast<int64_t>(i);
    if ((!isDirty && containsSame(inputs, out)) || aliasesEarlierOutput) out = out.detach();
    if (differentiable) {
      rebaseHistory(out, node, static_cast<uint32_t>(i));
    } else if (isDirty) {
      out.detach_();  // modified in place into something without a gradient: its old history no longer holds
    }
  }

  FunctionContext& c = node->context();
  c.saved_.reserve(c.toSave_.size());
  for (const Tensor& t : c.toSave_) c.saved_.emplace_back(t, containsSame(outputs, t));
  c.toSave_.clear();
  c.owner_ = node.get();
}

std::string readableTypeName(const std::type_info& type) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(type.name(), nullptr, nullptr, &status);
  std::string name = status == 0 && demangled != nullptr ? demangled : type.name();
  std::free(demangled);
  return name;
}

void throwMissingValue(const FunctionContext& ctx, const std::string& key) {
  const std::vector<std::string> keys = ctx.keys();
  throw InvalidArgument(str(ctx.functionName(), ": no value named '", key, "' was set in forward (set: ",
                            keys.empty() ? std::string("none") : join(keys, ", "), ")"));
}

void throwValueType(const FunctionContext& ctx, const std::string& key, const std::type_info& stored,
                    const std::type_info& wanted) {
  throw InvalidArgument(str(ctx.functionName(), ": value '", key, "' was set as ", readableTypeName(stored),
                            " but read as ", readableTypeName(wanted), "; get<T> must name the stored type"));
}

}  // namespace detail

}  // namespace dt::autograd
