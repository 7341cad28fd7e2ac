// Tensor and sequence parallelism (threads as ranks on shm) against the single-process layers
// built from the same seed: the MLP column -> GELU -> row at TP=2 and TP=4 in float64 (1e-12
// relative) and float32 (rtol 1.3e-6, atol 1e-5): output, every gradient (gathered) and the
// weights after SGD and AdamW steps; the vocab-parallel embedding and cross-entropy (loss and
// gradient); the region functions against plain tensors; the collectives each one issues,
// counted; and the refusals of sizes the degree does not divide.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "common/strings.h"
#include "parallel/mesh.h"
#include "parallel/tensor_parallel.h"
#include "tensor/optim/optim.h"
#include "tests/fsdp/harness.h"
#include "tests/parallel/harness.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

struct Case {
  int degree;
  DType dtype;
};

std::string describeCase(const Case& c) { return str("TP=", c.degree, " ", toString(c.dtype)); }

// A leaf copy of `t` in `dtype` (the reference model's parameters, the inputs).
Tensor leaf(const Tensor& t, DType dtype, bool requiresGrad = true) {
  Tensor out = t.detach().to(dtype).clone();
  out.setRequiresGrad(requiresGrad);
  return out;
}

// The whole MLP of width 8 (hidden 32), as nn::Linear draws it from one seed, and its batch.
struct MlpData {
  static constexpr int64_t kWidth = 8;
  Tensor w1, b1, w2, b2, x, outputGrad;
  explicit MlpData(DType dtype) {
    Generator init(1234);
    nn::Linear fc(kWidth, 4 * kWidth, true, init), proj(4 * kWidth, kWidth, true, init);
    w1 = leaf(fc.weight, dtype);
    b1 = leaf(fc.bias, dtype);
    w2 = leaf(proj.weight, dtype);
    b2 = leaf(proj.bias, dtype);
    Generator data(99);
    x = leaf(randn({3, 4, kWidth}, data), dtype);
    outputGrad = randn({3, 4, kWidth}, data).to(dtype);
  }
  std::vector<Tensor> parameters() const { return {w1, b1, w2, b2}; }
};

enum class Optimizer { Sgd, AdamW };

std::unique_ptr<optim::Optimizer> makeOptimizer(Optimizer kind, std::vector<Tensor> params) {
  if (kind == Optimizer::Sgd) return std::make_unique<optim::SGD>(std::move(params), optim::SGDOptions{.lr = 0.05});
  return std::make_unique<optim::AdamW>(std::move(params), optim::AdamWOptions{.lr = 1e-2});
}

