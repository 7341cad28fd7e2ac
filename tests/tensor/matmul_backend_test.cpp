// The CPU matrix product on OpenBLAS and on oneDNN (tensor/matmul_backend.h, tensor/internal/gemm.h):
// both engines forced in turn over the layouts mm, bmm, matmul and linear hand them, bfloat16
// products against a float64 reference, the primitive cache, the thread setting, the setting's errors.
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <spdlog/fmt/fmt.h>

#include "common/config.h"
#include "common/errors.h"
#include "common/sanitizers.h"
#include "common/strings.h"
#include "tensor/internal/gemm.h"
#include "tensor/matmul_backend.h"
#include "tensor/nn/module.h"
#include "tensor/ops.h"
#include "tensor/parallel.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

// These tests check bf16's kernels wherever the CPU has the instructions, also where auto would
// run float32 for speed (MatmulBackend.Bf16AutoRunsBf16OnlyWhereItIsFaster checks that choice).
[[maybe_unused]] const bool kBf16KernelsWhereverTheyExist = (setBf16Matmul(Bf16Matmul::Native), true);

using testing::expectThrowsWith;

// Sets the process's backend for a scope, and puts the previous one back.
class BackendScope {
 public:
  explicit BackendScope(MatmulBackend b) : previous_(matmulBackend()) { setMatmulBackend(b); }
  ~BackendScope() { setMatmulBackend(previous_); }
  BackendScope(const BackendScope&) = delete;
  BackendScope& operator=(const BackendScope&) = delete;

 private:
  MatmulBackend previous_;
};

constexpr double kEps32 = 1.0 / (1 << 24);  // float32's unit roundoff

// |x - y| <= 2 k u (|A| |B|) elementwise: two float32 sums of the same k products in any order
// each lie within k u |A||B| of the exact value. `bound` is |A| |B| computed in float64.
void expectWithinReassociation(const Tensor& x, const Tensor& y, const Tensor& bound, int64_t k, const std::string& what) {
  ASSERT_EQ(x.sizes(), y.sizes()) << what;
  const auto xv = x.toVector<double>(), yv = y.toVector<double>(), bv = bound.toVector<double>();
  ASSERT_EQ(xv.size(), bv.size()) << what;
  const double factor = 2.0 * static_cast<double>(k) * kEps32;
  for (size_t i = 0; i < xv.size(); ++i) {
    ASSERT_LE(std::abs(xv[i] - yv[i]), factor * bv[i] + 1e-30) << what << " at " << i << ": " << xv[i] << " vs " << yv[i];
  }
}

Tensor abs64(const Tensor& t) { return abs(t.to(DType::Float64)); }

struct ProductCase {
  std::string name;
  std::function<Tensor(const Tensor&, const Tensor&)> op;  // mm, bmm or matmul
  Tensor a, b;
  int64_t k;
};

