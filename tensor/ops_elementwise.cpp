// Elementwise ops: kernels, autograd, in-place variants, random fills.
#include <bit>
#include <cmath>
#include <cstring>

#include "common/check.h"
#include "common/config.h"
#include "tensor/autograd/anomaly.h"
#include "tensor/internal/detail.h"
#include "tensor/internal/fast_kernels.h"
#include "tensor/internal/loop.h"
#include "tensor/internal/op_scope.h"
#include "tensor/internal/ops_internal.h"
#include "tensor/parallel.h"

#if DT_HAVE_CUDA
#include "tensor/cuda/cuda.h"
#include "tensor/internal/cuda_ops.h"
#endif

namespace dt {

namespace detail {

// ---- autograd plumbing shared by all ops ----------------------------------------------------

TensorList FnNode::apply(TensorList&& grads) { return run(grads, nullptr); }

TensorList FnNode::applySome(const TensorList& grads, const std::vector<bool>& which) { return run(grads, &which); }

TensorList FnNode::run(const TensorList& grads, const std::vector<bool>* which) {
  if (!fn_) {
    throw InvalidArgument(str("Trying to backward through the graph a second time (", name_,
                              " already freed its saved tensors). Specify retainGraph=true on the first backward."));
  }
  TensorList saved;
  saved.reserve(saved_.size());
  for (const auto& s : saved_) saved.push_back(s.unpack(*this));
  std::vector<bool> needs(nextEdges().size());
  for (size_t i = 0; i < needs.size(); ++i) {
    needs[i] = nextEdges()[i].valid() && (which == nullptr || (i < which->size() && (*which)[i]));
  }
  TensorList out = fn_(BackwardContext{grads, saved, needs});
  for (size_t i = 0; i < out.size() && i < inputShapes_.size(); ++i) {
    if (!out[i].defined() || !needs[i]) {
      out[i] = Tensor();
      continue;
    }
    if (out[i].sizes() != inputShapes_[i]) out[i] = autograd::sumToShape(out[i], inputShapes_[i]);
    if (out[i].dtype() != inputTypes_[i]) out[i] = out[i].to(inputTypes_[i]);
  }
  return out;
}

std::optional<TensorList> FnNode::savedTensorsForReport() const {
  TensorList out;
  for (const auto& s : saved_) out.push_back(s.unpack(*this));
  return out;
}

void recordFn(const char* name, const TensorList& inputs, std::vector<Tensor*> outputs,
              const std::function<std::vector<SavedTensor>()>& saved, BackwardFn fn, WeightGrads weightGrads) {
  const bool anomalyActive = anomalyMayBeActive();
  if (anomalyActive) [[unlikely]] anomalyCheckForward(name, inputs, outputs);
  if (!autograd::needsGrad(inputs)) return;
  std::vector<Shape> shapes;
  std::vector<DType> types;
  for (const Tensor& t : inputs) {
    shapes.push_back(t.defined() ? t.sizes() : Shape{});
    types.push_back(t.defined() ? t.dtype() : DType::Float32);
  }
  auto node = std::make_shared<FnNode>(name, saved ? saved() : std::vector<SavedTensor>{}, std::move(fn),
                                       std::move(shapes), std::move(types), weightGrads);
  if (anomalyActive) [[unlikely]] node->setAnomalyRecord(anomalyRecordFor(name, inputs));
  auto& edges = node->nextEdges();
  for (const Tensor& t : inputs) edges.push_back(autograd::edgeFor(t));
  node->setNumOutputs(static_cast<uint32_t>(outputs.size()));
  uint32_t nr = 0;
  for (Tensor* out : outputs) {
    AutogradMeta& m = out->ensureAutogradMeta();
    m.gradFn = node;
    m.outputNr = nr++;
  }
}

void requireCpu(const Tensor& t, const char* op) {
  if (!t.defined()) throw InvalidArgument(str(op, ": got an undefined tensor"));
  if (!t.device().isCpu()) {
#if DT_HAVE_CUDA
    throw NotSupportedError(
        str(op, " is not supported on device ", t.device(), " (tensor ", t.describe(),
            "): it has no CUDA kernel yet; move the tensor to the cpu (to(Device::cpu())) for "
            "this op"));
#else
    throw NotSupportedError(str(op, " is not supported on device ", t.device(), " (tensor ", t.describe(),
                                "): this build has cpu kernels only"));
#endif
  }
}

bool cudaPathFor(const Tensor& t, const char* op) {
#if DT_HAVE_CUDA
  if (cuda::deviceCount() == 0) {
    throw NotSupportedError(str(op, " is not supported on device ", t.device(), " (tensor ", t.describe(),
                                "): ", cuda::unavailableReason()));
  }
  return true;
#else
  requireCpu(t, op);
  return false;
#endif
}

void requireSameDevice(const Tensor& a, const Tensor& b, const char* op) {
  if (a.device() != b.device()) {
    // describe() names only a non-cpu device; name both here.
    auto placed = [](const Tensor& t) {
      return t.device().isCpu() ? t.describe() + " on cpu" : t.describe();
    };
    throw InvalidArgument(
        str(op, ": Expected all tensors to be on the same device, but found at least two devices, ",
            a.device(), " and ", b.device(), "! (tensors on different devices: ", placed(a), " and ",
            placed(b), "); move one of them with to(", a.device(), ") or to(", b.device(), ")"));
  }
}

void requireFloat(const Tensor& t, const char* op) {
  if (!isFloatingPoint(t.dtype())) {
    throw InvalidArgument(str(op, ": expected a floating point tensor, got ", t.describe()));
  }
}

DType computeType(DType t) {
  if (t == DType::Float16 || t == DType::BFloat16) return DType::Float32;
  return t;
}

bool inplaceNeedsGrad(const Tensor& self, const TensorList& others, const char* op) {
  if (!gradModeEnabled()) return false;
  const bool any = self.requiresGrad() || autograd::needsGrad(others);
  if (!any) return false;
  if (self.requiresGrad() && self.isLeaf()) {
    throw InvalidArgument(str(op, ": a leaf Variable that requires grad (", self.describe(),
                              ") is being used in an in-place operation. Wrap the update in NoGradGuard."));
  }
  if (self.unsafeImpl()->isView) {
    throw NotSupportedError(str(op, ": in-place operation on a view (", self.describe(),
                                ") of a tensor that requires grad is not supported; clone() the view first"));
  }
  return true;
}

void commitInplace(Tensor& self, const Tensor& result) {
  {
    NoGradGuard ng;
    self.copy_(result);
  }
  if (AutogradMeta* m = result.autogradMeta(); m != nullptr && m->gradFn) {
    AutogradMeta& sm = self.ensureAutogradMeta();
    sm.gradFn = m->gradFn;
    sm.outputNr = m->outputNr;
  }
}

}  // namespace detail

using namespace detail;

Shape broadcastShapes(const Shape& a, const Shape& b, const char* op) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t x = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t y = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (x != y && x != 1 && y != 1) {
      throw InvalidArgument(str(op, ": shapes ", describeShape(a), " and ", describeShape(b),
                                " cannot be broadcast (dim ", i, ": ", x, " vs ", y, ")"));
    }
    out[i] = x == 1 ? y : x;
  }
  return out;
}

