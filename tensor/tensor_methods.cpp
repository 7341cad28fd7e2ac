// Tensor's math members: each forwards to the free function of tensor/ops.h. They live here,
// not in tensor.h, because ops.h includes tensor.h. Calls are qualified with dt:: since inside
// a member the unqualified name would find the member itself.
#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace dt {

Tensor Tensor::add(const Tensor& other, double alpha) const { return dt::add(*this, other, alpha); }
Tensor Tensor::add(double other) const { return dt::add(*this, other); }
Tensor Tensor::sub(const Tensor& other, double alpha) const { return dt::sub(*this, other, alpha); }
Tensor Tensor::sub(double other) const { return dt::sub(*this, other); }
Tensor Tensor::mul(const Tensor& other) const { return dt::mul(*this, other); }
Tensor Tensor::mul(double other) const { return dt::mul(*this, other); }
Tensor Tensor::div(const Tensor& other) const { return dt::div(*this, other); }
Tensor Tensor::div(double other) const { return dt::div(*this, other); }
Tensor Tensor::pow(const Tensor& exponent) const { return dt::pow(*this, exponent); }
Tensor Tensor::pow(double exponent) const { return dt::pow(*this, exponent); }
Tensor Tensor::maximum(const Tensor& other) const { return dt::maximum(*this, other); }
Tensor Tensor::minimum(const Tensor& other) const { return dt::minimum(*this, other); }
Tensor Tensor::neg() const { return dt::neg(*this); }
Tensor Tensor::exp() const { return dt::exp(*this); }
Tensor Tensor::log() const { return dt::log(*this); }
Tensor Tensor::sqrt() const { return dt::sqrt(*this); }
Tensor Tensor::abs() const { return dt::abs(*this); }
Tensor Tensor::clamp(std::optional<double> low, std::optional<double> high) const {
  return dt::clamp(*this, low, high);
}
Tensor Tensor::relu() const { return dt::relu(*this); }
Tensor Tensor::gelu() const { return dt::gelu(*this); }
Tensor Tensor::tanh() const { return dt::tanh(*this); }
Tensor Tensor::sigmoid() const { return dt::sigmoid(*this); }

Tensor Tensor::eq(const Tensor& other) const { return dt::eq(*this, other); }
Tensor Tensor::ne(const Tensor& other) const { return dt::ne(*this, other); }
Tensor Tensor::lt(const Tensor& other) const { return dt::lt(*this, other); }
Tensor Tensor::le(const Tensor& other) const { return dt::le(*this, other); }
Tensor Tensor::gt(const Tensor& other) const { return dt::gt(*this, other); }
Tensor Tensor::ge(const Tensor& other) const { return dt::ge(*this, other); }
Tensor Tensor::gt(double other) const { return dt::gt(*this, other); }
Tensor Tensor::lt(double other) const { return dt::lt(*this, other); }

Tensor Tensor::sum() const { return dt::sum(*this); }
Tensor Tensor::sum(const std::vector<int64_t>& dims, bool keepdim) const { return dt::sum(*this, dims, keepdim); }
Tensor Tensor::mean() const { return dt::mean(*this); }
Tensor Tensor::mean(const std::vector<int64_t>& dims, bool keepdim) const { return dt::mean(*this, dims, keepdim); }
Tensor Tensor::max() const { return dt::max(*this); }
Tensor Tensor::min() const { return dt::min(*this); }
ValuesIndices Tensor::max(int64_t dim, bool keepdim) const { return dt::max(*this, dim, keepdim); }
ValuesIndices Tensor::min(int64_t dim, bool keepdim) const { return dt::min(*this, dim, keepdim); }
Tensor Tensor::amax(const std::vector<int64_t>& dims, bool keepdim) const { return dt::amax(*this, dims, keepdim); }
Tensor Tensor::argmax() const { return dt::argmax(*this); }
Tensor Tensor::argmax(int64_t dim, bool keepdim) const { return dt::argmax(*this, dim, keepdim); }
Tensor Tensor::argmin(int64_t dim, bool keepdim) const { return dt::argmin(*this, dim, keepdim); }

Tensor Tensor::mm(const Tensor& other) const { return dt::mm(*this, other); }
Tensor Tensor::bmm(const Tensor& other) const { return dt::bmm(*this, other); }
Tensor Tensor::matmul(const Tensor& other) const { return dt::matmul(*this, other); }
Tensor Tensor::softmax(int64_t dim) const { return dt::softmax(*this, dim); }
Tensor Tensor::logSoftmax(int64_t dim) const { return dt::logSoftmax(*this, dim); }
Tensor Tensor::indexSelect(int64_t dim, const Tensor& index) const { return dt::indexSelect(*this, dim, index); }
bool Tensor::allclose(const Tensor& other, double rtol, double atol) const {
  return dt::allclose(*this, other, rtol, atol);
}

Tensor& Tensor::add_(const Tensor& other, double alpha) { return dt::add_(*this, other, alpha); }
Tensor& Tensor::add_(double other) { return dt::add_(*this, other); }
Tensor& Tensor::sub_(const Tensor& other, double alpha) { return dt::sub_(*this, other, alpha); }
Tensor& Tensor::mul_(const Tensor& other) { return dt::mul_(*this, other); }
Tensor& Tensor::mul_(double other) { return dt::mul_(*this, other); }
Tensor& Tensor::div_(const Tensor& other) { return dt::div_(*this, other); }
Tensor& Tensor::relu_() { return dt::relu_(*this); }
Tensor& Tensor::clamp_(std::optional<double> low, std::optional<double> high) { return dt::clamp_(*this, low, high); }
Tensor& Tensor::sqrt_() { return dt::sqrt_(*this); }

}  // namespace dt
