// GoogleTest glue for dt::testing::spawn (header-only; the testing library
// itself does not depend on gtest: include this from test code that links it).
//
//  * everyRankReturned(result): an AssertionResult for EXPECT_TRUE/ASSERT_TRUE
//    whose failure message is result.summary() (each rank's ending, then the
//    last log lines of those that did not return).
//  * reportGtestFailures(fn): fn as a rank function that turns the EXPECT_* /
//    ASSERT_* failures it records into an exception. A rank is a forked copy of
//    the test process: its gtest failures stay in that copy, so without this
//    the test would pass. The exception names each failure (file:line and
//    message) and reaches the parent as Ending::Threw.
//  * PrintTo for RankOutcome and SpawnResult, so gtest prints them readably.
#pragma once

#include <algorithm>
#include <ostream>
#include <string>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "common/strings.h"
#include "testing/spawn.h"

namespace dt::testing {

inline ::testing::AssertionResult everyRankReturned(const SpawnResult& result) {
  if (result.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "not every rank returned:\n" << result.summary();
}

template <typename F>
RankFunction reportGtestFailures(F fn) {
  RankFunction inner = detail::asRankFunction(std::move(fn));
  return [inner = std::move(inner)](RankContext& ctx) -> std::string {
    const ::testing::TestResult* results = nullptr;
    if (const auto* test = ::testing::UnitTest::GetInstance()->current_test_info()) results = test->result();
    const int before = results ? results->total_part_count() : 0;
    std::string value = inner(ctx);
    std::string failures;
    int count = 0;
    for (int i = before; results != nullptr && i < results->total_part_count(); ++i) {
      const auto& part = results->GetTestPartResult(i);
      if (!part.failed()) continue;
      ++count;
      std::string summary = part.summary();
      std::replace(summary.begin(), summary.end(), '\n', ' ');
      failures += str(failures.empty() ? "" : " | ", part.file_name() ? part.file_name() : "?", ":",
                      part.line_number(), ": ", trim(summary));
    }
    if (count > 0) throw Error(str("rank ", ctx.rank, ": ", count, " gtest failure(s): ", failures));
    return value;
  };
}

inline void PrintTo(const RankOutcome& outcome, std::ostream* out) { *out << outcome.describe(); }
inline void PrintTo(const SpawnResult& result, std::ostream* out) { *out << result.summary(); }

}  // namespace dt::testing