namespace {

// Strides of t broadcast to shape (0 where broadcast).
Shape stridesFor(const Tensor& t, const Shape& shape) {
  const size_t nd = shape.size();
  const size_t td = static_cast<size_t>(t.dim());
  Shape s(nd, 0);
  for (size_t i = 0; i < td; ++i) {
    const size_t d = nd - td + i;
    if (t.sizes()[i] != 1) s[d] = t.strides()[i];
  }
  return s;
}

// Only four compute types reach the kernels.
template <typename Fn>
decltype(auto) dispatchCompute(DType t, const char* op, Fn&& fn) {
  switch (t) {
    case DType::Float32: return fn.template operator()<float>();
    case DType::Float64: return fn.template operator()<double>();
    case DType::Int32: return fn.template operator()<int32_t>();
    case DType::Int64: return fn.template operator()<int64_t>();
    default: break;
  }
  throw InvalidArgument(str(op, ": dtype ", t, " is not supported"));
}

constexpr int64_t kGrain = 32768;

enum class Bin {
  Add, Sub, Mul, Div, Pow, Max, Min,
  Eq, Ne, Lt, Le, Gt, Ge,
  // Backward helpers (a = grad, b = saved value).
  ReluGrad, GeluGrad, TanhGrad, SigmoidGrad, SqrtGrad, AbsGrad,
};

const char* binName(Bin op) {
  switch (op) {
    case Bin::Add: return "add";
    case Bin::Sub: return "sub";
    case Bin::Mul: return "mul";
    case Bin::Div: return "div";
    case Bin::Pow: return "pow";
    case Bin::Max: return "maximum";
    case Bin::Min: return "minimum";
    case Bin::Eq: return "eq";
    case Bin::Ne: return "ne";
    case Bin::Lt: return "lt";
    case Bin::Le: return "le";
    case Bin::Gt: return "gt";
    case Bin::Ge: return "ge";
    default: return "elementwise backward";
  }
}

bool isCompare(Bin op) { return op >= Bin::Eq && op <= Bin::Ge; }

#if DT_HAVE_CUDA
// The CUDA kernels take Bin and Un by value: the enums must stay in step.
static_assert(static_cast<int>(Bin::Ge) == static_cast<int>(cuda::BinaryOp::Ge));
static_assert(static_cast<int>(Bin::AbsGrad) == static_cast<int>(cuda::BinaryOp::AbsGrad));
#endif

constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;

template <typename T, typename R, typename F>
void runBinary(const detail::ElementLoop<3>& loop, F f) {
  parallelFor(0, loop.numel(), kGrain, [&](int64_t b, int64_t e) {
    loop.run(b, e, [&](char** p, const int64_t* s, int64_t n) {
      constexpr int64_t ts = sizeof(T), rs = sizeof(R);
      R* o = reinterpret_cast<R*>(p[0]);
      const T* x = reinterpret_cast<const T*>(p[1]);
      const T* y = reinterpret_cast<const T*>(p[2]);
      if (s[0] == rs && s[1] == ts && s[2] == ts) {
        for (int64_t i = 0; i < n; ++i) o[i] = f(x[i], y[i]);
      } else if (s[0] == rs && s[1] == ts && s[2] == 0) {
        const T yv = *y;
        for (int64_t i = 0; i < n; ++i) o[i] = f(x[i], yv);
      } else if (s[0] == rs && s[1] == 0 && s[2] == ts) {
        const T xv = *x;
        for (int64_t i = 0; i < n; ++i) o[i] = f(xv, y[i]);
      } else {
        for (int64_t i = 0; i < n; ++i) {
          *reinterpret_cast<R*>(p[0] + i * s[0]) =
              f(*reinterpret_cast<const T*>(p[1] + i * s[1]), *reinterpret_cast<const T*>(p[2] + i * s[2]));
        }
      }
    });
  });
}

template <typename T>
void binaryDispatchOp(const detail::ElementLoop<3>& loop, Bin op, double alpha) {
  const T al = static_cast<T>(alpha);
  switch (op) {
    case Bin::Add:
      if (alpha == 1.0) return runBinary<T, T>(loop, [](T a, T b) { return static_cast<T>(a + b); });
      return runBinary<T, T>(loop, [al](T a, T b) { return static_cast<T>(a + al * b); });
    case Bin::Sub:
      if (alpha == 1.0) return runBinary<T, T>(loop, [](T a, T b) { return static_cast<T>(a - b); });
      return runBinary<T, T>(loop, [al](T a, T b) { return static_cast<T>(a - al * b); });
    case Bin::Mul: return runBinary<T, T>(loop, [](T a, T b) { return static_cast<T>(a * b); });
    case Bin::Div:
      if constexpr (std::is_integral_v<T>) {
        return runBinary<T, T>(loop, [](T a, T b) {
          if (b == 0) throw InvalidArgument("div: integer division by zero");
          return static_cast<T>(a / b);
        });
      } else {
        return runBinary<T, T>(loop, [](T a, T b) { return a / b; });
      }
    case Bin::Pow:
      return runBinary<T, T>(loop, [](T a, T b) {
        return static_cast<T>(std::pow(static_cast<double>(a), static_cast<double>(b)));
      });
    case Bin::Max:
      return runBinary<T, T>(loop, [](T a, T b) { return (a != a) ? a : (a > b ? a : b); });
    case Bin::Min:
      return runBinary<T, T>(loop, [](T a, T b) { return (a != a) ? a : (a < b ? a : b); });
    case Bin::Eq: return runBinary<T, bool>(loop, [](T a, T b) { return a == b; });
    case Bin::Ne: return runBinary<T, bool>(loop, [](T a, T b) { return a != b; });
    case Bin::Lt: return runBinary<T, bool>(loop, [](T a, T b) { return a < b; });
    case Bin::Le: return runBinary<T, bool>(loop, [](T a, T b) { return a <= b; });
    case Bin::Gt: return runBinary<T, bool>(loop, [](T a, T b) { return a > b; });
    case Bin::Ge: return runBinary<T, bool>(loop, [](T a, T b) { return a >= b; });
    case Bin::ReluGrad: return runBinary<T, T>(loop, [](T g, T out) { return out > T(0) ? g : T(0); });
    case Bin::GeluGrad:
      return runBinary<T, T>(loop, [](T g, T x) {
        const double xd = static_cast<double>(x);
        const double cdf = 0.5 * (1.0 + std::erf(xd * kInvSqrt2));
        const double pdf = kInvSqrt2Pi * std::exp(-0.5 * xd * xd);
        return static_cast<T>(static_cast<double>(g) * (cdf + xd * pdf));
      });
    case Bin::TanhGrad: return runBinary<T, T>(loop, [](T g, T y) { return static_cast<T>(g * (T(1) - y * y)); });
    case Bin::SigmoidGrad: return runBinary<T, T>(loop, [](T g, T y) { return static_cast<T>(g * y * (T(1) - y)); });
    case Bin::SqrtGrad: return runBinary<T, T>(loop, [](T g, T y) { return static_cast<T>(g / (T(2) * y)); });
    case Bin::AbsGrad:
      return runBinary<T, T>(loop, [](T g, T x) { return x > T(0) ? g : (x < T(0) ? static_cast<T>(-g) : T(0)); });
  }
}

DType arithType(DType a, DType b, Bin op) {
  DType t = promoteTypes(a, b);
  if (t == DType::Bool && !isCompare(op)) t = DType::Int64;
  if ((op == Bin::Div) && !isFloatingPoint(t)) t = DType::Float32;
  return t;
}

// out (if defined) must have the broadcast shape and the result dtype.
Tensor binaryKernel(const Tensor& a, const Tensor& b, Bin op, double alpha = 1.0, Tensor out = Tensor()) {
  NoGradGuard noGrad;  // conversions inside kernels are not part of the graph
  const char* name = binName(op);
  requireSameDevice(a, b, name);
  const bool onGpu = onCuda(a, name);
  const Shape shape = broadcastShapes(a.sizes(), b.sizes(), name);
  const DType resultType = arithType(a.dtype(), b.dtype(), op);
  const DType ct = computeType(resultType);
  const Tensor A = a.to(ct), B = b.to(ct);
  const DType outType = isCompare(op) ? DType::Bool : ct;
  Tensor target = out;
  if (!target.defined() || target.dtype() != outType) {
    target = empty(shape, outType, a.device());
  }
  const Shape as = stridesFor(A, shape), bs = stridesFor(B, shape);
  if (onGpu) {
#if DT_HAVE_CUDA
    cuda::binary(a.device(), static_cast<cuda::BinaryOp>(op), ct, target.dataPtr(), A.dataPtr(), B.dataPtr(),
                 cuda::makeGeometry(shape, {target.strides(), as, bs}, name), alpha);
#endif
  } else {
    detail::ElementLoop<3> loop(
        shape,
        {static_cast<char*>(target.dataPtr()), static_cast<char*>(const_cast<void*>(A.dataPtr())),
         static_cast<char*>(const_cast<void*>(B.dataPtr()))},
        {target.strides().data(), as.data(), bs.data()},
        {static_cast<int64_t>(itemSize(outType)), static_cast<int64_t>(itemSize(ct)),
         static_cast<int64_t>(itemSize(ct))});
    dispatchCompute(ct, name, [&]<typename T>() { binaryDispatchOp<T>(loop, op, alpha); });
  }
  if (out.defined() && !target.isSameAs(out)) {
    out.copy_(target);
    return out;
  }
  if (!isCompare(op) && resultType != ct) return target.to(resultType);
  return target;
}

enum class Un { Neg, Exp, Log, Sqrt, Abs, Clamp, Relu, Gelu, Tanh, Sigmoid, Fill };

#if DT_HAVE_CUDA
static_assert(static_cast<int>(Un::Sigmoid) == static_cast<int>(cuda::UnaryOp::Sigmoid));
static_assert(static_cast<int>(Un::Clamp) == static_cast<int>(cuda::UnaryOp::Clamp));
#endif

const char* unName(Un op) {
  switch (op) {
    case Un::Neg: return "neg";
    case Un::Exp: return "exp";
    case Un::Log: return "log";
    case Un::Sqrt: return "sqrt";
    case Un::Abs: return "abs";
    case Un::Clamp: return "clamp";
    case Un::Relu: return "relu";
    case Un::Gelu: return "gelu";
    case Un::Tanh: return "tanh";
    case Un::Sigmoid: return "sigmoid";
    case Un::Fill: return "fill";
  }
  return "unary";
}

template <typename T, typename F>
void runUnary(const detail::ElementLoop<2>& loop, F f) {
  parallelFor(0, loop.numel(), kGrain, [&](int64_t b, int64_t e) {
    loop.run(b, e, [&](char** p, const int64_t* s, int64_t n) {
      constexpr int64_t ts = sizeof(T);
      T* o = reinterpret_cast<T*>(p[0]);
      const T* x = reinterpret_cast<const T*>(p[1]);
      if (s[0] == ts && s[1] == ts) {
        for (int64_t i = 0; i < n; ++i) o[i] = f(x[i]);
      } else {
        for (int64_t i = 0; i < n; ++i) {
          *reinterpret_cast<T*>(p[0] + i * s[0]) = f(*reinterpret_cast<const T*>(p[1] + i * s[1]));
        }
      }
    });
  });
}

template <typename T>
void unaryDispatchOp(const detail::ElementLoop<2>& loop, Un op, double p0, double p1) {
  switch (op) {
    case Un::Neg: return runUnary<T>(loop, [](T x) { return static_cast<T>(-x); });
    case Un::Abs: return runUnary<T>(loop, [](T x) { return x < T(0) ? static_cast<T>(-x) : x; });
    case Un::Relu: return runUnary<T>(loop, [](T x) { return x > T(0) ? x : T(0); });
    case Un::Clamp: {
      const T lo = static_cast<T>(std::max(p0, static_cast<double>(std::numeric_limits<T>::lowest())));
      const T hi = static_cast<T>(std::min(p1, static_cast<double>(std::numeric_limits<T>::max())));
      return runUnary<T>(loop, [lo, hi](T x) { return x != x ? x : (x < lo ? lo : (x > hi ? hi : x)); });
    }
    default: break;
  }
  if constexpr (std::is_floating_point_v<T>) {
    switch (op) {
      case Un::Exp: return runUnary<T>(loop, [](T x) { return std::exp(x); });
      case Un::Log: return runUnary<T>(loop, [](T x) { return std::log(x); });
      case Un::Sqrt: return runUnary<T>(loop, [](T x) { return std::sqrt(x); });
      case Un::Tanh: return runUnary<T>(loop, [](T x) { return std::tanh(x); });
      case Un::Sigmoid: return runUnary<T>(loop, [](T x) { return static_cast<T>(T(1) / (T(1) + std::exp(-x))); });
      case Un::Gelu:
        return runUnary<T>(loop, [](T x) {
          return static_cast<T>(0.5 * static_cast<double>(x) * (1.0 + std::erf(static_cast<double>(x) * kInvSqrt2)));
        });
      default: break;
    }
  }
  throw InvalidArgument(str(unName(op), ": not supported for this dtype"));
}

bool floatOnly(Un op) {
  return op == Un::Exp || op == Un::Log || op == Un::Sqrt || op == Un::Tanh || op == Un::Sigmoid || op == Un::Gelu;
}

Tensor unaryKernel(const Tensor& a, Un op, double p0 = 0, double p1 = 0, Tensor out = Tensor()) {
  NoGradGuard noGrad;
  const char* name = unName(op);
  const bool onGpu = onCuda(a, name);
  DType resultType = a.dtype();
  if (resultType == DType::Bool) resultType = DType::Int64;
  if (floatOnly(op) && !isFloatingPoint(resultType)) resultType = DType::Float32;
  const DType ct = computeType(resultType);
  const Tensor A = a.to(ct);
  Tensor target = out;
  if (!target.defined() || target.dtype() != ct) target = empty(a.sizes(), ct, a.device());
  if (onGpu) {
#if DT_HAVE_CUDA
    cuda::unary(a.device(), static_cast<cuda::UnaryOp>(op), ct, target.dataPtr(), A.dataPtr(),
                cuda::makeGeometry(a.sizes(), {target.strides(), A.strides()}, name), p0, p1);
#endif
  } else {
    detail::ElementLoop<2> loop(
        a.sizes(), {static_cast<char*>(target.dataPtr()), static_cast<char*>(const_cast<void*>(A.dataPtr()))},
        {target.strides().data(), A.strides().data()},
        {static_cast<int64_t>(itemSize(ct)), static_cast<int64_t>(itemSize(ct))});
    dispatchCompute(ct, name, [&]<typename T>() { unaryDispatchOp<T>(loop, op, p0, p1); });
  }
  if (out.defined() && !target.isSameAs(out)) {
    out.copy_(target);
    return out;
  }
  if (resultType != ct) return target.to(resultType);
  return target;
}

bool isHalfLike(DType t) { return t == DType::Float16 || t == DType::BFloat16; }

Tensor scalarLike(double v, const Tensor& like) {
  // Python-scalar semantics: a scalar does not promote a float tensor; a float scalar
  // with an int tensor promotes to float32. 16-bit tensors get a float32 scalar (their
  // math runs in float32 anyway); callers convert the result back (withScalar).
  DType t = like.dtype();
  if (!isFloatingPoint(t) && v != std::floor(v)) t = DType::Float32;
  if (t == DType::Bool) t = DType::Int64;
  if (isHalfLike(t)) t = DType::Float32;
  // On like's device: a CUDA operand gets a device scalar (one fill kernel, no host wait).
  return full({}, v, t, like.device());
}

// op(a, scalar) keeping a's dtype for float16/bfloat16 (the scalar is not rounded to 16 bits).
template <typename F>
Tensor withScalar(const Tensor& a, double v, F op) {
  Tensor r = op(a, scalarLike(v, a));
  if (isHalfLike(a.dtype()) && r.dtype() != a.dtype()) return r.to(a.dtype());
  return r;
}

}  // namespace

