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
// Usage: tensor_bench [--threads N] [--warmup W] [--steps S] [--profiler-overhead 0|1]
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

}  // namespace

int main(int argc, char** argv) {
  int threads = 1, warmup = 5, steps = 30;
  bool profilerOverhead = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads")) {
      threads = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--warmup")) {
      warmup = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--steps")) {
      steps = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--profiler-overhead")) {
      profilerOverhead = std::atoi(argv[i + 1]) != 0;
    } else {
      std::fprintf(stderr, "unknown arg %s\n", argv[i]);
      return 2;
    }
  }
  dt::setNumThreads(threads);
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

  std::printf("RESULT sgemm impl=dtrain m=%d n=%d k=%d threads=%d blas=%s time_ms=%.3f gflops=%.2f\n", n, n, n, threads,
              blas.c_str(), tDt * 1e3, flops / tDt / 1e9);
  std::printf("RESULT sgemm impl=cblas m=%d n=%d k=%d threads=%d blas=%s time_ms=%.3f gflops=%.2f\n", n, n, n, threads,
              blas.c_str(), tBlas * 1e3, flops / tBlas / 1e9);
  std::printf(
      "RESULT ddp_mlp impl=dtrain world=1 batch=%lld threads=%d blas=%s steps=%d step_ms=%.2f min_ms=%.2f mean_ms=%.2f "
      "samples_per_s=%.1f peak_rss_mb=%.1f\n",
      static_cast<long long>(kBatch), threads, blas.c_str(), steps, med * 1e3, minD * 1e3, mean * 1e3, kBatch / med, rss);
  if (profilerOverhead) {
    std::printf(
        "RESULT profiler_overhead impl=dtrain op=add4 ops=%d off_ns=%.1f on_ns=%.1f per_op_ns=%.1f "
        "per_op_ns_without_memory=%.1f\n",
        kTinyOps, opOff * 1e9, opOn * 1e9, (opOn - opOff) * 1e9, (opEventsOnly - opOff) * 1e9);
  }
  return 0;
}
