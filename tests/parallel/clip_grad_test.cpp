// clipTensorParallelGradNorm (threads as ranks on shm): nn::Gpt parallelized at TP=2 and TP=4,
// sequence parallelism on and off, float64, dropout off: the norm before clipping and every
// clipped gradient (assembled from its ParameterShard) equal the single-process model's under
// nn::clipGradNorm within 1e-12 relative, for the 2-norm and the infinity norm; the clip bar is
// set below the norm so that the scaling really happens. Then TP=2 x DDP over dp=2 on one global
// batch (DDP averages over dp first), and the options the function refuses.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "common/strings.h"
#include "ddp/ddp.h"
#include "parallel/clip_grad.h"
#include "parallel/mesh.h"
#include "parallel/parallelize.h"
#include "tests/fsdp/harness.h"
#include "tests/parallel/harness.h"

namespace dt::testing {
namespace {

const nn::GptConfig kConfig{.vocabSize = 32, .contextLength = 8, .layers = 2, .heads = 4, .width = 16};
constexpr int64_t kRows = 4;

std::shared_ptr<nn::Gpt> buildGpt() {
  Generator init(31);
  auto model = std::make_shared<nn::Gpt>(kConfig, init);
  model->to(DType::Float64);
  return model;
}

Tensor batchRows() {
  Generator data(4242);
  return randint(0, kConfig.vocabSize, {kRows, kConfig.contextLength + 1}, data);
}
Tensor inputsOf(const Tensor& rows) { return rows.narrow(1, 0, kConfig.contextLength).contiguous(); }
Tensor targetsOf(const Tensor& rows) { return rows.narrow(1, 1, kConfig.contextLength).contiguous(); }

struct Reference {
  double norm = 0;
  NamedTensors clipped;  // every parameter's clipped gradient
};

// One process: backward on the whole batch, then nn::clipGradNorm at `fraction` of the norm.
Reference singleProcess(double normType, double fraction) {
  auto model = buildGpt();
  const Tensor rows = batchRows();
  nn::Gpt::loss((*model)(inputsOf(rows)), targetsOf(rows)).backward();
  Reference out;
  const double before = nn::clipGradNorm(model->parameters(), 1e30, {.normType = normType});
  out.norm = nn::clipGradNorm(model->parameters(), fraction * before, {.normType = normType});
  EXPECT_EQ(out.norm, before);
  for (const auto& [name, p] : model->namedParameters()) out.clipped.emplace_back(name, p.grad().clone());
  return out;
}

void expectClippedLikeOneProcess(ProcessGroup& tp, const nn::Gpt& model, double norm, const Reference& reference,
                                 const std::string& label) {
  EXPECT_LE(std::abs(norm - reference.norm), 1e-12 * reference.norm)
      << label << ": norm " << norm << " vs one process's " << reference.norm;
  const std::vector<ParameterShard> shards = parameterShardsOf(model);
  const NamedTensors mine = model.namedParameters();
  ASSERT_EQ(mine.size(), reference.clipped.size()) << label;
  for (size_t i = 0; i < mine.size(); ++i) {
    ASSERT_EQ(mine[i].first, reference.clipped[i].first) << label;
    const Tensor whole = wholeParameter(tp, mine[i].second.grad(), shards[i]);
    expectMatches(whole, reference.clipped[i].second, str(label, " ", mine[i].first, " clipped gradient"));
  }
}

TEST(TensorParallelClipGradNorm, CountsEachShardOnceAndEachReplicatedParameterOnce) {
  const double infinity = std::numeric_limits<double>::infinity();
  for (double normType : {2.0, infinity}) {
    const Reference reference = singleProcess(normType, 0.25);
    for (int degree : {2, 4}) {
      for (bool sequenceParallel : {false, true}) {
        const std::string label =
            str("TP=", degree, sequenceParallel ? " SP" : "", std::isinf(normType) ? " inf-norm" : " 2-norm");
        withRanks(degree, [&](int, const ProcessGroupPtr& tp) {
          auto model = buildGpt();
          parallelize(*model, tp, gptParallelPlan({.sequenceParallel = sequenceParallel}));
          const Tensor rows = batchRows();
          model->nextTokenLoss((*model)(inputsOf(rows)), targetsOf(rows)).backward();
          const double norm =
              clipTensorParallelGradNorm(*model, 0.25 * reference.norm, tp, {.normType = normType});
          expectClippedLikeOneProcess(*tp, *model, norm, reference, label);
        });
      }
    }
  }
}

TEST(TensorParallelClipGradNorm, ComposesWithDdpOverTheDataParallelDimension) {
  const Reference reference = singleProcess(2.0, 0.25);
  for (bool sequenceParallel : {false, true}) {
    const std::string label = str("TP=2 x DP=2", sequenceParallel ? " SP" : "");
    withRanks(4, [&](int, const ProcessGroupPtr& world) {
      const DeviceMesh mesh = DeviceMesh::create(world, {{"dp", 2}, {"tp", 2}});
      auto model = buildGpt();
      parallelize(*model, mesh, gptParallelPlan({.sequenceParallel = sequenceParallel}));
      DistributedDataParallel ddp(model, mesh["dp"]);
      const int64_t half = kRows / 2;
      const Tensor rows = batchRows().narrow(0, mesh.coordinate("dp") * half, half);
      model->nextTokenLoss(ddp(inputsOf(rows)), targetsOf(rows)).backward();
      const double norm = clipTensorParallelGradNorm(*model, 0.25 * reference.norm, mesh["tp"]);
      expectClippedLikeOneProcess(*mesh["tp"], *model, norm, reference, label);
    });
  }
}

TEST(TensorParallelClipGradNorm, RefusesOptionsItSetsItself) {
  withRanks(2, [&](int, const ProcessGroupPtr& tp) {
    auto model = buildGpt();
    parallelize(*model, tp, gptParallelPlan());
    nn::ClipGradNormOptions options;
    options.isSplit = [](size_t) { return false; };
    EXPECT_THROW(clipTensorParallelGradNorm(*model, 1.0, tp, options), InvalidArgument);
    EXPECT_THROW(clipTensorParallelGradNorm(*model, 1.0, nullptr), InvalidArgument);
  });
}

}  // namespace
}  // namespace dt::testing
