// Anomaly mode: a planted log(0) and 0/0 inside nested modules are found in
// backward (and with checkForward in forward), named with their module path
// and their cause; with anomaly mode off nothing changes.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <sys/wait.h>

#include "tensor/autograd/anomaly.h"
#include "common/strings.h"
#include "tensor/nn/module.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using testing::expectThrowsWith;

enum class Plant { Log, ZeroOverZero, LogTimesWeight };

// The planted op, in the innermost module.
class Inner : public nn::Module {
 public:
  explicit Inner(Plant plant) : plant_(plant) {
    weight = registerParameter("weight", fromVector<float>({0.5f, 1.0f, 1.5f, 2.0f}));
  }
  Tensor forward(const Tensor& x) override {
    switch (plant_) {
      case Plant::Log: return log(x);
      case Plant::ZeroOverZero: return div(x, x);
      case Plant::LogTimesWeight: return mul(log(x), weight);
    }
    return x;
  }
  std::string typeName() const override { return "Inner"; }
  Tensor weight;

 private:
  Plant plant_;
};

// Calls its one registered child; the outermost one sums the result into a loss.
class Wrapper : public nn::Module {
 public:
  Wrapper(std::string type, const std::string& childName, std::shared_ptr<nn::Module> child, bool sumResult = false)
      : type_(std::move(type)), child_(registerModule(childName, std::move(child))), sumResult_(sumResult) {}
  Tensor forward(const Tensor& x) override {
    Tensor out = (*child_)(x);
    return sumResult_ ? sum(out) : out;
  }
  std::string typeName() const override { return type_; }

 private:
  std::string type_;
  std::shared_ptr<nn::Module> child_;
  bool sumResult_;
};

// Model > Net > Block > Inner: the planted op runs in "net.block.inner"; the loss is a sum.
class Model : public Wrapper {
 public:
  explicit Model(Plant plant)
      : Wrapper("Model", "net",
                std::make_shared<Wrapper>("Net", "block",
                                          std::make_shared<Wrapper>("Block", "inner", std::make_shared<Inner>(plant))),
                /*sumResult=*/true) {}
};

// Element 1 is the planted zero.
Tensor inputWithZero() { return fromVector<float>({1.0f, 0.0f, 2.0f, 4.0f}).setRequiresGrad(true); }
Tensor finiteInput() { return fromVector<float>({1.0f, 3.0f, 2.0f, 4.0f}).setRequiresGrad(true); }

constexpr const char* kModule = "in module net.block.inner (Model > Net > Block > Inner)";

