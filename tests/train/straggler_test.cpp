// Straggler detection's rule as a pure function (train/straggler.h): figures in, verdicts out.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>

#include "common/errors.h"
#include "train/straggler.h"

namespace dt::train {
namespace {

using ::testing::HasSubstr;

// A rank's figures: data wait, forward, backward, the rest of its own work, communication wait.
StepFigures figures(double data, double forward, double backward, double other, double comm) {
  return StepFigures{data, forward, backward, comm, data + forward + backward + other + comm};
}

// Four ranks of a 20 ms step; `slow` (if >= 0) spends `extraForward` more in forward and the
// others wait that long in communication.
std::vector<StepFigures> world(int slow, double extraForward = 0, double extraData = 0) {
  std::vector<StepFigures> all;
  for (int r = 0; r < 4; ++r) {
    const bool me = r == slow;
    all.push_back(figures(0.2 + (me ? extraData : 0), 8 + (me ? extraForward : 0), 10, 1,
                          1 + (me ? 0 : extraForward + extraData)));
  }
  return all;
}

TEST(Straggler, ARankSlowInForwardIsNamedOnceTheWindowIsFullWithItsSection) {
  StragglerDetector d(1.5, 40);
  for (int gather = 1; gather <= 3; ++gather) {
    EXPECT_TRUE(d.add(world(3, 200), {}, 10).empty()) << "gather " << gather << ": only " << gather * 10 << " steps slow";
  }
  const auto found = d.add(world(3, 200), {}, 10);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 3);
  EXPECT_EQ(found[0].slowSteps, 40);
  EXPECT_EQ(found[0].section, "forward");
  EXPECT_EQ(found[0].bound(), "compute-bound");
  EXPECT_NEAR(found[0].ratio, 219.2 / 19.2, 1e-9);  // own time: data + forward + backward + other
  EXPECT_NEAR(found[0].sectionMs, 208, 1e-9);
  EXPECT_NEAR(found[0].sectionMedianMs, 8, 1e-9);
  const std::string line = describeStraggler("gpt", found[0], "b", 40);
  EXPECT_THAT(line, HasSubstr("gpt: rank 3 (host b) is a straggler at step 40"));
  EXPECT_THAT(line, HasSubstr("11.4x the median (19 ms) for 40 steps; forward 208 ms against 8.0 ms (26.0x): compute-bound"));
}

TEST(Straggler, ADataBoundRankIsNamedDataBound) {
  StragglerDetector d(1.5, 20);
  d.add(world(1, 0, 50), {}, 10);
  const auto found = d.add(world(1, 0, 50), {}, 10);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 1);
  EXPECT_EQ(found[0].section, "data wait");
  EXPECT_EQ(found[0].bound(), "data-bound");
  EXPECT_THAT(describeStraggler("t", found[0], "", 20), HasSubstr("t: rank 1 is a straggler at step 20"));
}

TEST(Straggler, BackwardAndTheRestOfTheStepAreSectionsToo) {
  StragglerDetector d(1.5, 10);
  auto all = world(-1);
  all[2] = figures(0.2, 8, 60, 1, 1);
  auto found = d.add(all, {}, 10);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].section, "backward");
  StragglerDetector e(1.5, 10);
  all = world(-1);
  all[0] = figures(0.2, 8, 10, 40, 1);  // an optimizer step four times the others'
  found = e.add(all, {}, 10);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 0);
  EXPECT_EQ(found[0].section, "other");
  EXPECT_EQ(found[0].bound(), "compute-bound");
}

TEST(Straggler, ReportedOncePerEpisodeAndAgainAfterItRecovered) {
  StragglerDetector d(1.5, 20);
  int reports = 0;
  for (int gather = 0; gather < 10; ++gather) reports += static_cast<int>(d.add(world(2, 100), {}, 10).size());
  EXPECT_EQ(reports, 1) << "one episode, one report";
  EXPECT_TRUE(d.add(world(-1), {}, 10).empty());  // recovered
  EXPECT_TRUE(d.add(world(2, 100), {}, 10).empty()) << "slow again, but not for a whole window yet";
  EXPECT_EQ(d.add(world(2, 100), {}, 10).size(), 1u) << "a second episode is a second report";
  EXPECT_TRUE(d.add(world(2, 100), {}, 10).empty());
}

TEST(Straggler, ABriefSlowdownInsideTheWindowIsNotAStraggler) {
  StragglerDetector d(1.5, 40);
  for (int gather = 0; gather < 20; ++gather) {
    // Slow for 30 steps out of every 40: never a whole window in a row.
    EXPECT_TRUE(d.add(gather % 4 == 3 ? world(-1) : world(1, 100), {}, 10).empty()) << "gather " << gather;
  }
}