// The single-process MLP and its TP split trained side by side: after the first backward the
// output and every gradient (gathered) agree, after `steps` optimizer steps every weight.
void checkMlp(const Case& c, Optimizer optimizer, int steps) {
  withRanks(c.degree, [&](int rank, const ProcessGroupPtr& world) {
    const std::string label = describeCase(c);
    const DeviceMesh mesh = DeviceMesh::create(world, {{"tp", c.degree}});
    const ProcessGroupPtr& tp = mesh["tp"];
    MlpData reference(c.dtype);
    MlpData whole(c.dtype);  // the same draws: what this rank splits
    ColumnParallelLinear up(whole.w1, whole.b1, tp);
    RowParallelLinear down(whole.w2, whole.b2, tp);
    std::vector<Tensor> parameters = up.parameters();
    for (const Tensor& p : down.parameters()) parameters.push_back(p);
    auto referenceOptimizer = makeOptimizer(optimizer, reference.parameters());
    auto parallelOptimizer = makeOptimizer(optimizer, parameters);

    for (int step = 0; step < steps; ++step) {
      referenceOptimizer->zeroGrad();
      parallelOptimizer->zeroGrad();
      whole.x.setGrad(Tensor());
      reference.x.setGrad(Tensor());
      const Tensor expected = linear(gelu(linear(reference.x, reference.w1, reference.b1)), reference.w2, reference.b2);
      sum(expected * reference.outputGrad).backward();

      const TpCollectiveCounts before = tpCollectiveCounts(*tp);
      const uint64_t seqBefore = tp->lastSeq();
      const Tensor actual = down(gelu(up(whole.x)));
      const TpCollectiveCounts afterForward = tpCollectiveCounts(*tp);
      sum(actual * whole.outputGrad).backward();
      const TpCollectiveCounts forward = afterForward - before;
      const TpCollectiveCounts backward = tpCollectiveCounts(*tp) - afterForward;
      // Forward: the row layer's all-reduce; backward: the column layer's copy, nothing else.
      EXPECT_EQ(forward.allReduces, 1) << label;
      EXPECT_EQ(forward.total(), 1) << label;
      EXPECT_EQ(forward.elements, actual.numel()) << label;
      EXPECT_EQ(backward.allReduces, 1) << label;
      EXPECT_EQ(backward.total(), 1) << label;
      EXPECT_EQ(tp->lastSeq() - seqBefore, 2u) << label << ": collectives the counters missed";

      if (step == 0) {
        expectMatches(actual, expected, label + " output");
        expectMatches(whole.x.grad(), reference.x.grad(), label + " input gradient");
        expectMatches(gatherBlocks(*tp, up.weight.grad(), 0), reference.w1.grad(), label + " fc weight gradient");
        expectMatches(gatherBlocks(*tp, up.bias.grad(), 0), reference.b1.grad(), label + " fc bias gradient");
        expectMatches(gatherBlocks(*tp, down.weight.grad(), 1), reference.w2.grad(), label + " proj weight gradient");
        expectMatches(down.bias.grad(), reference.b2.grad(), label + " proj bias gradient (replicated)");
      }
      referenceOptimizer->step();
      parallelOptimizer->step();
    }
    const std::string after = str(label, " after ", steps, optimizer == Optimizer::Sgd ? " SGD" : " AdamW", " steps: ");
    expectMatches(gatherBlocks(*tp, up.weight, 0), reference.w1, after + "fc weight");
    expectMatches(gatherBlocks(*tp, up.bias, 0), reference.b1, after + "fc bias");
    expectMatches(gatherBlocks(*tp, down.weight, 1), reference.w2, after + "proj weight");
    expectMatches(down.bias, reference.b2, after + "proj bias");
    (void)rank;
  });
}

const Case kCases[] = {{2, DType::Float64}, {4, DType::Float64}, {2, DType::Float32}, {4, DType::Float32}};

TEST(TensorParallel, MlpColumnGeluRowMatchesTheSingleProcessMlpWithSgd) {
  for (const Case& c : kCases) checkMlp(c, Optimizer::Sgd, 3);
}

TEST(TensorParallel, MlpColumnGeluRowMatchesTheSingleProcessMlpWithAdamW) {
  for (const Case& c : kCases) checkMlp(c, Optimizer::AdamW, 4);
}

TEST(TensorParallel, ColumnWithGatheredOutputAndRowWithAWholeInputAreDropInLinears) {
  for (const Case& c : kCases) {
    withRanks(c.degree, [&](int, const ProcessGroupPtr& tp) {
      const std::string label = describeCase(c);
      MlpData reference(c.dtype), whole(c.dtype);
      ColumnParallelLinear up(whole.w1, whole.b1, tp, {.gatherOutput = true});
      RowParallelLinear down(whole.w2, Tensor(), tp, {.inputIsParallel = false});
      const Tensor hidden = up(whole.x);
      const Tensor expectedHidden = linear(reference.x, reference.w1, reference.b1);
      expectMatches(hidden, expectedHidden, label + " gathered column output");
      const TpCollectiveCounts before = tpCollectiveCounts(*tp);
      const Tensor out = down(hidden);
      // The split of the whole input costs nothing forward; the sum is one all-reduce.
      EXPECT_EQ((tpCollectiveCounts(*tp) - before).allReduces, 1) << label;
      EXPECT_EQ((tpCollectiveCounts(*tp) - before).total(), 1) << label;
      const Tensor expected = linear(expectedHidden, reference.w2);
      expectMatches(out, expected, label + " row output from a whole input");
      sum(out * whole.outputGrad).backward();
      sum(expected * reference.outputGrad).backward();
      expectMatches(whole.x.grad(), reference.x.grad(), label + " input gradient");
      expectMatches(gatherBlocks(*tp, up.weight.grad(), 0), reference.w1.grad(), label + " fc weight gradient");
      expectMatches(gatherBlocks(*tp, down.weight.grad(), 1), reference.w2.grad(), label + " proj weight gradient");
    });
  }
}

