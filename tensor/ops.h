// Tensor ops (CPU kernels) with autograd.
//
// Contract:
//  * Every op is a free function; differentiable ops record an autograd node
//    when grad mode is on and an input requires grad (tensor/autograd). The
//    common ones also have member forms on Tensor (x.sum({1}) is sum(x, {1}));
//    a new op that LibTorch offers as a method gets a one-line member too.
//  * Binary ops broadcast like NumPy/PyTorch and compute in the promoted dtype
//    (promoteTypes); float16/bfloat16 compute in float32 and round back once.
//    Bool operands of arithmetic are treated as int64.
//  * Shape/dtype/device mismatches and out-of-range indices throw
//    InvalidArgument naming both sides; a tensor on a device without kernels
//    throws NotSupportedError naming the op and the device.
//  * matmul/mm/bmm/linear on the cpu go through OpenBLAS or oneDNN, shape by shape
//    (tensor/matmul_backend.h); transposed operands are passed as such, not copied.
//  * Kernels may use numThreads() threads (tensor/parallel.h). Ops are
//    thread-safe for distinct outputs; in-place ops (names ending in _) bump
//    the version counter of the modified tensor.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "tensor/autograd/autograd.h"
#include "tensor/generator.h"
#include "tensor/tensor.h"

namespace dt {

// ---- elementwise ---------------------------------------------------------------------------
Tensor add(const Tensor& a, const Tensor& b, double alpha = 1.0);  // a + alpha * b
Tensor sub(const Tensor& a, const Tensor& b, double alpha = 1.0);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor sub(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor div(const Tensor& a, double b);
Tensor pow(const Tensor& a, double exponent);
Tensor rsub(const Tensor& a, double b);  // b - a

Tensor neg(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor sqrt(const Tensor& a);
Tensor abs(const Tensor& a);
Tensor clamp(const Tensor& a, std::optional<double> min, std::optional<double> max);
Tensor relu(const Tensor& a);
Tensor gelu(const Tensor& a);  // exact (erf) form, PyTorch's default
Tensor tanh(const Tensor& a);
Tensor sigmoid(const Tensor& a);

// Comparisons return bool tensors (not differentiable).
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, double b);
Tensor lt(const Tensor& a, double b);

// cond ? a : b (broadcasting all three; cond must be bool).
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator*(double a, const Tensor& b);

// ---- in-place (bump the version; autograd: not on leaves that require grad) --------------
Tensor& add_(Tensor& self, const Tensor& other, double alpha = 1.0);
Tensor& sub_(Tensor& self, const Tensor& other, double alpha = 1.0);
Tensor& mul_(Tensor& self, const Tensor& other);
Tensor& div_(Tensor& self, const Tensor& other);
Tensor& add_(Tensor& self, double value);
Tensor& mul_(Tensor& self, double value);
Tensor& relu_(Tensor& self);
Tensor& clamp_(Tensor& self, std::optional<double> min, std::optional<double> max);
// self += value * t1 * t2 ; self += value * t1 / t2  (optimizer helpers; no autograd)
Tensor& addcmul_(Tensor& self, const Tensor& t1, const Tensor& t2, double value = 1.0);
Tensor& addcdiv_(Tensor& self, const Tensor& t1, const Tensor& t2, double value = 1.0);
Tensor& sqrt_(Tensor& self);
// dst += alpha * src without autograd (gradient accumulation, optimizers).
void addInPlace(Tensor& dst, const Tensor& src, double alpha = 1.0);

// ---- reductions -------------------------------------------------------------------------------
Tensor sum(const Tensor& a);
Tensor sum(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim = false);
Tensor mean(const Tensor& a);
Tensor mean(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim = false);
Tensor max(const Tensor& a);  // over all elements
Tensor min(const Tensor& a);
// ValuesIndices is in tensor/tensor.h (Tensor's member forms return it too).
ValuesIndices max(const Tensor& a, int64_t dim, bool keepdim = false);
ValuesIndices min(const Tensor& a, int64_t dim, bool keepdim = false);
Tensor amax(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim = false);
Tensor argmax(const Tensor& a, int64_t dim, bool keepdim = false);
Tensor argmax(const Tensor& a);  // flat index
Tensor argmin(const Tensor& a, int64_t dim, bool keepdim = false);

// ---- linear algebra --------------------------------------------------------------------------
Tensor mm(const Tensor& a, const Tensor& b);   // [n,k] x [k,m]
Tensor bmm(const Tensor& a, const Tensor& b);  // [B,n,k] x [B,k,m]
// PyTorch matmul semantics: 1-D/2-D/batched with broadcast batch dims.
Tensor matmul(const Tensor& a, const Tensor& b);
// x [*, in] . weight[out, in]^T + bias[out]: one gemm forward, two gemms backward.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// ---- nn functions -------------------------------------------------------------------------------
Tensor softmax(const Tensor& a, int64_t dim);
Tensor logSoftmax(const Tensor& a, int64_t dim);
enum class Reduction { None, Mean, Sum };
struct CrossEntropyOptions {
  int64_t ignoreIndex = -100;
  double labelSmoothing = 0.0;
  Reduction reduction = Reduction::Mean;
};
// logits [N, C] (or [C]), target int64 [N] class indices.
Tensor crossEntropy(const Tensor& logits, const Tensor& target, const CrossEntropyOptions& options = {});
Tensor mseLoss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean);
// weight [num, dim], indices int32/int64 of any shape -> [*indices.shape, dim].
Tensor embedding(const Tensor& weight, const Tensor& indices);
Tensor layerNorm(const Tensor& x, const std::vector<int64_t>& normalizedShape, const Tensor& weight = Tensor(),
                 const Tensor& bias = Tensor(), double eps = 1e-5);
Tensor dropout(const Tensor& x, double p, bool training, Generator& generator = defaultGenerator());

// ---- attention (tensor/ops_attention.cpp; cpu kernels, a CUDA tensor throws NotSupportedError) ----
struct AttentionOptions {
  bool causal = true;    // query i sees keys 0..i (needs as many queries as keys)
  double dropoutP = 0.0;  // on the attention probabilities, only while training
  bool training = true;
  std::optional<double> scale;  // default 1 / sqrt(head dim)
};
// softmax(q k^T * scale [+ causal mask]) v, fused: q [*, Tq, D], k [*, Tk, D], v [*, Tk, Dv]
// -> [*, Tq, Dv]. The probabilities exist once per head (saved for backward); dropout draws one
// number per visible score from `generator`, in (head, query, key) order.
Tensor scaledDotProductAttention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& options = {},
                                 Generator& generator = defaultGenerator());
