// Internal: how ops record autograd nodes, and kernel helpers shared by ops_*.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/autograd.h"
#include "tensor/ops.h"

namespace dt::detail {

// What a backward function sees.
struct BackwardContext {
  const TensorList& grads;  // one per output (undefined = zero)
  const TensorList& saved;  // unpacked saved tensors, in the order given
  const std::vector<bool>& needs;  // needs[i]: input i wants a gradient
};
using BackwardFn = std::function<TensorList(const BackwardContext&)>;

// When a node's weight gradients are computed under backwardDeferringWeights (zero-bubble
// pipelines): Deferred keeps what they need until WeightGradients::run(); WithInputs computes
// them with the input gradients, for ops whose weight gradients cost a column sum while keeping
// their state would cost memory (LayerNorm: its input and output gradient, two widths of the
// twenty a GPT block's deferred weight gradients keep).
enum class WeightGrads : uint8_t { Deferred, WithInputs };

// A node defined by a lambda. Returned gradients are summed over broadcast
// dims and converted to each input's dtype automatically.
class FnNode final : public Node {
 public:
  FnNode(const char* name, std::vector<SavedTensor> saved, BackwardFn fn, std::vector<Shape> inputShapes,
         std::vector<DType> inputTypes, WeightGrads weightGrads = WeightGrads::Deferred)
      : name_(name), saved_(std::move(saved)), fn_(std::move(fn)), inputShapes_(std::move(inputShapes)),
        inputTypes_(std::move(inputTypes)), weightGrads_(weightGrads) {}
  TensorList apply(TensorList&& grads) override;
  bool splitsGradients() const override { return weightGrads_ == WeightGrads::Deferred; }
  TensorList applySome(const TensorList& grads, const std::vector<bool>& which) override;
  std::string name() const override { return name_; }
  void releaseVariables() override {
    for (auto& s : saved_) s.reset();
    fn_ = nullptr;
  }
  std::optional<TensorList> savedTensorsForReport() const override;

 private:
  TensorList run(const TensorList& grads, const std::vector<bool>* which);

  const char* name_;
  std::vector<SavedTensor> saved_;
  BackwardFn fn_;
  std::vector<Shape> inputShapes_;
  std::vector<DType> inputTypes_;
  WeightGrads weightGrads_;
};

// Records a node for outputs if any input requires grad (grad mode on).
// `saved` is built only when needed.
void recordFn(const char* name, const TensorList& inputs, std::vector<Tensor*> outputs,
              const std::function<std::vector<SavedTensor>()>& saved, BackwardFn fn,
              WeightGrads weightGrads = WeightGrads::Deferred);
inline void recordFn(const char* name, const TensorList& inputs, Tensor& out,
                     const std::function<std::vector<SavedTensor>()>& saved, BackwardFn fn,
                     WeightGrads weightGrads = WeightGrads::Deferred) {
  recordFn(name, inputs, std::vector<Tensor*>{&out}, saved, std::move(fn), weightGrads);
}

// Throws NotSupportedError unless t is on the CPU: for ops (and paths of ops) without a CUDA
// kernel. The message names the op, the device and why (a cpu-only build, or no CUDA kernel yet).
void requireCpu(const Tensor& t, const char* op);
// Throws InvalidArgument in PyTorch's words ("Expected all tensors to be on the same device, but
// found at least two devices, cuda:0 and cpu!") naming op and both tensors. It checks devices
// only: the caller then dispatches with onCuda().
void requireSameDevice(const Tensor& a, const Tensor& b, const char* op);
// Whether op takes its CUDA path for t: false on the cpu (inline, so the cpu path pays one
// compare); true for a CUDA tensor in a CUDA build on a machine with a device; otherwise throws
// NotSupportedError naming op, device and reason (a cpu-only build, no usable device).
bool cudaPathFor(const Tensor& t, const char* op);
inline bool onCuda(const Tensor& t, const char* op) {
  if (t.device().isCpu()) [[likely]]
    return false;
  return cudaPathFor(t, op);
}
void requireFloat(const Tensor& t, const char* op);
// float16/bfloat16 compute in float32.
DType computeType(DType t);
// In-place autograd bookkeeping: throws for leaves requiring grad and for views.
// Returns true when the op must be recorded (then the caller computes out of place and rebases).
bool inplaceNeedsGrad(const Tensor& self, const TensorList& others, const char* op);
// Copies `result` into self (no autograd) and makes result's history self's.
void commitInplace(Tensor& self, const Tensor& result);

// Reduction helpers.
std::vector<int64_t> normalizeDims(const std::vector<int64_t>& dims, int64_t ndim, const char* op);
Shape reducedShape(const Shape& sizes, const std::vector<bool>& reduce, bool keepdim);

// Fused kernels used by backward functions.
Tensor reluBackward(const Tensor& grad, const Tensor& output);

}  // namespace dt::detail
