#include <gtest/gtest.h>

#include <array>
#include <memory>

#include "common/check.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/small_function.h"
#include "common/strings.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using testing::expectThrowsWith;
using testing::ScopedEnv;

TEST(Errors, HierarchyAndKind) {
  try {
    throw TimeoutError("waited too long");
  } catch (const Error& e) {
    EXPECT_STREQ(e.kind(), "dt::TimeoutError");
    EXPECT_EQ(describe(e), "dt::TimeoutError: waited too long");
  }
  EXPECT_EQ(describe(std::runtime_error("x")), "std::exception: x");
  EXPECT_STREQ(DesyncError("a").kind(), "dt::DesyncError");
  EXPECT_STREQ(NotSupportedError("a").kind(), "dt::NotSupportedError");
}

TEST(Check, PrintsBothOperandsAndLocation) {
  const int a = 6;
  const int b = 8;
  const auto message = expectThrowsWith<InvalidArgument>(
      [&] { DT_CHECK_EQ(a, b, "sizes differ for ", "tensor x"); }, {"sizes differ for tensor x", "a == b", "(6 vs 8)", "common_test.cpp:"});
  EXPECT_EQ(message.find("sizes differ"), 0u);
}

TEST(Check, EvaluatesOperandsOnce) {
  int calls = 0;
  auto next = [&] { return ++calls; };
  DT_CHECK_LT(next(), 5);
  EXPECT_EQ(calls, 1);
  DT_CHECK(true);
}

TEST(Check, InternalCheckIsPlainError) {
  try {
    DT_INTERNAL_CHECK(1 + 1 == 3, "math");
    FAIL() << "did not throw";
  } catch (const InvalidArgument&) {
    FAIL() << "internal checks are not argument errors";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("internal error"), std::string::npos);
  }
}

// A callable that counts its live copies (moves included).
struct Counted {
  std::shared_ptr<int> live;
  int add = 0;
  explicit Counted(std::shared_ptr<int> l, int a) : live(std::move(l)), add(a) { ++*live; }
  Counted(Counted&& o) noexcept : live(o.live), add(o.add) { ++*live; }
  ~Counted() { --*live; }
  int operator()(int x) const { return x + add; }
};

TEST(SmallFunction, KeepsSmallAndLargeCallablesAndDestroysEachOnce) {
  auto live = std::make_shared<int>(0);
  {
    SmallFunction<int(int)> small(Counted(live, 1));
    EXPECT_EQ(small(41), 42);
    EXPECT_EQ(*live, 1);
    std::array<int64_t, 32> big{};  // 256 bytes: kept on the heap
    big[31] = 5;
    SmallFunction<int(int)> large([big, c = Counted(live, 0)](int x) { return x + static_cast<int>(big[31]); });
    EXPECT_EQ(large(1), 6);
    EXPECT_EQ(*live, 2);
    SmallFunction<int(int)> moved(std::move(small));
    EXPECT_FALSE(small);  // NOLINT: a moved-from one is empty
    EXPECT_EQ(moved(1), 2);
    moved = std::move(large);
    EXPECT_EQ(*live, 1) << "the callable moved over was destroyed";
    EXPECT_EQ(moved(2), 7);
  }
  EXPECT_EQ(*live, 0);
  SmallFunction<void()> empty;
  EXPECT_THROW(empty(), std::bad_function_call);
}

TEST(Strings, Ranges) {
  EXPECT_EQ(formatRanges({0, 1, 2, 3, 5, 7, 8}), "0-3, 5, 7-8");
  EXPECT_EQ(formatRanges({}), "");
  EXPECT_EQ(formatRanges({4}), "4");
}

TEST(Strings, Durations) {
  using std::chrono::milliseconds;
  EXPECT_EQ(formatDuration(milliseconds(1500)), "1500 ms");
  EXPECT_EQ(formatDuration(milliseconds(30000)), "30 s");
  EXPECT_EQ(formatDuration(milliseconds(600000)), "10 min");
}

