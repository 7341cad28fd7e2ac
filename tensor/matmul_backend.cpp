// The CPU matrix product's routing between OpenBLAS and oneDNN, and the OpenBLAS side of it.
// The oneDNN side is tensor/onednn_matmul.cpp (only in a build with DT_HAVE_ONEDNN).
#include "tensor/matmul_backend.h"

#include <cblas.h>
#include <strings.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "common/check.h"
#include "common/config.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"
#include "tensor/internal/gemm.h"
#include "tensor/parallel.h"

namespace dt {

namespace {

// -1: not read yet; else a MatmulBackend.
std::atomic<int> gBackend{-1};

void requireBuildHas(MatmulBackend backend, const std::string& what) {
  if (backend == MatmulBackend::OneDnn && !onednnAvailable()) {
    throw NotSupportedError(str(what, " asks for oneDNN, but this build of dtrain has none (DT_USE_ONEDNN=OFF, or libdnnl-dev "
                                      "was not installed when it was configured: scripts/setup.sh installs it)"));
  }
}

}  // namespace

const char* matmulBackendName(MatmulBackend backend) {
  switch (backend) {
    case MatmulBackend::Auto: return "auto";
    case MatmulBackend::OpenBlas: return "openblas";
    case MatmulBackend::OneDnn: return "onednn";
  }
  return "?";
}

MatmulBackend parseMatmulBackend(std::string_view text) {
  for (MatmulBackend b : {MatmulBackend::Auto, MatmulBackend::OpenBlas, MatmulBackend::OneDnn}) {
    const char* name = matmulBackendName(b);
    if (text.size() == std::strlen(name) && strncasecmp(text.data(), name, text.size()) == 0) return b;
  }
  throw InvalidArgument(str("matrix product backend '", text, "' is not known: expected auto, openblas or onednn"));
}

MatmulBackend matmulBackend() {
  int v = gBackend.load(std::memory_order_acquire);
  if (v >= 0) return static_cast<MatmulBackend>(v);
  const std::string text = env::getString("DT_MATMUL_BACKEND");
  MatmulBackend b = MatmulBackend::Auto;
  try {
    b = parseMatmulBackend(text);
  } catch (const InvalidArgument&) {
    throw InvalidArgument(str("DT_MATMUL_BACKEND=", text, " is not valid: expected auto, openblas or onednn"));
  }
  requireBuildHas(b, str("DT_MATMUL_BACKEND=", text));
  // Two threads reading it at once store the same value.
  gBackend.store(static_cast<int>(b), std::memory_order_release);
  return b;
}

void setMatmulBackend(MatmulBackend backend) {
  requireBuildHas(backend, str("setMatmulBackend(", matmulBackendName(backend), ")"));
  gBackend.store(static_cast<int>(backend), std::memory_order_release);
}

bool onednnAvailable() { return DT_HAVE_ONEDNN != 0; }

namespace {

// -1: not read yet; else a Bf16Matmul.
std::atomic<int> gBf16Matmul{-1};

// AVX512_BF16's dot products must outrun float32 FMAs by this much for auto to use them: a
// Zen 4/5 core runs them at about 2x, an Emerald Rapids Xeon without AMX (as cloud machines
// expose it) at 0.50x, where oneDNN's bf16 matmul ran the GPT's products at 0.55x float32's.
constexpr double kBf16MinSpeedup = 1.25;

}  // namespace

const char* bf16MatmulName(Bf16Matmul setting) { return setting == Bf16Matmul::Native ? "native" : "auto"; }

Bf16Matmul parseBf16Matmul(std::string_view text) {
  for (Bf16Matmul s : {Bf16Matmul::Auto, Bf16Matmul::Native}) {
    const char* name = bf16MatmulName(s);
    if (text.size() == std::strlen(name) && strncasecmp(text.data(), name, text.size()) == 0) return s;
  }
  throw InvalidArgument(str("bf16 matrix product setting '", text, "' is not known: expected auto or native"));
}

Bf16Matmul bf16MatmulSetting() {
  int v = gBf16Matmul.load(std::memory_order_acquire);
  if (v >= 0) return static_cast<Bf16Matmul>(v);
  const std::string text = env::getString("DT_BF16_MATMUL");
  Bf16Matmul s = Bf16Matmul::Auto;
  if (!text.empty()) {
    try {
      s = parseBf16Matmul(text);
    } catch (const InvalidArgument&) {
      throw InvalidArgument(str("DT_BF16_MATMUL=", text, " is not valid: expected auto or native"));
    }
  }
  gBf16Matmul.store(static_cast<int>(s), std::memory_order_release);
  return s;
}

void setBf16Matmul(Bf16Matmul setting) { gBf16Matmul.store(static_cast<int>(setting), std::memory_order_release); }

bool bf16MatmulNative() {
  if (!detail::onednn::bf16Instructions()) return false;
  if (bf16MatmulSetting() == Bf16Matmul::Native || detail::onednn::hasAmx()) return true;
  return detail::onednn::bf16DotOverFloat32FmaRate() >= kBf16MinSpeedup;
}

std::string bf16MatmulFallbackReason() {
  if (!onednnAvailable()) return "this build of dtrain has no oneDNN (DT_USE_ONEDNN)";
  if (!detail::onednn::bf16Instructions()) return detail::onednn::bf16MissingReason();
  if (bf16MatmulNative()) return "";
  return str("this CPU's AVX512_BF16 dot products run at ", fmt::format("{:.2f}", detail::onednn::bf16DotOverFloat32FmaRate()),
             "x the multiply-add rate of its float32 FMAs and it has no AMX (measured at the first bf16 product), so "
             "bf16 products would be slower than float32 ones; DT_BF16_MATMUL=native runs them in bf16 anyway");
}

namespace detail {

const char* gemmEngineName(GemmEngine engine) { return engine == GemmEngine::OneDnn ? "onednn" : "openblas"; }

namespace {

// The measured rule (docs/tensor.md, "Matrix products", the tables there). Float32 goes to
// oneDNN only when all of these hold:
//  * more than 2^18 multiply-adds (64^3; 2^15 where OpenBLAS's kernels are older than the CPU,
//    below), and m and n above 1: below that, and for matrix-vector products, oneDNN's per-call
//    cost (cache lookup, memory objects, its OpenMP team) is not won back (16^3: 40-109 GF/s on
//    OpenBLAS, 2-5 on oneDNN; 1x512x512 34 and 10; the attention core's 32x64x128, exactly
//    2^18, 0.46x on oneDNN);
//  * OpenBLAS's kernels are older than the CPU (an AVX2 core on an AVX-512 CPU, or the SSE3
//    fallback for a CPU model newer than the library): about 2x there; or oneDNN runs AVX-512
//    and the product runs on one thread (what dtrun gives each of several ranks on a host):
//    1.04-1.34x OpenBLAS's own SkylakeX kernels on an Ice Lake Xeon's GPT products, level with
//    its Cooperlake kernels on a Zen 5. With several threads and fitting kernels OpenBLAS stays:
//    its pool stood a busy machine better than oneDNN's OpenMP team (8-60 GF/s at two threads
//    beside a compile, where OpenBLAS kept 107-180).
constexpr int64_t kOneDnnMinMacs = int64_t{1} << 18;
// Against OpenBLAS's SSE3 fallback (14-27 GF/s on the attention core's products, 8-28 on 16^3
// to 128^3, in two runs on an Emerald Rapids) oneDNN wins from 64^3 on (the attention core's
// products 63-89 GF/s, 64^3 83-91) and is level at 32^3 (18-22 against 12-24): over 2^15
// multiply-adds.
constexpr int64_t kOneDnnMinMacsOverOldKernels = int64_t{1} << 15;

// OpenBLAS's cores by the widest vectors their sgemm kernels use: 512, 256, else older.
int coreVectorBits(const std::string& core) {
  for (const char* c : {"SkylakeX", "Cooperlake", "SapphireRapids"}) {
    if (strcasecmp(core.c_str(), c) == 0) return 512;
  }
  for (const char* c : {"Haswell", "Zen", "Excavator", "Steamroller"}) {
    if (strcasecmp(core.c_str(), c) == 0) return 256;
  }
  for (const char* c : {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom", "Katmai", "Coppermine",
                        "Northwood", "Banias", "Sandybridge", "Bulldozer", "Piledriver", "Opteron", "Barcelona"}) {
    if (strcasecmp(core.c_str(), c) == 0) return 128;
  }
  return 0;  // a name this table does not know (a newer OpenBLAS): taken as fitting
}

}  // namespace

bool openblasKernelsFitCpu(const std::string& core, bool cpuHasAvx512, bool cpuHasAvx2) {
  const int have = coreVectorBits(core);
  if (have == 0) return true;
  const int cpu = cpuHasAvx512 ? 512 : cpuHasAvx2 ? 256 : 128;
  return have >= cpu;
}

namespace {

// Read once per process: the OpenBLAS core and the CPU do not change while it runs.
bool openblasKernelsFitThisCpu() {
  static const bool fit =
      openblasKernelsFitCpu(blasKernelName(), __builtin_cpu_supports("avx512f"), __builtin_cpu_supports("avx2"));
  return fit;
}

bool autoPrefersOneDnn(const GemmProblem& p) {
  if (p.inType != DType::Float32 || p.m <= 1 || p.n <= 1) return false;
  const int64_t macs = p.batch * p.m * p.n * p.k;
  if (!openblasKernelsFitThisCpu()) return macs > kOneDnnMinMacsOverOldKernels;
  return macs > kOneDnnMinMacs && onednn::hasAvx512() && (numThreads() == 1 || insideParallelFor());
}

void runOpenBlas(const GemmProblem& p) {
  numThreads();  // makes sure OpenBLAS's thread count follows DT_NUM_THREADS
  const CBLAS_TRANSPOSE ta = p.transA ? CblasTrans : CblasNoTrans, tb = p.transB ? CblasTrans : CblasNoTrans;
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  const int lda = static_cast<int>(p.lda), ldb = static_cast<int>(p.ldb), ldc = static_cast<int>(p.ldc);
  double beta = p.beta;
  if (p.bias != nullptr) {  // the bias rows first, then the product accumulates onto them
    DT_INTERNAL_CHECK(p.outType == DType::Float32 && p.beta == 0.0, "gemm: a bias needs a float32 C and beta 0");
    for (int64_t i = 0; i < p.batch; ++i) {
      float* c = static_cast<float*>(p.c) + i * p.strideC;
      for (int64_t r = 0; r < p.m; ++r) std::memcpy(c + r * p.ldc, p.bias, static_cast<size_t>(p.n) * sizeof(float));
    }
    beta = 1.0;
  }
  for (int64_t i = 0; i < p.batch; ++i) {
    if (p.inType == DType::Float64) {
      cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, p.alpha, static_cast<const double*>(p.a) + i * p.strideA, lda,
                  static_cast<const double*>(p.b) + i * p.strideB, ldb, beta, static_cast<double*>(p.c) + i * p.strideC,
                  ldc);
    } else if (p.inType == DType::Float32) {
      cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, static_cast<float>(p.alpha),
                  static_cast<const float*>(p.a) + i * p.strideA, lda, static_cast<const float*>(p.b) + i * p.strideB,
                  ldb, static_cast<float>(beta), static_cast<float*>(p.c) + i * p.strideC, ldc);
    } else {
      // bf16 operands on OpenBLAS (which has no bf16 kernels in Debian's build): float32 copies.
      DT_INTERNAL_CHECK(p.inType == DType::BFloat16, "gemm: unexpected operand dtype ", p.inType);
      auto widen = [](const void* base, int64_t rows, int64_t cols, int64_t ld) {
        std::vector<float> dense(static_cast<size_t>(rows * cols));
        const auto* src = static_cast<const BFloat16*>(base);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) dense[static_cast<size_t>(r * cols + c)] = toFloat(src[r * ld + c]);
        }
        return dense;
      };
      const int64_t aRows = p.transA ? p.k : p.m, aCols = p.transA ? p.m : p.k;
      const int64_t bRows = p.transB ? p.n : p.k, bCols = p.transB ? p.k : p.n;
      const std::vector<float> A = widen(static_cast<const BFloat16*>(p.a) + i * p.strideA, aRows, aCols, p.lda);
      const std::vector<float> B = widen(static_cast<const BFloat16*>(p.b) + i * p.strideB, bRows, bCols, p.ldb);
      cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, static_cast<float>(p.alpha), A.data(),
                  static_cast<int>(std::max<int64_t>(1, aCols)), B.data(), static_cast<int>(std::max<int64_t>(1, bCols)),
                  static_cast<float>(beta), static_cast<float*>(p.c) + i * p.strideC, ldc);
    }
  }
}

}  // namespace

