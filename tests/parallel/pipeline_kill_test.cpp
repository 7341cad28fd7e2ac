// Pipeline parallelism with processes as ranks (dt::testing::spawn): a stage SIGKILLed in the
// middle of a step. Every surviving rank must end that step with one error that names the lost
// rank (directly, or as what its neighbour reported, or as the cause the first survivor left
// in the store), never hang, on shm and Gloo. Threads cannot show this: a killed thread takes the whole test with it.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/config.h"
#include "common/strings.h"
#include "parallel/pipeline.h"
#include "process_group/process_group.h"
#include "testing/point.h"
#include "testing/spawn.h"

namespace dt {
namespace {

namespace pp = dt::pipeline;
using testing::Ending;
using testing::RankContext;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// y = x * weight, with a point the plan kills at.
class PointedChunk final : public nn::Module {
 public:
  PointedChunk() { weight = registerParameter("weight", ones({1})); }
  Tensor forward(const Tensor& x) override {
    testing::point("stage-forward");
    return mul(x, weight);
  }
  std::string typeName() const override { return "PointedChunk"; }
  Tensor weight;
};

class PipelineKill : public ::testing::TestWithParam<std::string> {};

TEST_P(PipelineKill, AStageKilledMidStepEndsEverySurvivorWithOneErrorNamingIt) {
  constexpr int kWorld = 4, kMicro = 4, kLost = 2;
  constexpr auto kTimeout = 10s;
  testing::SpawnOptions options;
  // Rank 2's sixth forward: the second step's second micro-batch, with transfers in flight both ways.
  options.plan = {testing::killAt(kLost, "stage-forward", 6)};
  options.deadline = 120s;
  const auto results = testing::spawn(kWorld, [&](RankContext& ctx) -> std::string {
    ProcessGroupOptions o;
    o.backend = GetParam();
    o.timeout = kTimeout;
    auto group = ProcessGroup::create(ctx.store(), ctx.rank, kWorld, o);
    const pp::Schedule schedule = pp::oneFOneB(kWorld, kMicro);
    pp::RunnerStages stages;
    stages.chunks = {std::make_shared<PointedChunk>()};
    stages.loss = [](const Tensor& output, const Tensor& target) { return mean(mul(output, target)); };
    const Shape shape{2, 3};
    pp::PipelineRunner runner(schedule, stages, group, {.activationShape = shape, .store = ctx.store()});
    std::vector<Tensor> inputs, targets;
    for (int i = 0; i < kMicro; ++i) {
      if (ctx.rank == 0) inputs.push_back(ones(shape));
      if (ctx.rank == kWorld - 1) targets.push_back(ones(shape));
    }
    for (int step = 0; step < 50; ++step) {
      const auto start = Clock::now();
      try {
        runner.step(inputs, targets);
      } catch (const std::exception& e) {
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
        return str("FAILED step ", step, " after ", ms, " ms: ", e.what());
      }
    }
    return "NO-FAILURE";
  }, options);
  ASSERT_EQ(results[kLost].ending, Ending::Killed) << results.summary();
  ASSERT_EQ(results[kLost].signal, SIGKILL) << results.summary();
  for (int r = 0; r < kWorld; ++r) {
    if (r == kLost) continue;
    const std::string& text = results[r].value;
    ASSERT_TRUE(results[r].returned()) << results.summary();
    ASSERT_EQ(text.rfind("FAILED step 1 ", 0), 0u) << "rank " << r << ": " << text;
    EXPECT_NE(text.find(str("pipeline rank ", r, "/4")), std::string::npos) << text;
    const std::string firstLine = text.substr(0, text.find('\n'));
    // On Gloo the rank behind a live neighbour sees only that neighbour's connection close; the
    // neighbour published its own failure first, and the error quotes it.
    EXPECT_NE(firstLine.find(str("rank ", kLost)), std::string::npos) << "the lost rank is not named: " << text;
    // One error: the grid once, with this rank's failing action marked.
    EXPECT_EQ(text.find("rank 0:"), text.rfind("rank 0:")) << text;
    EXPECT_NE(text.find("*"), std::string::npos) << text;
    std::printf("rank %d: %s\n", r, text.substr(0, text.find('\n')).c_str());
  }
}

std::vector<std::string> backends() {
#if DT_HAVE_GLOO
  return {"shm", "gloo"};
#else
  return {"shm"};
#endif
}

INSTANTIATE_TEST_SUITE_P(Backends, PipelineKill, ::testing::ValuesIn(backends()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace dt
