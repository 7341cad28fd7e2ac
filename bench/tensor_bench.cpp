// Tensor benchmark: float32 GEMM through dtrain vs OpenBLAS called directly,
// and the training step of the peers' MLP (8 x [Linear(1024,1024)+ReLU] then
// Linear(1024,10), batch 32, cross-entropy, SGD lr 0.01), measured the way
// bench/peers/libtorch_mlp.cpp measures LibTorch: 5 warm-up + 30 timed
// steps, median; GEMM 3 warm-up + 10 timed, median. Prints a table on stderr
// and RESULT lines on stdout (format of bench/peers/README.md).
//
// With --profiler-overhead 1, then the profiler's cost per recorded op: N tiny
// adds with no profiler and with one recording (tensor/profiler.h), in thread
// CPU time, interleaved over 9 rounds; the fastest round of each (the least
// disturbed), per op. Off by default: its events would add to the process's
// peak RSS, which run_tensor_bench.sh compares with LibTorch's.
//
// With --gemm-shapes 1 it measures only the matrix products of the 38M GPT (L12-H8-C512-T128,
// vocabulary 256, global batch 8: 1024 token rows at world 1, 256 at world 4): each Linear's
// forward, input-gradient and weight-gradient product and three of the attention core's
// per-head products, on each engine of --engines (openblas, onednn, onednn-bf16: oneDNN with
// bfloat16 operands and float32 output), interleaved over 5 rounds, median GF/s. RESULT
// gemm_shape lines carry the kernel that ran and the engine the auto rule picks
// (tensor/internal/gemm.h; docs/tensor.md "Matrix products").
//
// Usage: tensor_bench [--threads N] [--warmup W] [--steps S] [--profiler-overhead 0|1]
//                     [--gemm-shapes 1 [--engines openblas,onednn,onednn-bf16]]
#include <cblas.h>
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_common.h"
#include "common/strings.h"
#include "tensor/internal/gemm.h"
#include "tensor/matmul_backend.h"
#include "tensor/nn/module.h"
#include "tensor/ops.h"
#include "tensor/optim/optim.h"
#include "tensor/parallel.h"
#include "tensor/profiler.h"

