#include "launcher/summary.h"

#include <csignal>
#include <ctime>
#include <fstream>

#include "common/strings.h"
#include "launcher/options.h"

namespace dt::launcher {

std::string describeOutcome(const WorkerOutcome& o) {
  if (!o.signaled) return str("exit code ", o.code);
  std::string text = str("signal ", signalName(o.code));
  if (o.code == SIGKILL && !o.killedByLauncher) {
    if (o.oomKillsMeanwhile > 0) {
      text += str(" (not sent by dtrun; the kernel's out-of-memory killer killed ", o.oomKillsMeanwhile,
                  " process(es) while it ran (/proc/vmstat oom_kill): check dmesg for which)");
    } else if (o.oomKillsMeanwhile == 0) {
      text += " (not sent by dtrun, nor by the out-of-memory killer, which killed nothing while it ran "
              "(/proc/vmstat oom_kill): another process sent it)";
    } else {
      text += " (not sent by dtrun: the out-of-memory killer or another process; check dmesg)";
    }
  } else if (o.code == SIGKILL && !o.killReason.empty()) {
    text += str(" (sent by dtrun: ", o.killReason, ")");
  }
  return text;
}

int64_t oomKillCount() {
  std::ifstream vmstat("/proc/vmstat");
  std::string name;
  int64_t value = 0;
  while (vmstat >> name >> value) {
    if (name == "oom_kill") return value;
  }
  return -1;
}

int exitCodeOf(const WorkerOutcome& o) { return o.signaled ? 128 + o.code : o.code; }

std::optional<size_t> rootCause(const std::vector<WorkerOutcome>& outcomes) {
  // Earliest first. Exits that dtrun saw at the same millisecond were reaped together (dtrun was
  // busy, or they died together), so their times say nothing about their order: a worker killed
  // by a signal is then taken before one that exited with an error, which is what the others do
  // when a peer vanishes ("a peer is gone"); then the lower rank.
  auto before = [](const WorkerOutcome& a, const WorkerOutcome& b) {
    if (a.timeMs != b.timeMs) return a.timeMs < b.timeMs;
    if (a.signaled != b.signaled) return a.signaled;
    return a.rank < b.rank;
  };
  std::optional<size_t> best;
  for (size_t i = 0; i < outcomes.size(); ++i) {
    const auto& o = outcomes[i];
    if (!o.failed() || o.stoppedByLauncher) continue;
    if (!best || before(o, outcomes[*best])) best = i;
  }
  return best;
}

std::string formatWallTime(int64_t epochMs) {
  const std::time_t seconds = static_cast<std::time_t>(epochMs / 1000);
  std::tm tm{};
  gmtime_r(&seconds, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm);
  char ms[8];
  std::snprintf(ms, sizeof(ms), ".%03d", static_cast<int>(epochMs % 1000));
  return str(buf, ms, " UTC");
}

namespace {

std::string describeWorker(const WorkerOutcome& o, int64_t startMs) {
  const double after = static_cast<double>(o.timeMs - startMs) / 1000.0;
  char afterText[32];
  std::snprintf(afterText, sizeof(afterText), "%.3f", after < 0 ? 0.0 : after);
  return str("rank ", o.rank, " (local rank ", o.localRank, ", host ", o.host, ", pid ", o.pid, "): ",
             describeOutcome(o), " at ", formatWallTime(o.timeMs), " (", afterText, " s after start)");
}

void appendTail(std::string& out, const WorkerOutcome& o, size_t lines) {
  if (o.stderrTail.empty()) {
    out += "      (no stderr output)\n";
    return;
  }
  out += str("      last ", std::min(lines, o.stderrTail.size()), " stderr line(s):\n");
  const size_t first = o.stderrTail.size() > lines ? o.stderrTail.size() - lines : 0;
  for (size_t i = first; i < o.stderrTail.size(); ++i) out += str("      | ", o.stderrTail[i], "\n");
}

}  // namespace

std::string formatSummary(const SummaryInput& in) {
  std::string out = str("dtrun: job failed (run id ", in.runId, ", node ", in.nodeRank, ", attempt ", in.attempt + 1,
                        " of ", in.maxRestarts + 1, ")\n");
  const auto root = rootCause(in.outcomes);
  if (!in.externalCause.empty()) {
    out += str("  root cause: ", in.externalCause, "\n");
  } else if (root) {
    out += str("  root cause: ", describeWorker(in.outcomes[*root], in.startMs), "\n");
    appendTail(out, in.outcomes[*root], in.tailLines);
  }
  std::vector<int> stopped;
  for (size_t i = 0; i < in.outcomes.size(); ++i) {
    const auto& o = in.outcomes[i];
    if (root && i == *root && in.externalCause.empty()) continue;
    if (o.stoppedByLauncher) {
      stopped.push_back(o.rank);
      continue;
    }
    if (!o.failed()) continue;
    out += str("  also failed: ", describeWorker(o, in.startMs), "\n");
    appendTail(out, o, in.tailLines);
  }
  if (!stopped.empty()) {
    std::sort(stopped.begin(), stopped.end());
    out += str("  stopped by dtrun: rank(s) ", formatRanges(stopped), "\n");
  }
  return out;
}

}  // namespace dt::launcher
