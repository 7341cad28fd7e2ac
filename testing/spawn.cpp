#include "testing/spawn.h"

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "common/errors.h"
#include "common/strings.h"

namespace dt::testing {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using namespace std::chrono_literals;

namespace {

// ---- small helpers ------------------------------------------------------------

[[noreturn]] void throwSystemError(const std::string& what) {
  throw Error(str("spawn: ", what, " failed: ", std::strerror(errno)));
}

std::string ordinal(int n) {
  const int lastTwo = n % 100;
  const int last = n % 10;
  const char* suffix = (lastTwo >= 11 && lastTwo <= 13) ? "th" : last == 1 ? "st" : last == 2 ? "nd" : last == 3 ? "rd" : "th";
  return str(n, suffix);
}

std::string rankRange(int worldSize) { return worldSize == 1 ? "rank 0" : str("ranks 0-", worldSize - 1); }

std::string randomHex(int bytes) {
  std::random_device device;
  std::string out;
  static constexpr char kDigits[] = "0123456789abcdef";
  for (int i = 0; i < bytes; ++i) {
    const unsigned value = device() & 0xffu;
    out += kDigits[value >> 4];
    out += kDigits[value & 0xfu];
  }
  return out;
}

// Writes everything (EINTR-safe); false when the other end is gone. Sockets
// use send(MSG_NOSIGNAL) so a vanished parent cannot SIGPIPE a rank.
bool writeAll(int fd, std::string_view data, bool socket) {
  while (!data.empty()) {
    const ssize_t n = socket ? ::send(fd, data.data(), data.size(), MSG_NOSIGNAL) : ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// This process's thread ids (empty when /proc cannot tell).
std::vector<std::string> threadIds() {
  std::vector<std::string> ids;
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return ids;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string tid = entry->d_name;
    if (tid != "." && tid != "..") ids.push_back(tid);
  }
  ::closedir(dir);
  return ids;
}

// Threads that ran before main(): those of shared libraries' own pools (the
// pthread OpenBLAS starts one per core when it loads), which make themselves
// safe across fork() (pthread_atfork). They do not count against spawn.
const std::vector<std::string> threadsBeforeMain = threadIds();

// dtrain's pools that a forked child rebuilds for itself instead of using
// the parent's (their owner pid is checked at every use): tensor ops' workers
// and Work's callback threads. Left idle by earlier work in the test process.
constexpr std::string_view kForkAwarePools[] = {"dt-cpu-pool", "dt-pg-callback"};

// The names of the threads started since, other than the calling one and
// the fork-aware pools.
std::vector<std::string> threadsStartedSinceLoad() {
  std::vector<std::string> names;
  const std::string self = std::to_string(::gettid());
  for (const auto& tid : threadIds()) {
    if (tid == self || std::find(threadsBeforeMain.begin(), threadsBeforeMain.end(), tid) != threadsBeforeMain.end()) {
      continue;
    }
    std::ifstream comm("/proc/self/task/" + tid + "/comm");
    std::string name;
    std::getline(comm, name);
    if (std::find(std::begin(kForkAwarePools), std::end(kForkAwarePools), name) != std::end(kForkAwarePools)) continue;
    names.push_back(name.empty() ? str("thread ", tid) : name);
  }
  return names;
}

// A loopback port that was free a moment ago (torchrun's MASTER_PORT for the ranks).
uint16_t freeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throwSystemError("socket()");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof addr;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) == 0;
  ::close(fd);
  if (!ok) throwSystemError("binding a free loopback port");
  return ntohs(addr.sin_port);
}

int pidFdOpen(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  return -1;
#endif
}

void closeFd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// ---- records a rank sends its parent on the control socket --------------------------
//
// kind u8 | hit u32 | freeze ms i64 (-1: until resumed) | length u32 | text

enum class RecordKind : uint8_t { Value = 1, Error = 2, PointKill = 3, PointFreeze = 4 };

struct Record {
  RecordKind kind = RecordKind::Value;
  uint32_t hit = 0;
  int64_t freezeMs = -1;
  std::string text;
};

constexpr size_t kRecordHeaderBytes = 1 + 4 + 8 + 4;
constexpr size_t kMaxValueBytes = 256u << 20;

template <typename T>
void putRaw(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof value);
}

template <typename T>
T getRaw(const char* data) {
  T value;
  std::memcpy(&value, data, sizeof value);
  return value;
}

std::string encode(const Record& record) {
  std::string out;
  putRaw(out, static_cast<uint8_t>(record.kind));
  putRaw(out, record.hit);
  putRaw(out, record.freezeMs);
  putRaw(out, static_cast<uint32_t>(record.text.size()));
  out += record.text;
  return out;
}