TEST(TensorParallel, VocabParallelEmbeddingMatchesTheWholeTable) {
  for (const Case& c : kCases) {
    withRanks(c.degree, [&](int, const ProcessGroupPtr& tp) {
      const std::string label = describeCase(c);
      Generator init(5);
      nn::Embedding table(12, 5, init);
      const Tensor expectedWeight = leaf(table.weight, c.dtype);
      VocabParallelEmbedding parallel(leaf(table.weight, c.dtype), tp);
      Generator data(6);
      const Tensor tokens = randint(0, 12, {3, 4}, data);
      const Tensor gradient = randn({3, 4, 5}, data).to(c.dtype);
      const TpCollectiveCounts before = tpCollectiveCounts(*tp);
      const Tensor out = parallel(tokens);
      EXPECT_EQ((tpCollectiveCounts(*tp) - before).allReduces, 1) << label;
      const Tensor expected = embedding(expectedWeight, tokens);
      expectMatches(out, expected, label + " lookup");
      sum(out * gradient).backward();
      sum(expected * gradient).backward();
      expectMatches(gatherBlocks(*tp, parallel.weight.grad(), 0), expectedWeight.grad(), label + " table gradient");
      expectThrowsWith<InvalidArgument>([&] { parallel(fromVector<int64_t>({3, 12})); },
                                        {"VocabParallelEmbedding: token 12", "outside the vocabulary [0, 12)"});
    });
  }
}

// Logits [2, 3, 12] (one target ignored) against crossEntropy of the whole [6, 12] logits.
void checkCrossEntropy(const Case& c, Reduction reduction) {
  withRanks(c.degree, [&](int rank, const ProcessGroupPtr& tp) {
    const std::string label = describeCase(c) + (reduction == Reduction::Mean ? " mean" : reduction == Reduction::Sum ? " sum" : " none");
    constexpr int64_t kVocab = 12;
    Generator data(11);
    const Tensor whole = leaf(mul(randn({2, 3, kVocab}, data), 3.0), c.dtype);
    const Tensor targets = fromVector<int64_t>({0, 11, -100, 5, 6, 3}, {2, 3});
    const Tensor rowWeights = randn({2, 3}, data).to(c.dtype);
    const int64_t block = kVocab / c.degree;
    Tensor local = leaf(whole.narrow(2, rank * block, block), c.dtype);

    const TpCollectiveCounts before = tpCollectiveCounts(*tp);
    const uint64_t seqBefore = tp->lastSeq();
    Tensor loss = vocabParallelCrossEntropy(local, targets, tp, {.reduction = reduction});
    const TpCollectiveCounts forward = tpCollectiveCounts(*tp) - before;
    // A max, a sum of exponentials and the target logits: one value per row each, never the logits.
    EXPECT_EQ(forward.allReduces, 3) << label;
    EXPECT_EQ(forward.total(), 3) << label;
    EXPECT_EQ(forward.elements, 3 * 6) << label;
    EXPECT_EQ(tp->lastSeq() - seqBefore, 3u) << label;

    Tensor expected = crossEntropy(whole.reshape({6, kVocab}), targets.reshape({6}), {.reduction = reduction});
    if (reduction == Reduction::None) {
      expected = expected.reshape({2, 3});
      expectMatches(loss, expected, label + " loss per row");
      loss = sum(loss * rowWeights);
      expected = sum(expected * rowWeights);
    }
    expectMatches(loss, expected, label + " loss");
    const TpCollectiveCounts beforeBackward = tpCollectiveCounts(*tp);
    loss.backward();
    expected.backward();
    EXPECT_EQ((tpCollectiveCounts(*tp) - beforeBackward).total(), 0) << label << ": backward communicates";
    expectMatches(local.grad(), whole.grad().narrow(2, rank * block, block), label + " logits gradient");
  });
}

