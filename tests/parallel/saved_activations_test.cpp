// Sequence parallelism's memory claim, measured with the autograd core's own record of what
// each node saved for backward (Node::savedTensorsForReport, walked from the loss): the
// activations the norms (LayerNormBackward) and the residual-stream dropouts (MulBackward of an
// activation and its equally shaped mask) keep are 1/t of the single process's per rank with SP,
// and the single process's whole without it (plain TP replicates that region).
#include <cstddef>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/strings.h"
#include "parallel/parallelize.h"
#include "tensor/autograd/autograd.h"
#include "tests/fsdp/harness.h"

namespace dt::testing {
namespace {

const nn::GptConfig kConfig{.vocabSize = 32, .contextLength = 8, .layers = 2, .heads = 4, .width = 16,
                            .dropout = 0.1};
constexpr int64_t kBatch = 3;

struct SavedBytes {
  size_t norms = 0;     // LayerNormBackward's saved activations (its input, mean and rstd; not the weight)
  size_t dropouts = 0;  // MulBackward's where both factors have one shape: an activation and its dropout mask
  int normNodes = 0, dropoutNodes = 0;
};

size_t bytesOf(const Tensor& t) { return t.defined() ? static_cast<size_t>(t.numel()) * itemSize(t.dtype()) : 0; }

// Every node reachable from the loss, once, with what it saved.
SavedBytes savedBytesBehind(const Tensor& loss) {
  SavedBytes total;
  std::vector<std::shared_ptr<Node>> pending{loss.gradFn()};
  std::set<const Node*> seen;
  while (!pending.empty()) {
    const std::shared_ptr<Node> node = pending.back();
    pending.pop_back();
    if (!node || !seen.insert(node.get()).second) continue;
    for (const Edge& edge : node->nextEdges()) pending.push_back(edge.node);
    const std::optional<TensorList> saved = node->savedTensorsForReport();
    if (!saved) continue;
    if (node->name() == "LayerNormBackward") {
      ++total.normNodes;
      for (const Tensor& t : *saved) {
        // The weight ([C]) is a parameter's copy, the same at any degree: not an activation.
        if (t.defined() && t.sizes() != Shape{kConfig.width}) total.norms += bytesOf(t);
      }
    } else if (node->name() == "MulBackward" && saved->size() == 2 && (*saved)[0].defined() &&
               (*saved)[1].defined() && (*saved)[0].sizes() == (*saved)[1].sizes() && (*saved)[0].dim() >= 2) {
      ++total.dropoutNodes;
      total.dropouts += bytesOf((*saved)[0]) + bytesOf((*saved)[1]);
    }
  }
  return total;
}

Tensor tokens() {
  Generator data(3);
  return randint(0, kConfig.vocabSize, {kBatch, kConfig.contextLength}, data);
}

SavedBytes singleProcess() {
  Generator init(2024), dropping(5);
  nn::Gpt model(kConfig, init, &dropping);
  const Tensor input = tokens();
  return savedBytesBehind(nn::Gpt::loss(model(input), input));
}

TEST(SequenceParallelMemory, NormAndDropoutRegionsSaveOneOverTOfTheSingleProcessesActivations) {
  const SavedBytes whole = singleProcess();
  // ln_1, ln_2 per block and ln_f; the embeddings' dropout and both residual branches' per block.
  ASSERT_EQ(whole.normNodes, 2 * kConfig.layers + 1);
  ASSERT_EQ(whole.dropoutNodes, 2 * kConfig.layers + 1);
  ASSERT_GT(whole.norms, 0u);
  for (int degree : {2, 4}) {
    for (bool sequenceParallel : {false, true}) {
      withRanks(degree, [&](int rank, const ProcessGroupPtr& world) {
        const std::string label = str("TP=", degree, sequenceParallel ? " SP" : "", " rank ", rank);
        Generator init(2024), dropping(5);
        nn::Gpt model(kConfig, init, &dropping);
        parallelize(model, world, gptParallelPlan({.sequenceParallel = sequenceParallel}));
        const Tensor input = tokens();
        const SavedBytes mine = savedBytesBehind(model.nextTokenLoss(model(input), input));
        EXPECT_EQ(mine.normNodes, whole.normNodes) << label;
        EXPECT_EQ(mine.dropoutNodes, whole.dropoutNodes) << label;
        const size_t divisor = sequenceParallel ? static_cast<size_t>(degree) : 1;
        EXPECT_EQ(mine.norms * divisor, whole.norms) << label << ": the norms' saved activations";
        EXPECT_EQ(mine.dropouts * divisor, whole.dropouts) << label << ": the dropouts' saved activations";
      });
    }
  }
}

}  // namespace
}  // namespace dt::testing
