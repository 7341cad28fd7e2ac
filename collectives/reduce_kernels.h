// CPU reduction kernels on raw buffers, for backends whose library lacks a
// dtype or op (Gloo has no bfloat16, no avg) and for local reductions
// (reduce-scatter's final step, tests).
//
// Contract: pure functions over caller-owned memory, thread-safe, no
// allocation. `out` may alias `a` or `b` exactly (same pointer), never
// partially. Loops are written to auto-vectorise (compiled -O3); float16 and
// bfloat16 are widened to float32, combined, and rounded back to nearest
// even once per call, so a chain of pairwise reductions accumulates one
// rounding per step (the same as PyTorch's gloo path). Avg combines as Sum;
// the caller divides once at the end with divideBy().
#pragma once

#include <cstddef>
#include <cstdint>

#include "collectives/reduce_op.h"
#include "tensor/dtype.h"

namespace dt {

// out[i] = a[i] (op) b[i] for i < count. Throws InvalidArgument for
// (Bool, Avg); NotSupportedError for a dtype it does not know.
void reduceBuffers(DType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t count);

// data[i] /= divisor (Avg's last step). Integers truncate toward zero.
void divideBy(DType dtype, void* data, size_t count, int64_t divisor);

// A function pointer with Gloo's reduce signature (out, a, b, count) for the
// given dtype and op, so backends can hand it to their library directly.
using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t count);
ReduceFn reduceFunction(DType dtype, ReduceOp op);

// Branch-free conversions used by the kernels (vectorisable; same results
// as dt::toFloat/toHalf/toBFloat16 including inf, NaN and subnormals).
namespace kernels {
float halfBitsToFloat(uint16_t bits);
uint16_t floatToHalfBits(float value);
float bfloat16BitsToFloat(uint16_t bits);
uint16_t floatToBFloat16Bits(float value);
}  // namespace kernels

}  // namespace dt
