// ddp_bench: data-parallel training step of the peers' MLP (8 x
// [Linear(1024,1024)+ReLU] then Linear(1024,10), 8.4 M float32 parameters),
// batch 32 per rank, cross-entropy, SGD lr 0.01, one thread per rank, with
// the methodology of bench/peers/torch_ddp_mlp.py so the numbers pair up:
// 4 fixed random batches per rank (seed 1000 + rank) cycled; a step is
// zeroGrad (set to none) + forward + backward (+ averaging) + step; 5 warm-up
// steps, a barrier, 30 timed steps; each step's time is the slowest rank's;
// step_ms is the median; peak_rss_mb is the largest VmHWM over the ranks.
//
// Modes (one per launch, so that each one's peak memory is its own):
//   dtrain            DistributedDataParallel (25 MiB buckets, 1 MiB first):
//                     buckets are allreduced while backward runs
//   dtrain-nooverlap  the plain model; after backward all gradients are
//                     flattened, allreduced once, divided and copied back
//   dtrain-compute    the plain model, no communication at all: the step
//                     time the others would have if communication were free
//
// Usage: ddp_bench --nproc N [--mode dtrain] [--backend shm|gloo] [--warmup 5] [--steps 30] [--threads 1]
//                  [--bucket-cap-mb 25]
// (or one rank of an externally launched job). Rank 0 prints
//   RESULT ddp_mlp impl=<mode> backend=<shm|gloo> world=N batch=32 threads=1 blas=openblas steps=30 step_ms=... min_ms=...
//   mean_ms=... samples_per_s=... peak_rss_mb=...
// and, for dtrain, DDP's own per-iteration averages on stderr.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "bench/bench_common.h"
#include "collectives/coalesce.h"
#include "common/strings.h"
#include "ddp/ddp.h"
#include "process_group/init.h"
#include "tensor/nn/module.h"
#include "tensor/ops.h"
#include "tensor/optim/optim.h"
#include "tensor/parallel.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  int nproc = 0;
  std::string mode = "dtrain";
  int warmup = 5;
  int steps = 30;
  int threads = 1;
  double bucketCapMb = 25;
  std::string backend = "shm";
};

constexpr int64_t kBatch = 32;
constexpr int64_t kWidth = 1024;
constexpr int kHiddenLayers = 8;
constexpr int64_t kClasses = 10;
constexpr int kBatches = 4;

Args parseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "ddp_bench: %s needs a value\n", arg.c_str());
      std::exit(2);
    }
    const std::string value = argv[++i];
    if (arg == "--nproc") a.nproc = std::stoi(value);
    else if (arg == "--mode") a.mode = value;
    else if (arg == "--warmup") a.warmup = std::stoi(value);
    else if (arg == "--steps") a.steps = std::stoi(value);
    else if (arg == "--threads") a.threads = std::stoi(value);
    else if (arg == "--bucket-cap-mb") a.bucketCapMb = std::stod(value);
    else if (arg == "--backend") a.backend = value;
    else {
      std::fprintf(stderr, "ddp_bench: unknown argument %s\nusage: ddp_bench --nproc N [--mode "
                           "dtrain|dtrain-nooverlap|dtrain-compute] [--warmup W] [--steps S] [--threads T] "
                           "[--bucket-cap-mb MB]\n", arg.c_str());
      std::exit(2);
    }
  }
  if (a.backend != "shm" && a.backend != "gloo") {
    std::fprintf(stderr, "ddp_bench: --backend must be shm or gloo, got %s\n", a.backend.c_str());
    std::exit(2);
  }
  ::setenv("DT_BACKEND", a.backend.c_str(), 1);  // the ranks' initProcessGroup reads it
  if (a.mode != "dtrain" && a.mode != "dtrain-nooverlap" && a.mode != "dtrain-compute") {
    std::fprintf(stderr, "ddp_bench: unknown mode %s (dtrain, dtrain-nooverlap, dtrain-compute)\n", a.mode.c_str());
    std::exit(2);
  }
  return a;
}


std::shared_ptr<dt::nn::Sequential> makeModel() {
  dt::Generator g(1234);
  auto model = std::make_shared<dt::nn::Sequential>();
  for (int i = 0; i < kHiddenLayers; ++i) {
    model->pushBack(std::make_shared<dt::nn::Linear>(kWidth, kWidth, true, g));
    model->pushBack(std::make_shared<dt::nn::ReLU>());
  }
  model->pushBack(std::make_shared<dt::nn::Linear>(kWidth, kClasses, true, g));
  return model;
}

