// The sharded wrapper and ZeRO on CUDA tensors over NCCL: an MLP of three units trained a few
// steps ends where the same model trained on the CPU in one process ends. One rank per GPU
// (NCCL refuses two ranks on one GPU), so with one GPU this is world 1: the gathers, the
// reduce-scatters, the freed storage and the stream ordering are exercised, the cross-rank
// sums only with more GPUs. Built everywhere; skipped, saying why, without a device.
#include <gtest/gtest.h>

#include "ddp/zero.h"
#include "fsdp/fully_shard.h"
#include "store/hash_store.h"
#include "tensor/optim/optim.h"
#include "tests/fsdp/harness.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

std::shared_ptr<nn::Sequential> mlp() {
  Generator g(5);
  auto model = std::make_shared<nn::Sequential>();
  for (int i = 0; i < 3; ++i) {
    auto block = std::make_shared<nn::Sequential>();
    block->pushBack(std::make_shared<nn::Linear>(12, 12, true, g));
    block->pushBack(std::make_shared<nn::ReLU>());
    model->pushBack(block);
  }
  return model;
}

Tensor batch(int64_t step, int rank, int world) {
  Generator g(100 + static_cast<uint64_t>(step));
  const Tensor all = randn({8, 12}, g);
  const int64_t rows = 8 / world;
  return all.narrow(0, rank * rows, rows).contiguous();
}

std::vector<Tensor> cpuReference(int steps) {
  auto model = mlp();
  optim::SGD sgd(model->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int s = 0; s < steps; ++s) {
    sgd.zeroGrad();
    mean(mul((*model)(batch(s, 0, 1)), 1.0)).backward();
    sgd.step();
  }
  std::vector<Tensor> out;
  for (const Tensor& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(ShardedCuda, ShardedAndZeroOverNcclMatchTheCpu) {
  if (!deviceAvailable(Device::cuda(0))) GTEST_SKIP() << "needs a CUDA device: " << deviceUnavailableReason(Device::cuda(0));
  constexpr int kSteps = 4;
  const auto reference = cpuReference(kSteps);
  const int world = std::min(deviceCount(DeviceType::CUDA), 2);
  for (bool sharded : {true, false}) {
    auto store = std::make_shared<HashStore>();
    std::vector<Tensor> result;
    runRanks(world, [&](int rank) {
      const Device device = Device::cuda(rank);
      setCurrentDevice(device);
      auto group = ProcessGroup::create(store, rank, world, {});
      auto model = mlp();
      model->to(device);
      std::vector<std::shared_ptr<nn::Module>> units;
      for (const auto& [name, block] : model->namedChildren()) units.push_back(block);
      std::unique_ptr<FullyShardedDataParallel> fsdp;
      std::shared_ptr<DistributedDataParallel> ddp;
      std::unique_ptr<ZeroRedundancy> zero;
      std::unique_ptr<optim::SGD> sgd;
      if (sharded) {
        fsdp = std::make_unique<FullyShardedDataParallel>(model, group, FullyShardOptions{.units = units});
        sgd = std::make_unique<optim::SGD>(fsdp->parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
      } else {
        ddp = std::make_shared<DistributedDataParallel>(model, group);
        zero = std::make_unique<ZeroRedundancy>(*ddp, ZeroOptions{.stage = 2});
        sgd = std::make_unique<optim::SGD>(zero->parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
      }
      for (int s = 0; s < kSteps; ++s) {
        sgd->zeroGrad();
        const Tensor x = batch(s, rank, world).to(device);
        const Tensor y = fsdp ? (*fsdp)(x) : (*ddp)(x);
        mean(y).backward();
        sgd->step();
      }
      std::vector<Tensor> params;
      if (fsdp) {
        params = gatherShards(*group, fsdp->parameters(), fsdp->parameterMap(), [](const Tensor& t) { return t.to(Device::cpu()); });
      } else {
        zero->synchronize();
        for (const Tensor& p : model->parameters()) params.push_back(p.detach().to(Device::cpu()));
      }
      if (rank == 0) result = params;
      zero.reset();
      fsdp.reset();
      group->destroy();
    });
    // cuBLAS and the CUDA reductions round differently from the CPU's.
    EXPECT_LT(relativeDifference(reference, result), 1e-4) << (sharded ? "sharded" : "ZeRO-2");
  }
}

}  // namespace
}  // namespace dt::testing