// ---- differentiable binary ops -------------------------------------------------------------------

Tensor add(const Tensor& a, const Tensor& b, double alpha) {
  detail::OpScope opScope("add", a, b);
  Tensor out = binaryKernel(a, b, Bin::Add, alpha);
  recordFn("AddBackward", {a, b}, out, nullptr, [alpha](const BackwardContext& c) -> TensorList {
    return {c.grads[0], alpha == 1.0 ? c.grads[0] : mul(c.grads[0], alpha)};
  });
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b, double alpha) {
  detail::OpScope opScope("sub", a, b);
  Tensor out = binaryKernel(a, b, Bin::Sub, alpha);
  recordFn("SubBackward", {a, b}, out, nullptr, [alpha](const BackwardContext& c) -> TensorList {
    return {c.grads[0], c.needs[1] ? mul(c.grads[0], -alpha) : Tensor()};
  });
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  detail::OpScope opScope("mul", a, b);
  Tensor out = binaryKernel(a, b, Bin::Mul);
  recordFn(
      "MulBackward", {a, b}, out, [&] { return std::vector<SavedTensor>{SavedTensor(a), SavedTensor(b)}; },
      [](const BackwardContext& c) -> TensorList {
        return {c.needs[0] ? mul(c.grads[0], c.saved[1]) : Tensor(), c.needs[1] ? mul(c.grads[0], c.saved[0]) : Tensor()};
      });
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  detail::OpScope opScope("div", a, b);
  Tensor out = binaryKernel(a, b, Bin::Div);
  recordFn(
      "DivBackward", {a, b}, out, [&] { return std::vector<SavedTensor>{SavedTensor(a), SavedTensor(b)}; },
      [](const BackwardContext& c) -> TensorList {
        const Tensor& g = c.grads[0];
        Tensor ga = c.needs[0] ? div(g, c.saved[1]) : Tensor();
        Tensor gb = c.needs[1] ? neg(div(mul(g, c.saved[0]), mul(c.saved[1], c.saved[1]))) : Tensor();
        return {ga, gb};
      });
  return out;
}

