// Custom autograd functions: an op whose forward and backward the user writes in C++.
//
//   struct StableSoftplus : dt::autograd::Function<StableSoftplus> {
//     static constexpr std::string_view name = "StableSoftplus";
//     static Tensor forward(FunctionContext& ctx, const Tensor& x) { ...; ctx.saveForBackward(x); return y; }
//     static Tensor backward(FunctionContext& ctx, const TensorList& gradOutputs) { ... }
//   };
//   Tensor y = StableSoftplus::apply(x);
//
// Contract:
//  * Arguments: apply(args...) passes every argument to forward unchanged. The
//    arguments of type Tensor are the function's tensor inputs, numbered 0, 1, ...
//    in the order they appear; all others (double, int64_t, enums, structs) are
//    plain values that are not differentiated. A TensorList argument does not
//    compile (its tensors would silently get no gradient): pass tensors one by one.
//  * forward returns a Tensor, a TensorList or a std::tuple of Tensors; apply
//    returns the same type. backward gets one gradient per output (an output
//    whose gradient is unknown gets zeros of its shape, unless
//    ctx.setMaterializeGrads(false), then it is undefined) and returns one
//    gradient per tensor input, as a TensorList, or as a Tensor when there is
//    exactly one tensor input. An undefined Tensor means "no gradient". A
//    wrong count, or a gradient whose shape differs from its input's, throws
//    InvalidArgument naming the function, the input index and both shapes;
//    a gradient of another dtype is converted to the input's. Gradients for
//    inputs that do not need one are dropped.
//  * Grad mode: forward runs under NoGradGuard, so the ops inside record
//    nothing; backward runs under it too (the engine's rule), so a custom
//    function has no double backward. The node is recorded only when grad mode
//    is on and some tensor input requires grad; it is named "<name>Backward"
//    (name: the static `name` member, else the demangled type name) and shows
//    under that name in autograd errors.
//  * Context: saveForBackward keeps tensors with the version they have when
//    forward returns; savedTensors() in backward throws the built-in ops'
//    in-place error ("... saved by StableSoftplusBackward, is at version 1;
//    expected version 0 ...") if one was modified in place since. Tensors
//    reach backward only this way: set() refuses a Tensor at compile time (it
//    would skip the version check and could keep the graph alive through a
//    reference cycle). markNonDifferentiable(outputs) leaves those outputs
//    without gradFn (non-floating-point outputs are so always). markDirty(inputs)
//    says forward modified those inputs in place: forward must return them; their
//    version is bumped and, when recorded, they become outputs of the node
//    (the same Tensor handle comes back with the new history). A dirty input
//    that is a leaf requiring grad, or a view, is refused as built-in in-place
//    ops refuse it (after forward has run, as in PyTorch). An output that is an
//    unmodified input comes back as a new handle on the same data (so the input
//    keeps its own history).
//  * Errors in forward propagate from apply unchanged; grad mode is restored.
//  * Threads: apply may run on any thread; one call's context is used by the
//    thread running forward and later by the one running backward, never by
//    two at once. Graph rules as in autograd.h.
//  * Ownership: the recorded node owns the context; saved tensors are freed
//    after the node runs unless backward is called with retainGraph. Without a
//    recorded node the context is dropped when apply returns.
#pragma once

#include <any>
#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "tensor/autograd/autograd.h"

namespace dt::autograd {

class FunctionContext;

namespace detail {

using FunctionBackward = TensorList (*)(FunctionContext& ctx, const TensorList& gradOutputs);

// Checks the marks, bumps dirty inputs' versions, records the node (when
// `recording`) and packs the saved tensors. May replace entries of outputs
// (an unmodified input returned as output becomes a new handle).
void finishApply(std::unique_ptr<FunctionContext> ctx, const TensorList& inputs, TensorList& outputs,
                 FunctionBackward backward, bool recording);
std::string readableTypeName(const std::type_info& type);
[[noreturn]] void throwMissingValue(const FunctionContext& ctx, const std::string& key);
[[noreturn]] void throwValueType(const FunctionContext& ctx, const std::string& key, const std::type_info& stored,
                                 const std::type_info& wanted);

template <class T>
inline constexpr bool isTensor = std::is_same_v<std::remove_cvref_t<T>, Tensor>;

template <class T>
struct IsTensorTuple : std::false_type {};
template <class... Ts>
struct IsTensorTuple<std::tuple<Ts...>> : std::bool_constant<(std::is_same_v<Ts, Tensor> && ...)> {};

}  // namespace detail

class FunctionContext {
 public:
  // apply makes one per call; constructing one by hand is for calling forward directly in a test.
  FunctionContext(std::string functionName, std::vector<bool> needsInputGrad);
  FunctionContext(const FunctionContext&) = delete;
  FunctionContext& operator=(const FunctionContext&) = delete;

  const std::string& functionName() const { return functionName_; }

  // ---- in forward --------------------------------------------------------------------
  // Replaces what an earlier call saved. Undefined tensors may be saved (they come back undefined).
  void saveForBackward(TensorList tensors);
  template <class... Ts>
    requires(detail::isTensor<Ts> && ...)
  void saveForBackward(const Ts&... tensors) {
    saveForBackward(TensorList{tensors...});
  }
  template <class... Ts>
    requires(detail::isTensor<Ts> && ...)
  void markNonDifferentiable(const Ts&... outputs) {
    (nonDifferentiable_.push_back(outputs), ...);
  }
  template <class... Ts>
    requires(detail::isTensor<Ts> && ...)
  void markDirty(const Ts&... inputs) {
    (dirty_.push_back(inputs), ...);
  }
  // Whether backward's gradient for tensor input i is used (grad mode was on and
  // the input requires grad); backward may skip computing the others. In a split
  // backward (backwardDeferringWeights) backward is called twice, first for the
  // inputs that are not weights, then for the weights, and this says which.
  bool needsInputGrad(size_t tensorInput) const;
  size_t numTensorInputs() const { return needsInputGrad_.size(); }
  void setMaterializeGrads(bool materialize) { materializeGrads_ = materialize; }
  bool materializeGrads() const { return materializeGrads_; }