// Takes one complete record off the front of `buffer`, if there is one.
std::optional<Record> takeRecord(std::string& buffer) {
  if (buffer.size() < kRecordHeaderBytes) return std::nullopt;
  const auto length = getRaw<uint32_t>(buffer.data() + 13);
  if (buffer.size() < kRecordHeaderBytes + length) return std::nullopt;
  Record record;
  record.kind = static_cast<RecordKind>(getRaw<uint8_t>(buffer.data()));
  record.hit = getRaw<uint32_t>(buffer.data() + 1);
  record.freezeMs = getRaw<int64_t>(buffer.data() + 5);
  record.text = buffer.substr(kRecordHeaderBytes, length);
  buffer.erase(0, kRecordHeaderBytes + length);
  return record;
}

// ---- the child's side -------------------------------------------------------------

// Exit codes of a rank that never ran fn.
constexpr int kExitOrphaned = 120;   // the spawning thread was gone before the rank started
constexpr int kExitAbandoned = 121;  // the parent gave up starting the run (its store failed)

struct ChildState {
  int rank = 0;
  int controlFd = -1;
  std::mutex sendMutex;
  std::vector<PlanStep> steps;  // this rank's
  std::mutex hitsMutex;
  std::map<std::string, int, std::less<>> hits;
};
ChildState* child = nullptr;  // set in a rank only

void sendRecord(const Record& record) {
  std::lock_guard<std::mutex> lock(child->sendMutex);
  writeAll(child->controlFd, encode(record), true);
}

void reachPoint(std::string_view name) {
  const PlanStep* step = nullptr;
  int hit = 0;
  {
    std::lock_guard<std::mutex> lock(child->hitsMutex);
    auto it = child->hits.find(name);
    if (it == child->hits.end()) it = child->hits.emplace(std::string(name), 0).first;
    hit = ++it->second;
    for (const auto& candidate : child->steps) {
      if (candidate.hit == hit && candidate.point == name) step = &candidate;
    }
  }
  if (step == nullptr) return;
  std::fflush(nullptr);  // so that the log shows what led here
  Record record;
  record.hit = static_cast<uint32_t>(hit);
  record.text = std::string(name);
  if (step->action == PlanStep::Action::Kill) {
    record.kind = RecordKind::PointKill;
    sendRecord(record);
    ::raise(SIGKILL);
  } else {
    record.kind = RecordKind::PointFreeze;
    record.freezeMs = step->freezeFor ? step->freezeFor->count() : -1;
    sendRecord(record);
    ::raise(SIGSTOP);  // every thread stops; the parent sends SIGCONT
  }
}

struct StartMessage {
  uint16_t storePort = 0;
  std::string token;
  uint16_t masterPort = 0;
  std::string runId;
};

std::string encodeStart(const StartMessage& m) {
  return str(m.storePort, " ", m.token, " ", m.masterPort, " ", m.runId, "\n");
}

std::optional<StartMessage> readStart(int fd) {
  std::string line;
  char c = 0;
  while (line.size() < 512) {
    const ssize_t n = ::read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::nullopt;
    if (c == '\n') break;
    line += c;
  }
  const auto fields = split(line, ' ');
  if (fields.size() != 4) return std::nullopt;
  StartMessage m;
  m.storePort = static_cast<uint16_t>(std::stoul(fields[0]));
  m.token = fields[1];
  m.masterPort = static_cast<uint16_t>(std::stoul(fields[2]));
  m.runId = fields[3];
  return m;
}

void setEnv(const std::string& name, const std::string& value) { ::setenv(name.c_str(), value.c_str(), 1); }

void setDtrunEnvironment(int rank, int worldSize, const StartMessage& start, const SpawnOptions& options) {
  setEnv("RANK", str(rank));
  setEnv("WORLD_SIZE", str(worldSize));
  setEnv("LOCAL_RANK", str(rank));
  setEnv("LOCAL_WORLD_SIZE", str(worldSize));
  setEnv("GROUP_RANK", "0");
  setEnv("GROUP_WORLD_SIZE", "1");
  setEnv("MASTER_ADDR", "127.0.0.1");
  setEnv("MASTER_PORT", str(start.masterPort));
  setEnv("DT_STORE_ADDR", str("127.0.0.1:", start.storePort));
  setEnv("DT_STORE_TOKEN", start.token);
  setEnv("DT_RUN_ID", start.runId);
  setEnv("DT_RESTART_COUNT", "0");
  if (worldSize > 1) {  // as dtrun does when ranks share a machine
    for (const char* name : {"OMP_NUM_THREADS", "DT_NUM_THREADS"}) {
      const char* value = std::getenv(name);
      if (value == nullptr || *value == '\0') setEnv(name, "1");
    }
  }
  for (const auto& [name, value] : options.env) setEnv(name, value);
}