// The layouts ops_test's MatmulThroughBlasAllLayouts covers, at sizes above the auto rule's
// threshold as well as below it, plus batched, strided and broadcast cases.
std::vector<ProductCase> productCases() {
  Generator g(11);
  auto mmOp = [](const Tensor& a, const Tensor& b) { return mm(a, b); };
  auto bmmOp = [](const Tensor& a, const Tensor& b) { return bmm(a, b); };
  auto matmulOp = [](const Tensor& a, const Tensor& b) { return matmul(a, b); };
  std::vector<ProductCase> cases;
  for (int64_t s : {7, 96}) {
    const int64_t m = s + 3, k = s + 5, n = s - 2;
    cases.push_back({"mm NN " + std::to_string(s), mmOp, randn({m, k}, g), randn({k, n}, g), k});
    cases.push_back({"mm TN " + std::to_string(s), mmOp, randn({k, m}, g).t(), randn({k, n}, g), k});
    cases.push_back({"mm NT " + std::to_string(s), mmOp, randn({m, k}, g), randn({n, k}, g).t(), k});
    cases.push_back({"mm TT " + std::to_string(s), mmOp, randn({k, m}, g).t(), randn({n, k}, g).t(), k});
    // Column stride 2: not BLAS-expressible, copied first.
    cases.push_back({"mm strided " + std::to_string(s), mmOp, randn({m, 2 * k}, g).slice(1, 0, 2 * k, 2),
                     randn({k, n}, g), k});
    // Leading dims larger than the rows: narrowed views.
    cases.push_back({"mm narrowed " + std::to_string(s), mmOp, randn({m, k + 9}, g).narrow(1, 0, k),
                     randn({k, n + 4}, g).narrow(1, 2, n), k});
  }
  cases.push_back({"bmm", bmmOp, randn({3, 17, 19}, g), randn({3, 19, 23}, g), 19});
  cases.push_back({"bmm transposed", bmmOp, randn({4, 40, 33}, g).transpose(1, 2), randn({4, 65, 40}, g).transpose(1, 2), 40});
  // Each batch entry a narrowed window of a larger one: batch strides beyond m * k.
  cases.push_back({"bmm batch-strided", bmmOp, randn({2, 50, 80}, g).narrow(2, 10, 64), randn({2, 64, 70}, g), 64});
  cases.push_back({"matmul 3d x 2d", matmulOp, randn({6, 30, 48}, g), randn({48, 20}, g), 48});
  cases.push_back({"matmul broadcast", matmulOp, randn({2, 1, 33, 48}, g), randn({3, 48, 21}, g), 48});
  cases.push_back({"matmul matrix-vector", matmulOp, randn({130, 70}, g), randn({70}, g), 70});
  return cases;
}

TEST(MatmulBackend, OneDnnAgreesWithOpenBlasOnEveryLayoutWithinReassociation) {
  if (!onednnAvailable()) GTEST_SKIP() << "this build has no oneDNN (DT_USE_ONEDNN=OFF): nothing to compare OpenBLAS with";
  for (const ProductCase& c : productCases()) {
    Tensor viaBlas, viaDnn;
    {
      BackendScope scope(MatmulBackend::OpenBlas);
      viaBlas = c.op(c.a, c.b);
    }
    const int64_t runBefore = detail::onednn::productsRun();
    {
      BackendScope scope(MatmulBackend::OneDnn);
      viaDnn = c.op(c.a, c.b);
    }
    EXPECT_GT(detail::onednn::productsRun(), runBefore) << c.name << " did not run on oneDNN";
    expectWithinReassociation(viaDnn, viaBlas, c.op(abs64(c.a), abs64(c.b)), c.k, c.name);
  }
}

// linear's forward (the bias in oneDNN's epilogue; on OpenBLAS its rows first, the product
// accumulating onto them) and both backward products.
TEST(MatmulBackend, LinearAndItsGradientsAgreeAcrossEngines) {
  if (!onednnAvailable()) GTEST_SKIP() << "this build has no oneDNN (DT_USE_ONEDNN=OFF): nothing to compare OpenBLAS with";
  Generator g(3);
  const Tensor x0 = randn({4, 32, 96}, g), w0 = randn({80, 96}, g), b0 = randn({80}, g), up = randn({4, 32, 80}, g);
  struct Result {
    Tensor y, gx, gw;
  };
  auto run = [&](MatmulBackend backend) {
    BackendScope scope(backend);
    Tensor x = x0.clone().setRequiresGrad(true), w = w0.clone().setRequiresGrad(true), b = b0.clone().setRequiresGrad(true);
    Tensor y = linear(x, w, b);
    sum(mul(y, up)).backward();
    return Result{y.detach(), x.grad(), w.grad()};
  };
  const Result blas = run(MatmulBackend::OpenBlas);
  const int64_t runBefore = detail::onednn::productsRun();
  const Result dnn = run(MatmulBackend::OneDnn);
  EXPECT_EQ(detail::onednn::productsRun() - runBefore, 3) << "forward, input gradient, weight gradient";
  // The bias enters once, exactly, on both: it only widens the bound by its own size.
  const Tensor yBound = add(matmul(abs64(x0), abs64(w0).t()), abs64(b0));
  expectWithinReassociation(dnn.y, blas.y, yBound, 96 + 1, "linear forward");
  expectWithinReassociation(dnn.gx, blas.gx, matmul(abs64(up), abs64(w0)), 80, "linear input gradient");
  const Tensor up2 = abs64(up).reshape({-1, 80}), x2 = abs64(x0).reshape({-1, 96});
  expectWithinReassociation(dnn.gw, blas.gw, mm(up2.t(), x2), 4 * 32, "linear weight gradient");
}