Tensor pow(const Tensor& a, const Tensor& b) {
  detail::OpScope opScope("pow", a, b);
  Tensor out = binaryKernel(a, b, Bin::Pow);
  recordFn(
      "PowBackward", {a, b}, out,
      [&] { return std::vector<SavedTensor>{SavedTensor(a), SavedTensor(b), SavedTensor(out, true)}; },
      [](const BackwardContext& c) -> TensorList {
        const Tensor& g = c.grads[0];
        const Tensor &x = c.saved[0], &y = c.saved[1], &o = c.saved[2];
        Tensor ga =
            c.needs[0] ? mul(g, mul(y, pow(x, sub(y, full({}, 1.0, y.dtype(), y.device()))))) : Tensor();
        Tensor gb;
        if (c.needs[1]) {
          // d/dy x^y = x^y log x; defined as 0 where x == 0 (PyTorch's convention).
          Tensor lg = where(eq(x, full({}, 0.0, x.dtype(), x.device())), zerosLike(x), log(x));
          gb = mul(g, mul(o, lg));
        }
        return {ga, gb};
      });
  return out;
}

namespace {
Tensor minmaxBinary(const Tensor& a, const Tensor& b, Bin op, const char* name) {
  Tensor out = binaryKernel(a, b, op);
  recordFn(
      name, {a, b}, out, [&] { return std::vector<SavedTensor>{SavedTensor(a), SavedTensor(b)}; },
      [op](const BackwardContext& c) -> TensorList {
        const Tensor& g = c.grads[0];
        const Tensor &x = c.saved[0], &y = c.saved[1];
        // Ties split the gradient evenly, as PyTorch does.
        Tensor aWins = op == Bin::Max ? gt(x, y) : lt(x, y);
        Tensor tie = eq(x, y);
        Tensor half = mul(g, 0.5);
        Tensor zero = zerosLike(g);
        Tensor ga = where(aWins, g, where(tie, half, zero));
        Tensor bWins = op == Bin::Max ? lt(x, y) : gt(x, y);
        Tensor gb = where(bWins, g, where(tie, half, zero));
        return {ga, gb};
      });
  return out;
}
}  // namespace

