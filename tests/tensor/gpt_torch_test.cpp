// The whole GPT against PyTorch 1.13: the same weights (through a safetensors file) and tokens
// give the same logits, loss and parameter gradients within float32 tolerance. The PyTorch
// side is tests/tensor/gpt_torch_reference.py over bench/peers/torch_gpt.py's model, run with
// /usr/bin/python3 (Debian's python3-torch, which scripts/setup.sh installs). Without it the
// test fails: it is the check that the model is the model it claims to be.
#include <cmath>
#include <cstdio>
#include <map>
#include <string>

#include <gtest/gtest.h>

#include "common/strings.h"
#include "tensor/nn/gpt.h"
#include "tensor/nn/safetensors.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

std::string run(const std::string& command, int& status) {
  std::string output;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) {
    status = -1;
    return "popen failed";
  }
  char buf[512];
  while (std::fgets(buf, sizeof(buf), pipe) != nullptr) output += buf;
  status = ::pclose(pipe);
  return output;
}

// Worst |a - b| against atol + rtol * |b| over all elements; fails naming the tensor.
void expectClose(const std::string& what, const Tensor& mine, const Tensor& theirs, double rtol, double atol) {
  ASSERT_EQ(mine.sizes(), theirs.sizes()) << what;
  const auto a = mine.toVector<double>(), b = theirs.toVector<double>();
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double excess = std::fabs(a[i] - b[i]) - (atol + rtol * std::fabs(b[i]));
    if (excess > worst) worst = excess, at = i;
  }
  EXPECT_LE(worst, 0.0) << what << ": element " << at << " is " << a[at] << " here and " << b[at] << " in PyTorch";
}

TEST(GptTorch, ForwardAndBackwardMatchPyTorchWithTheSameWeights) {
  const nn::GptConfig config{.vocabSize = 256, .contextLength = 40, .layers = 2, .heads = 4, .width = 32};
  Generator g(11);
  nn::Gpt model(config, g);
  // Non-trivial LayerNorm parameters, so their gradients and uses are checked too.
  {
    NoGradGuard ng;
    for (auto& [name, p] : model.namedParameters()) {
      if (name.find("ln_") != std::string::npos) {
        Tensor t = p;
        t.copy_(add(t, mul(randn(t.sizes(), g), 0.1)));
      }
    }
  }
  const Tensor tokens = randint(0, 256, {3, config.contextLength + 1}, g);
  testing::TempDir dir;
  const auto in = dir.path() / "in.safetensors", out = dir.path() / "out.safetensors";
  NamedTensors state = model.stateDict();
  state.emplace_back("tokens", tokens);
  saveSafetensors(in, state);

  const std::string script = std::string(DT_SOURCE_DIR) + "/tests/tensor/gpt_torch_reference.py";
  int status = 0;
  const std::string output = run(str("/usr/bin/python3 ", script, " ", in.string(), " ", out.string(), " --layers ",
                                     config.layers, " --heads ", config.heads, " --width ", config.width, " --context ",
                                     config.contextLength),
                                 status);
  ASSERT_EQ(status, 0) << "the PyTorch reference did not run (is python3-torch installed? scripts/setup.sh):\n" << output;

  const Tensor inputs = tokens.narrow(1, 0, config.contextLength).contiguous();
  const Tensor targets = tokens.narrow(1, 1, config.contextLength).contiguous();
  const Tensor logits = model(inputs);
  const Tensor loss = nn::Gpt::loss(logits, targets);
  loss.backward();

  std::map<std::string, Tensor> torch;
  for (auto& [name, t] : loadSafetensors(out).tensors) torch[name] = t;
  expectClose("logits", logits, torch.at("logits"), 1e-4, 2e-5);
  expectClose("loss", loss, torch.at("loss"), 1e-5, 1e-6);
  size_t compared = 0;
  for (const auto& [name, p] : model.namedParameters()) {
    ASSERT_TRUE(torch.count("grad." + name)) << "PyTorch has no parameter " << name;
    const Tensor theirs = torch.at("grad." + name);
    const double scale = max(abs(theirs)).item<double>();
    expectClose("gradient of " + name, p.grad(), theirs, 1e-3, 1e-4 * scale + 1e-7);
    ++compared;
  }
  EXPECT_EQ(compared, 2u + 12u * static_cast<size_t>(config.layers) + 2u);
}

}  // namespace
}  // namespace dt