[[noreturn]] void runChild(int rank, int worldSize, const RankFunction& fn, const SpawnOptions& options, pid_t parent,
                           int outFd, int controlFd, int startFd) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(kExitOrphaned);
  ::dup2(outFd, STDOUT_FILENO);
  ::dup2(outFd, STDERR_FILENO);
  ::close(outFd);
  // Line-buffered, so a rank that dies keeps its last lines. glibc applies a
  // new mode to a stream that has been used only with a buffer of our own.
  static char stdoutBuffer[BUFSIZ];
  std::setvbuf(stdout, stdoutBuffer, _IOLBF, sizeof stdoutBuffer);
  const auto start = readStart(startFd);
  ::close(startFd);
  if (!start) ::_exit(kExitAbandoned);
  setDtrunEnvironment(rank, worldSize, *start, options);

  static ChildState state;  // lives until _exit; the point hook reads it
  state.rank = rank;
  state.controlFd = controlFd;
  for (const auto& step : options.plan) {
    if (step.rank == rank) state.steps.push_back(step);
  }
  child = &state;
  if (!state.steps.empty()) detail::pointHook.store(&reachPoint, std::memory_order_release);

  RankContext ctx;
  ctx.rank = rank;
  ctx.worldSize = worldSize;
  ctx.storeHost = "127.0.0.1";
  ctx.storePort = start->storePort;
  ctx.storeToken = start->token;
  Record record;
  int code = 0;
  try {
    record.text = fn(ctx);
    record.kind = RecordKind::Value;
    if (record.text.size() > kMaxValueBytes) {
      record.text = str(record.text.substr(0, kMaxValueBytes), "... (truncated: ", record.text.size(), " bytes)");
    }
  } catch (const std::exception& e) {
    record.kind = RecordKind::Error;
    record.text = describe(e);
    code = 1;
  } catch (...) {
    record.kind = RecordKind::Error;
    record.text = "an exception not derived from std::exception";
    code = 1;
  }
  std::cout.flush();
  std::fflush(nullptr);
  sendRecord(record);
  ::_exit(code);
}

}  // namespace

// ---- public helpers --------------------------------------------------------------

std::shared_ptr<TcpStore> RankContext::store() {
  if (!store_) {
    TcpStoreOptions options;
    options.rank = rank;
    options.token = storeToken;
    store_ = std::make_shared<TcpStore>(storeHost, storePort, options);
  }
  return store_;
}

std::string_view toString(Ending ending) {
  switch (ending) {
    case Ending::Returned: return "returned";
    case Ending::Threw: return "threw";
    case Ending::Exited: return "exited";
    case Ending::Signaled: return "signaled";
    case Ending::Killed: return "killed";
    case Ending::KilledAfterFailure: return "killed after a failure";
    case Ending::KilledAtDeadline: return "killed at the deadline";
  }
  return "unknown";
}

std::string signalName(int signal) {
  if (const char* abbreviation = ::sigabbrev_np(signal)) return str("SIG", abbreviation);
  return str("signal ", signal);
}

bool RankOutcome::failed() const {
  return ending == Ending::Threw || ending == Ending::Signaled || (ending == Ending::Exited && exitCode != 0);
}

std::vector<std::string> RankOutcome::lastLines(size_t count) const {
  std::vector<std::string> lines = split(log, '\n');
  if (!lines.empty() && lines.back().empty()) lines.pop_back();
  if (lines.size() > count) lines.erase(lines.begin(), lines.end() - static_cast<std::ptrdiff_t>(count));
  return lines;
}

std::string RankOutcome::describe() const {
  std::string text = str("rank ", rank, "/", worldSize, " ");
  switch (ending) {
    case Ending::Returned: text += str("returned ", quoteBytes(value, 160)); break;
    case Ending::Threw: text += str("threw ", error); break;
    case Ending::Exited: text += str("exited with code ", exitCode, " before its function returned"); break;
    case Ending::Signaled:
      text += str("died of ", signalName(signal), ", a signal neither the plan nor the test sent");
      break;
    case Ending::Killed:
    case Ending::KilledAfterFailure:
    case Ending::KilledAtDeadline: text += str("was killed (", signalName(signal), ") ", note); break;
  }
  if (!events.empty()) text += str(" [", join(events, "; "), "]");
  return text;
}

bool SpawnResult::ok() const {
  return !ranks.empty() && std::all_of(ranks.begin(), ranks.end(), [](const RankOutcome& o) { return o.returned(); });
}

std::string SpawnResult::summary(size_t logLines) const {
  std::string text = str(ranks.size(), " ranks in ", elapsed.count(), " ms",
                         firstFailure >= 0 ? str("; first failure: rank ", firstFailure) : std::string(), "\n");
  for (const auto& outcome : ranks) text += str("  ", outcome.describe(), "\n");
  for (const auto& step : planNotFired) text += str("  plan step never reached: ", step, "\n");
  for (const auto& outcome : ranks) {
    if (outcome.returned() || logLines == 0) continue;
    const auto lines = outcome.lastLines(logLines);
    text += str("  last ", lines.size(), " lines of rank ", outcome.rank, lines.empty() ? " (no output)" : ":", "\n");
    for (const auto& line : lines) text += str("    ", line, "\n");
  }
  return text;
}