  // Plain values for backward (scalars, shapes, options); get<T> must name the type set() stored.
  template <class T>
  void set(const std::string& key, T value) {
    static_assert(!detail::isTensor<T> && !std::is_same_v<std::remove_cvref_t<T>, TensorList>,
                  "FunctionContext::set: keep tensors with saveForBackward (it checks in-place changes and does "
                  "not hold the graph alive)");
    values_[key] = std::move(value);
  }
  void set(const std::string& key, const char* value) { set(key, std::string(value)); }
  template <class T>
  const T& get(const std::string& key) const {
    auto it = values_.find(key);
    if (it == values_.end()) detail::throwMissingValue(*this, key);
    const T* value = std::any_cast<T>(&it->second);
    if (value == nullptr) detail::throwValueType(*this, key, it->second.type(), typeid(T));
    return *value;
  }
  bool has(const std::string& key) const { return values_.count(key) != 0; }
  std::vector<std::string> keys() const;

  // ---- in backward -------------------------------------------------------------------
  // The saved tensors, in saving order; throws if one was modified in place
  // since forward, if the graph was already freed, or when called in forward.
  TensorList savedTensors() const;

 private:
  friend void detail::finishApply(std::unique_ptr<FunctionContext>, const TensorList&, TensorList&,
                                  detail::FunctionBackward, bool);
  friend class FunctionNode;

  std::string functionName_;
  std::vector<bool> needsInputGrad_;
  bool materializeGrads_ = true;
  TensorList toSave_;
  TensorList nonDifferentiable_;
  TensorList dirty_;
  std::vector<SavedTensor> saved_;
  const Node* owner_ = nullptr;  // the node holding this context, once recorded
  std::map<std::string, std::any, std::less<>> values_;
};

template <class Derived>
class Function {
 public:
  template <class... Args>
  static auto apply(Args&&... args) {
    static_assert((!std::is_same_v<std::remove_cvref_t<Args>, TensorList> && ...),
                  "Function::apply: pass tensors as separate arguments; tensors inside a TensorList would get no "
                  "gradient");
    using Out = decltype(Derived::forward(std::declval<FunctionContext&>(), std::forward<Args>(args)...));
    static_assert(std::is_same_v<Out, Tensor> || std::is_same_v<Out, TensorList> || detail::IsTensorTuple<Out>::value,
                  "Function: forward must return Tensor, TensorList or std::tuple<Tensor, ...>");

    TensorList inputs;
    auto collect = [&inputs](const auto& arg) {
      if constexpr (detail::isTensor<decltype(arg)>) inputs.push_back(arg);
    };
    (collect(args), ...);
    const bool recording = needsGrad(inputs);
    std::vector<bool> needs(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) needs[i] = recording && inputs[i].defined() && inputs[i].requiresGrad();
    auto ctx = std::make_unique<FunctionContext>(functionName(), std::move(needs));

    Out out = [&] {
      NoGradGuard noGrad;
      return Derived::forward(*ctx, std::forward<Args>(args)...);
    }();
    TensorList flat = flatten(std::move(out));
    detail::finishApply(std::move(ctx), inputs, flat, &runBackward, recording);
    return unflatten<Out>(std::move(flat));
  }

  static std::string functionName() {
    if constexpr (requires { std::string_view(Derived::name); }) {
      return std::string(std::string_view(Derived::name));
    } else {
      return detail::readableTypeName(typeid(Derived));
    }
  }

 private:
  static TensorList runBackward(FunctionContext& ctx, const TensorList& gradOutputs) {
    using Grads = decltype(Derived::backward(ctx, gradOutputs));
    static_assert(std::is_same_v<Grads, Tensor> || std::is_same_v<Grads, TensorList>,
                  "Function: backward must return TensorList (one per tensor input) or Tensor (one tensor input)");
    if constexpr (std::is_same_v<Grads, Tensor>) {
      return TensorList{Derived::backward(ctx, gradOutputs)};
    } else {
      return Derived::backward(ctx, gradOutputs);
    }
  }

  template <class Out>
  static TensorList flatten(Out&& out) {
    using T = std::remove_cvref_t<Out>;
    if constexpr (std::is_same_v<T, Tensor>) {
      return TensorList{std::forward<Out>(out)};
    } else if constexpr (std::is_same_v<T, TensorList>) {
      return std::forward<Out>(out);
    } else {
      return std::apply([](auto&... ts) { return TensorList{ts...}; }, out);
    }
  }

  template <class Out>
  static Out unflatten(TensorList&& flat) {
    if constexpr (std::is_same_v<Out, Tensor>) {
      return std::move(flat[0]);
    } else if constexpr (std::is_same_v<Out, TensorList>) {
      return std::move(flat);
    } else {
      return [&]<size_t... I>(std::index_sequence<I...>) {
        return Out{std::move(flat[I])...};
      }(std::make_index_sequence<std::tuple_size_v<Out>>{});
    }
  }
};

}  // namespace dt::autograd
