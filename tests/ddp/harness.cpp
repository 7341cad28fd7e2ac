#include "tests/ddp/harness.h"

#include <algorithm>
#include <cmath>

#include "tensor/autograd/autograd.h"
#include "tensor/generator.h"
#include "tensor/ops.h"
#include "tensor/optim/optim.h"

namespace dt::testing {
namespace {

constexpr int64_t kIn = 6;
constexpr int64_t kHidden = 12;
constexpr int64_t kClasses = 3;

optim::SGD makeOptimizer(std::vector<Tensor> params) { return optim::SGD(std::move(params), {.lr = 0.05, .momentum = 0.9}); }

bool active(const TrainSpec& spec, int step, int rank) { return step < spec.stepsOf(rank); }

}  // namespace

int TrainSpec::maxSteps() const {
  int most = 0;
  for (int r = 0; r < world; ++r) most = std::max(most, stepsOf(r));
  return most;
}

TestNet::TestNet(uint64_t seed, bool deadLayer) {
  Generator g(seed);
  registerModule("input", std::make_shared<nn::Linear>(kIn, kHidden, true, g));
  registerModule("skip", std::make_shared<nn::Linear>(kHidden, kHidden, true, g));
  registerModule("output", std::make_shared<nn::Linear>(kHidden, kClasses, true, g));
  if (deadLayer) registerModule("dead", std::make_shared<nn::Linear>(kHidden, 2, true, g));
}

Tensor TestNet::forward(const Tensor& x) {
  Tensor h = relu((*child("input"))(x));
  if (useSkip) h = h + relu((*child("skip"))(h));
  return (*child("output"))(h);
}

bool usesBranch(int step, int rank) { return step % 3 != 0 && (step + rank) % 2 == 1; }

std::pair<Tensor, Tensor> batchFor(const TrainSpec& spec, int step, int micro, int rank) {
  Generator g(1000 + 97 * static_cast<uint64_t>(step) + 13 * static_cast<uint64_t>(micro) + 7919 * static_cast<uint64_t>(rank));
  Tensor x = randn({spec.batchPerRank, kIn}, g);
  Tensor y = argmax(randn({spec.batchPerRank, kClasses}, g), 1);
  return {x, y};
}

std::vector<Tensor> referenceParameters(const TrainSpec& spec) {
  auto model = std::make_shared<TestNet>(42, spec.deadLayer);
  auto optimizer = makeOptimizer(model->parameters());
  for (int step = 0; step < spec.maxSteps(); ++step) {
    optimizer.zeroGrad();
    for (int micro = 0; micro <= spec.accumulate; ++micro) {
      std::vector<int> ranks;
      for (int r = 0; r < spec.world; ++r) {
        if (active(spec, step, r)) ranks.push_back(r);
      }
      if (!spec.branchy && static_cast<int>(ranks.size()) == spec.world) {
        // Literally the concatenated batch.
        std::vector<Tensor> xs, ys;
        for (int r : ranks) {
          auto [x, y] = batchFor(spec, step, micro, r);
          xs.push_back(x);
          ys.push_back(y);
        }
        model->useSkip = true;
        crossEntropy((*model)(cat(xs)), cat(ys)).backward();
        continue;
      }
      // Ranks that differ (branch, ran out of data): the mean over ranks of
      // their batch means, with absent ranks counted as zero.
      for (int r : ranks) {
        auto [x, y] = batchFor(spec, step, micro, r);
        model->useSkip = !spec.branchy || usesBranch(step, r);
        mul(crossEntropy((*model)(x), y), 1.0 / spec.world).backward();
      }
    }
    optimizer.step();
  }
  return model->parameters();
}

std::vector<Tensor> trainRank(const TrainSpec& spec, const std::shared_ptr<ProcessGroup>& group) {
  const int rank = group->rank();
  // Different starting values on every rank: DDP must copy rank 0's.
  auto model = std::make_shared<TestNet>(rank == 0 ? 42 : 4242 + static_cast<uint64_t>(rank), spec.deadLayer);
  model->to(spec.device);
  auto ddp = std::make_shared<DistributedDataParallel>(model, group, spec.ddp);
  auto optimizer = makeOptimizer(ddp->parameters());
  auto forwardBackward = [&](int step, int micro) {
    auto [x, y] = batchFor(spec, step, micro, rank);
    model->useSkip = !spec.branchy || usesBranch(step, rank);
    crossEntropy((*ddp)(x.to(spec.device)), y.to(spec.device)).backward();
  };
  auto loop = [&] {
    for (int step = 0; step < spec.stepsOf(rank); ++step) {
      optimizer.zeroGrad();
      for (int micro = 0; micro < spec.accumulate; ++micro) {
        auto guard = ddp->noSync();
        forwardBackward(step, micro);
      }
      forwardBackward(step, spec.accumulate);
      optimizer.step();
    }
  };
  if (spec.stepsPerRank.empty()) {
    loop();
  } else {
    ddp->join(loop);
  }
  std::vector<Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().to(Device::cpu()).clone());
  return out;
}

float maxAbsDifference(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return INFINITY;
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].sizes() != b[i].sizes()) return INFINITY;
    worst = std::max(worst, max(abs(sub(a[i], b[i]))).item<float>());
  }
  return worst;
}

}  // namespace dt::testing
