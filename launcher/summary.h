// How a finished worker is described, and the failure summary dtrun prints.
//
// Contract: pure functions over plain records (no clocks, no processes), so
// the exact text is unit-tested. The root cause is the failure with the
// earliest time (ties: lowest rank); ranks that dtrun itself stopped during a
// teardown are listed as stopped, never as the root cause. dtrun's exit code
// is the root cause's: its exit code, or 128 + signal number.
// Thread safety: pure, thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dt::launcher {

struct WorkerOutcome {
  int rank = 0;
  int localRank = 0;
  std::string host;
  int pid = 0;
  bool signaled = false;
  int code = 0;                   // exit code, or the signal number when signaled
  int64_t timeMs = 0;             // wall clock (ms since the epoch) when it ended
  bool stoppedByLauncher = false; // ended after dtrun began tearing down the job
  bool killedByLauncher = false;  // dtrun sent SIGKILL to it
  std::string killReason;         // why dtrun did ("no heartbeat for 2.1 s (--liveness-timeout 2s)")
  int64_t oomKillsMeanwhile = -1; // the kernel's out-of-memory kills while it ran (-1: unknown)
  std::vector<std::string> stderrTail;

  bool failed() const { return signaled || code != 0; }
};

// "exit code 3", "signal SIGSEGV", "signal SIGKILL (sent by dtrun: <killReason>)"; a SIGKILL
// dtrun did not send says what oomKillsMeanwhile shows: the out-of-memory killer acted while
// the worker ran, or it did not (another process sent it), or that is unknown.
std::string describeOutcome(const WorkerOutcome& outcome);
// How many processes the kernel's out-of-memory killer has killed since boot (the oom_kill
// line of /proc/vmstat), or -1 where the kernel does not say.
int64_t oomKillCount();
// 128 + signal, or the exit code.
int exitCodeOf(const WorkerOutcome& outcome);
// Index of the root cause among `outcomes`, or nullopt when none failed on its own.
std::optional<size_t> rootCause(const std::vector<WorkerOutcome>& outcomes);

struct SummaryInput {
  std::string runId;
  int attempt = 0;       // restart count of this attempt
  int maxRestarts = 0;
  int nodeRank = 0;
  int64_t startMs = 0;   // when the attempt's workers started
  std::vector<WorkerOutcome> outcomes;  // this node's workers
  // Why the job is being torn down when the cause is not a local worker:
  // another node's report, a lost node, a hang, a signal to dtrun.
  std::string externalCause;
  size_t tailLines = 10;
};

// The multi-line summary (ends with a newline).
std::string formatSummary(const SummaryInput& input);

// "2026-11-29 08:15:02.123 UTC"
std::string formatWallTime(int64_t epochMs);

}  // namespace dt::launcher