std::string PlanStep::describe() const {
  const std::string when = str("the ", ordinal(hit), " time it reaches \"", point, "\"");
  if (action == Action::Kill) return str("kill rank ", rank, " ", when);
  const std::string howLong = freezeFor ? str("for ", formatDuration(*freezeFor)) : std::string("until resumed");
  return str("freeze rank ", rank, " ", howLong, " ", when);
}

PlanStep killAt(int rank, std::string point, int hit) {
  PlanStep step;
  step.action = PlanStep::Action::Kill;
  step.rank = rank;
  step.point = std::move(point);
  step.hit = hit;
  return step;
}

PlanStep freezeAt(int rank, std::string point, std::optional<milliseconds> duration, int hit) {
  PlanStep step;
  step.action = PlanStep::Action::Freeze;
  step.rank = rank;
  step.point = std::move(point);
  step.hit = hit;
  step.freezeFor = duration;
  return step;
}

// ---- the parent's side ------------------------------------------------------------

namespace {

constexpr int kMaxWorldSize = 4096;

void validate(int worldSize, const SpawnOptions& options) {
  if (worldSize < 1 || worldSize > kMaxWorldSize) {
    throw InvalidArgument(str("spawn: world size must be 1..", kMaxWorldSize, ", got ", worldSize));
  }
  if (options.deadline <= milliseconds(0)) {
    throw InvalidArgument(str("spawn: deadline must be positive, got ", options.deadline.count(), " ms"));
  }
  for (size_t i = 0; i < options.plan.size(); ++i) {
    const PlanStep& step = options.plan[i];
    if (step.point.empty()) {
      throw InvalidArgument(str("spawn: plan step ", i, " (for rank ", step.rank, ") has an empty point name"));
    }
    if (step.rank < 0 || step.rank >= worldSize) {
      throw InvalidArgument(str("spawn: plan step '", step.describe(), "' names rank ", step.rank,
                                ", but the world has ", rankRange(worldSize)));
    }
    if (step.hit < 1) {
      throw InvalidArgument(str("spawn: plan step for rank ", step.rank, " at \"", step.point, "\" has hit ", step.hit,
                                "; hits count from 1 (the first time the rank reaches the point)"));
    }
    if (step.freezeFor && *step.freezeFor < milliseconds(0)) {
      throw InvalidArgument(str("spawn: plan step '", step.describe(), "' freezes for ", step.freezeFor->count(),
                                " ms; give a duration >= 0, or none to freeze until resumed"));
    }
    for (size_t j = 0; j < i; ++j) {
      const PlanStep& other = options.plan[j];
      if (other.rank == step.rank && other.point == step.point && other.hit == step.hit) {
        throw InvalidArgument(str("spawn: plan steps '", other.describe(), "' and '", step.describe(),
                                  "' both act on the same moment; keep one"));
      }
    }
  }
  for (const auto& [name, value] : options.env) {
    if (name.empty() || name.find('=') != std::string::npos) {
      throw InvalidArgument(str("spawn: environment variable name ", quoteBytes(name),
                                " is empty or contains '='"));
    }
  }
}

}  // namespace

struct RankProcess {
  pid_t pid = -1;
  int outFd = -1;      // its stdout+stderr
  int controlFd = -1;  // its records
  int startFd = -1;    // the start message goes here, then it is closed
  int pidFd = -1;      // readable once it has exited (-1 where the kernel has no pidfd)
  bool ended = false;
  // Freezing: a freeze was asked (plan or test) and not yet seen; seen; how long.
  bool stopExpected = false;
  bool stopped = false;
  std::optional<milliseconds> freezeFor;
  std::optional<Clock::time_point> resumeAt;
  // Why the harness or the plan killed it, should it die of SIGKILL.
  std::optional<Ending> killIntent;
  std::string killNote;
  bool haveValue = false;
  bool haveError = false;
  std::string controlBuffer;
  std::string echoLine;
  RankOutcome outcome;

  bool frozenForGood() const { return (stopped || stopExpected) && !freezeFor; }
};

struct SpawnedRanks::State {
  int worldSize = 0;
  SpawnOptions options;
  Clock::time_point start;
  std::shared_ptr<TcpStore> store;
  mutable std::mutex mutex;
  std::condition_variable changed;
  std::vector<RankProcess> ranks;
  std::vector<bool> planFired;
  int firstFailure = -1;
  bool waiting = false;  // wait() was called (or the object is going): nobody can resume a rank
  bool deadlinePassed = false;
  bool done = false;
  int wakeRead = -1, wakeWrite = -1;
  std::thread monitor;
  SpawnResult result;