namespace {

using Clock = std::chrono::steady_clock;

double peakRssMb() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

struct GemmShape {
  std::string name;
  int64_t m, n, k;
  bool transA, transB;
};

// The 38M GPT's products for `rows` token rows. A Linear(in, out) is x[rows, in] . W[out, in]^T
// forward, g[rows, out] . W input gradient, g^T . x weight gradient (ops_linalg.cpp's linear).
std::vector<GemmShape> gptShapes(int64_t rows) {
  struct Layer {
    const char* name;
    int64_t in, out;
  };
  static const Layer layers[] = {{"qkv", 512, 1536}, {"proj", 512, 512}, {"fc1", 512, 2048}, {"fc2", 2048, 512},
                                 {"head", 512, 256}};
  std::vector<GemmShape> shapes;
  for (const Layer& l : layers) {
    const std::string suffix = dt::str("_r", rows);
    shapes.push_back({dt::str(l.name, "_fwd", suffix), rows, l.out, l.in, false, true});
    shapes.push_back({dt::str(l.name, "_dx", suffix), rows, l.in, l.out, false, false});
    shapes.push_back({dt::str(l.name, "_dw", suffix), l.out, l.in, rows, true, false});
  }
  return shapes;
}

// Per head (T 128, head dim 64, causal row blocks of 32): S = Q K^T, O = P V, dK = dS^T Q.
const GemmShape kAttentionShapes[] = {
    {"attn_qk", 32, 128, 64, false, true}, {"attn_pv", 32, 64, 128, false, false}, {"attn_dk", 128, 64, 32, true, false}};
// Where the rule's threshold lies: small squares, skinny products (a batch of one, a single
// output column), and the tensor benchmark's MLP layer (batch 32, Linear(1024, 1024)).
const GemmShape kSmallShapes[] = {{"sq16", 16, 16, 16, false, false},         {"sq32", 32, 32, 32, false, false},
                                  {"sq64", 64, 64, 64, false, false},         {"sq128", 128, 128, 128, false, true},
                                  {"row1", 1, 512, 512, false, true},         {"col1", 1024, 1, 512, false, true},
                                  {"rows8", 8, 512, 512, false, true},        {"mlp_fwd_b32", 32, 1024, 1024, false, true},
                                  {"mlp_dw_b32", 1024, 1024, 32, true, false}};

int runGemmShapes(int threads, const std::string& engines) {
  using dt::detail::GemmEngine;
  using dt::detail::GemmProblem;
  std::vector<GemmShape> shapes = gptShapes(1024);
  for (const GemmShape& s : gptShapes(256)) shapes.push_back(s);
  for (const GemmShape& s : kAttentionShapes) shapes.push_back(s);
  for (const GemmShape& s : kSmallShapes) shapes.push_back(s);
  struct EngineRun {
    std::string name;
    GemmEngine engine;
    dt::DType in;
  };
  std::vector<EngineRun> runs;
  for (const std::string& e : dt::split(engines, ',')) {
    if (e == "openblas") runs.push_back({e, GemmEngine::OpenBlas, dt::DType::Float32});
    else if (e == "onednn") runs.push_back({e, GemmEngine::OneDnn, dt::DType::Float32});
    else if (e == "onednn-bf16") runs.push_back({e, GemmEngine::OneDnn, dt::DType::BFloat16});
    else {
      std::fprintf(stderr, "unknown engine %s (openblas, onednn, onednn-bf16)\n", e.c_str());
      return 2;
    }
  }
  dt::Generator gen(7);
  std::fprintf(stderr, "\n%-16s %5s %5s %5s %2s%2s", "shape", "m", "n", "k", "tA", "tB");
  for (const EngineRun& r : runs) std::fprintf(stderr, " %12s", r.name.c_str());
  std::fprintf(stderr, "  auto picks   (GF/s, threads=%d)\n", threads);
  for (const GemmShape& s : shapes) {
    const int64_t aRows = s.transA ? s.k : s.m, aCols = s.transA ? s.m : s.k;
    const int64_t bRows = s.transB ? s.n : s.k, bCols = s.transB ? s.k : s.n;
    const dt::Tensor a32 = dt::randn({aRows, aCols}, gen), b32 = dt::randn({bRows, bCols}, gen);
    const dt::Tensor a16 = a32.to(dt::DType::BFloat16), b16 = b32.to(dt::DType::BFloat16);
    dt::Tensor c = dt::zeros({s.m, s.n});
    auto problem = [&](dt::DType in) {
      const bool bf = in == dt::DType::BFloat16;
      return GemmProblem{.inType = in, .outType = dt::DType::Float32, .transA = s.transA, .transB = s.transB,
                         .m = s.m, .n = s.n, .k = s.k, .a = bf ? a16.dataPtr() : a32.dataPtr(), .lda = aCols,
                         .b = bf ? b16.dataPtr() : b32.dataPtr(), .ldb = bCols, .c = c.dataPtr(), .ldc = s.n};
    };
    const double flops = 2.0 * static_cast<double>(s.m * s.n * s.k);
    // Enough calls per timing for about 20 ms of work at 100 GF/s.
    const int calls = static_cast<int>(std::clamp(2e9 / flops, 3.0, 20000.0));
    std::vector<std::vector<double>> rates(runs.size());
    std::vector<std::string> kernels(runs.size());
    for (size_t r = 0; r < runs.size(); ++r) {  // warm-up: creates oneDNN's primitives, wakes the pools
      const GemmProblem p = problem(runs[r].in);
      const GemmEngine ran = dt::detail::cpuGemmOn(runs[r].engine, p);
      for (int i = 0; i < calls / 3 + 1; ++i) dt::detail::cpuGemmOn(runs[r].engine, p);
      kernels[r] = ran == GemmEngine::OneDnn ? "onednn:" + dt::detail::onednn::implName(p) : "openblas:" + dt::blasKernelName();
    }
    for (int round = 0; round < 5; ++round) {
      for (size_t r = 0; r < runs.size(); ++r) {
        const GemmProblem p = problem(runs[r].in);
        const auto t0 = Clock::now();
        for (int i = 0; i < calls; ++i) dt::detail::cpuGemmOn(runs[r].engine, p);
        const double t = std::chrono::duration<double>(Clock::now() - t0).count();
        rates[r].push_back(flops * calls / t / 1e9);
      }
    }
    const GemmEngine pick = dt::detail::gemmEngineFor(problem(dt::DType::Float32));
    std::fprintf(stderr, "%-16s %5lld %5lld %5lld %2d%2d", s.name.c_str(), static_cast<long long>(s.m),
                 static_cast<long long>(s.n), static_cast<long long>(s.k), s.transA, s.transB);
    for (size_t r = 0; r < runs.size(); ++r) std::fprintf(stderr, " %12.1f", dt::bench::median(rates[r]));
    std::fprintf(stderr, "  %s\n", dt::detail::gemmEngineName(pick));
    for (size_t r = 0; r < runs.size(); ++r) {
      std::printf("RESULT gemm_shape impl=%s shape=%s m=%lld n=%lld k=%lld trans_a=%d trans_b=%d threads=%d kernel=%s "
                  "auto=%s gflops=%.2f\n",
                  runs[r].name.c_str(), s.name.c_str(), static_cast<long long>(s.m), static_cast<long long>(s.n),
                  static_cast<long long>(s.k), s.transA, s.transB, threads, kernels[r].c_str(),
                  dt::detail::gemmEngineName(pick), dt::bench::median(rates[r]));
    }
  }
  std::fprintf(stderr, "matmul kernels: %s; oneDNN primitives created: %lld\n\n", dt::matmulKernelName().c_str(),
               static_cast<long long>(dt::detail::onednn::primitivesCreated()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1, warmup = 5, steps = 30;
  bool profilerOverhead = false, gemmShapes = false;
  std::string engines = dt::onednnAvailable() ? "openblas,onednn,onednn-bf16" : "openblas";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads")) {
      threads = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--warmup")) {
      warmup = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--steps")) {
      steps = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--profiler-overhead")) {
      profilerOverhead = std::atoi(argv[i + 1]) != 0;
    } else if (!std::strcmp(argv[i], "--gemm-shapes")) {
      gemmShapes = std::atoi(argv[i + 1]) != 0;
    } else if (!std::strcmp(argv[i], "--engines")) {
      engines = argv[i + 1];
    } else {
      std::fprintf(stderr, "unknown arg %s\n", argv[i]);
      return 2;
    }
  }
  dt::setNumThreads(threads);
  if (gemmShapes) return runGemmShapes(threads, engines);
  const std::string blas = dt::bench::blasName();

  // ---- MLP training step (first, as in the LibTorch peer, so peak RSS is comparable) ----
  constexpr int64_t kBatch = 32, kWidth = 1024, kDepth = 8, kClasses = 10;
  dt::Generator gen(1234);
  auto model = std::make_shared<dt::nn::Sequential>();
  for (int i = 0; i < kDepth; ++i) {
    model->pushBack(std::make_shared<dt::nn::Linear>(kWidth, kWidth, true, gen));
    model->pushBack(std::make_shared<dt::nn::ReLU>());
  }
  model->pushBack(std::make_shared<dt::nn::Linear>(kWidth, kClasses, true, gen));
  dt::optim::SGD opt(model->parameters(), {0.01});
  std::vector<dt::Tensor> xs, ys;
  for (int i = 0; i < 4; ++i) {
    xs.push_back(dt::randn({kBatch, kWidth}, gen));
    ys.push_back(dt::randint(0, kClasses, {kBatch}, gen));
  }
  double lastLoss = 0;
  auto step = [&](int i) {
    opt.zeroGrad(/*setToNone=*/true);
    dt::Tensor out = model->forward(xs[i % 4]);
    dt::Tensor loss = dt::crossEntropy(out, ys[i % 4]);
    loss.backward();
    opt.step();
    lastLoss = loss.item<float>();
  };
  for (int i = 0; i < warmup; ++i) step(i);
  std::vector<double> durs;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = Clock::now();
    step(warmup + i);
    durs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  const double med = dt::bench::median(durs);
  const double mean = std::accumulate(durs.begin(), durs.end(), 0.0) / static_cast<double>(durs.size());
  const double minD = *std::min_element(durs.begin(), durs.end());

  // ---- GEMM: dtrain mm vs cblas_sgemm on the same buffers ----
  const int n = 1024;
  dt::Tensor a = dt::randn({n, n}, gen), b = dt::randn({n, n}, gen);
  dt::Tensor c = dt::empty({n, n});
  auto timeIt = [&](auto&& fn) {
    for (int i = 0; i < 3; ++i) fn();
    std::vector<double> ts;
    for (int i = 0; i < 10; ++i) {
      const auto t0 = Clock::now();
      fn();
      ts.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return dt::bench::median(ts);
  };
  // Interleave so that frequency/noise drifts hit both sides alike.
  std::vector<double> dtTimes, blasTimes;
  for (int round = 0; round < 3; ++round) {
    dtTimes.push_back(timeIt([&] { dt::Tensor r = dt::mm(a, b); }));
    blasTimes.push_back(timeIt([&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data<float>(), n, b.data<float>(), n, 0.0f,
                  c.data<float>(), n);
    }));
  }
  const double tDt = dt::bench::median(dtTimes), tBlas = dt::bench::median(blasTimes);

  const double flops = 2.0 * n * n * n;
  const double rss = peakRssMb();

  // ---- profiler cost per recorded op: tiny adds, off vs on ----
  // After the peak RSS reading: the recorded events must not count against the MLP's memory.
  constexpr int kTinyOps = 20000;
  const int overheadRounds = profilerOverhead ? 9 : 0;
  dt::Tensor tiny = dt::ones({4});
  // Thread CPU time, not wall time: on a shared machine, time spent descheduled
  // would otherwise swamp a difference of tens of nanoseconds.
  auto threadCpuSeconds = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  };
  auto tinyOps = [&] {
    const double t0 = threadCpuSeconds();
    for (int i = 0; i < kTinyOps; ++i) dt::Tensor r = dt::add(tiny, tiny);
    return (threadCpuSeconds() - t0) / kTinyOps;
  };
  std::vector<double> offTimes, onTimes, eventsOnlyTimes;
  for (int round = 0; round < overheadRounds; ++round) {
    offTimes.push_back(tinyOps());
    {
      dt::Profiler profiler;
      onTimes.push_back(tinyOps());
    }
    dt::Profiler eventsOnly(dt::ProfilerOptions{.profileMemory = false});
    eventsOnlyTimes.push_back(tinyOps());
  }
  auto fastest = [](const std::vector<double>& times) {
    return times.empty() ? 0.0 : *std::min_element(times.begin(), times.end());
  };
  const double opOff = fastest(offTimes), opOn = fastest(onTimes), opEventsOnly = fastest(eventsOnlyTimes);

