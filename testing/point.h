// dt::testing::point: a named place in code under test where a spawn() plan
// may kill or freeze the rank (see testing/spawn.h).
//
// Contract:
//  * point("in-backward") does nothing unless this process is a rank started
//    by dt::testing::spawn whose plan names this rank. Then the rank counts
//    how often it reached each name (across all its threads) and, when a
//    plan step matches the name and the count, acts before point returns:
//    Kill ends the process with SIGKILL (no destructors, no flush beyond
//    stdio's buffers, which point flushes so that the log shows what led
//    there); Freeze stops the whole process (SIGSTOP, every thread) until the
//    plan's duration has passed, the test resumes it, or the run ends.
//  * Cost when no plan is active: one atomic load and a branch, no call, no
//    allocation. It needs no library to link: this header is all of it, so
//    any module may mark its points. Safe to call from any thread, in any
//    process (outside a spawned rank it is always a no-op).
//  * Names are compared exactly; pass a string that lives for the call.
#pragma once

#include <atomic>
#include <string_view>

namespace dt::testing {

namespace detail {
using PointHook = void (*)(std::string_view name);
// Set only inside a spawned rank whose plan names it (testing/spawn.cpp).
inline std::atomic<PointHook> pointHook{nullptr};
}  // namespace detail

inline void point(std::string_view name) {
  if (const detail::PointHook hook = detail::pointHook.load(std::memory_order_acquire)) [[unlikely]] {
    hook(name);
  }
}

}  // namespace dt::testing