  ~State() {
    for (auto& r : ranks) {
      closeFd(r.outFd);
      closeFd(r.controlFd);
      closeFd(r.startFd);
      closeFd(r.pidFd);
    }
    closeFd(wakeRead);
    closeFd(wakeWrite);
  }

  void wake() const {
    const char byte = 1;
    [[maybe_unused]] const ssize_t ignored = ::write(wakeWrite, &byte, 1);
  }

  // Kills every rank forked so far and reaps it: the run could not start.
  void abandon() {
    for (auto& r : ranks) closeFd(r.startFd);  // a rank that reads EOF exits at once
    for (auto& r : ranks) {
      if (r.pid > 0) {
        ::kill(r.pid, SIGKILL);
        while (::waitpid(r.pid, nullptr, 0) < 0 && errno == EINTR) {
        }
        r.ended = true;
      }
    }
  }

  void signalRank(RankProcess& r, Ending intent, std::string note) {
    if (r.ended) return;
    if (!r.killIntent) {
      r.killIntent = intent;
      r.killNote = std::move(note);
    }
    ::kill(r.pid, SIGKILL);
  }

  void echo(RankProcess& r, bool flushPartial) {
    if (!options.echo) return;
    size_t newline;
    while ((newline = r.echoLine.find('\n')) != std::string::npos || r.echoLine.size() > 4096 ||
           (flushPartial && !r.echoLine.empty())) {
      const size_t take = newline == std::string::npos ? r.echoLine.size() : newline + 1;
      std::string line = str("[rank ", r.outcome.rank, "] ", std::string_view(r.echoLine).substr(0, take));
      if (line.back() != '\n') line += '\n';
      writeAll(STDERR_FILENO, line, false);
      r.echoLine.erase(0, take);
    }
  }

  void appendLog(RankProcess& r, std::string_view data) {
    std::string& log = r.outcome.log;
    log.append(data);
    if (log.size() > 2 * options.logBytes + 4096) trimLog(r);
    if (options.echo) {
      r.echoLine.append(data);
      echo(r, false);
    }
  }

  void trimLog(RankProcess& r) {
    std::string& log = r.outcome.log;
    if (log.size() <= options.logBytes) return;
    const size_t drop = log.size() - options.logBytes;
    log.erase(0, drop);
    r.outcome.logBytesDropped += drop;
  }

  int planIndex(int rank, const std::string& point, int hit) const {
    for (size_t i = 0; i < options.plan.size(); ++i) {
      const auto& step = options.plan[i];
      if (step.rank == rank && step.point == point && step.hit == hit) return static_cast<int>(i);
    }
    return -1;
  }

  void onRecord(RankProcess& r, Record record) {
    const int rank = r.outcome.rank;
    switch (record.kind) {
      case RecordKind::Value:
        r.haveValue = true;
        r.outcome.value = std::move(record.text);
        return;
      case RecordKind::Error:
        r.haveError = true;
        r.outcome.error = std::move(record.text);
        return;
      case RecordKind::PointKill: {
        const int index = planIndex(rank, record.text, static_cast<int>(record.hit));
        if (index >= 0) planFired[static_cast<size_t>(index)] = true;
        const std::string where = str("at point \"", record.text, "\" (hit ", record.hit, ")");
        if (!r.killIntent) {
          r.killIntent = Ending::Killed;
          r.killNote = str(where, ", as planned");
        }
        return;
      }
      case RecordKind::PointFreeze: {
        const int index = planIndex(rank, record.text, static_cast<int>(record.hit));
        if (index >= 0) planFired[static_cast<size_t>(index)] = true;
        if (record.freezeMs >= 0) r.freezeFor = milliseconds(record.freezeMs);
        r.outcome.events.push_back(str("frozen at point \"", record.text, "\" (hit ", record.hit, ") ",
                                       r.freezeFor ? str("for ", formatDuration(*r.freezeFor)) : "until resumed",
                                       ", as planned"));
        if (r.stopped) {  // the stop was seen before its record
          if (r.freezeFor) r.resumeAt = Clock::now() + *r.freezeFor;
        } else {
          r.stopExpected = true;
        }
        return;
      }
    }
    r.outcome.events.push_back(str("sent a record of unknown kind ", static_cast<int>(record.kind),
                                   " on its control socket (did its code write there?); the rest was ignored"));
    closeFd(r.controlFd);
    r.controlBuffer.clear();
  }