TEST(TensorParallel, VocabParallelCrossEntropyMatchesCrossEntropyWithThreeSmallAllReduces) {
  for (const Case& c : kCases) {
    for (Reduction reduction : {Reduction::Mean, Reduction::Sum, Reduction::None}) checkCrossEntropy(c, reduction);
  }
}

TEST(TensorParallel, RegionFunctionsAgainstPlainTensors) {
  for (const Case& c : kCases) {
    withRanks(c.degree, [&](int rank, const ProcessGroupPtr& tp) {
      const std::string label = describeCase(c);
      const int t = c.degree;
      Generator data(21);
      const Tensor x = randn({2, 8, 4 * t}, data).to(c.dtype);
      // Each rank's own tensor: rank r's is x * (r + 1), so sums over ranks are x * t (t + 1) / 2.
      const double rankSum = t * (t + 1) / 2.0;
      const Tensor mine = x * static_cast<double>(rank + 1);

      // Last dim: scatter keeps block r; its backward gathers every rank's gradient block.
      Tensor input = leaf(x, c.dtype);
      const Tensor block = scatterToTensorParallelRegion(input, tp);
      expectMatches(block, x.narrow(2, rank * 4, 4), label + " scatter (last dim)");
      sum(block * block.detach()).backward();  // gradient: the block itself
      expectMatches(input.grad(), x, label + " scatter's backward gathers");
      Tensor part = leaf(x.narrow(2, rank * 4, 4), c.dtype);
      const Tensor gathered = gatherFromTensorParallelRegion(part, tp);
      expectMatches(gathered, x, label + " gather (last dim)");
      sum(gathered * x).backward();
      expectMatches(part.grad(), x.narrow(2, rank * 4, 4), label + " gather's backward splits");

      // Copy and reduce, the conjugate pair.
      Tensor copied = leaf(x, c.dtype);
      sum(copyToTensorParallelRegion(copied, tp) * mine).backward();
      expectMatches(copied.grad(), x * rankSum, label + " copy's backward all-reduces");
      Tensor reduced = leaf(mine, c.dtype);
      const Tensor total = reduceFromTensorParallelRegion(reduced, tp);
      expectMatches(total, x * rankSum, label + " reduce");
      sum(total * x).backward();
      expectMatches(reduced.grad(), x, label + " reduce's backward is the identity");

      // Sequence dim (1): all-gather forward, reduce-scatter backward.
      const int64_t seqBlock = 8 / t;
      Tensor shard = leaf(x.narrow(1, rank * seqBlock, seqBlock), c.dtype);
      TpCollectiveCounts before = tpCollectiveCounts(*tp);
      const Tensor sequence = gatherFromSequenceParallelRegion(shard, tp);
      EXPECT_EQ((tpCollectiveCounts(*tp) - before).allGathers, 1) << label;
      expectMatches(sequence, x, label + " sequence gather");
      before = tpCollectiveCounts(*tp);
      sum(sequence * mine).backward();
      EXPECT_EQ((tpCollectiveCounts(*tp) - before).reduceScatters, 1) << label;
      EXPECT_EQ((tpCollectiveCounts(*tp) - before).total(), 1) << label;
      expectMatches(shard.grad(), x.narrow(1, rank * seqBlock, seqBlock) * rankSum,
                    label + " sequence gather's backward reduce-scatters");

      // Reduce-scatter forward, all-gather backward.
      Tensor partial = leaf(mine, c.dtype);
      before = tpCollectiveCounts(*tp);
      const Tensor scattered = reduceScatterToSequenceParallelRegion(partial, tp);
      EXPECT_EQ((tpCollectiveCounts(*tp) - before).reduceScatters, 1) << label;
      expectMatches(scattered, x.narrow(1, rank * seqBlock, seqBlock) * rankSum, label + " sequence reduce-scatter");
      sum(scattered * x.narrow(1, rank * seqBlock, seqBlock)).backward();
      expectMatches(partial.grad(), x, label + " sequence reduce-scatter's backward gathers");

      // Split along the sequence: block r; backward gathers.
      Tensor wholeSequence = leaf(x, c.dtype);
      const Tensor split = scatterToSequenceParallelRegion(wholeSequence, tp);
      expectMatches(split, x.narrow(1, rank * seqBlock, seqBlock), label + " sequence split");
      sum(split * split.detach()).backward();
      expectMatches(wholeSequence.grad(), x, label + " sequence split's backward gathers");
    });
  }
}

