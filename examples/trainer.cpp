// trainer: data-parallel training of a small MLP, the program README's main
// command runs under `dtrun --nproc 4 ./trainer`.
//
// Every rank builds the same model and wraps it in DistributedDataParallel,
// which starts every rank from rank 0's parameters and averages gradients
// across ranks while backward runs (bucket by bucket). Each rank trains on its
// own synthetic batches (a fixed random "teacher" network labels random
// inputs) and applies the same SGD step. At the end the ranks check that their
// parameters are identical and that the loss fell. Runs on embedded defaults;
// flags override them:
//   --steps N (200) --batch B (64) --hidden H (128) --lr LR (0.1) --log-every K (25)
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "collectives/coalesce.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "ddp/ddp.h"
#include "process_group/init.h"
#include "tensor/autograd/autograd.h"
#include "tensor/generator.h"
#include "tensor/nn/module.h"
#include "tensor/ops.h"
#include "tensor/optim/optim.h"

namespace {

struct TrainerConfig {
  int64_t steps = 200;
  int64_t batch = 64;
  int64_t hidden = 128;
  double lr = 0.1;
  int64_t logEvery = 25;
  static constexpr int64_t kInputs = 32;
  static constexpr int64_t kClasses = 10;
};

TrainerConfig parseArgs(int argc, char** argv) {
  TrainerConfig config;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << "usage: trainer [--steps N] [--batch B] [--hidden H] [--lr LR] [--log-every K]\n";
      std::exit(0);
    }
    if (i + 1 >= argc) throw dt::InvalidArgument(dt::str("trainer: ", flag, " needs a value"));
    const std::string value = argv[++i];
    if (flag == "--steps") config.steps = dt::env::parseInt(value, flag);
    else if (flag == "--batch") config.batch = dt::env::parseInt(value, flag);
    else if (flag == "--hidden") config.hidden = dt::env::parseInt(value, flag);
    else if (flag == "--log-every") config.logEvery = dt::env::parseInt(value, flag);
    else if (flag == "--lr") config.lr = std::stod(value);
    else throw dt::InvalidArgument(dt::str("trainer: unknown flag ", flag, "; see --help"));
  }
  if (config.steps < 1 || config.batch < 1 || config.hidden < 1 || config.logEvery < 1) {
    throw dt::InvalidArgument("trainer: --steps, --batch, --hidden and --log-every must be positive");
  }
  return config;
}

// The mean of a scalar over all ranks.
double globalMean(dt::ProcessGroup& group, double value) {
  dt::Tensor t = dt::fromVector<double>({value});
  group.allreduce(t, {.reduceOp = dt::ReduceOp::Avg})->wait();
  return t.item<double>();
}

int run(int argc, char** argv) {
  const TrainerConfig config = parseArgs(argc, argv);
  auto group = dt::initProcessGroup();
  const int rank = group->rank();
  const int world = group->size();

  dt::Generator initGenerator(42);
  auto model = std::make_shared<dt::nn::Sequential>(std::vector<std::shared_ptr<dt::nn::Module>>{
      std::make_shared<dt::nn::Linear>(TrainerConfig::kInputs, config.hidden, true, initGenerator),
      std::make_shared<dt::nn::ReLU>(),
      std::make_shared<dt::nn::Linear>(config.hidden, config.hidden, true, initGenerator),
      std::make_shared<dt::nn::ReLU>(),
      std::make_shared<dt::nn::Linear>(config.hidden, TrainerConfig::kClasses, true, initGenerator)});
  dt::DistributedDataParallel ddp(model, group);
  const std::vector<dt::Tensor> params = model->parameters();

  dt::Generator teacherGenerator(7);
  dt::nn::Linear teacher(TrainerConfig::kInputs, TrainerConfig::kClasses, true, teacherGenerator);
  dt::Generator dataGenerator(1000 + static_cast<uint64_t>(rank));
  dt::optim::SGD optimizer(params, {.lr = config.lr, .momentum = 0.9});

  if (rank == 0) {
    std::printf("trainer: %d ranks, %lld steps, batch %lld per rank, MLP %lld-%lld-%lld-%lld\n", world,
                static_cast<long long>(config.steps), static_cast<long long>(config.batch),
                static_cast<long long>(TrainerConfig::kInputs), static_cast<long long>(config.hidden),
                static_cast<long long>(config.hidden), static_cast<long long>(TrainerConfig::kClasses));
  }
  double firstLoss = 0;
  double lastLoss = 0;
  for (int64_t step = 1; step <= config.steps; ++step) {
    dt::Tensor x = dt::randn({config.batch, TrainerConfig::kInputs}, dataGenerator);
    dt::Tensor labels;
    {
      dt::NoGradGuard noGrad;
      labels = dt::argmax(teacher(x), 1);
    }
    optimizer.zeroGrad();
    dt::Tensor loss = dt::crossEntropy(ddp(x), labels);
    loss.backward();  // returns with gradients averaged over the ranks
    optimizer.step();

    if (step == 1 || step % config.logEvery == 0 || step == config.steps) {
      const double meanLoss = globalMean(*group, loss.item<float>());
      if (step == 1) firstLoss = meanLoss;
      lastLoss = meanLoss;
      if (rank == 0) std::printf("step %5lld  loss %.4f\n", static_cast<long long>(step), meanLoss);
    }
  }

  // Identical parameters everywhere: max and min over ranks must agree.
  dt::Tensor flatParams = dt::flattenTensors(params);
  dt::Tensor highest = flatParams.clone();
  dt::Tensor lowest = flatParams.clone();
  group->allreduce(highest, {.reduceOp = dt::ReduceOp::Max})->wait();
  group->allreduce(lowest, {.reduceOp = dt::ReduceOp::Min})->wait();
  const double spread = dt::max(dt::abs(highest - lowest)).item<float>();
  group->barrier()->wait();
  group->destroy();

  std::printf("rank %d/%d: done, loss %.4f -> %.4f, parameter spread across ranks %.3g\n", rank, world,
              firstLoss, lastLoss, spread);
  if (spread != 0.0) {
    std::fprintf(stderr, "trainer: parameters differ across ranks (max difference %g)\n", spread);
    return 1;
  }
  if (!(lastLoss < 0.5 * firstLoss)) {
    std::fprintf(stderr, "trainer: loss did not halve (%.4f -> %.4f)\n", firstLoss, lastLoss);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainer: %s\n", dt::describe(e).c_str());
    return 1;
  }
}