GemmEngine gemmEngineFor(const GemmProblem& p) {
  if (p.inType == DType::Float64 || !onednnAvailable()) return GemmEngine::OpenBlas;
  switch (matmulBackend()) {
    case MatmulBackend::OpenBlas: return GemmEngine::OpenBlas;
    case MatmulBackend::OneDnn: return GemmEngine::OneDnn;
    case MatmulBackend::Auto: break;
  }
  // bf16 operands reach here only where oneDNN runs them natively (gemmOperandType).
  if (p.inType == DType::BFloat16) return GemmEngine::OneDnn;
  return autoPrefersOneDnn(p) ? GemmEngine::OneDnn : GemmEngine::OpenBlas;
}

GemmEngine cpuGemmOn(GemmEngine engine, const GemmProblem& p) {
  if (engine == GemmEngine::OneDnn && p.inType != DType::Float64 && onednn::gemm(p)) return GemmEngine::OneDnn;
  runOpenBlas(p);
  return GemmEngine::OpenBlas;
}

GemmEngine cpuGemm(const GemmProblem& p) { return cpuGemmOn(gemmEngineFor(p), p); }

DType gemmOperandType(DType in, DType compute) {
  if (in != DType::BFloat16 || compute != DType::Float32) return compute;
  if (matmulBackend() == MatmulBackend::OpenBlas) return compute;  // asked for: no bf16 kernels, no log
  if (bf16MatmulNative()) return DType::BFloat16;
  static std::once_flag once;
  std::call_once(once, [] {
    logger("tensor")->warn("bfloat16 matrix products run in float32 (operands converted, no bf16 speed-up): {}",
                           bf16MatmulFallbackReason());
  });
  return compute;
}