Tensor maximum(const Tensor& a, const Tensor& b) {
  detail::OpScope opScope("maximum", a, b);
  return minmaxBinary(a, b, Bin::Max, "MaximumBackward");
}
Tensor minimum(const Tensor& a, const Tensor& b) {
  detail::OpScope opScope("minimum", a, b);
  return minmaxBinary(a, b, Bin::Min, "MinimumBackward");
}

Tensor add(const Tensor& a, double b) {
  return withScalar(a, b, [](const Tensor& x, const Tensor& s) { return add(x, s); });
}
Tensor sub(const Tensor& a, double b) {
  return withScalar(a, b, [](const Tensor& x, const Tensor& s) { return sub(x, s); });
}
Tensor mul(const Tensor& a, double b) {
  return withScalar(a, b, [](const Tensor& x, const Tensor& s) { return mul(x, s); });
}
Tensor div(const Tensor& a, double b) {
  return withScalar(a, b, [](const Tensor& x, const Tensor& s) { return div(x, s); });
}
Tensor rsub(const Tensor& a, double b) {
  return withScalar(a, b, [](const Tensor& x, const Tensor& s) { return sub(s, x); });
}

Tensor pow(const Tensor& a, double e) {
  detail::OpScope opScope("pow", a);
  Tensor out = binaryKernel(a, scalarLike(e, a), Bin::Pow);
  if (isHalfLike(a.dtype()) && out.dtype() != a.dtype()) {
    NoGradGuard ng;
    out = out.to(a.dtype());
  }
  recordFn(
      "PowBackward", {a}, out, [&] { return std::vector<SavedTensor>{SavedTensor(a)}; },
      [e](const BackwardContext& c) -> TensorList {
        if (e == 0.0) return {zerosLike(c.grads[0])};
        return {mul(c.grads[0], mul(pow(c.saved[0], e - 1.0), e))};
      });
  return out;
}

// ---- unary ------------------------------------------------------------------------------------------

Tensor neg(const Tensor& a) {
  detail::OpScope opScope("neg", a);
  Tensor out = unaryKernel(a, Un::Neg);
  recordFn("NegBackward", {a}, out, nullptr, [](const BackwardContext& c) -> TensorList { return {neg(c.grads[0])}; });
  return out;
}

Tensor exp(const Tensor& a) {
  detail::OpScope opScope("exp", a);
  Tensor out = unaryKernel(a, Un::Exp);
  recordFn(
      "ExpBackward", {a}, out, [&] { return std::vector<SavedTensor>{SavedTensor(out, true)}; },
      [](const BackwardContext& c) -> TensorList { return {mul(c.grads[0], c.saved[0])}; });
  return out;
}

Tensor log(const Tensor& a) {
  detail::OpScope opScope("log", a);
  Tensor out = unaryKernel(a, Un::Log);
  recordFn(
      "LogBackward", {a}, out, [&] { return std::vector<SavedTensor>{SavedTensor(a)}; },
      [](const BackwardContext& c) -> TensorList { return {div(c.grads[0], c.saved[0])}; });
  return out;
}

