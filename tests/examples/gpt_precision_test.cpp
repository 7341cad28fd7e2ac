// examples/gpt --precision bf16 under dtrun (the matrix products under dt::autocast, weights,
// AdamW, LayerNorm and the loss in fp32): from the same seed a 250-step bf16 run reaches the
// validation loss of the fp32 run within 1 % (relative), and bf16 on two ranks under DDP, ZeRO-2
// and the fully sharded wrapper, with fp32 or bf16 gradients on the wire (--grad-reduce), trains
// one process's bf16 curve at the same global batch.
//
// The model (kModel) is the smallest whose comparison still says something: two blocks of width
// 64 over 32-token windows make products with inner dimensions of 64 to 256, where bf16's 8-bit
// mantissa rounds every operand, and 250 steps bring the validation loss from ln 256 = 5.55 to
// about 2.6 (well into learning the text, past the unigram loss of ~3.4), so a bf16 run that
// learned worse would show beyond 1 %. On a CPU without bf16 instructions the products run in
// fp32 and the comparison is skipped, saying so. Every run sets DT_BF16_MATMUL=native: bf16's
// kernels are what is checked, also on a CPU where auto would run float32 for speed.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/strings.h"
#include "tests/launcher/dtrun_process.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using namespace std::chrono_literals;

const std::vector<std::string> kModel{"--layers", "2", "--heads", "2", "--width", "64", "--context", "32", "--dropout", "0",
                                      "--global-batch", "8", "--warmup", "10", "--eval-every", "0", "--eval-windows", "64",
                                      "--sample-tokens", "0", "--checkpoint-dir", "none", "--seed", "11"};

struct GptRun {
  ProcessResult result;
  std::optional<double> validationLoss;
  std::string precision;               // what the done line says ran: fp32, bf16, bf16-as-fp32
  std::map<int64_t, double> lossCurve;  // from the metrics file: step -> training loss
};

GptRun train(int nproc, const std::vector<std::string>& extra) {
  TempDir dir;
  const std::string metrics = (dir.path() / "m.jsonl").string();
  std::vector<std::string> argv{DTRUN_PATH, "--standalone", "--nproc", std::to_string(nproc), GPT_PATH};
  argv.insert(argv.end(), kModel.begin(), kModel.end());
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), {"--metrics", metrics});
  const ScopedEnv bf16Kernels("DT_BF16_MATMUL", "native");  // dtrun's ranks inherit it
  GptRun run{runProcess(argv, 120s), std::nullopt, "", {}};
  const ProcessResult& r = run.result;
  EXPECT_EQ(r.exitCode, 0) << join(argv, " ") << "\n" << r.out << r.err;
  static const std::regex done(R"(gpt: done: .*validation loss ([0-9.]+); precision=([a-z0-9-]+))");
  std::smatch m;
  if (std::regex_search(r.out, m, done)) run.validationLoss = std::stod(m[1].str()), run.precision = m[2].str();
  static const std::regex line(R"re("step": (\d+).*"loss": ([-0-9.e+]+))re");
  std::ifstream in(metrics);
  for (std::string text; std::getline(in, text);) {
    if (std::regex_search(text, m, line)) run.lossCurve[std::stoll(m[1].str())] = std::stod(m[2].str());
  }
  return run;
}

TEST(GptPrecision, Bf16ReachesTheValidationLossOfFp32FromTheSameSeed) {
  const GptRun fp32 = train(1, {"--steps", "250", "--log-every", "50", "--precision", "fp32"});
  const GptRun bf16 = train(1, {"--steps", "250", "--log-every", "50", "--precision", "bf16"});
  ASSERT_TRUE(fp32.validationLoss && bf16.validationLoss) << fp32.result.out << bf16.result.out;
  EXPECT_EQ(fp32.precision, "fp32");
  if (bf16.precision == "bf16-as-fp32") GTEST_SKIP() << "this CPU has no bf16 instructions: the bf16 run computed in fp32";
  EXPECT_EQ(bf16.precision, "bf16") << bf16.result.out;
  EXPECT_LT(*fp32.validationLoss, 3.0) << "the comparison needs a model that learned the text";
  EXPECT_LT(std::fabs(*bf16.validationLoss - *fp32.validationLoss) / *fp32.validationLoss, 0.01)
      << "bf16 " << *bf16.validationLoss << " vs fp32 " << *fp32.validationLoss;
  // It ran in bf16: the curves are not the same (bf16 rounds every product's operands).
  EXPECT_NE(bf16.lossCurve, fp32.lossCurve);
}

// Each data-parallel mode of --precision bf16 on two ranks against one process's bf16 curve at the
// same global batch. With fp32 gradients on the wire the ranks' sums differ from one process's
// only in their order (1e-4); with --grad-reduce bf16 every gradient is rounded to bf16's 8
// significant bits before the sum (2^-8 relative per element), which AdamW's normalised update
// carries into the loss at 1.4e-5 here over 20 steps (bound 1e-3).
struct DataParallelCase {
  std::string sharding, gradReduce;
  double tolerance;
};

class GptPrecisionDataParallel : public ::testing::TestWithParam<DataParallelCase> {};

TEST_P(GptPrecisionDataParallel, Bf16OnTwoRanksTrainsOneProcesssBf16Curve) {
  const DataParallelCase& c = GetParam();
  const std::vector<std::string> flags{"--steps", "20", "--log-every", "1", "--precision", "bf16"};
  static const GptRun one = train(1, flags);  // the reference, shared by every case
  std::vector<std::string> twoFlags = flags;
  twoFlags.insert(twoFlags.end(), {"--sharding", c.sharding, "--grad-reduce", c.gradReduce});
  const GptRun two = train(2, twoFlags);
  ASSERT_EQ(one.lossCurve.size(), 20u) << one.result.out << one.result.err;
  ASSERT_EQ(two.lossCurve.size(), 20u) << two.result.out << two.result.err;
  EXPECT_EQ(two.precision, one.precision);
  // The loop averages a step's loss over the ranks on the next step's control allreduce, so the
  // first logged line holds rank 0's own loss (half the batch here) in any precision.
  for (const auto& [step, loss] : one.lossCurve) {
    if (step == 1) continue;
    EXPECT_LT(std::fabs(two.lossCurve.at(step) - loss) / loss, c.tolerance)
        << "step " << step << ": 2 ranks (" << c.sharding << ", " << c.gradReduce << " gradients) " << two.lossCurve.at(step)
        << ", 1 process " << loss;
  }
  if (c.gradReduce == "bf16") {
    // The gradients really crossed in bf16: the curve is not fp32 reduction's.
    std::vector<std::string> fp32Flags = flags;
    fp32Flags.insert(fp32Flags.end(), {"--sharding", c.sharding, "--grad-reduce", "fp32"});
    EXPECT_NE(two.lossCurve, train(2, fp32Flags).lossCurve);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, GptPrecisionDataParallel,
                         ::testing::Values(DataParallelCase{"ddp", "fp32", 1e-4}, DataParallelCase{"zero2", "fp32", 1e-4},
                                           DataParallelCase{"fsdp", "fp32", 1e-4}, DataParallelCase{"ddp", "bf16", 1e-3},
                                           DataParallelCase{"fsdp", "bf16", 1e-3}),
                         [](const ::testing::TestParamInfo<DataParallelCase>& info) {
                           return info.param.sharding + "_" + info.param.gradReduce + "_gradients";
                         });

}  // namespace
}  // namespace dt::testing