int runRank(const Args& args) {
  dt::setNumThreads(args.threads);
  auto group = dt::initProcessGroup();
  const int rank = group->rank();
  const int world = group->size();

  dt::Generator data(1000 + static_cast<uint64_t>(rank));
  std::vector<dt::Tensor> inputs, labels;
  for (int i = 0; i < kBatches; ++i) {
    inputs.push_back(dt::randn({kBatch, kWidth}, data));
    labels.push_back(dt::randint(0, kClasses, {kBatch}, data));
  }

  auto model = makeModel();
  std::shared_ptr<dt::DistributedDataParallel> ddp;
  if (args.mode == "dtrain") {
    dt::DdpOptions options;
    options.bucketCapBytes = static_cast<size_t>(args.bucketCapMb * 1024 * 1024);
    ddp = std::make_shared<dt::DistributedDataParallel>(model, group, options);
  }
  const std::vector<dt::Tensor> params = model->parameters();
  dt::optim::SGD optimizer(params, {.lr = 0.01});
  auto step = [&](int i) {
    optimizer.zeroGrad();
    const dt::Tensor& x = inputs[i % kBatches];
    dt::Tensor logits = ddp ? (*ddp)(x) : (*model)(x);
    dt::crossEntropy(logits, labels[i % kBatches]).backward();
    if (args.mode == "dtrain-nooverlap") {
      std::vector<dt::Tensor> grads;
      for (const auto& p : params) grads.push_back(p.grad());
      dt::Tensor flat = dt::flattenTensors(grads);
      group->allreduce(flat)->wait();
      dt::mul_(flat, 1.0 / world);
      dt::unflattenInto(flat, grads);
    }
    optimizer.step();
  };

  for (int i = 0; i < args.warmup; ++i) step(i);
  const dt::DdpIterationStats before = ddp ? ddp->totals() : dt::DdpIterationStats{};
  group->barrier()->wait();
  dt::Tensor durations = dt::zeros({args.steps}, dt::DType::Float64);
  double* d = durations.data<double>();
  for (int i = 0; i < args.steps; ++i) {
    const auto t0 = Clock::now();
    step(args.warmup + i);
    d[i] = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  }
  group->allreduce(durations, {.reduceOp = dt::ReduceOp::Max})->wait();
  dt::Tensor rss = dt::fromVector<double>({dt::bench::peakRssMb()});
  group->allreduce(rss, {.reduceOp = dt::ReduceOp::Max})->wait();

  if (rank == 0) {
    const std::vector<double> v(d, d + args.steps);
    const double med = dt::bench::median(v);
    std::printf("RESULT ddp_mlp impl=%s backend=%s world=%d batch=%lld threads=%d blas=%s steps=%d step_ms=%.2f "
                "min_ms=%.2f mean_ms=%.2f samples_per_s=%.1f peak_rss_mb=%.1f\n",
                args.mode.c_str(), args.backend.c_str(), world, static_cast<long long>(kBatch), args.threads, dt::bench::blasName().c_str(),
                args.steps, med, *std::min_element(v.begin(), v.end()),
                std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size()),
                static_cast<double>(world * kBatch) / (med / 1000.0), rss.item<double>());
    std::fflush(stdout);
    if (ddp) {
      const dt::DdpIterationStats& t = ddp->totals();
      const double n = static_cast<double>(t.iteration - before.iteration);
      std::fprintf(stderr,
                   "# ddp_bench world %d: %zu buckets; per step: forward %.2f ms, backward %.2f ms, comm %.2f ms, "
                   "exposed comm %.2f ms, %.1f of %zu buckets launched during backward\n",
                   world, ddp->buckets().size(), (t.forwardMs - before.forwardMs) / n,
                   (t.backwardMs - before.backwardMs) / n, (t.commMs - before.commMs) / n,
                   (t.exposedCommMs - before.exposedCommMs) / n,
                   static_cast<double>(t.bucketsLaunchedInBackward - before.bucketsLaunchedInBackward) / n,
                   ddp->buckets().size());
    }
  }
  group->barrier()->wait();
  ddp.reset();
  group->destroy();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parseArgs(argc, argv);
  return dt::bench::rankMain(args.nproc, [&] { return runRank(args); }, "ddp_bench");
}