// bfloat16 operands: float32 accumulation, one rounding of the output to bfloat16.
void expectBf16Close(const Tensor& got, const Tensor& ref64, const Tensor& bound, int64_t k, const std::string& what) {
  ASSERT_EQ(got.sizes(), ref64.sizes()) << what;
  const auto gv = got.toVector<double>(), rv = ref64.toVector<double>(), bv = bound.toVector<double>();
  for (size_t i = 0; i < gv.size(); ++i) {
    const double tol = std::abs(rv[i]) / 256.0 + 2.0 * static_cast<double>(k) * kEps32 * bv[i] + 1e-30;
    ASSERT_LE(std::abs(gv[i] - rv[i]), tol) << what << " at " << i << ": " << gv[i] << " vs " << rv[i];
  }
}

TEST(MatmulBackend, BFloat16ProductsAreWithinBf16ToleranceOfFloat64) {
  Generator g(21);
  const int64_t runBefore = detail::onednn::productsRun();
  const Tensor a = randn({70, 130}, g).to(DType::BFloat16), b = randn({130, 90}, g).to(DType::BFloat16);
  const Tensor a64 = a.to(DType::Float64), b64 = b.to(DType::Float64);
  const Tensor r = mm(a, b);
  EXPECT_EQ(r.dtype(), DType::BFloat16);
  expectBf16Close(r, mm(a64, b64), mm(abs(a64), abs(b64)), 130, "mm");
  const Tensor at = a.t().contiguous().t();  // the same values, stored transposed
  expectBf16Close(mm(at, b), mm(a64, b64), mm(abs(a64), abs(b64)), 130, "mm transposed");

  const Tensor ba = randn({3, 40, 50}, g).to(DType::BFloat16), bb = randn({3, 50, 60}, g).to(DType::BFloat16);
  const Tensor ba64 = ba.to(DType::Float64), bb64 = bb.to(DType::Float64);
  expectBf16Close(bmm(ba, bb), bmm(ba64, bb64), bmm(abs(ba64), abs(bb64)), 50, "bmm");
  expectBf16Close(matmul(ba, bb.select(0, 1)), matmul(ba64, bb64.select(0, 1)),
                  matmul(abs(ba64), abs(bb64.select(0, 1))), 50, "matmul");

  Tensor x = randn({64, 96}, g).to(DType::BFloat16).setRequiresGrad(true);
  Tensor w = randn({48, 96}, g).to(DType::BFloat16).setRequiresGrad(true);
  const Tensor bias = randn({48}, g).to(DType::BFloat16);
  const Tensor up = randn({64, 48}, g).to(DType::BFloat16);
  Tensor y = linear(x, w, bias);
  sum(mul(y, up)).backward();
  const Tensor x64 = x.detach().to(DType::Float64), w64 = w.detach().to(DType::Float64), up64 = up.to(DType::Float64);
  expectBf16Close(y, add(mm(x64, w64.t()), bias.to(DType::Float64)),
                  add(mm(abs(x64), abs(w64).t()), abs(bias.to(DType::Float64))), 97, "linear");
  // The gradients' upstream is mul(y, up)'s, rounded to bfloat16 on the way: up itself.
  expectBf16Close(x.grad(), mm(up64, w64), mm(abs(up64), abs(w64)), 48, "linear input gradient");
  expectBf16Close(w.grad(), mm(up64.t(), x64), mm(abs(up64).t(), abs(x64)), 64, "linear weight gradient");

  if (detail::gemmOperandType(DType::BFloat16, DType::Float32) == DType::BFloat16) {
    EXPECT_GE(detail::onednn::productsRun() - runBefore, 7) << "the bfloat16 products did not all run on oneDNN";
    detail::GemmProblem p{.inType = DType::BFloat16, .m = 64, .n = 64, .k = 64, .lda = 64, .ldb = 64, .ldc = 64};
    const std::string impl = detail::onednn::implName(p);
    EXPECT_TRUE(impl.find("bf16") != std::string::npos || impl.find("amx") != std::string::npos) << impl;
    EXPECT_NE(matmulKernelName().find("bf16=onednn:"), std::string::npos) << matmulKernelName();
  } else {
    std::printf("bf16 products ran in float32 here (%s); checked their values only\n", bf16MatmulFallbackReason().c_str());
    EXPECT_NE(matmulKernelName().find("bf16=fp32"), std::string::npos) << matmulKernelName();
  }
}