  // Reads what is there (non-blocking), at most `reads` times, so that a
  // rank that writes without pause cannot hold the monitor; closes the
  // descriptor at EOF.
  void drain(RankProcess& r, int& fd, bool control, int reads = 16) {
    char buffer[65536];
    for (int i = 0; i < reads && fd >= 0; ++i) {
      const ssize_t n = ::read(fd, buffer, sizeof buffer);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return;  // EAGAIN: nothing more now
      if (n == 0) {
        closeFd(fd);
        return;
      }
      if (control) {
        r.controlBuffer.append(buffer, static_cast<size_t>(n));
        while (fd >= 0) {
          auto record = takeRecord(r.controlBuffer);
          if (!record) break;
          onRecord(r, std::move(*record));
        }
      } else {
        appendLog(r, std::string_view(buffer, static_cast<size_t>(n)));
      }
    }
  }

  // `status` from waitpid, or -1 when it is unknown.
  void finish(RankProcess& r, int status) {
    drain(r, r.outFd, false, 4096);  // what a dead rank left (up to 256 MiB)
    drain(r, r.controlFd, true, 4096);
    closeFd(r.outFd);
    closeFd(r.controlFd);
    closeFd(r.pidFd);
    closeFd(r.startFd);
    r.ended = true;
    r.stopped = r.stopExpected = false;
    r.resumeAt.reset();
    echo(r, true);
    trimLog(r);
    RankOutcome& o = r.outcome;
    const bool known = status != -1;
    o.exitCode = known && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    o.signal = known && WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    if (r.haveValue) {
      o.ending = Ending::Returned;
    } else if (r.haveError) {
      o.ending = Ending::Threw;
    } else if (r.killIntent && (o.signal == SIGKILL || !known)) {
      o.ending = *r.killIntent;
      o.note = r.killNote;
    } else if (!known || WIFEXITED(status)) {
      o.ending = Ending::Exited;
    } else {
      o.ending = Ending::Signaled;
    }
    if (o.failed() && firstFailure < 0) {
      firstFailure = o.rank;
      if (options.killAllOnFailure) {
        const std::string note = str("after rank ", o.rank, " failed (", o.describe(), ")");
        for (auto& other : ranks) signalRank(other, Ending::KilledAfterFailure, note);
      }
    }
    changed.notify_all();
  }

  void reap() {
    for (auto& r : ranks) {
      if (r.ended) continue;
      int status = 0;
      const pid_t got = ::waitpid(r.pid, &status, WNOHANG | WUNTRACED | WCONTINUED);
      if (got < 0 && errno == ECHILD) {
        // Someone else reaped it (a SIGCHLD handler of the test that calls
        // wait()): its status is lost; what it sent still counts.
        r.outcome.events.push_back("reaped by someone else: its exit status is unknown");
        finish(r, -1);
        continue;
      }
      if (got != r.pid) continue;
      if (WIFSTOPPED(status)) {
        // A planned freeze sends its record before it stops: read it now, so
        // that its duration is known before anyone takes the stop for good.
        drain(r, r.controlFd, true);
        r.stopped = true;
        r.stopExpected = false;
        if (r.freezeFor) r.resumeAt = Clock::now() + *r.freezeFor;
        changed.notify_all();
      } else if (WIFCONTINUED(status)) {
        // Resumed by us (already noted) or by someone else (its own code).
        r.stopped = false;
        r.resumeAt.reset();
      } else {
        finish(r, status);
      }
    }
  }

  void resumeRank(RankProcess& r, const std::string& event) {
    ::kill(r.pid, SIGCONT);
    r.stopped = r.stopExpected = false;
    r.freezeFor.reset();
    r.resumeAt.reset();
    r.outcome.events.push_back(event);
  }

  void runTimers() {
    const auto now = Clock::now();
    for (auto& r : ranks) {
      if (!r.ended && r.resumeAt && *r.resumeAt <= now) resumeRank(r, "resumed as planned");
    }
    if (!deadlinePassed && now >= start + options.deadline) {
      deadlinePassed = true;
      for (auto& r : ranks) {
        const bool frozen = r.stopped || r.stopExpected;
        signalRank(r, Ending::KilledAtDeadline,
                   str("at the ", formatDuration(options.deadline), " deadline, ", frozen ? "frozen" : "still running"));
      }
    }
    if (waiting) {
      // Only ranks frozen for good are left: nobody can resume them now.
      const bool anyLive = std::any_of(ranks.begin(), ranks.end(), [](const RankProcess& r) { return !r.ended; });
      const bool onlyFrozen = std::all_of(ranks.begin(), ranks.end(), [](const RankProcess& r) {
        return r.ended || r.frozenForGood();
      });
      if (anyLive && onlyFrozen) {
        for (auto& r : ranks) {
          signalRank(r, Ending::Killed, "while frozen for good, once every other rank had ended (nobody could resume it)");
        }
      }
    }
  }

