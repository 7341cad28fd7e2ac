// bfloat16 autocast: a scope in which the cpu matrix products (mm, bmm, matmul, linear) multiply
// bfloat16 copies of their float32 operands with float32 accumulation and give float32 results,
// while every other op runs as written (float32 stays float32).
//
//   {
//     dt::autocast scope(dt::DType::BFloat16);
//     dt::Tensor loss = dt::crossEntropy((*model)(x), labels);   // Linear layers in bf16
//     loss.backward();                                            // may run outside the scope
//   }
//
// Contract:
//  * Thread-local: the guard affects ops started on the thread that made it, from construction
//    to destruction; other threads (ranks as threads, the autograd engine's) are unaffected.
//    Guards nest; each restores what was in effect before it. Not thread-safe to share a guard.
//  * Which ops: mm, bmm, matmul and linear on cpu tensors whose operands are float32 or bfloat16
//    (mixed is allowed inside the scope). Their results are float32. float64 and CUDA tensors,
//    and every other op, are untouched. linear's bias is added in float32.
//  * The fused attention core (scaledDotProductAttention, selfAttention) joins them only where
//    autocastAttention() is true: then its per-head products (Q K^T, P V and the backward's four)
//    take bf16 operands with float32 accumulation, while the softmax and its statistics, the
//    dropout, the outputs and the gradients stay float32. Off by default: measured no faster on
//    the GPT's shapes (the core alone 2-26 % slower, the step the same; docs/tensor.md).
//  * Gradients: the products' backward runs with the operand type chosen at forward time
//    (whether or not backward runs inside a scope); each input gets its gradient in its own
//    dtype, so float32 parameters get float32 gradients.
//  * Where bf16 products do not run natively (bf16MatmulNative() is false: no bf16 instructions,
//    or instructions slower than float32's under DT_BF16_MATMUL=auto; or the matmul backend is
//    openblas) the products run in float32 on the float32 operands, and the first such product
//    logs one line naming why (tensor/matmul_backend.h).
//  * Nothing here blocks or allocates; the guard owns nothing but the previous setting.
#pragma once

#include <optional>

#include "tensor/dtype.h"

namespace dt {

// Only DType::BFloat16 is supported (InvalidArgument naming the dtype otherwise); enabled =
// false makes a scope without autocast (inside an enabled one, say).
class autocast {
 public:
  explicit autocast(DType dtype = DType::BFloat16, bool enabled = true);
  ~autocast();
  autocast(const autocast&) = delete;
  autocast& operator=(const autocast&) = delete;

 private:
  std::optional<DType> previous_;
};

// The calling thread's autocast dtype; nullopt outside any enabled scope.
std::optional<DType> autocastDType();

// Whether the fused attention core runs its products in bf16 inside an enabled scope (see the
// contract above). Process-wide and thread-safe: DT_AUTOCAST_ATTENTION (0 or 1; InvalidArgument
// naming the variable otherwise) read at the first attention op, or setAutocastAttention(),
// which takes effect for attention ops that start after it returns. A backward keeps the choice
// its forward made.
bool autocastAttention();
void setAutocastAttention(bool bf16);

}  // namespace dt