Tensor sqrt(const Tensor& a) {
  detail::OpScope opScope("sqrt", a);
  Tensor out = unaryKernel(a, Un::Sqrt);
  recordFn(
      "SqrtBackward", {a}, out, [&] { return std::vector<SavedTensor>{SavedTensor(out, true)}; },
      [](const BackwardContext& c) -> TensorList {
        return {binaryKernel(c.grads[0], c.saved[0], Bin::SqrtGrad)};
      });
  return out;
}

Tensor abs(const Tensor& a) {
  detail::OpScope opScope("abs", a);
  Tensor out = unaryKernel(a, Un::Abs);
  recordFn(
      "AbsBackward", {a}, out, [&] { return std::vector<SavedTensor>{SavedTensor(a)}; },
      [](const BackwardContext& c) -> TensorList { return {binaryKernel(c.grads[0], c.saved[0], Bin::AbsGrad)}; });
  return out;
}

Tensor clamp(const Tensor& a, std::optional<double> lo, std::optional<double> hi) {
  detail::OpScope opScope("clamp", a);
  const double l = lo.value_or(-INFINITY), h = hi.value_or(INFINITY);
  Tensor out = unaryKernel(a, Un::Clamp, l, h);
  recordFn(
      "ClampBackward", {a}, out, [&] { return std::vector<SavedTensor>{SavedTensor(a)}; },
      [l, h](const BackwardContext& c) -> TensorList {
        const Tensor& x = c.saved[0];
        Tensor inside = mul(ge(x, full({}, l, DType::Float64, x.device())).to(DType::Int64),
                            le(x, full({}, h, DType::Float64, x.device())).to(DType::Int64));
        return {where(inside.to(DType::Bool), c.grads[0], zerosLike(c.grads[0]))};
      });
  return out;
}

Tensor detail::reluBackward(const Tensor& grad, const Tensor& output) {
  return binaryKernel(grad, output, Bin::ReluGrad);
}

Tensor relu(const Tensor& a) {
  detail::OpScope opScope("relu", a);
  Tensor out = unaryKernel(a, Un::Relu);
  recordFn(
      "ReluBackward", {a}, out, [&] { return std::vector<SavedTensor>{SavedTensor(out, true)}; },
      [](const BackwardContext& c) -> TensorList { return {reluBackward(c.grads[0], c.saved[0])}; });
  return out;
}

namespace {

// Float32 on the cpu: the vectorised GELU of fast_kernels.h over contiguous memory.
bool fastGelu(const Tensor& t) { return t.device().isCpu() && t.dtype() == DType::Float32; }

}  // namespace

Tensor gelu(const Tensor& a) {
  detail::OpScope opScope("gelu", a);
  Tensor out;
  if (fastGelu(a)) {
    NoGradGuard ng;
    const Tensor x = a.contiguous();
    out = empty(a.sizes());
    const float* xp = x.data<float>();
    float* yp = out.data<float>();
    parallelFor(0, x.numel(), kGrain, [&](int64_t b, int64_t e) { fast::geluForward(xp + b, yp + b, e - b); });
  } else {
    out = unaryKernel(a, Un::Gelu);
  }
  recordFn(
      "GeluBackward", {a}, out, [&] { return std::vector<SavedTensor>{SavedTensor(a)}; },
      [](const BackwardContext& c) -> TensorList {
        const Tensor& x = c.saved[0];
        if (fastGelu(x) && c.grads[0].sizes() == x.sizes()) {
          const Tensor xc = x.contiguous(), g = c.grads[0].to(DType::Float32).contiguous();
          Tensor gx = empty(x.sizes());
          const float *xp = xc.data<float>(), *gp = g.data<float>();
          float* op = gx.data<float>();
          parallelFor(0, xc.numel(), kGrain,
                      [&](int64_t b, int64_t e) { fast::geluBackward(gp + b, xp + b, op + b, e - b); });
          return {gx};
        }
        return {binaryKernel(c.grads[0], x, Bin::GeluGrad)};
      });
  return out;
}

Tensor tanh(const Tensor& a) {
  detail::OpScope opScope("tanh", a);
  Tensor out = unaryKernel(a, Un::Tanh);
  recordFn(
      "TanhBackward", {a}, out, [&] { return std::vector<SavedTensor>{SavedTensor(out, true)}; },
      [](const BackwardContext& c) -> TensorList { return {binaryKernel(c.grads[0], c.saved[0], Bin::TanhGrad)}; });
  return out;
}

Tensor sigmoid(const Tensor& a) {
  detail::OpScope opScope("sigmoid", a);
  Tensor out = unaryKernel(a, Un::Sigmoid);
  recordFn(
      "SigmoidBackward", {a}, out, [&] { return std::vector<SavedTensor>{SavedTensor(out, true)}; },
      [](const BackwardContext& c) -> TensorList {
        return {binaryKernel(c.grads[0], c.saved[0], Bin::SigmoidGrad)};
      });
  return out;
}

// ---- comparisons and where -------------------------------------------------------------------------

namespace {
Tensor comparison(const char* name, const Tensor& a, const Tensor& b, Bin op) {
  detail::OpScope opScope(name, a, b);
  return binaryKernel(a, b, op);
}
}  // namespace

