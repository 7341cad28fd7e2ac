// bfloat16 products on a CPU without bf16 instructions, made by capping oneDNN's ISA with its own
// environment variable (ONEDNN_MAX_CPU_ISA=AVX2, set by ctest; main sets it when run by hand,
// before oneDNN's first use, which is when oneDNN reads it): they run in float32, give correct
// values, and the process logs exactly one line naming what is missing.
#include <cstdlib>
#include <sstream>
#include <string>
#include <utility>

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include "common/logging.h"
#include "tensor/autocast.h"
#include "tensor/internal/gemm.h"
#include "tensor/matmul_backend.h"
#include "tensor/ops.h"

namespace dt {
namespace {

size_t countOf(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(MatmulIsaCap, BFloat16FallsBackToFloat32WithOneLogLine) {
  if (!onednnAvailable()) {
    GTEST_SKIP() << "this build has no oneDNN (DT_USE_ONEDNN=OFF): there is no ISA to cap (the build's own fallback "
                    "reason is checked by matmul_backend_test)";
  }
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  ASSERT_FALSE(bf16MatmulNative()) << "ONEDNN_MAX_CPU_ISA=" << (cap != nullptr ? cap : "(unset)")
                                   << " did not cap oneDNN below bf16";
  const std::string reason = bf16MatmulFallbackReason();
  // The reason depends on the CPU under the cap: one with the instructions names the cap, one
  // without names what it lacks (an AVX2-only CPU lacks avx512f too, an AVX-512 one only bf16).
  if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
    EXPECT_NE(reason.find("capped below it"), std::string::npos) << reason;
    if (cap != nullptr) {
      EXPECT_NE(reason.find(std::string("ONEDNN_MAX_CPU_ISA=") + cap), std::string::npos) << reason;
    }
  } else {
    EXPECT_NE(reason.find("this CPU lacks"), std::string::npos) << reason;
    EXPECT_NE(reason.find("avx512bf16"), std::string::npos) << reason;
  }
  EXPECT_NE(reason.find("avx512_core_bf16"), std::string::npos) << "every reason names oneDNN's ISA: " << reason;

  // Attached for the test's duration; detached on every exit (an ASSERT returns early).
  std::ostringstream log;
  struct SinkScope {
    explicit SinkScope(std::ostringstream& out) { logger("tensor")->sinks().push_back(std::make_shared<spdlog::sinks::ostream_sink_mt>(out)); }
    ~SinkScope() { logger("tensor")->sinks().pop_back(); }
  } sinkScope(log);

  Generator g(8);
  for (int rep = 0; rep < 3; ++rep) {
    const Tensor a = randn({40, 300}, g).to(DType::BFloat16), b = randn({300, 50}, g).to(DType::BFloat16);
    const Tensor r = mm(a, b);
    ASSERT_EQ(r.dtype(), DType::BFloat16);
    const Tensor ref = mm(a.to(DType::Float64), b.to(DType::Float64));
    const Tensor bound = mm(abs(a.to(DType::Float64)), abs(b.to(DType::Float64)));
    const auto rv = r.toVector<double>(), fv = ref.toVector<double>(), bv = bound.toVector<double>();
    for (size_t i = 0; i < rv.size(); ++i) {
      ASSERT_LE(std::abs(rv[i] - fv[i]), std::abs(fv[i]) / 256.0 + 600.0 / (1 << 24) * bv[i]) << "at " << i;
    }
  }
  logger("tensor")->flush();
  const std::string text = log.str();
  EXPECT_EQ(countOf(text, "bfloat16 matrix products run in float32"), 1u) << text;
  // One line, the reason on it (other warnings may share the log: OpenBLAS's kernels under a
  // forced OPENBLAS_CORETYPE, say).
  const size_t at = text.find("bfloat16 matrix products run in float32");
  const std::string line = at == std::string::npos ? "" : text.substr(at, text.find('\n', at) - at);
  EXPECT_NE(line.find("avx512_core_bf16"), std::string::npos) << "one line with the reason: " << text;
  // Under autocast the products run on the float32 operands as they are: float32's result exactly.
  {
    const Tensor a = randn({64, 96}, g), b = randn({96, 48}, g);
    const Tensor plain = mm(a, b);
    autocast scope;
    EXPECT_TRUE(allclose(mm(a, b), plain, 0.0, 0.0));
  }
  logger("tensor")->flush();
  EXPECT_EQ(countOf(log.str(), "bfloat16 matrix products run in float32"), 1u) << "still one line";
  // The operands were converted to float32, not handed to oneDNN's bf16 emulation.
  EXPECT_EQ(detail::gemmOperandType(DType::BFloat16, DType::Float32), DType::Float32);
  EXPECT_NE(matmulKernelName().find("bf16=fp32"), std::string::npos) << matmulKernelName();
}

// The fused attention core, switched to bf16 under autocast, falls back to its float32 path
// (no oneDNN, no emulation): float32's result and gradients exactly.
TEST(MatmulIsaCap, AttentionUnderAutocastStaysFloat32) {
  ASSERT_FALSE(bf16MatmulNative()) << "ONEDNN_MAX_CPU_ISA did not cap oneDNN below bf16";
  const bool previous = autocastAttention();
  setAutocastAttention(true);
  Generator g(9);
  const Tensor qkv0 = randn({2, 37, 3 * 24}, g), up = randn({2, 37, 24}, g);
  auto run = [&](bool inScope) {
    Tensor qkv = qkv0.clone().setRequiresGrad(true);
    Tensor out;
    {
      autocast scope(DType::BFloat16, inScope);
      out = selfAttention(qkv, 3);
    }
    sum(mul(out, up)).backward();
    return std::pair<Tensor, Tensor>(out.detach(), qkv.grad());
  };
  const int64_t before = detail::onednn::productsRun();
  const auto [out, grad] = run(true);
  const int64_t products = detail::onednn::productsRun() - before;
  const auto [plainOut, plainGrad] = run(false);
  setAutocastAttention(previous);
  EXPECT_EQ(products, 0) << "attention handed products to oneDNN's bf16 emulation";
  EXPECT_TRUE(allclose(out, plainOut, 0.0, 0.0));
  EXPECT_TRUE(allclose(grad, plainGrad, 0.0, 0.0));
  EXPECT_EQ(grad.dtype(), DType::Float32);
}

}  // namespace
}  // namespace dt

int main(int argc, char** argv) {
  // ctest sets it (tests/tensor/CMakeLists.txt); by hand, the cap is set here, before any oneDNN call.
  if (std::getenv("ONEDNN_MAX_CPU_ISA") == nullptr) setenv("ONEDNN_MAX_CPU_ISA", "AVX2", 1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