TEST(AnomalyBackward, NamesLogBackwardItsModuleAndThatItProducedTheInf) {
  AnomalyMode anomaly;
  Model model(Plant::Log);
  Tensor x = inputWithZero();
  Tensor loss = model(x);  // forward check is off by default: log(0) = -inf passes
  const std::string message = expectThrowsWith<AnomalyError>(
      [&] { loss.backward(); },
      {"anomaly mode: LogBackward returned inf (1 of 4 elements non-finite, the first at [1]) in gradient 0",
       "the gradient for input 0 of log(float32[4]) ", kModule,
       "its incoming gradients and saved tensors were all finite, so LogBackward itself produced the inf"});
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

TEST(AnomalyBackward, NamesDivBackwardForZeroOverZero) {
  AnomalyMode anomaly;
  Model model(Plant::ZeroOverZero);
  Tensor x = inputWithZero();
  Tensor loss = model(x);
  EXPECT_TRUE(std::isnan(loss.item<float>()));
  expectThrowsWith<AnomalyError>([&] { loss.backward(); },
                                 {"DivBackward returned inf (1 of 4 elements non-finite, the first at [1]) in gradient 0",
                                  "of div(float32[4], float32[4]) ", kModule, "so DivBackward itself produced the inf"});
}

TEST(AnomalyBackward, BlamesASavedTensorThatForwardAlreadyMadeNonFinite) {
  AnomalyMode anomaly;
  Model model(Plant::LogTimesWeight);
  Tensor x = inputWithZero();
  Tensor loss = model(x);
  // MulBackward runs before LogBackward: its gradient for the weight is g * log(x) = -inf.
  expectThrowsWith<AnomalyError>(
      [&] { loss.backward(); },
      {"MulBackward returned -inf (1 of 4 elements non-finite, the first at [1]) in gradient 1",
       "the gradient for input 1 of mul(float32[4], float32[4]) ", kModule,
       "its incoming gradients were finite but its saved tensor 0 (float32[4]) held -inf",
       "AnomalyOptions{.checkForward = true}"});
}

TEST(AnomalyBackward, BlamesAnIncomingGradientThatWasAlreadyNonFinite) {
  AnomalyMode anomaly;
  Tensor x = finiteInput();
  Tensor y = log(x);
  const float inf = std::numeric_limits<float>::infinity();
  expectThrowsWith<AnomalyError>([&] { y.backward(fromVector<float>({1.0f, 1.0f, inf, 1.0f})); },
                                 {"LogBackward returned inf", "of log(float32[4]) outside any module",
                                  "its incoming gradient 0 (for output 0 of log) already held inf",
                                  "the gradient given to backward()"});
}

TEST(AnomalyBackward, NodeMadeWhileAnomalyModeWasOffIsCheckedWithoutARecord) {
  Model model(Plant::Log);
  Tensor x = inputWithZero();
  Tensor loss = model(x);
  AnomalyMode anomaly;
  expectThrowsWith<AnomalyError>([&] { loss.backward(); },
                                 {"LogBackward returned inf", "of its forward op (no record: anomaly mode was off when the op ran)"});
}

TEST(AnomalyBackward, EngineRunsAgainAfterAnAnomaly) {
  AnomalyMode anomaly;
  Model bad(Plant::Log);
  Tensor zero = inputWithZero();
  Tensor badLoss = bad(zero);
  EXPECT_THROW(badLoss.backward(), AnomalyError);
  EXPECT_FALSE(inBackward());
  Tensor x = finiteInput();
  Model good(Plant::Log);
  good(x).backward();
  EXPECT_TRUE(allclose(x.grad(), fromVector<float>({1.0f, 1.0f / 3.0f, 0.5f, 0.25f})));
}

TEST(AnomalyForward, NamesLogAndItsModuleWhenCheckForwardIsOn) {
  AnomalyMode anomaly(AnomalyOptions{.checkForward = true});
  Model model(Plant::Log);
  Tensor x = inputWithZero();
  const std::string message = expectThrowsWith<AnomalyError>(
      [&] { model(x); },
      {"anomaly mode (forward check): log(float32[4]) ", kModule,
       " returned -inf (1 of 4 elements non-finite, the first at [1]) from finite inputs"});
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

TEST(AnomalyForward, NamesDivForZeroOverZero) {
  AnomalyMode anomaly(AnomalyOptions{.checkForward = true});
  Model model(Plant::ZeroOverZero);
  Tensor x = inputWithZero();
  expectThrowsWith<AnomalyError>([&] { model(x); },
                                 {"anomaly mode (forward check): div(float32[4], float32[4]) ", kModule,
                                  " returned nan (1 of 4 elements non-finite, the first at [1]) from finite inputs"});
}

TEST(AnomalyForward, DoesNotBlameAnOpWhoseInputWasAlreadyNonFinite) {
  AnomalyMode anomaly(AnomalyOptions{.checkForward = true});
  const float inf = std::numeric_limits<float>::infinity();
  Tensor x = fromVector<float>({1.0f, inf});
  Tensor y = mul(x, 2.0);  // inf in, inf out: the value was bad before mul
  EXPECT_TRUE(std::isinf(y.toVector<float>()[1]));
  // Checked without grad too: the forward check does not need a graph.
  NoGradGuard noGrad;
  expectThrowsWith<AnomalyError>([&] { log(fromVector<float>({0.0f})); }, {"log(float32[1]) outside any module"});
}

TEST(AnomalyMode, OffRaisesNothingAndRecordsNothing) {
  ASSERT_FALSE(AnomalyMode::isEnabled());
  Model model(Plant::Log);
  Tensor x = inputWithZero();
  Tensor loss = model(x);
  EXPECT_EQ(loss.gradFn()->anomalyRecord(), nullptr);
  loss.backward();  // no throw: an inf gradient at the planted zero, as PyTorch gives
  const std::vector<float> grad = x.grad().toVector<float>();
  EXPECT_FLOAT_EQ(grad[0], 1.0f);
  EXPECT_TRUE(std::isinf(grad[1]));
}

TEST(AnomalyMode, OnGivesTheSameLossAndGradientsAsOff) {
  auto step = [](bool anomalyOn) {
    std::optional<AnomalyMode> anomaly;
    if (anomalyOn) anomaly.emplace(AnomalyOptions{.checkForward = true});
    Model model(Plant::LogTimesWeight);
    Tensor x = finiteInput();
    Tensor loss = model(x);
    loss.backward();
    return std::vector<std::vector<float>>{loss.toVector<float>(), x.grad().toVector<float>(),
                                           model.parameters()[0].grad().toVector<float>()};
  };
  EXPECT_EQ(step(false), step(true));
}

TEST(AnomalyMode, RecordsTheForwardOpOnItsNode) {
  AnomalyMode anomaly;
  Model model(Plant::ZeroOverZero);
  Tensor loss = model(finiteInput());
  const auto& sumRecord = loss.gradFn()->anomalyRecord();
  ASSERT_NE(sumRecord, nullptr);
  EXPECT_EQ(sumRecord->describe(), "sum(float32[4]) in the outermost module (Model)");
  const auto& divRecord = loss.gradFn()->nextEdges()[0].node->anomalyRecord();
  ASSERT_NE(divRecord, nullptr);
  EXPECT_EQ(divRecord->op, "div");
  EXPECT_EQ(divRecord->inputs, "float32[4], float32[4]");
  EXPECT_EQ(divRecord->modulePath, "net.block.inner");
  EXPECT_EQ(divRecord->moduleTypes, "Model > Net > Block > Inner");
}

TEST(AnomalyMode, GuardsNestAndRestore) {
  EXPECT_FALSE(AnomalyMode::isEnabled());
  {
    AnomalyMode on;
    EXPECT_TRUE(AnomalyMode::isEnabled());
    EXPECT_FALSE(AnomalyMode::current().checkForward);
    {
      AnomalyMode off(AnomalyOptions{.enabled = false, .checkForward = true});
      EXPECT_FALSE(AnomalyMode::isEnabled());
      EXPECT_FALSE(AnomalyMode::current().checkForward);  // nothing is checked while off
      Model model(Plant::Log);
      Tensor x = inputWithZero();
      model(x).backward();
      EXPECT_TRUE(std::isinf(x.grad().toVector<float>()[1]));
    }
    EXPECT_TRUE(AnomalyMode::isEnabled());
    Model model(Plant::Log);
    Tensor loss = model(inputWithZero());
    EXPECT_THROW(loss.backward(), AnomalyError);
  }
  EXPECT_FALSE(AnomalyMode::isEnabled());
}

TEST(AnomalyMode, IsPerThread) {
  AnomalyMode anomaly;
  bool enabledElsewhere = true;
  testing::runRanks(1, [&](int) { enabledElsewhere = AnomalyMode::isEnabled(); });
  EXPECT_FALSE(enabledElsewhere);
  EXPECT_TRUE(AnomalyMode::isEnabled());
}

// ---- module path -------------------------------------------------------------------------------------------

class PathProbe : public nn::Module {
 public:
  Tensor forward(const Tensor& x) override {
    seen = nn::currentModulePath();
    return x;
  }
  std::string typeName() const override { return "PathProbe"; }
  nn::ModulePath seen;
};

TEST(ModulePath, FollowsCallOperatorsAndNamesUnregisteredModulesByType) {
  auto probe = std::make_shared<PathProbe>();
  nn::Sequential outer({std::make_shared<nn::ReLU>(), std::make_shared<nn::Sequential>(
                                                            std::vector<std::shared_ptr<nn::Module>>{probe})});
  outer(ones({2}));
  EXPECT_EQ(probe->seen.path, "1.0");
  EXPECT_EQ(probe->seen.types, "Sequential > Sequential > PathProbe");

  nn::Sequential unrelated;
  {
    nn::ModuleScope scope(unrelated);
    (*probe)(ones({2}));  // probe is not a child of `unrelated`
  }
  EXPECT_EQ(probe->seen.path, "<PathProbe>");
  EXPECT_TRUE(nn::currentModulePath().empty());

  probe->forward(ones({2}));  // forward() called directly pushes nothing
  EXPECT_TRUE(probe->seen.empty());
}

// ---- DT_DETECT_ANOMALY -------------------------------------------------------------------------------------
// The variable is read once per process, so each case runs this test binary
// again with it set; the child runs the planted model without a guard.

constexpr const char* kChildMarker = "ANOMALY_TEST_CHILD";

// Runs the current test in a fresh process with DT_DETECT_ANOMALY set and expects it to pass there.
void expectThisTestPassesWith(const std::string& detectAnomaly) {
  testing::ScopedEnv variable("DT_DETECT_ANOMALY", detectAnomaly);
  testing::ScopedEnv marker(kChildMarker, "1");
  const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
  // popen runs a shell, whose /proc/self/exe would be the shell: resolve ours first.
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string command =
      str("'", self, "' --gtest_filter=", test->test_suite_name(), ".", test->name(), " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr) << command;
  std::string output;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) output.append(buffer, n);
  const int status = pclose(pipe);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << output;
  EXPECT_NE(output.find("[  PASSED  ] 1 test"), std::string::npos) << output;
}

bool isChild() { return std::getenv(kChildMarker) != nullptr; }

TEST(AnomalyEnvironment, OneTurnsOnTheBackwardCheck) {
  if (isChild()) {
    EXPECT_TRUE(AnomalyMode::isEnabled());
    EXPECT_FALSE(AnomalyMode::current().checkForward);
    Model model(Plant::Log);
    Tensor loss = model(inputWithZero());
    expectThrowsWith<AnomalyError>([&] { loss.backward(); }, {"LogBackward returned inf", kModule});
    return;
  }
  expectThisTestPassesWith("1");
}

TEST(AnomalyEnvironment, ForwardAlsoTurnsOnTheForwardCheck) {
  if (isChild()) {
    EXPECT_TRUE(AnomalyMode::current().checkForward);
    Model model(Plant::ZeroOverZero);
    Tensor x = inputWithZero();
    expectThrowsWith<AnomalyError>([&] { model(x); }, {"div(float32[4], float32[4]) ", kModule, "returned nan"});
    return;
  }
  expectThisTestPassesWith("forward");
}

TEST(AnomalyEnvironment, BadValueIsNamedAtTheFirstOp) {
  if (isChild()) {
    Tensor x = finiteInput();
    for (int attempt = 0; attempt < 2; ++attempt) {  // reported again, not swallowed after the first time
      expectThrowsWith<InvalidArgument>([&] { log(x); },
                                        {"DT_DETECT_ANOMALY=\"maybe\" is not an anomaly mode", "forward"});
    }
    return;
  }
  expectThisTestPassesWith("maybe");
}

}  // namespace
}  // namespace dt