Tensor eq(const Tensor& a, const Tensor& b) { return comparison("eq", a, b, Bin::Eq); }
Tensor ne(const Tensor& a, const Tensor& b) { return comparison("ne", a, b, Bin::Ne); }
Tensor lt(const Tensor& a, const Tensor& b) { return comparison("lt", a, b, Bin::Lt); }
Tensor le(const Tensor& a, const Tensor& b) { return comparison("le", a, b, Bin::Le); }
Tensor gt(const Tensor& a, const Tensor& b) { return comparison("gt", a, b, Bin::Gt); }
Tensor ge(const Tensor& a, const Tensor& b) { return comparison("ge", a, b, Bin::Ge); }
Tensor gt(const Tensor& a, double b) { return gt(a, scalarLike(b, a)); }
Tensor lt(const Tensor& a, double b) { return lt(a, scalarLike(b, a)); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  detail::OpScope opScope("where", cond, a, b);
  requireSameDevice(cond, a, "where");
  requireSameDevice(a, b, "where");
  const bool onGpu = onCuda(a, "where");
  if (cond.dtype() != DType::Bool) {
    throw InvalidArgument(str("where: condition must be bool, got ", cond.describe()));
  }
  const Shape shape = broadcastShapes(broadcastShapes(cond.sizes(), a.sizes(), "where"), b.sizes(), "where");
  const DType rt = promoteTypes(a.dtype(), b.dtype());
  Tensor A, B;
  {
    NoGradGuard noGrad;
    A = a.to(rt);
    B = b.to(rt);
  }
  Tensor out = empty(shape, rt, a.device());
  const Shape cs = stridesFor(cond, shape), as = stridesFor(A, shape), bs = stridesFor(B, shape);
  const int64_t isz = static_cast<int64_t>(itemSize(rt));
  if (onGpu) {
#if DT_HAVE_CUDA
    cuda::where(a.device(), rt, out.dataPtr(), cond.dataPtr(), A.dataPtr(), B.dataPtr(),
                cuda::makeGeometry(shape, {out.strides(), cs, as, bs}, "where"));
#endif
  } else {
    detail::ElementLoop<4> loop(
        shape,
        {static_cast<char*>(out.dataPtr()), static_cast<char*>(const_cast<void*>(cond.dataPtr())),
         static_cast<char*>(const_cast<void*>(A.dataPtr())),
         static_cast<char*>(const_cast<void*>(B.dataPtr()))},
        {out.strides().data(), cs.data(), as.data(), bs.data()}, {isz, 1, isz, isz});
    loop.run(0, loop.numel(), [&](char** p, const int64_t* s, int64_t n) {
      for (int64_t i = 0; i < n; ++i) {
        const bool c = *reinterpret_cast<const bool*>(p[1] + i * s[1]);
        std::memcpy(p[0] + i * s[0], c ? p[2] + i * s[2] : p[3] + i * s[3], static_cast<size_t>(isz));
      }
    });
  }
  recordFn(
      "WhereBackward", {a, b}, out, [&] { return std::vector<SavedTensor>{SavedTensor(cond)}; },
      [](const BackwardContext& c) -> TensorList {
        const Tensor& g = c.grads[0];
        Tensor zero = zerosLike(g);
        return {c.needs[0] ? where(c.saved[0], g, zero) : Tensor(), c.needs[1] ? where(c.saved[0], zero, g) : Tensor()};
      });
  return out;
}

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator-(const Tensor& a) { return neg(a); }
Tensor operator+(const Tensor& a, double b) { return add(a, b); }
Tensor operator-(const Tensor& a, double b) { return sub(a, b); }
Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
Tensor operator/(const Tensor& a, double b) { return div(a, b); }
Tensor operator*(double a, const Tensor& b) { return mul(b, a); }

// ---- in-place ------------------------------------------------------------------------------------------

namespace {

// self = op(self, other) computed straight into self when dtypes allow.
Tensor& binaryInplace(Tensor& self, const Tensor& other, Bin op, double alpha, const char* name,
                      Tensor (*outOfPlace)(const Tensor&, const Tensor&, double)) {
  if (inplaceNeedsGrad(self, {other}, name)) {
    // Compute from a clone so tensors saved by the op are not the ones overwritten below.
    Tensor r = outOfPlace(self.clone(), other, alpha);
    commitInplace(self, r);
    return self;
  }
  requireSameDevice(self, other, name);
  const Shape shape = broadcastShapes(self.sizes(), other.sizes(), name);
  if (shape != self.sizes()) {
    throw InvalidArgument(str(name, ": result shape ", describeShape(shape), " does not fit in-place target ",
                              self.describe(), " (other is ", other.describe(), ")"));
  }
  binaryKernel(self, other, op, alpha, self);
  self.bumpVersion();
  return self;
}

Tensor addAlpha(const Tensor& a, const Tensor& b, double alpha) { return add(a, b, alpha); }
Tensor subAlpha(const Tensor& a, const Tensor& b, double alpha) { return sub(a, b, alpha); }
Tensor mulAlpha(const Tensor& a, const Tensor& b, double) { return mul(a, b); }
Tensor divAlpha(const Tensor& a, const Tensor& b, double) { return div(a, b); }

}  // namespace

Tensor& add_(Tensor& self, const Tensor& other, double alpha) {
  detail::OpScope opScope("add_", self, other);
  return binaryInplace(self, other, Bin::Add, alpha, "add_", addAlpha);
}
Tensor& sub_(Tensor& self, const Tensor& other, double alpha) {
  detail::OpScope opScope("sub_", self, other);
  return binaryInplace(self, other, Bin::Sub, alpha, "sub_", subAlpha);
}
Tensor& mul_(Tensor& self, const Tensor& other) {
  detail::OpScope opScope("mul_", self, other);
  return binaryInplace(self, other, Bin::Mul, 1.0, "mul_", mulAlpha);
}
Tensor& div_(Tensor& self, const Tensor& other) {
  detail::OpScope opScope("div_", self, other);
  return binaryInplace(self, other, Bin::Div, 1.0, "div_", divAlpha);
}
// A scalar does not promote the tensor (PyTorch's rule): float32 stays float32, no temporary.
Tensor& add_(Tensor& self, double value) { return add_(self, scalarLike(value, self)); }
Tensor& mul_(Tensor& self, double value) { return mul_(self, scalarLike(value, self)); }

Tensor& relu_(Tensor& self) {
  detail::OpScope opScope("relu_", self);
  if (inplaceNeedsGrad(self, {}, "relu_")) {
    commitInplace(self, relu(self));
    return self;
  }
  unaryKernel(self, Un::Relu, 0, 0, self);
  self.bumpVersion();
  return self;
}

Tensor& clamp_(Tensor& self, std::optional<double> lo, std::optional<double> hi) {
  detail::OpScope opScope("clamp_", self);
  if (inplaceNeedsGrad(self, {}, "clamp_")) {
    commitInplace(self, clamp(self.clone(), lo, hi));
    return self;
  }
  unaryKernel(self, Un::Clamp, lo.value_or(-INFINITY), hi.value_or(INFINITY), self);
  self.bumpVersion();
  return self;
}