TEST(Strings, QuoteBytes) {
  EXPECT_EQ(quoteBytes(std::string("a\0b", 3)), "\"a\\x00b\"");
  EXPECT_EQ(quoteBytes("abcdef", 3), "\"abc...\" (6 bytes)");
  EXPECT_EQ(split("a,,b", ','), (std::vector<std::string>{"a", "", "b"}));
  EXPECT_EQ(trim("  x y \n"), "x y");
}

TEST(Env, DefaultsAndOverrides) {
  ::unsetenv("DT_STORE_TIMEOUT");
  EXPECT_EQ(env::getDuration("DT_STORE_TIMEOUT"), std::chrono::seconds(300));
  {
    ScopedEnv timeout("DT_STORE_TIMEOUT", "1500ms");
    EXPECT_EQ(env::getDuration("DT_STORE_TIMEOUT"), std::chrono::milliseconds(1500));
  }
  {
    ScopedEnv timeout("DT_PG_TIMEOUT", "2min");
    EXPECT_EQ(env::getDuration("DT_PG_TIMEOUT"), std::chrono::minutes(2));
  }
  EXPECT_EQ(env::parseDuration("45", "x"), std::chrono::seconds(45));
  EXPECT_EQ(env::parseDuration("1h", "x"), std::chrono::hours(1));
  EXPECT_EQ(env::parseInt(" 42 ", "x"), 42);
  EXPECT_TRUE(env::parseBool("Yes", "x"));
  EXPECT_FALSE(env::parseBool("0", "x"));
}

TEST(Env, BadValuesNameTheVariable) {
  ScopedEnv timeout("DT_STORE_TIMEOUT", "soon");
  expectThrowsWith<InvalidArgument>([] { env::getDuration("DT_STORE_TIMEOUT"); },
                                    {"DT_STORE_TIMEOUT=\"soon\"", "is not a duration", "30s"});
  expectThrowsWith<InvalidArgument>([] { env::parseInt("12x", "--nproc"); }, {"--nproc=\"12x\"", "integer"});
  expectThrowsWith<InvalidArgument>([] { env::parseBool("maybe", "DT_X"); }, {"maybe", "boolean"});
}

TEST(Env, UndeclaredKnobIsAnError) {
  expectThrowsWith<Error>([] { env::getString("DT_NO_SUCH_KNOB"); }, {"DT_NO_SUCH_KNOB", "not declared"});
  // Non-DT names are read as they are.
  EXPECT_EQ(env::getString("SURELY_UNSET_VARIABLE_12345"), "");
}

TEST(Env, EveryKnobIsDocumented) {
  const std::string listing = env::markdownListing();
  for (const auto& knob : env::knobs()) {
    EXPECT_FALSE(knob.meaning.empty()) << knob.name;
    EXPECT_NE(listing.find(std::string("`") + std::string(knob.name) + "`"), std::string::npos) << knob.name;
  }
}

TEST(Logging, LevelFromEnvAndRankPrefix) {
  ScopedEnv level("DT_LOG_LEVEL", "debug");
  auto log = makeLogger("test", "rank 1/4");
  EXPECT_EQ(log->level(), spdlog::level::debug);
  ScopedEnv bad("DT_LOG_LEVEL", "loud");
  expectThrowsWith<InvalidArgument>([] { makeLogger("test", ""); }, {"DT_LOG_LEVEL", "loud"});
}

TEST(RunRanks, RethrowsFirstError) {
  std::atomic<int> ran{0};
  EXPECT_THROW(testing::runRanks(4,
                                 [&](int rank) {
                                   ++ran;
                                   if (rank == 2) throw InvalidArgument("rank 2 failed");
                                 }),
               InvalidArgument);
  EXPECT_EQ(ran.load(), 4);
}

}  // namespace
}  // namespace dt