  std::fprintf(stderr, "\n%-34s %12s %12s\n", "benchmark (threads=1, blas)", "time", "rate");
  std::fprintf(stderr, "%-34s %9.2f ms %8.1f GF/s\n", "sgemm 1024^3 dtrain mm", tDt * 1e3, flops / tDt / 1e9);
  std::fprintf(stderr, "%-34s %9.2f ms %8.1f GF/s\n", "sgemm 1024^3 cblas_sgemm direct", tBlas * 1e3, flops / tBlas / 1e9);
  std::fprintf(stderr, "%-34s %9.2f ms %8.1f samples/s\n", "MLP step (median of 30)", med * 1e3, kBatch / med);
  std::fprintf(stderr, "%-34s %9.2f ms   min %.2f ms\n", "MLP step (mean)", mean * 1e3, minD * 1e3);
  std::fprintf(stderr, "%-34s %9.1f MB   (last loss %.4f)\n", "peak RSS", rss, lastLoss);
  if (profilerOverhead) {
    std::fprintf(stderr, "%-34s %9.1f ns   profiler on %.1f ns (+%.1f ns per recorded op; +%.1f ns without profileMemory)\n",
                 "tiny add, profiler off", opOff * 1e9, opOn * 1e9, (opOn - opOff) * 1e9, (opEventsOnly - opOff) * 1e9);
  }
  std::fprintf(stderr, "\n");