  // How long the monitor may sleep in poll().
  int pollTimeoutMs() const {
    auto next = deadlinePassed ? Clock::now() + 1h : start + options.deadline;
    bool fast = false;  // a stop to see, or no pidfd to wake us at an exit
    for (const auto& r : ranks) {
      if (r.ended) continue;
      if (r.resumeAt) next = std::min(next, *r.resumeAt);
      if (r.stopExpected) fast = true;
      if (r.pidFd < 0 && !fast) next = std::min(next, Clock::now() + 20ms);
    }
    const auto wait = std::chrono::duration_cast<milliseconds>(next - Clock::now()).count() + 1;
    return fast ? 1 : static_cast<int>(std::clamp<int64_t>(wait, 0, 1000));
  }

  void monitorLoop() {
    std::vector<pollfd> fds;
    std::unique_lock<std::mutex> lock(mutex);
    while (true) {
      fds.clear();
      fds.push_back({wakeRead, POLLIN, 0});
      for (const auto& r : ranks) {
        for (int fd : {r.outFd, r.controlFd, r.pidFd}) {
          if (fd >= 0) fds.push_back({fd, POLLIN, 0});
        }
      }
      const int timeout = pollTimeoutMs();
      lock.unlock();
      ::poll(fds.data(), fds.size(), timeout);
      lock.lock();
      char sink[64];
      while (::read(wakeRead, sink, sizeof sink) > 0) {
      }
      for (auto& r : ranks) {
        drain(r, r.outFd, false);
        drain(r, r.controlFd, true);
      }
      reap();
      runTimers();
      if (std::all_of(ranks.begin(), ranks.end(), [](const RankProcess& r) { return r.ended; })) break;
    }
    result.firstFailure = firstFailure;
    result.elapsed = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
    for (auto& r : ranks) result.ranks.push_back(r.outcome);
    for (size_t i = 0; i < options.plan.size(); ++i) {
      if (!planFired[i]) result.planNotFired.push_back(options.plan[i].describe());
    }
    done = true;
    changed.notify_all();
  }

  RankProcess& at(int rank, const char* what) {
    if (rank < 0 || rank >= worldSize) {
      throw InvalidArgument(str("SpawnedRanks::", what, "(", rank, "): no such rank; the world has ", rankRange(worldSize)));
    }
    return ranks[static_cast<size_t>(rank)];
  }
};

SpawnedRanks::SpawnedRanks(int worldSize, RankFunction fn, SpawnOptions options) {
  validate(worldSize, options);
  if (!fn) throw InvalidArgument("spawn: the rank function is empty");
  struct sigaction onChild {};
  if (::sigaction(SIGCHLD, nullptr, &onChild) == 0 &&
      (onChild.sa_handler == SIG_IGN || (onChild.sa_flags & SA_NOCLDWAIT) != 0)) {
    throw InvalidArgument("spawn: this process ignores SIGCHLD (SIG_IGN or SA_NOCLDWAIT), so the kernel would reap the "
                          "ranks and their endings would be lost; restore its default action before spawning");
  }
  if (!options.allowThreads) {
    auto threads = threadsStartedSinceLoad();
    // A thread joined a moment ago can still be listed while the kernel finishes its exit
    // (seen under load, right after an earlier spawn's store thread was joined): give the
    // exiting ones a moment; a live thread stays and is refused.
    for (int tries = 0; !threads.empty() && tries < 50; ++tries) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      threads = threadsStartedSinceLoad();
    }
    if (!threads.empty()) {
      throw InvalidArgument(str("spawn(", worldSize, " ranks): this process has started ", threads.size(),
                                " other thread(s) (", join(threads, ", "),
                                "); fork() copies only the calling thread, so a rank could block forever on a lock one "
                                "of them held. Spawn before starting threads (compute references inside a rank), or set "
                                "SpawnOptions::allowThreads if they hold no lock the ranks need"));
    }
  }
  state_ = std::make_unique<State>();
  State& s = *state_;
  s.worldSize = worldSize;
  s.options = std::move(options);
  s.planFired.assign(s.options.plan.size(), false);
  s.ranks.resize(static_cast<size_t>(worldSize));

  static std::atomic<int> runs{0};
  StartMessage start;
  start.masterPort = freeLoopbackPort();
  start.token = randomHex(16);
  start.runId = str("spawn-", ::getpid(), "-", ++runs, "-", randomHex(4));

  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) throwSystemError("pipe2()");
  s.wakeRead = wake[0];
  s.wakeWrite = wake[1];

  // A rank must not print this process's buffered output again.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  std::vector<int> parentFds = {s.wakeRead, s.wakeWrite};  // what each later child closes
  for (int rank = 0; rank < worldSize; ++rank) {
    RankProcess& r = s.ranks[static_cast<size_t>(rank)];
    r.outcome.rank = rank;
    r.outcome.worldSize = worldSize;
    // Sockets where this process writes, so that a rank already gone cannot
    // SIGPIPE it (send with MSG_NOSIGNAL).
    int out[2] = {-1, -1}, control[2] = {-1, -1}, startPipe[2] = {-1, -1};
    if (::pipe2(out, O_CLOEXEC) != 0 || ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, control) != 0 ||
        ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, startPipe) != 0) {
      const int saved = errno;
      for (int fd : {out[0], out[1], control[0], control[1], startPipe[0], startPipe[1]}) {
        if (fd >= 0) ::close(fd);
      }
      s.abandon();
      errno = saved;
      throwSystemError(str("creating the pipes of rank ", rank));
    }
    const pid_t pid = ::fork();
    if (pid == 0) {
      for (int fd : parentFds) ::close(fd);
      ::close(out[0]);
      ::close(control[0]);
      ::close(startPipe[1]);
      runChild(rank, worldSize, fn, s.options, parent, out[1], control[1], startPipe[0]);
    }
    const int saved = errno;
    ::close(out[1]);
    ::close(control[1]);
    ::close(startPipe[0]);
    if (pid < 0) {
      ::close(out[0]);
      ::close(control[0]);
      ::close(startPipe[1]);
      s.abandon();
      errno = saved;
      throwSystemError(str("fork() of rank ", rank));
    }
    r.pid = pid;
    r.outFd = out[0];
    r.controlFd = control[0];
    r.startFd = startPipe[1];
    r.pidFd = pidFdOpen(pid);
    for (int fd : {r.outFd, r.controlFd}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    for (int fd : {r.outFd, r.controlFd, r.startFd, r.pidFd}) {
      if (fd >= 0) parentFds.push_back(fd);
    }
  }

  // Only now, with every rank forked, does this process start threads.
  try {
    TcpStoreOptions storeOptions;
    storeOptions.isServer = true;
    storeOptions.waitForWorkers = false;
    storeOptions.token = start.token;
    s.store = std::make_shared<TcpStore>("127.0.0.1", 0, storeOptions);
  } catch (...) {
    s.abandon();
    throw;
  }
  start.storePort = s.store->port();
  const std::string message = encodeStart(start);
  for (auto& r : s.ranks) {
    writeAll(r.startFd, message, true);  // a rank that died already is reaped by the monitor
    closeFd(r.startFd);
  }
  s.start = Clock::now();
  s.monitor = std::thread([&s] { s.monitorLoop(); });
}