#if !DT_HAVE_ONEDNN
namespace onednn {
bool gemm(const GemmProblem&) { return false; }
std::string implName(const GemmProblem&) { return ""; }
int64_t primitivesCreated() { return 0; }
int64_t productsRun() { return 0; }
std::string version() { return ""; }
bool bf16Instructions() { return false; }
bool hasAmx() { return false; }
double bf16DotOverFloat32FmaRate() { return 0.0; }
bool hasAvx512() { return false; }
std::string bf16MissingReason() { return "this build of dtrain has no oneDNN (DT_USE_ONEDNN)"; }
}  // namespace onednn
#endif

}  // namespace detail

std::string matmulKernelName() {
  using namespace detail;
  const std::string blas = "openblas:" + blasKernelName();
  if (!onednnAvailable()) return blas + ",bf16=fp32";
  // A product large enough for the rule to send to oneDNN: the GPT's MLP shape.
  GemmProblem probe{.inType = DType::Float32, .transB = true, .m = 1024, .n = 2048, .k = 512, .lda = 512, .ldb = 512,
                    .ldc = 2048};
  std::string dnn = onednn::implName(probe);
  dnn = dnn.empty() ? blas : "onednn:" + dnn;
  std::string fp32;
  switch (matmulBackend()) {
    case MatmulBackend::OpenBlas: fp32 = blas; break;
    case MatmulBackend::OneDnn: fp32 = dnn; break;
    case MatmulBackend::Auto:  // the small products stay on OpenBLAS
      fp32 = gemmEngineFor(probe) == GemmEngine::OneDnn && dnn != blas ? dnn + "+" + blas : blas;
      break;
  }
  std::string bf16 = "fp32";
  if (matmulBackend() != MatmulBackend::OpenBlas && bf16MatmulNative()) {
    probe.inType = DType::BFloat16;
    const std::string impl = onednn::implName(probe);
    if (!impl.empty()) bf16 = "onednn:" + impl;
  }
  return fp32 + ",bf16=" + bf16;
}

}  // namespace dt
