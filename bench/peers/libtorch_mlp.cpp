// LibTorch (C++) peer for bench/tensor_bench: the MLP training step of torch_ddp_mlp.py in
// one process, and a 1024^3 fp32 GEMM through torch::mm.
//
//   model   8 x [Linear(1024,1024) + ReLU], then Linear(1024,10), seed 1234
//   data    batch 32; 4 random batches made up front and cycled
//   step    gradients reset to undefined (Python's zero_grad(set_to_none=True)), forward,
//           cross-entropy, backward, SGD(lr 0.01) step
//   timing  5 warm-up + 30 timed steps: step_ms = median, min_ms, mean_ms
//   sgemm   torch::mm of two 1024x1024 fp32 matrices: 3 warm-up + 10 timed calls, median;
//           gflops = 2*1024^3 / time
// One intra-op thread (at::set_num_threads) unless --threads says otherwise. stdout:
//   RESULT ddp_mlp impl=libtorch world=1 batch=32 threads=1 blas=.. steps=30 step_ms=.. min_ms=.. mean_ms=.. samples_per_s=..
//   RESULT sgemm impl=libtorch m=1024 n=1024 k=1024 threads=1 blas=.. time_ms=.. gflops=..
//
// usage: libtorch_mlp [--threads N] [--warmup W] [--steps S]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <numeric>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBatch = 32;
constexpr int64_t kWidth = 1024;
constexpr int kHiddenLayers = 8;
constexpr int64_t kClasses = 10;
constexpr int kBatches = 4;

double seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

double medianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t mid = v.size() / 2;
  return v.size() % 2 == 1 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
}

// The BLAS library the process mapped (Debian's libtorch calls libblas.so.3, whichever
// implementation the alternatives system or LD_LIBRARY_PATH makes that).
std::string loadedBlas() {
  std::ifstream in("/proc/self/maps");
  const std::string maps((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  struct Probe {
    const char* marker;
    const char* name;
  };
  for (const Probe& p : {Probe{"openblas", "openblas"}, Probe{"libblis", "blis"}, Probe{"libmkl", "mkl"},
                         Probe{"/blas/libblas.so", "reference"}, Probe{"libblas.so", "libblas"}}) {
    if (maps.find(p.marker) != std::string::npos) return p.name;
  }
  return "unknown";
}

int intArg(int argc, char** argv, int& i) {
  if (i + 1 >= argc) {
    std::fprintf(stderr, "libtorch_mlp: %s needs a value\n", argv[i]);
    std::exit(2);
  }
  return std::atoi(argv[++i]);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1, warmup = 5, steps = 30;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--threads") threads = intArg(argc, argv, i);
    else if (arg == "--warmup") warmup = intArg(argc, argv, i);
    else if (arg == "--steps") steps = intArg(argc, argv, i);
    else {
      std::fprintf(stderr, "usage: libtorch_mlp [--threads N] [--warmup W] [--steps S]\n");
      return 2;
    }
  }
  if (steps < 1) steps = 1;
  at::set_num_threads(threads);
  torch::manual_seed(1234);

  torch::nn::Sequential net;
  for (int l = 0; l < kHiddenLayers; ++l) {
    net->push_back(torch::nn::Linear(kWidth, kWidth));
    net->push_back(torch::nn::ReLU());
  }
  net->push_back(torch::nn::Linear(kWidth, kClasses));
  std::vector<torch::Tensor> params = net->parameters();
  torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.01));

  std::vector<torch::Tensor> inputs, labels;
  for (int b = 0; b < kBatches; ++b) {
    inputs.push_back(torch::randn({kBatch, kWidth}));
    labels.push_back(torch::randint(kClasses, {kBatch}, torch::kLong));
  }

  auto trainStep = [&](int i) {
    // LibTorch 1.13's zero_grad() zeroes in place; dropping the gradients is what
    // set_to_none=True does in Python (backward then allocates them fresh).
    for (torch::Tensor& p : params) p.mutable_grad() = torch::Tensor();
    const int k = i % kBatches;
    torch::Tensor loss = torch::nn::functional::cross_entropy(net->forward(inputs[k]), labels[k]);
    loss.backward();
    sgd.step();
  };

  for (int i = 0; i < warmup; ++i) trainStep(i);
  std::vector<double> stepTimes;
  for (int i = warmup; i < warmup + steps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    trainStep(i);
    stepTimes.push_back(seconds(start));
  }
  const std::string blas = loadedBlas();
  const double stepMedian = medianOf(stepTimes);
  const double stepMean = std::accumulate(stepTimes.begin(), stepTimes.end(), 0.0) / stepTimes.size();
  std::printf("RESULT ddp_mlp impl=libtorch world=1 batch=%d threads=%d blas=%s steps=%d step_ms=%.2f min_ms=%.2f "
              "mean_ms=%.2f samples_per_s=%.1f\n",
              static_cast<int>(kBatch), threads, blas.c_str(), steps, stepMedian * 1e3,
              *std::min_element(stepTimes.begin(), stepTimes.end()) * 1e3, stepMean * 1e3, kBatch / stepMedian);
  std::fflush(stdout);

  const torch::Tensor a = torch::randn({1024, 1024}), b = torch::randn({1024, 1024});
  for (int i = 0; i < 3; ++i) (void)torch::mm(a, b);
  std::vector<double> mmTimes;
  for (int i = 0; i < 10; ++i) {
    const auto start = std::chrono::steady_clock::now();
    torch::Tensor c = torch::mm(a, b);
    mmTimes.push_back(seconds(start));
  }
  const double mm = medianOf(mmTimes);
  std::printf("RESULT sgemm impl=libtorch m=1024 n=1024 k=1024 threads=%d blas=%s time_ms=%.2f gflops=%.2f\n", threads,
              blas.c_str(), mm * 1e3, 2.0 * 1024 * 1024 * 1024 / mm / 1e9);
  return 0;
}
