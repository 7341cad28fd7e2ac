// minimal_trainer: the complete elastic, checkpointed, pre-emptible trainer of docs/train.md.
//   dtrun --nproc 4 --elastic --max-restarts 2 ./minimal_trainer DATA_DIR CHECKPOINT_DIR
#include <cstdio>
#include <memory>
#include <string>

#include "data/dataset.h"
#include "tensor/nn/module.h"
#include "tensor/ops.h"
#include "tensor/optim/optim.h"
#include "train/loop.h"

int main(int argc, char** argv) try {
  if (argc < 3) {
    std::fprintf(stderr, "usage: minimal_trainer DATA_DIR CHECKPOINT_DIR [STEPS]\n");
    return 2;
  }
  const int64_t steps = argc > 3 ? std::stoll(argv[3]) : 100;
  dt::train::Loop loop({.program = "minimal_trainer", .steps = steps, .globalBatch = 128, .seed = 7, .dropLast = true,
                        .checkpointDir = argv[2], .checkpointEvery = 25, .logEvery = 20});
  auto train = dt::data::loadFashionMnist(argv[1], dt::data::Split::Train);
  auto test = dt::data::loadFashionMnist(argv[1], dt::data::Split::Test);

  dt::Generator init;  // the same initial model on every rank
  init.manualSeed(7);
  auto model = std::make_shared<dt::nn::Sequential>();
  model->pushBack(std::make_shared<dt::nn::Linear>(train->features(), 128, true, init));
  model->pushBack(std::make_shared<dt::nn::ReLU>());
  model->pushBack(std::make_shared<dt::nn::Linear>(128, 10, true, init));
  dt::optim::AdamW adam(model->parameters(), {.lr = 2e-3});

  loop.setModel(model);
  loop.setOptimizer(adam, [&](int64_t step) { return 2e-3 * (1.0 - static_cast<double>(step) / steps); });
  loop.setData(train);
  loop.setEvaluation([&] {  // every rank scores a share of the test set; the sums are reduced
    dt::NoGradGuard noGrad;
    std::vector<int64_t> ids;
    for (int64_t i = loop.rank(); i < test->size(); i += loop.worldSize()) ids.push_back(i);
    const dt::data::Batch b = test->get(ids);
    dt::Tensor sums = dt::fromVector<double>(
        {static_cast<double>(dt::sum(dt::eq(dt::argmax(loop.model()(b.inputs), 1), b.targets)).item<int64_t>()),
         static_cast<double>(ids.size())});
    loop.group().allreduce(sums)->wait();
    return std::vector<std::pair<std::string, double>>{{"test_accuracy", sums.toVector<double>()[0] / sums.toVector<double>()[1]}};
  });

  const dt::train::LoopResult r = loop.run([&](const dt::data::Batch& batch) {
    return dt::train::StepOutput{dt::crossEntropy(loop.forward(batch.inputs), batch.targets)};
  });
  std::printf("minimal_trainer: rank %d/%d %s after %lld steps; fingerprint %016llx; test accuracy %.4f\n", loop.rank(),
              loop.worldSize(), r.stopped ? "stopped" : "done", static_cast<long long>(r.steps),
              static_cast<unsigned long long>(r.fingerprint), r.evaluation.empty() ? 0.0 : r.evaluation[0].second);
  return r.parameterSpread == 0 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "minimal_trainer: %s\n", e.what());
  return 1;
}
