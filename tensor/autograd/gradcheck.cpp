#include "tensor/autograd/gradcheck.h"

#include <cmath>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/ops.h"

namespace dt {

namespace {

// Pointer to the element with flat (row-major logical) index i of t.
double* elementPtr(Tensor& t, int64_t i) {
  int64_t off = 0;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    const int64_t s = t.sizes()[d];
    off += (i % s) * t.strides()[d];
    i /= s;
  }
  return static_cast<double*>(t.dataPtr()) + off;
}

double projected(const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs, const Tensor& v) {
  NoGradGuard ng;
  Tensor out = fn(inputs);
  return sum(mul(out.to(DType::Float64), v)).item<double>();
}

}  // namespace

GradcheckResult gradcheck(const std::function<Tensor(const TensorList&)>& fn, const TensorList& inputs,
                          const GradcheckOptions& options) {
  GradcheckResult result;
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (inputs[k].defined() && inputs[k].requiresGrad() && inputs[k].dtype() != DType::Float64) {
      throw InvalidArgument(str("gradcheck: input ", k, " is ", inputs[k].describe(), "; use float64 inputs"));
    }
    // It perturbs the inputs through host pointers.
    if (inputs[k].defined() && !inputs[k].device().isCpu()) {
      throw InvalidArgument(str("gradcheck: input ", k, " is ", inputs[k].describe(), " on ", inputs[k].device(),
                                "; gradcheck runs on cpu inputs (compare a device's gradients with the cpu's instead)"));
    }
  }
  for (const Tensor& t : inputs) {
    if (t.defined() && t.requiresGrad()) const_cast<Tensor&>(t).setGrad(Tensor());
  }
  Tensor out = fn(inputs);
  Generator gen(options.seed);
  Tensor v = randn(out.sizes(), gen, DType::Float64);
  TensorList wanted;
  std::vector<size_t> wantedIdx;
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (inputs[k].defined() && inputs[k].requiresGrad()) {
      wanted.push_back(inputs[k]);
      wantedIdx.push_back(k);
    }
  }
  Tensor loss = sum(mul(out.to(DType::Float64), v));
  TensorList analytic = grad({loss}, wanted, {}, false);
  double worst = 0;
  for (size_t w = 0; w < wanted.size(); ++w) {
    Tensor x = wanted[w];
    Tensor a = analytic[w].defined() ? analytic[w].to(DType::Float64).contiguous() : zerosLike(x);
    const double* ap = a.data<double>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      double* p = elementPtr(x, i);
      const double orig = *p;
      *p = orig + options.eps;
      const double fp = projected(fn, inputs, v);
      *p = orig - options.eps;
      const double fm = projected(fn, inputs, v);
      *p = orig;
      const double numeric = (fp - fm) / (2 * options.eps);
      const double err = std::abs(numeric - ap[i]);
      if (err > options.atol + options.rtol * std::abs(numeric) && err > worst) {
        worst = err;
        result.ok = false;
        result.message = str("input ", wantedIdx[w], " ", x.describe(), " element ", i, ": analytical ", ap[i],
                             " vs numerical ", numeric, " (|diff| ", err, ")");
      }
    }
  }
  return result;
}

}  // namespace dt