// Rank r's rows of a fused [3C, ...] q/k/v tensor: the q, k and v rows of its heads.
Tensor headRows(const Tensor& fused, int rank, int degree) {
  const int64_t width = fused.size(0) / 3, block = width / degree;
  return cat({fused.narrow(0, rank * block, block), fused.narrow(0, width + rank * block, block),
              fused.narrow(0, 2 * width + rank * block, block)});
}

TEST(TensorParallel, AttentionSplitByHeadMatchesTheWholeAttention) {
  for (const Case& c : kCases) {
    withRanks(c.degree, [&](int rank, const ProcessGroupPtr& tp) {
      const std::string label = describeCase(c) + " attention";
      const nn::GptConfig config{.vocabSize = 16, .contextLength = 8, .layers = 1, .heads = 4, .width = 16};
      Generator init(17);
      nn::CausalSelfAttention full(config, init, init);
      const Tensor qkvWeight = leaf(full.c_attn->weight, c.dtype), qkvBias = leaf(full.c_attn->bias, c.dtype);
      const Tensor projWeight = leaf(full.c_proj->weight, c.dtype), projBias = leaf(full.c_proj->bias, c.dtype);
      ParallelSelfAttention parallel(qkvWeight, qkvBias, projWeight, projBias, config.heads, tp);
      EXPECT_EQ(parallel.localHeads(), config.heads / c.degree);
      EXPECT_EQ(parallel.c_attn->parameterShards()[0].parts, 3);
      Generator data(18);
      const Tensor x = leaf(randn({2, 6, config.width}, data), c.dtype);
      const Tensor xParallel = leaf(x, c.dtype);
      const Tensor outputGrad = randn({2, 6, config.width}, data).to(c.dtype);

      const Tensor expected = linear(selfAttention(linear(x, qkvWeight, qkvBias), config.heads), projWeight, projBias);
      if (c.dtype == DType::Float32) expectMatches(full(x.detach()), expected.detach(), label + ": the module itself");
      const TpCollectiveCounts before = tpCollectiveCounts(*tp);
      const Tensor actual = parallel(xParallel);
      const TpCollectiveCounts forward = tpCollectiveCounts(*tp) - before;
      sum(actual * outputGrad).backward();
      const TpCollectiveCounts backward = tpCollectiveCounts(*tp) - before - forward;
      EXPECT_EQ(forward.allReduces, 1) << label;
      EXPECT_EQ(forward.total(), 1) << label;
      EXPECT_EQ(backward.allReduces, 1) << label;
      EXPECT_EQ(backward.total(), 1) << label;
      sum(expected * outputGrad).backward();
      expectMatches(actual, expected, label + " output");
      expectMatches(xParallel.grad(), x.grad(), label + " input gradient");
      expectMatches(parallel.c_attn->weight, headRows(qkvWeight, rank, c.degree).detach(), label + " q/k/v rows of my heads");
      expectMatches(parallel.c_attn->weight.grad(), headRows(qkvWeight.grad(), rank, c.degree), label + " c_attn weight gradient");
      expectMatches(parallel.c_attn->bias.grad(), headRows(qkvBias.grad(), rank, c.degree), label + " c_attn bias gradient");
      expectMatches(gatherBlocks(*tp, parallel.c_proj->weight.grad(), 1), projWeight.grad(), label + " c_proj weight gradient");
      expectMatches(parallel.c_proj->bias.grad(), projBias.grad(), label + " c_proj bias gradient");
      std::vector<std::string> names;
      for (const auto& [name, unused] : parallel.namedParameters()) names.push_back(name);
      EXPECT_EQ(names, (std::vector<std::string>{"c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias"}));
    });
  }
  withRanks(4, [&](int, const ProcessGroupPtr& tp) {
    const nn::GptConfig config{.vocabSize = 16, .contextLength = 8, .layers = 1, .heads = 6, .width = 24};
    Generator init(19);
    nn::CausalSelfAttention full(config, init, init);
    expectThrowsWith<InvalidArgument>([&] { ParallelSelfAttention layer(full, config.heads, tp); },
                                      {"ParallelSelfAttention: 6 heads", "tensor-parallel degree 4"});
  });
}

