// A LibTorch program whose collectives run on dtrain: `dtrun --nproc 2 ./torch_allreduce`.
// Each rank trains the same linear model on its own data and averages the gradients.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>

#include "torch_shim/process_group_dtrain.h"

int main() {
  const int rank = std::atoi(std::getenv("RANK")), world = std::atoi(std::getenv("WORLD_SIZE"));
  auto store = dt::torch_shim::connectLauncherStore(rank, world, std::chrono::minutes(5));
  auto pg = dt::torch_shim::ProcessGroupDtrain::create(store, rank, world);
  torch::manual_seed(0);  // the same start on every rank
  torch::nn::Linear model(8, 1);
  torch::optim::SGD opt(model->parameters(), 0.1);
  for (int step = 0; step < 10; ++step) {
    auto x = torch::randn({16, 8}) + rank, y = x.sum(1, true);
    opt.zero_grad();
    torch::mse_loss(model(x), y).backward();
    for (auto& p : model->parameters()) {
      std::vector<at::Tensor> grad{p.grad()};
      c10d::AllreduceOptions avg;
      avg.reduceOp = c10d::ReduceOp::AVG;
      pg->allreduce(grad, avg)->wait();  // throws dtrain's error (who is stuck, who died)
    }
    opt.step();
  }
  at::Tensor flat = torch::cat({model->weight.flatten(), model->bias}).detach();
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < world; ++r) all[0].push_back(torch::empty_like(flat));
  std::vector<at::Tensor> mine{flat};
  pg->allgather(all, mine)->wait();
  for (const auto& other : all[0]) TORCH_CHECK(torch::equal(other, flat), "ranks hold different parameters");
  std::printf("rank %d/%d: parameters agree after 10 steps\n", rank, world);
}