Tensor& sqrt_(Tensor& self) {
  detail::OpScope opScope("sqrt_", self);
  if (inplaceNeedsGrad(self, {}, "sqrt_")) {
    commitInplace(self, sqrt(self));
    return self;
  }
  unaryKernel(self, Un::Sqrt, 0, 0, self);
  self.bumpVersion();
  return self;
}

void addInPlace(Tensor& dst, const Tensor& src, double alpha) {
  detail::OpScope opScope("addInPlace", dst, src);
  NoGradGuard ng;
  requireSameDevice(dst, src, "add_");
  if (dst.sizes() != src.sizes() && broadcastShapes(dst.sizes(), src.sizes(), "add_") != dst.sizes()) {
    throw InvalidArgument(str("add_: cannot accumulate ", src.describe(), " into ", dst.describe()));
  }
  // Fast path: contiguous float32 of equal shape (gradient accumulation, optimizer steps).
  if (dst.device().isCpu() && dst.dtype() == DType::Float32 && src.dtype() == DType::Float32 &&
      dst.isContiguous() && src.isContiguous() && dst.sizes() == src.sizes()) {
    float* d = dst.data<float>();
    const float* s = src.data<float>();
    const float a = static_cast<float>(alpha);
    parallelFor(0, dst.numel(), kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) d[i] += a * s[i];
    });
    dst.bumpVersion();
    return;
  }
  binaryKernel(dst, src, Bin::Add, alpha, dst);
  dst.bumpVersion();
}

Tensor& addcmul_(Tensor& self, const Tensor& t1, const Tensor& t2, double value) {
  detail::OpScope opScope("addcmul_", self, t1, t2);
  NoGradGuard ng;
  addInPlace(self, mul(t1, t2), value);
  return self;
}

Tensor& addcdiv_(Tensor& self, const Tensor& t1, const Tensor& t2, double value) {
  detail::OpScope opScope("addcdiv_", self, t1, t2);
  NoGradGuard ng;
  addInPlace(self, div(t1, t2), value);
  return self;
}

// ---- random ----------------------------------------------------------------------------------------------

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

uint64_t Generator::nextUint64() { return splitmix64(splitmix64(seed_) + 0x9e3779b97f4a7c15ull * ++counter_); }

double Generator::nextNormal() {
  if (hasSpareNormal_) {
    hasSpareNormal_ = false;
    return spareNormal_;
  }
  double u1 = nextDouble();
  while (u1 <= 0.0) u1 = nextDouble();
  const double u2 = nextDouble();
  const double r = std::sqrt(-2.0 * std::log(u1));
  spareNormal_ = r * std::sin(2.0 * M_PI * u2);
  hasSpareNormal_ = true;
  return r * std::cos(2.0 * M_PI * u2);
}

std::array<uint64_t, 4> GeneratorState::toWords() const {
  return {seed, counter, hasSpareNormal ? 1u : 0u, std::bit_cast<uint64_t>(hasSpareNormal ? spareNormal : 0.0)};
}

GeneratorState GeneratorState::fromWords(const std::array<uint64_t, 4>& words, const std::string& what) {
  if (words[2] > 1) {
    throw InvalidArgument(str(what, ": word 2 (has a spare normal) is ", words[2], "; expected 0 or 1"));
  }
  return {words[0], words[1], words[2] == 1, words[2] == 1 ? std::bit_cast<double>(words[3]) : 0.0};
}

Generator& defaultGenerator() {
  static Generator g(0);
  return g;
}

void manualSeed(uint64_t seed) { defaultGenerator().manualSeed(seed); }

namespace {
template <typename F>
Tensor& fillRandom(Tensor& self, const char* op, F next) {
  // A CUDA tensor gets the same cpu-generated sequence through copy_ (the stream stays the cpu's).
  (void)onCuda(self, op);
  requireFloat(self, op);
  // Generate contiguously in float64, then convert: same sequence whatever the dtype.
  Tensor tmp = empty(self.sizes(), DType::Float64);
  double* p = tmp.data<double>();
  for (int64_t i = 0; i < tmp.numel(); ++i) p[i] = next();
  NoGradGuard ng;
  self.copy_(tmp);
  return self;
}
}  // namespace

Tensor& normal_(Tensor& self, double meanValue, double stdValue, Generator& g) {
  detail::OpScope opScope("normal_", self);
  return fillRandom(self, "normal_", [&] { return meanValue + stdValue * g.nextNormal(); });
}

Tensor& uniform_(Tensor& self, double low, double high, Generator& g) {
  detail::OpScope opScope("uniform_", self);
  return fillRandom(self, "uniform_", [&] { return low + (high - low) * g.nextDouble(); });
}

Tensor randn(Shape sizes, Generator& g, DType dtype) {
  detail::OpScope opScope("randn");
  Tensor t = empty(std::move(sizes), dtype);
  normal_(t, 0.0, 1.0, g);
  return t;
}

Tensor rand(Shape sizes, Generator& g, DType dtype) {
  detail::OpScope opScope("rand");
  Tensor t = empty(std::move(sizes), dtype);
  uniform_(t, 0.0, 1.0, g);
  return t;
}

Tensor randint(int64_t low, int64_t high, Shape sizes, Generator& g, DType dtype) {
  detail::OpScope opScope("randint");
  DT_CHECK_LT(low, high, "randint: empty range");
  Tensor t = empty(std::move(sizes), DType::Int64);
  int64_t* p = t.data<int64_t>();
  const uint64_t range = static_cast<uint64_t>(high - low);
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = low + static_cast<int64_t>(g.nextUint64() % range);
  return t.to(dtype);
}

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol) {
  detail::OpScope opScope("allclose", a, b);
  if (a.sizes() != b.sizes()) return false;
  const auto x = a.toVector<double>(), y = b.toVector<double>();
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) {
      if (std::isnan(x[i]) != std::isnan(y[i])) return false;
      continue;
    }
    if (std::abs(x[i] - y[i]) > atol + rtol * std::abs(y[i])) return false;
  }
  return true;
}

}  // namespace dt