TEST(MatmulBackend, ATrainingStepCreatesNoPrimitiveAfterItsFirst) {
  if (!onednnAvailable()) GTEST_SKIP() << "this build has no oneDNN (DT_USE_ONEDNN=OFF): it has no primitive cache";
  BackendScope scope(MatmulBackend::OneDnn);
  Generator g(5);
  auto model = std::make_shared<nn::Sequential>();
  model->pushBack(std::make_shared<nn::Linear>(64, 128, true, g));
  model->pushBack(std::make_shared<nn::ReLU>());
  model->pushBack(std::make_shared<nn::Linear>(128, 10, true, g));
  const Tensor x = randn({32, 64}, g);
  const Tensor labels = randint(0, 10, {32}, g);
  auto step = [&] {
    model->zeroGrad(true);
    crossEntropy((*model)(x), labels).backward();
  };
  step();
  const int64_t afterFirst = detail::onednn::primitivesCreated();
  const int64_t runAfterFirst = detail::onednn::productsRun();
  step();
  step();
  EXPECT_EQ(detail::onednn::primitivesCreated(), afterFirst);
  EXPECT_EQ(detail::onednn::productsRun() - runAfterFirst, 2 * 5) << "2 forward + 3 backward products per step";
}

// oneDNN runs on the calling thread's OpenMP team: its size follows setNumThreads.
TEST(MatmulBackend, OneDnnThreadsFollowTheThreadSetting) {
  if (!onednnAvailable()) GTEST_SKIP() << "this build has no oneDNN (DT_USE_ONEDNN=OFF)";
  using GetThreads = int (*)();
  const auto ompMaxThreads = reinterpret_cast<GetThreads>(::dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
  if (ompMaxThreads == nullptr) GTEST_SKIP() << "oneDNN here does not thread with OpenMP: no OpenMP setting to check";
#if defined(DT_THREAD_SANITIZER)
  GTEST_SKIP() << "under ThreadSanitizer oneDNN runs on the calling thread (libgomp is not instrumented)";
#endif
  BackendScope scope(MatmulBackend::OneDnn);
  const int before = numThreads();
  Generator g(1);
  const Tensor a = randn({64, 64}, g);
  for (int n : {1, 3, 2}) {
    setNumThreads(n);
    mm(a, a);
    EXPECT_EQ(ompMaxThreads(), n);
  }
  setNumThreads(before);
}

// GCC's OpenMP runtime does not survive fork: a child whose parent ran a two-thread team used to
// wait forever at its own first parallel region. A forked child runs oneDNN on one thread.
TEST(MatmulBackend, AForkedChildMultipliesOnOneDnnAfterItsParentRanATeam) {
  if (!onednnAvailable()) GTEST_SKIP() << "this build has no oneDNN (DT_USE_ONEDNN=OFF)";
  BackendScope scope(MatmulBackend::OneDnn);
  const int before = numThreads();
  setNumThreads(2);
  Generator g(4);
  const Tensor a = randn({256, 256}, g);
  const Tensor expected = mm(a, a);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(60);  // a hang ends the child by SIGALRM: the parent reports it
    const int64_t runBefore = detail::onednn::productsRun();
    const Tensor r = mm(a, a);
    const bool ok = detail::onednn::productsRun() == runBefore + 1 && r.allclose(expected, 1e-5, 1e-4);
    std::_Exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  setNumThreads(before);
  ASSERT_FALSE(WIFSIGNALED(status)) << "the child was killed by signal " << WTERMSIG(status) << " (SIGALRM: it hung)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's product did not run on oneDNN or differs";
}

TEST(MatmulBackend, TheSettingParsesAndNamesBadValues) {
  EXPECT_EQ(parseMatmulBackend("OneDNN"), MatmulBackend::OneDnn);
  EXPECT_EQ(parseMatmulBackend("openblas"), MatmulBackend::OpenBlas);
  EXPECT_EQ(parseMatmulBackend("auto"), MatmulBackend::Auto);
  expectThrowsWith<InvalidArgument>([] { parseMatmulBackend("mkl"); }, {"'mkl'", "auto, openblas or onednn"});
  if (!onednnAvailable()) {
    expectThrowsWith<NotSupportedError>([] { setMatmulBackend(MatmulBackend::OneDnn); }, {"has none", "DT_USE_ONEDNN"});
  }
  // Whether OpenBLAS's kernels use the CPU's widest vectors (auto's rule asks; the test below checks it).
  EXPECT_FALSE(detail::openblasKernelsFitCpu("Haswell", true, true));
  EXPECT_FALSE(detail::openblasKernelsFitCpu("Prescott", false, true));
  EXPECT_TRUE(detail::openblasKernelsFitCpu("Cooperlake", true, true));
  EXPECT_TRUE(detail::openblasKernelsFitCpu("Haswell", false, true));
  EXPECT_TRUE(detail::openblasKernelsFitCpu("SomeFutureCore", true, true));
  BackendScope autoRule(MatmulBackend::Auto);
  const std::string name = matmulKernelName();
  EXPECT_NE(name.find("openblas:" + blasKernelName()), std::string::npos) << name;
  EXPECT_EQ(name.find(' '), std::string::npos) << "one token for RESULT lines: " << name;
}

TEST(MatmulBackend, AutoKeepsSmallAndMatrixVectorProductsOnOpenBlas) {
  BackendScope autoRule(MatmulBackend::Auto);  // whatever DT_MATMUL_BACKEND says
  detail::GemmProblem tiny{.m = 16, .n = 16, .k = 16, .lda = 16, .ldb = 16, .ldc = 16};
  detail::GemmProblem vector{.m = 1, .n = 4096, .k = 4096, .lda = 4096, .ldb = 4096, .ldc = 4096};
  detail::GemmProblem large{.m = 1024, .n = 1024, .k = 1024, .lda = 1024, .ldb = 1024, .ldc = 1024};
  detail::GemmProblem f64 = large;
  f64.inType = f64.outType = DType::Float64;
  EXPECT_EQ(detail::gemmEngineFor(tiny), detail::GemmEngine::OpenBlas);
  EXPECT_EQ(detail::gemmEngineFor(vector), detail::GemmEngine::OpenBlas);
  EXPECT_EQ(detail::gemmEngineFor(f64), detail::GemmEngine::OpenBlas);
  if (onednnAvailable()) {
    BackendScope scope(MatmulBackend::OneDnn);
    EXPECT_EQ(detail::gemmEngineFor(tiny), detail::GemmEngine::OneDnn) << "forced: every float32 product";
    EXPECT_EQ(detail::gemmEngineFor(f64), detail::GemmEngine::OpenBlas) << "float64 stays on OpenBLAS";
  }
}

// Which branch of the rule this CPU takes is printed with each check: the kernels OpenBLAS
// picked here decide it, and CI machines differ (AVX2-only, AVX-512, a model OpenBLAS does not know).
TEST(MatmulBackend, AutoSendsLargeFloat32ProductsToOneDnnWhereOpenBlasIsOlderOrOneThreadRunsAvx512) {
  if (!onednnAvailable()) GTEST_SKIP() << "this build has no oneDNN (DT_USE_ONEDNN): every product runs on OpenBLAS";
  BackendScope autoRule(MatmulBackend::Auto);
  detail::GemmProblem large{.m = 1024, .n = 1024, .k = 1024, .lda = 1024, .ldb = 1024, .ldc = 1024};
  // The attention core's 32x64x128, exactly 2^18 multiply-adds: OpenBLAS where its kernels fit
  // (oneDNN ran it at 0.46x its SkylakeX kernel), oneDNN where they are older (3.3x the SSE3 one).
  detail::GemmProblem attnPv{.m = 32, .n = 64, .k = 128, .lda = 128, .ldb = 64, .ldc = 64};
  // 32^3: OpenBLAS whatever its kernels.
  detail::GemmProblem cube32{.m = 32, .n = 32, .k = 32, .lda = 32, .ldb = 32, .ldc = 32};
  const bool fit = detail::openblasKernelsFitCpu(blasKernelName(), __builtin_cpu_supports("avx512f"),
                                                 __builtin_cpu_supports("avx2"));
  const bool avx512 = detail::onednn::hasAvx512();
  const int before = numThreads();
  for (int threads : {1, 2}) {
    setNumThreads(threads);
    SCOPED_TRACE(str("OpenBLAS's \"", blasKernelName(), "\" kernels ", fit ? "fit" : "are older than", " this CPU; oneDNN ",
                     avx512 ? "runs" : "has no", " AVX-512; ", threads, " thread(s)"));
    const bool oneDnn = !fit || (avx512 && threads == 1);
    EXPECT_EQ(detail::gemmEngineFor(large), oneDnn ? detail::GemmEngine::OneDnn : detail::GemmEngine::OpenBlas);
    EXPECT_EQ(detail::gemmEngineFor(attnPv), fit ? detail::GemmEngine::OpenBlas : detail::GemmEngine::OneDnn);
    EXPECT_EQ(detail::gemmEngineFor(cube32), detail::GemmEngine::OpenBlas);
    // "onednn:<impl>+openblas:<core>,bf16=..." where the large products go to oneDNN.
    EXPECT_EQ(matmulKernelName().rfind(oneDnn ? "onednn:" : "openblas:", 0), 0u) << matmulKernelName();
  }
  setNumThreads(before);
}

// Auto runs bf16 products in bf16 only where that is faster than float32: AMX, or AVX512_BF16
// dot products measured faster than float32 FMAs. Which branch this CPU takes is printed.
TEST(MatmulBackend, Bf16AutoRunsBf16OnlyWhereItIsFaster) {
  if (!onednnAvailable()) GTEST_SKIP() << "this build has no oneDNN (DT_USE_ONEDNN=OFF): bf16 products always run in float32";
  if (!detail::onednn::bf16Instructions()) {
    GTEST_SKIP() << "no bf16 instructions within oneDNN's ISA here (" << bf16MatmulFallbackReason()
                 << "): that fallback is matmul_isa_cap_test's";
  }
  const double rate = detail::onednn::bf16DotOverFloat32FmaRate();
  const bool amx = detail::onednn::hasAmx();
  std::printf("AVX512_BF16 dot products here: %.2fx the multiply-add rate of float32 FMAs; AMX %s\n", rate,
              amx ? "present" : "absent");
  EXPECT_GT(rate, 0.05) << "the probe measured nothing";
  EXPECT_LT(rate, 20.0) << "the probe's loops were folded away";
  setBf16Matmul(Bf16Matmul::Auto);
  const bool native = bf16MatmulNative();
  const std::string reason = bf16MatmulFallbackReason();
  setBf16Matmul(Bf16Matmul::Native);
  EXPECT_EQ(native, amx || rate >= 1.25) << reason;
  if (native) {
    EXPECT_EQ(reason, "");
  } else {
    EXPECT_NE(reason.find(fmt::format("{:.2f}x the multiply-add rate", rate)), std::string::npos) << reason;
    EXPECT_NE(reason.find("DT_BF16_MATMUL=native"), std::string::npos) << reason;
  }
  EXPECT_TRUE(bf16MatmulNative()) << "native runs bf16 wherever the instructions are";
  EXPECT_EQ(parseBf16Matmul("Native"), Bf16Matmul::Native);
  expectThrowsWith<InvalidArgument>([] { parseBf16Matmul("fast"); }, {"'fast'", "auto or native"});
}

}  // namespace
}  // namespace dt
