// DDP over the GPT model (threads as ranks, Gloo): the tied output layer is one parameter, its
// gradient is reduced once, and ranks with half the batch each end a step with the gradients
// of one process on the whole batch, with gradient accumulation (noSync) too.
#include <chrono>

#include <gtest/gtest.h>

#include "common/config.h"
#include "ddp/ddp.h"
#include "store/hash_store.h"
#include "tensor/nn/gpt.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

#if DT_HAVE_GLOO

using namespace std::chrono_literals;

const nn::GptConfig kConfig{.vocabSize = 256, .contextLength = 12, .layers = 2, .heads = 2, .width = 16};

Tensor batch(int64_t rows, uint64_t seed) {
  Generator g(seed);
  return randint(0, 256, {rows, kConfig.contextLength + 1}, g);
}

// Gradients of the mean next-token loss over `tokens` (rows x (T + 1)), one process.
std::vector<Tensor> referenceGradients(const Tensor& tokens, int micro) {
  Generator init(7);
  nn::Gpt model(kConfig, init);
  const int64_t rows = tokens.sizes()[0] / micro;
  for (int m = 0; m < micro; ++m) {
    const Tensor part = tokens.narrow(0, m * rows, rows);
    const Tensor loss = nn::Gpt::loss(model(part.narrow(1, 0, kConfig.contextLength).contiguous()),
                                      part.narrow(1, 1, kConfig.contextLength).contiguous());
    mul(loss, 1.0 / micro).backward();
  }
  std::vector<Tensor> grads;
  for (const Tensor& p : model.parameters()) grads.push_back(p.grad().clone());
  return grads;
}

void expectDdpMatches(int world, int micro) {
  const Tensor all = batch(8, 3);
  const auto reference = referenceGradients(all, 1);
  auto store = std::make_shared<HashStore>();
  std::vector<std::vector<Tensor>> grads(static_cast<size_t>(world));
  std::vector<int> hookCalls(static_cast<size_t>(world), 0);
  testing::runRanks(world, [&](int rank) {
    ProcessGroupOptions o;
    o.timeout = 30s;
    auto group = ProcessGroup::create(store, rank, world, o);
    Generator init(7);
    auto model = std::make_shared<nn::Gpt>(kConfig, init);
    DistributedDataParallel ddp(model, group);
    model->wte->weight.registerPostAccumulateGradHook([&hookCalls, rank](Tensor&) { ++hookCalls[static_cast<size_t>(rank)]; });
    // Rank r's rows: r, r + W, ... (the interleaving the samplers use), in micro-batches.
    std::vector<int64_t> mine;
    for (int64_t i = rank; i < all.sizes()[0]; i += world) mine.push_back(i);
    const Tensor rows = indexSelect(all, 0, fromVector<int64_t>(mine));
    const int64_t per = rows.sizes()[0] / micro;
    for (int m = 0; m < micro; ++m) {
      std::optional<DistributedDataParallel::NoSyncGuard> noSync;
      if (m + 1 < micro) noSync.emplace(ddp.noSync());
      const Tensor part = rows.narrow(0, m * per, per);
      const Tensor loss = nn::Gpt::loss(ddp(part.narrow(1, 0, kConfig.contextLength).contiguous()),
                                        part.narrow(1, 1, kConfig.contextLength).contiguous());
      mul(loss, 1.0 / micro).backward();
    }
    for (const Tensor& p : model->parameters()) grads[static_cast<size_t>(rank)].push_back(p.grad().clone());
    group->destroy();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(hookCalls[static_cast<size_t>(r)], micro) << "rank " << r;  // once per backward
    ASSERT_EQ(grads[static_cast<size_t>(r)].size(), reference.size());
    for (size_t i = 0; i < reference.size(); ++i) {
      const double diff = max(abs(sub(grads[static_cast<size_t>(r)][i], reference[i]))).item<double>();
      EXPECT_LT(diff, 2e-6) << "rank " << r << " parameter " << i;
    }
  }
}

TEST(GptDdp, TwoRanksMatchOneProcessAndReduceTheTiedWeightOnce) { expectDdpMatches(2, 1); }

TEST(GptDdp, GradientAccumulationWithNoSyncMatchesToo) { expectDdpMatches(2, 2); }

#else
TEST(GptDdp, NeedsGloo) { GTEST_SKIP() << "this build has no Gloo backend (DT_USE_GLOO=OFF)"; }
#endif

}  // namespace
}  // namespace dt