SpawnedRanks::~SpawnedRanks() {
  if (!state_) return;
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.waiting = true;
    for (auto& r : s.ranks) s.signalRank(r, Ending::Killed, "when its SpawnedRanks object was destroyed");
    s.wake();
  }
  if (s.monitor.joinable()) s.monitor.join();
}

int SpawnedRanks::worldSize() const { return state_->worldSize; }

TcpStore& SpawnedRanks::store() { return *state_->store; }

pid_t SpawnedRanks::pid(int rank) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->at(rank, "pid").pid;
}

RankState SpawnedRanks::state(int rank) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  const RankProcess& r = state_->at(rank, "state");
  if (r.ended) return RankState::Ended;
  return r.stopped || r.stopExpected ? RankState::Frozen : RankState::Running;
}

bool SpawnedRanks::kill(int rank) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  RankProcess& r = s.at(rank, "kill");
  if (r.ended) return false;
  s.signalRank(r, Ending::Killed, "by the test (SpawnedRanks::kill)");
  s.wake();
  return true;
}

bool SpawnedRanks::freeze(int rank) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  RankProcess& r = s.at(rank, "freeze");
  if (r.ended) return false;
  if (!r.stopped) {
    r.stopExpected = true;
    r.freezeFor.reset();
    r.outcome.events.push_back("frozen by the test");
    ::kill(r.pid, SIGSTOP);
    s.wake();
    // A stop is seen within milliseconds unless the rank sits in the kernel
    // (an uninterruptible wait): then it stops when it comes back.
    s.changed.wait(lock, [&] { return r.stopped || r.ended; });
  }
  return r.stopped;
}

bool SpawnedRanks::resume(int rank) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  RankProcess& r = s.at(rank, "resume");
  if (r.ended || !(r.stopped || r.stopExpected)) return false;
  // A freeze still on its way would land after our SIGCONT and stick.
  s.changed.wait(lock, [&] { return r.stopped || r.ended; });
  if (r.ended) return false;
  s.resumeRank(r, "resumed by the test");
  s.wake();
  return true;
}

SpawnResult SpawnedRanks::wait() {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  s.waiting = true;
  s.wake();
  s.changed.wait(lock, [&] { return s.done; });
  return s.result;
}

SpawnResult spawn(int worldSize, RankFunction fn, SpawnOptions options) {
  SpawnedRanks ranks(worldSize, std::move(fn), std::move(options));
  return ranks.wait();
}

}  // namespace dt::testing
