// The elastic examples' tests read back what examples/gpt logged: rank 0's metrics file (every
// step's loss and grad norm) and the final fingerprints each rank prints, and hold a disturbed
// run's curve against an undisturbed one's.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>

#include "common/strings.h"
#include "tests/launcher/dtrun_process.h"

namespace dt::testing {

struct CurvePoint {
  double loss = 0, gradNorm = 0;
};
using Curve = std::map<int64_t, CurvePoint>;

// Step -> its point, from a --metrics file. A step redone after a recovery went back to a
// checkpoint is logged again: the last line counts.
inline Curve readCurve(const std::filesystem::path& metrics) {
  static const std::regex line(R"re("step": (\d+).*"loss": ([-0-9.e+]+).*"grad_norm": ([-0-9.e+]+))re");
  Curve curve;
  std::ifstream in(metrics);
  for (std::string text; std::getline(in, text);) {
    std::smatch m;
    if (std::regex_search(text, m, line)) curve[std::stoll(m[1].str())] = {std::stod(m[2].str()), std::stod(m[3].str())};
  }
  return curve;
}

// Every one of `steps` steps logged once, each loss and grad norm the reference's within 1e-4
// relative; `out` (the run's stdout) goes with a missing step. Prints the worst difference.
inline void expectTheSameCurve(const Curve& run, const Curve& reference, int64_t steps, const std::string& what,
                               const std::string& out) {
  ASSERT_EQ(reference.size(), static_cast<size_t>(steps)) << "the reference run logged every step";
  ASSERT_EQ(run.size(), reference.size()) << what << "\n" << out;
  double worst = 0;
  for (const auto& [step, want] : reference) {
    const auto it = run.find(step);
    ASSERT_NE(it, run.end()) << what << ": no step " << step;
    const double loss = std::fabs(it->second.loss - want.loss) / std::fabs(want.loss);
    const double norm = std::fabs(it->second.gradNorm - want.gradNorm) / std::fabs(want.gradNorm);
    EXPECT_LT(loss, 1e-4) << what << ", step " << step << ": loss " << it->second.loss << " vs " << want.loss;
    EXPECT_LT(norm, 1e-4) << what << ", step " << step << ": grad norm " << it->second.gradNorm << " vs " << want.gradNorm;
    worst = std::max({worst, loss, norm});
  }
  std::printf("%s: every step's loss and grad norm within %.3g of the undisturbed run's\n", what.c_str(), worst);
}

// rank -> the final fingerprint of its parameters (its stage, its TP shards) it printed, where
// they agree over its dp group (spread 0).
inline std::map<int, std::string> fingerprints(const std::string& out) {
  static const std::regex line(R"(gpt: rank (\d+)/\d+ final parameters fingerprint ([0-9a-f]{16}) \(spread across ranks 0\))");
  std::map<int, std::string> seen;
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) seen[std::stoi((*it)[1])] = (*it)[2];
  return seen;
}

// A sharded job of `steps` steps that lost rank `killed` and went back to its checkpoint of step
// `reload`: the two survivors' line in `out`, that checkpoint not written again, the job done,
// and no error in `err`.
inline void expectTwoWentBackToTheCheckpoint(const std::string& out, const std::string& err, int killed, int64_t reload,
                                             int64_t steps) {
  using ::testing::HasSubstr;
  EXPECT_THAT(out, HasSubstr(str("2 rank(s) go on from step ", reload, " (the newest checkpoint: the lost shards have no other copy) "
                                 "without rank ", killed, " exited: signal SIGKILL\n")))
      << out;
  EXPECT_EQ(countOccurrences(out, str("gpt: checkpoint at step ", reload, " (")), 1)
      << "the checkpoint just reloaded is not written again\n" << out;
  EXPECT_THAT(out, HasSubstr(str("gpt: done: ", steps, " steps"))) << out;
  EXPECT_THAT(err, ::testing::Not(HasSubstr("Error"))) << err;
}

}  // namespace dt::testing