  // matmul=: what ran dtrain's products (tensor/matmul_backend.h); the cblas line ran OpenBLAS directly.
  const std::string kernels = dt::matmulKernelName();
  std::printf("RESULT sgemm impl=dtrain m=%d n=%d k=%d threads=%d blas=%s matmul=%s time_ms=%.3f gflops=%.2f\n", n, n,
              n, threads, blas.c_str(), kernels.c_str(), tDt * 1e3, flops / tDt / 1e9);
  std::printf("RESULT sgemm impl=cblas m=%d n=%d k=%d threads=%d blas=%s matmul=openblas:%s time_ms=%.3f gflops=%.2f\n",
              n, n, n, threads, blas.c_str(), dt::blasKernelName().c_str(), tBlas * 1e3, flops / tBlas / 1e9);
  std::printf(
      "RESULT ddp_mlp impl=dtrain world=1 batch=%lld threads=%d blas=%s matmul=%s steps=%d step_ms=%.2f min_ms=%.2f "
      "mean_ms=%.2f samples_per_s=%.1f peak_rss_mb=%.1f\n",
      static_cast<long long>(kBatch), threads, blas.c_str(), kernels.c_str(), steps, med * 1e3, minD * 1e3, mean * 1e3,
      kBatch / med, rss);
  if (profilerOverhead) {
    std::printf(
        "RESULT profiler_overhead impl=dtrain op=add4 ops=%d off_ns=%.1f on_ns=%.1f per_op_ns=%.1f "
        "per_op_ns_without_memory=%.1f\n",
        kTinyOps, opOff * 1e9, opOn * 1e9, (opOn - opOff) * 1e9, (opEventsOnly - opOff) * 1e9);
  }
  return 0;
}