TEST(TensorParallel, SizesTheDegreeDoesNotDivideAreRefusedNamingModuleSizeAndDegree) {
  withRanks(4, [&](int, const ProcessGroupPtr& tp) {
    Generator init(3);
    nn::Linear narrowOut(8, 10, true, init), narrowIn(6, 8, true, init);
    nn::Embedding table(10, 4, init);
    expectThrowsWith<InvalidArgument>([&] { ColumnParallelLinear layer(narrowOut, tp); },
                                      {"ColumnParallelLinear", "10 output features", "tensor-parallel degree 4"});
    expectThrowsWith<InvalidArgument>([&] { RowParallelLinear layer(narrowIn, tp); },
                                      {"RowParallelLinear", "6 input features", "tensor-parallel degree 4"});
    expectThrowsWith<InvalidArgument>([&] { VocabParallelEmbedding layer(table, tp); },
                                      {"VocabParallelEmbedding", "10 vocabulary rows", "tensor-parallel degree 4"});
    expectThrowsWith<InvalidArgument>([&] { scatterToTensorParallelRegion(zeros({2, 6}), tp); },
                                      {"scatterToTensorParallelRegion", "dim 1 of float32[2, 6] has size 6",
                                       "tensor-parallel degree 4"});
    expectThrowsWith<InvalidArgument>([&] { reduceScatterToSequenceParallelRegion(zeros({2, 6, 4}), tp); },
                                      {"reduceScatterToSequenceParallelRegion", "has size 6", "degree 4"});
    ColumnParallelLinear layer(nn::Linear(8, 16, true, init), tp);
    expectThrowsWith<InvalidArgument>([&] { layer(zeros({2, 7})); }, {"ColumnParallelLinear", "must end in 8"});
    expectThrowsWith<InvalidArgument>(
        [&] { vocabParallelCrossEntropy(zeros({3, 4}), fromVector<int64_t>({1, 16, 2}), tp); },
        {"vocabParallelCrossEntropy: target 16", "outside the vocabulary [0, 16)"});
    expectThrowsWith<InvalidArgument>([&] { copyToTensorParallelRegion(zeros({2}), nullptr); },
                                      {"copyToTensorParallelRegion", "group is null"});
  });
}

