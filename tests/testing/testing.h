// Shared test helpers.
//
//  * runRanks(n, fn, deadline): runs fn(rank) on n threads ("threads as
//    ranks"), joins them, and rethrows the first exception. If they have not
//    all finished by the deadline it fails the test naming the ranks still
//    running, then aborts the process so the hang becomes a failure rather than
//    a stuck CI job (this is test code, not library code).
//  * TempDir: a fresh directory removed at scope exit.
//  * expectThrowsWith<E>(fn, {"substring", ...}): the call throws E and its
//    message contains every substring.
#pragma once

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace dt::testing {

void runRanks(int worldSize, const std::function<void(int rank)>& fn,
              std::chrono::milliseconds deadline = std::chrono::seconds(60));

class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Runs fn, expects it to throw E whose what() contains every needle.
// Returns the message so a test can check more.
template <typename E>
std::string expectThrowsWith(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const E& e) {
    const std::string message = e.what();
    for (const auto& needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos)
          << "message lacks \"" << needle << "\": " << message;
    }
    return message;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a different exception type: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "did not throw";
  return {};
}

// Scoped environment variable (restores the old value).
class ScopedEnv {
 public:
  ScopedEnv(std::string name, const std::string& value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  bool hadOld_ = false;
  std::string old_;
};

}  // namespace dt::testing