TEST(Straggler, NoisyButEvenFiguresNeverMakeAStraggler) {
  // Every rank's figures jitter by up to +-40 % around the same means, independently, and now
  // and then one rank has a whole bad window (preempted 60 % longer): none stays over 1.5x the
  // median for 40 steps.
  std::mt19937 random(7);
  std::uniform_real_distribution<double> jitter(0.6, 1.4);
  std::bernoulli_distribution bad(0.1);
  StragglerDetector d(1.5, 40);
  for (int gather = 0; gather < 2000; ++gather) {
    std::vector<StepFigures> all;
    for (int r = 0; r < 8; ++r) {
      const double hiccup = bad(random) ? 1.6 : 1.0;
      all.push_back(figures(0.3 * jitter(random), 6 * jitter(random) * hiccup, 9 * jitter(random), 1 * jitter(random),
                            4 * jitter(random)));
    }
    ASSERT_TRUE(d.add(all, {}, 10).empty()) << "gather " << gather;
  }
}

TEST(Straggler, SubMillisecondExcessIsNoise) {
  StragglerDetector d(1.5, 10);
  std::vector<StepFigures> all(4, figures(0.01, 0.1, 0.1, 0.05, 0.05));
  all[1] = figures(0.01, 0.8, 0.1, 0.05, 0.05);  // 3.7x the median, but 0.7 ms
  for (int gather = 0; gather < 5; ++gather) EXPECT_TRUE(d.add(all, {}, 10).empty());
}

TEST(Straggler, PipelineStagesAreComparedWithinTheirRole) {
  // Stage 1 (ranks 1 and 3) does twice stage 0's work: not a straggler. Rank 2 of stage 0 is.
  StragglerDetector d(1.5, 10);
  std::vector<StepFigures> all = {figures(0, 10, 0, 0, 10), figures(0, 20, 0, 0, 0), figures(0, 40, 0, 0, 0),
                                  figures(0, 20, 0, 0, 0)};
  const auto found = d.add(all, {0, 1, 0, 1}, 10);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].rank, 2);
  StragglerDetector alone(1.5, 10);
  EXPECT_TRUE(alone.add(all, {0, 1, 2, 3}, 10).empty()) << "a rank alone in its role has nobody to compare with";
}

TEST(Straggler, ANewWorldStartsTheCountsAgain) {
  StragglerDetector d(1.5, 20);
  EXPECT_TRUE(d.add(world(3, 100), {}, 10).empty());
  d.reset();
  EXPECT_TRUE(d.add(world(3, 100), {}, 10).empty()) << "the count started again";
  EXPECT_EQ(d.add(world(3, 100), {}, 10).size(), 1u);
  StragglerDetector e(1.5, 20);
  EXPECT_TRUE(e.add(world(3, 100), {}, 10).empty());
  auto three = world(2, 100);
  three.pop_back();  // three ranks now: another world
  EXPECT_TRUE(e.add(three, {}, 10).empty());
  EXPECT_EQ(e.add(three, {}, 10).size(), 1u);
}

TEST(Straggler, KnobsComeFromTheEnvironmentAndAreChecked) {
  ::setenv("DT_STRAGGLER_EVERY", "5", 1);
  ::setenv("DT_STRAGGLER_THRESHOLD", "2.5", 1);
  ::setenv("DT_STRAGGLER_WINDOW", "15", 1);
  const StragglerOptions o = StragglerOptions::fromEnvironment({});
  EXPECT_EQ(o.every, 5);
  EXPECT_EQ(o.threshold, 2.5);
  EXPECT_EQ(o.window, 15);
  ::setenv("DT_STRAGGLER_THRESHOLD", "fast", 1);
  EXPECT_THROW(StragglerOptions::fromEnvironment({}), InvalidArgument);
  ::setenv("DT_STRAGGLER_THRESHOLD", "0.9", 1);
  try {
    StragglerOptions::fromEnvironment({});
    ADD_FAILURE() << "a threshold under 1 was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("threshold 0.9 must be a finite ratio above 1"));
  }
  ::unsetenv("DT_STRAGGLER_EVERY");
  ::unsetenv("DT_STRAGGLER_THRESHOLD");
  ::unsetenv("DT_STRAGGLER_WINDOW");
  EXPECT_EQ(StragglerOptions::fromEnvironment({.every = 0}).every, 0) << "0 stays off";
  EXPECT_THROW(StragglerOptions::fromEnvironment({.window = 0}), InvalidArgument);
}

}  // namespace
}  // namespace dt::train