TEST(TensorParallel, AtDegreeOneTheLayersAreThePlainLayersAndCommunicateNothing) {
  withRanks(2, [&](int, const ProcessGroupPtr& world) {
    const DeviceMesh mesh = DeviceMesh::create(world, {{"dp", 2}, {"tp", 1}});
    const ProcessGroupPtr& tp = mesh["tp"];
    MlpData reference(DType::Float64), whole(DType::Float64);
    ColumnParallelLinear up(whole.w1, whole.b1, tp);
    RowParallelLinear down(whole.w2, whole.b2, tp);
    const uint64_t seqBefore = tp->lastSeq();
    const Tensor actual = down(gelu(up(whole.x)));
    sum(actual * whole.outputGrad).backward();
    const Tensor expected = linear(gelu(linear(reference.x, reference.w1, reference.b1)), reference.w2, reference.b2);
    sum(expected * reference.outputGrad).backward();
    expectMatches(actual, expected, "TP=1 output");
    expectMatches(up.weight.grad(), reference.w1.grad(), "TP=1 fc weight gradient");
    expectMatches(whole.x.grad(), reference.x.grad(), "TP=1 input gradient");
    EXPECT_EQ(tpCollectiveCounts(*tp).total(), 0);
    EXPECT_EQ(tp->lastSeq(), seqBefore);
  });
}

TEST(TensorParallel, AMeshOrLayerOnAGroupThisRankIsNotInIsRefused) {
  withRanks(4, [&](int rank, const ProcessGroupPtr& world) {
    const ProcessGroupPtr firstTwo = world->newGroup({0, 1});
    if (firstTwo->isMember()) return;
    expectThrowsWith<InvalidArgument>([&] { DeviceMesh::create(firstTwo, {{"tp", 2}}); },
                                      {"not a member of group", "rank -1/2"});
    Generator init(4);
    expectThrowsWith<InvalidArgument>([&] { ColumnParallelLinear layer(nn::Linear(4, 4, true, init), firstTwo); },
                                      {"not a member of tensor-parallel group", "ranks 0-1", "mesh[\"tp\"]"});
    (void)rank;
  });
}

TEST(TensorParallel, ShardsReportTheirPlaceInTheWholeParameter) {
  withRanks(2, [&](int rank, const ProcessGroupPtr& tp) {
    Generator init(8);
    ColumnParallelLinear column(nn::Linear(6, 4, true, init), tp);
    RowParallelLinear row(nn::Linear(4, 6, true, init), tp);
    VocabParallelEmbedding embedding(nn::Embedding(10, 3, init), tp);
    const auto columnShards = column.parameterShards();
    ASSERT_EQ(columnShards.size(), 2u);
    EXPECT_EQ(columnShards[0].name, "weight");
    EXPECT_EQ(columnShards[0].globalShape, (Shape{4, 6}));
    EXPECT_EQ(columnShards[0].dim, 0);
    EXPECT_EQ(columnShards[0].offset, rank * 2);
    EXPECT_EQ(column.weight.sizes(), (Shape{2, 6}));
    EXPECT_EQ(columnShards[1].globalShape, (Shape{4}));
    const auto rowShards = row.parameterShards();
    EXPECT_EQ(rowShards[0].globalShape, (Shape{6, 4}));
    EXPECT_EQ(rowShards[0].dim, 1);
    EXPECT_EQ(rowShards[0].offset, rank * 2);
    EXPECT_EQ(rowShards[1].dim, -1);  // the bias is whole on every rank
    EXPECT_EQ(row.bias.sizes(), (Shape{6}));
    const auto embeddingShards = embedding.parameterShards();
    EXPECT_EQ(embeddingShards[0].globalShape, (Shape{10, 3}));
    EXPECT_EQ(embeddingShards[0].offset, rank * 5);
    EXPECT_EQ(embedding.vocabStart(), rank * 5);
  });
}

}  // namespace
}  // namespace dt::testing
