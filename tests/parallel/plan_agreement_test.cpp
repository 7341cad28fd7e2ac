// Ranks of one tensor-parallel group that parallelize with different plans (a module split on one
// rank and whole on another, sequence parallelism on one only, dropout streams seeded per rank)
// are refused by parallelize on every rank in one line naming the module and the ranks, before
// any layer is built: never a hang at the first step, the model left whole.
#include <string>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "common/strings.h"
#include "parallel/parallelize.h"
#include "tests/fsdp/harness.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

const nn::GptConfig kConfig{.vocabSize = 32, .contextLength = 8, .layers = 2, .heads = 4, .width = 16};

// Runs parallelize on two ranks, rank r with plans[r] and its dropout stream seeded dropoutSeeds[r];
// every rank must be refused with all of `needles` and keep the plain model.
void expectRefused(const nn::GptConfig& config, const ParallelPlan (&plans)[2], const uint64_t (&dropoutSeeds)[2],
                   const std::vector<std::string>& needles) {
  withRanks(2, [&](int rank, const ProcessGroupPtr& world) {
    Generator init(2024), dropping(dropoutSeeds[rank]);
    nn::Gpt model(config, init, &dropping);
    const size_t parameters = model.parameters().size();
    const std::string message = expectThrowsWith<InvalidArgument>(
        [&] { parallelize(model, world, plans[rank]); }, needles);
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
    EXPECT_EQ(model.layout(), nullptr) << "rank " << rank << ": the refused model must stay plain";
    EXPECT_EQ(model.parameters().size(), parameters) << "rank " << rank;
    EXPECT_EQ(model.h->child("0")->child("mlp")->child("c_fc")->typeName(), "Linear") << "rank " << rank;
  });
}

TEST(PlanAgreement, AModuleSplitOnOneRankAndWholeOnAnotherIsNamedWithTheRanks) {
  ParallelPlan withoutMlp = gptParallelPlan();
  std::erase_if(withoutMlp.styles, [](const auto& entry) { return entry.first.starts_with("h.*.mlp"); });
  expectRefused(kConfig, {gptParallelPlan(), withoutMlp}, {1, 1},
                {"parallelize: the ranks of tensor-parallel group", "apply different plans",
                 "rank 0 has h.0.mlp.c_fc -> column; rank 1 has h.0.mlp.c_fc -> whole",
                 "give every rank of the group the same plan"});
}

TEST(PlanAgreement, SequenceParallelOnOneRankOnlyIsNamedAtItsFirstModule) {
  expectRefused(kConfig, {gptParallelPlan({.sequenceParallel = true}), gptParallelPlan()}, {1, 1},
                {"apply different plans", "rank 0 has h.0.ln_1 -> sequence; rank 1 has h.0.ln_1 -> whole"});
}

TEST(PlanAgreement, DropoutStreamsSeededPerRankAreRefusedNamingTheSeeds) {
  nn::GptConfig dropping = kConfig;
  dropping.dropout = 0.1;
  expectRefused(dropping, {gptParallelPlan(), gptParallelPlan()}, {7, 8},
                {"apply different plans", "rank 0 has dropout 0.1 stream seed 7 position 0; rank 1 has dropout 0.1 "
                                          "stream seed 8 position 0",
                 "the same dropout seed"});
}

TEST(PlanAgreement, EqualPlansPassWithOneSmallAllgather) {
  withRanks(2, [&](int, const ProcessGroupPtr& world) {
    Generator init(2024);
    nn::Gpt model(kConfig, init);
    const uint64_t before = world->lastSeq();
    parallelize(model, world, gptParallelPlan());
    EXPECT_EQ(world->lastSeq() - before, 1u) << "agreeing costs one allgather of (count, hash)";
    EXPECT_NE(model.layout(), nullptr);
  });
}

}  // namespace
}  // namespace dt::testing