// Multi-head self-attention on a fused projection: qkv [B, T, 3C] holds q, k and v side by side
// (each [B, T, C], head h in columns [h C/H, (h+1) C/H)); returns the heads' outputs merged back
// to [B, T, C]. The same as splitting, viewing as [B, H, T, C/H], scaledDotProductAttention and
// merging, without the copies; its backward writes the gradient of qkv in one tensor.
Tensor selfAttention(const Tensor& qkv, int64_t numHeads, const AttentionOptions& options = {},
                     Generator& generator = defaultGenerator());

// ---- joining and indexing -----------------------------------------------------------------------
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor indexSelect(const Tensor& a, int64_t dim, const Tensor& index);

// ---- random -------------------------------------------------------------------------------------------
Tensor randn(Shape sizes, Generator& generator = defaultGenerator(), DType dtype = DType::Float32);
Tensor rand(Shape sizes, Generator& generator = defaultGenerator(), DType dtype = DType::Float32);
Tensor randint(int64_t low, int64_t high, Shape sizes, Generator& generator = defaultGenerator(),
               DType dtype = DType::Int64);
Tensor& normal_(Tensor& self, double mean = 0.0, double std = 1.0, Generator& generator = defaultGenerator());
Tensor& uniform_(Tensor& self, double low = 0.0, double high = 1.0, Generator& generator = defaultGenerator());

// ---- misc ------------------------------------------------------------------------------------------------
// True when a and b have the same shape and all |a-b| <= atol + rtol*|b|.
bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8);
// Broadcast shape of a and b, or InvalidArgument naming both.
Shape broadcastShapes(const Shape& a, const Shape& b, const char* op = "broadcast");

}  // namespace dt
