// A program on the training loop library for its tests (tests/train/loop_test.cpp): an MLP on a
// Fashion-MNIST slice with user state (a counter and an exponential moving average of the
// weights, both updated once per committed step), and switches that misuse the library.
//
//   loop_worker DATA CHECKPOINT_DIR STEPS [--micro-batches K] [--clip C] [--pause-ms MS]
//               [--throw-at STEP | --no-backward | --other-optimizer] [--profile DIR]
//               [--anomaly] [--nan-at STEP] [--sharding none|full|zero2] [--metrics FILE]
//
// Prints, on every rank: "loop_worker: rank R/W steps N counter C ema E ema_sum X params P
// stopped S" (E, P: fingerprints).
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "data/dataset.h"
#include "tensor/autograd/autograd.h"
#include "tensor/nn/module.h"
#include "tensor/ops.h"
#include "tensor/optim/optim.h"
#include "train/loop.h"
#include "train/support.h"

int main(int argc, char** argv) try {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc < 4) throw std::invalid_argument("usage: loop_worker DATA CHECKPOINT_DIR STEPS [switches]");
  const int64_t steps = std::stoll(argv[3]);
  int microBatches = 1, pauseMs = 0;
  int64_t throwAt = -1;
  double clip = 0;
  bool noBackward = false, otherOptimizer = false, anomaly = false;
  int64_t nanAt = -1;
  std::string profileDir, sharding = "none", metrics;
  for (int i = 4; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--micro-batches") microBatches = std::stoi(argv[++i]);
    else if (flag == "--clip") clip = std::stod(argv[++i]);
    else if (flag == "--pause-ms") pauseMs = std::stoi(argv[++i]);
    else if (flag == "--throw-at") throwAt = std::stoll(argv[++i]);
    else if (flag == "--no-backward") noBackward = true;
    else if (flag == "--other-optimizer") otherOptimizer = true;
    else if (flag == "--profile") profileDir = argv[++i];
    else if (flag == "--metrics") metrics = argv[++i];
    else if (flag == "--anomaly") anomaly = true;
    else if (flag == "--nan-at") nanAt = std::stoll(argv[++i]);
    else if (flag == "--sharding") sharding = argv[++i];
    else throw std::invalid_argument("unknown switch " + flag);
  }
  auto train = dt::data::loadFashionMnist(argv[1], dt::data::Split::Train);
  dt::Generator init;
  init.manualSeed(11);
  auto model = std::make_shared<dt::nn::Sequential>();
  model->pushBack(std::make_shared<dt::nn::Linear>(train->features(), 32, true, init));
  model->pushBack(std::make_shared<dt::nn::ReLU>());
  model->pushBack(std::make_shared<dt::nn::Linear>(32, 10, true, init));
  const dt::Tensor weight = model->parameters().front();

  // The user's state: updated after each committed step, so a redone step counts once. Sharded,
  // the model's own weight holds this rank's rows only: the average follows the counter instead.
  const bool sharded = sharding != "none";
  int64_t counter = 0;
  dt::Tensor ema = sharded ? dt::zeros({1}) : weight.detach().clone();
  dt::train::LoopOptions options{.program = "loop_worker", .steps = steps, .globalBatch = 64, .microBatches = microBatches,
                                 .clipGradNorm = clip, .seed = 3, .dropLast = true, .checkpointDir = argv[2],
                                 .checkpointEvery = 10, .config = {{"hidden", "32"}}, .logEvery = 10};
  options.test.stepPauseMs = pauseMs;
  options.sharding = sharding == "full"    ? dt::train::Sharding::Full
                     : sharding == "zero2" ? dt::train::Sharding::Zero2
                                           : dt::train::Sharding::None;
  options.anomalyMode = anomaly;
  options.metricsFile = metrics;
  if (!profileDir.empty()) {
    options.profileFrom = 3;
    options.profileSteps = 2;
    options.profileTrace = profileDir + "/trace-{rank}.json";
  }
  options.hooks.afterStep = [&](const dt::train::StepDone&) {
    ++counter;
    dt::NoGradGuard noGrad;
    const dt::Tensor now = sharded ? dt::full({1}, static_cast<double>(counter)) : weight.detach();
    ema.copy_(dt::add(dt::mul(ema, 0.9), dt::mul(now, 0.1)));
  };
  dt::train::Loop loop(options);
  loop.setModel(model);
  auto other = std::make_shared<dt::nn::Linear>(4, 4, true, init);
  dt::optim::AdamW otherAdam(other->parameters(), {.lr = 1e-3});
  loop.addState("counter", counter);
  loop.addState("ema", ema);
  if (otherOptimizer) {
    loop.setOptimizer(otherAdam);
  } else {  // over whatever the loop's wrapper hands out: the module's parameters, or its shards
    loop.setOptimizer([](dt::train::Loop& l) { return std::make_unique<dt::optim::AdamW>(l.parameters(), dt::optim::AdamWOptions{.lr = 1e-3}); });
  }
  loop.setData(train);
  const dt::train::LoopResult r = loop.run([&](const dt::data::Batch& b) {
    if (loop.step() == throwAt) throw std::runtime_error("the user's step failed on purpose");
    dt::Tensor loss = dt::crossEntropy(loop.forward(b.inputs), b.targets);
    // sqrt's gradient at 0 is infinite: a NaN-free forward whose backward makes an infinity.
    if (loop.step() == nanAt) loss = dt::add(loss, dt::sum(dt::sqrt(dt::mul(loss, 0.0))));
    return dt::train::StepOutput{noBackward ? loss.detach() : loss, {{"batch_rows", static_cast<double>(b.inputs.size(0))}}};
  });
  std::printf("loop_worker: rank %d/%d steps %lld counter %lld ema %016llx ema_sum %.9g params %016llx stopped %d\n",
              loop.rank(), loop.worldSize(), static_cast<long long>(r.steps), static_cast<long long>(counter),
              static_cast<unsigned long long>(dt::train::fingerprint({ema})), dt::sum(ema).item<float>() * 1.0,
              static_cast<unsigned long long>(r.fingerprint), r.stopped ? 1 : 0);
  return r.parameterSpread == 0 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "loop_worker: %s\n", e.what());
  return 1;
}
