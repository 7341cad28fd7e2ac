// Which library runs the CPU matrix products of mm, bmm, matmul and linear: OpenBLAS or oneDNN.
//
// Contract: every function is thread-safe. The setting is process-wide: DT_MATMUL_BACKEND
// (auto, openblas, onednn) read at the first matrix product, or setMatmulBackend(), which
// takes effect for products that start after it returns. Nothing here blocks on other threads
// beyond a short lock; nothing hands out ownership. Float64 products always run on OpenBLAS;
// CUDA tensors on cuBLAS, whatever the setting.
//
// Auto picks per shape by the rule measured in docs/tensor.md ("Matrix products"); openblas
// and onednn force one library for every float32 product (for tests and benchmarks).
// BFloat16 operands run oneDNN's bf16 kernels (float32 accumulation) where the CPU has bf16
// instructions, the setting is not openblas, and (under DT_BF16_MATMUL=auto, the default) they
// are faster than float32 here: AMX, or AVX512_BF16 dot products that outrun the CPU's float32
// FMAs (measured once, at the first bf16 product: about 2 ms). Otherwise they are converted to
// float32 first, and the first such product logs one line naming why.
#pragma once

#include <string>
#include <string_view>

namespace dt {

enum class MatmulBackend { Auto, OpenBlas, OneDnn };

// "auto", "openblas", "onednn".
const char* matmulBackendName(MatmulBackend backend);
// Parses those names (case-insensitive); InvalidArgument naming `text` and what is accepted.
MatmulBackend parseMatmulBackend(std::string_view text);

// The current setting (DT_MATMUL_BACKEND at first use: InvalidArgument naming the variable if it
// does not parse; NotSupportedError for onednn in a build without oneDNN).
MatmulBackend matmulBackend();
// Overrides the setting for the process; OneDnn in a build without oneDNN is a NotSupportedError.
void setMatmulBackend(MatmulBackend backend);

// Whether this build has oneDNN (DT_HAVE_ONEDNN).
bool onednnAvailable();

// Where bf16 instructions exist, whether bf16 products use them: auto (default) where they are
// faster than float32, native wherever they exist (tests, benchmarks, or to get bf16's rounding).
enum class Bf16Matmul { Auto, Native };
// "auto", "native".
const char* bf16MatmulName(Bf16Matmul setting);
// Parses those names (case-insensitive); InvalidArgument naming `text` and what is accepted.
Bf16Matmul parseBf16Matmul(std::string_view text);
// The current setting (DT_BF16_MATMUL at first use: InvalidArgument naming the variable if it
// does not parse).
Bf16Matmul bf16MatmulSetting();
// Overrides it for the process, for products that start after it returns.
void setBf16Matmul(Bf16Matmul setting);

// Whether bfloat16 products run as bfloat16 (oneDNN with AVX512_BF16 or AMX within oneDNN's
// ISA cap, ONEDNN_MAX_CPU_ISA, and faster than float32 unless the setting is native); false
// means they are converted to float32.
bool bf16MatmulNative();
// Why bf16MatmulNative() is false ("" when it is true): the build, the instructions the CPU (or
// oneDNN's ISA cap) lacks, or bf16 dot products measured slower than float32 FMAs here.
std::string bf16MatmulFallbackReason();

// What runs this process's float32 and bfloat16 products under the current setting, one token
// for RESULT lines, e.g. "onednn:brg:avx512_core+openblas:SkylakeX" (auto: both, by the rule),
// "openblas:Haswell", "onednn:brg:avx512_core"; with ",bf16=onednn:brg:avx512_core_bf16" or
// ",bf16=fp32" appended. oneDNN's part is its implementation string for a large product.
std::string matmulKernelName();

}  // namespace dt
