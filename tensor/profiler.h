// Profiler: what a training step spends its time on, as a table and as a
// Chrome trace (Perfetto / chrome://tracing).
//
// Contract:
//  * Profiler is an RAII scope: construction starts recording, destruction
//    (or stop()) ends it. While any profiler records, every tensor op
//    (category op), every autograd node's apply() (backward, named by the
//    node, "MulBackward"), every recordFunction range (user), every
//    process-group collective (collective: from start to end on the thread
//    that ran it, with its sequence number, bytes and time queued since
//    issue), every DDP bucket (ddp: from launch to done, with its bytes) and
//    every gather and reduce-scatter of the sharded wrapper (sharded: from
//    launch to done, each on a track of its own) becomes an event: name, category, thread, rank, start and duration
//    (steady clock, ns), and the input shapes when ProfilerOptions::
//    recordShapes is on.
//  * Several profilers may record at once (nested scopes, or one inside a
//    process profiled by DT_PROFILE); each sees the events that began after
//    it started and ended before it stopped.
//  * Thread safety: recording is thread-safe and takes no global lock: each
//    thread appends to its own buffer (its own, uncontended mutex), and stop()
//    merges the buffers. A Profiler object itself is used from one thread.
//  * Cost: while no profiler records, an op pays one relaxed load and a
//    predictable branch at entry and a branch on a local flag at exit. While
//    recording, about one clock read pair and one buffer append per event
//    (docs/profiling.md has the measured numbers).
//  * Rank: ops, backward and user events carry the process's rank:
//    Profiler::setRank(), else the RANK environment variable, else 0.
//    Collectives and DDP buckets carry their group's (global) rank, so with
//    threads as ranks those get one pid per rank in the trace.
//  * Memory: events stay in the per-thread buffers until the profilers that
//    may want them have stopped (roughly 150 bytes each, plus shapes);
//    stop() copies its events out, costing time linear in the events held.
//  * DT_PROFILE=path profiles the whole process from start-up and writes the
//    trace to `path` (with "{rank}" replaced by the rank; without one, and
//    with WORLD_SIZE > 1, ".rank<r>" goes before the extension) and the table to
//    `path.txt` when the process exits normally (atexit) or when
//    flushProcessProfile() is called, whichever comes first. A process killed
//    by a signal writes nothing.
//  * Errors: writing a trace to a path that cannot be opened throws dt::Error
//    naming the path and the reason.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dt {

// Sharded: the sharded wrapper's parameter gathers and gradient reduce-scatters (fsdp/).
enum class EventCategory : uint8_t { Op, Backward, User, Collective, Ddp, Sharded };
const char* categoryName(EventCategory category);

struct ProfilerOptions {
  // Records the input shapes of each op ("[32, 1024], [1024, 1024]"); the
  // table can then split rows by shape. Costs a string per op.
  bool recordShapes = false;
  // Lists every block allocated while recording with the op that made it
  // (memorySnapshot(), tensor/memory_stats.h). Costs a locked map insert per
  // small allocation; off, small blocks are only counted.
  bool profileMemory = true;
};

struct ProfileEvent {
  std::string name;
  EventCategory category = EventCategory::Op;
  uint64_t threadId = 0;  // small per-process number (1 = first thread that recorded), or a track
  int rank = 0;
  int64_t startNs = 0;  // steady clock
  int64_t durationNs = 0;
  std::string shapes;  // with recordShapes, for ops
  std::string args;    // extra trace arguments as JSON members ("\"seq\": 3, \"bytes\": 4096"), or ""
  std::string trackName;  // for events on a track of their own (DDP buckets), else ""
};

// One row of the table: all events with the same name (and shapes, when split by shape).
struct ProfileRow {
  std::string name;
  EventCategory category = EventCategory::Op;
  std::string shapes;
  int64_t calls = 0;
  int64_t totalNs = 0;
  // Total minus the time of events nested inside these ones on the same thread.
  int64_t selfNs = 0;
};

struct ProfileTableOptions {
  bool groupByShapes = false;  // one row per (name, shapes) and a shapes column
  size_t rowLimit = 0;         // 0 = every row
};

class Profiler {
 public:
  explicit Profiler(ProfilerOptions options = {});
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Ends recording (idempotent); the destructor calls it.
  void stop();
  bool recording() const { return session_ != nullptr; }

  // The events, sorted by thread then start. Only after stop(); empty before.
  const std::vector<ProfileEvent>& events() const { return events_; }
  // Rows sorted by self time, largest first.
  std::vector<ProfileRow> rows(bool groupByShapes = false) const;
  // The rows as a fixed-width table: name, category, calls, total, self, mean (and shapes).
  std::string table(const ProfileTableOptions& options = {}) const;
  // Chrome trace JSON: rank as "pid", thread as "tid", complete ("X") events in us.
  std::string chromeTrace() const;
  void writeChromeTrace(const std::string& path) const;

  // The rank stamped on events recorded from now on (default: RANK, else 0).
  static void setRank(int rank);
  static int rank();

 private:
  struct Session;
  std::shared_ptr<Session> session_;
  ProfilerOptions options_;
  std::vector<ProfileEvent> events_;
};

// A user range: recorded as a "user" event from construction to destruction
// while a profiler records; free otherwise (one branch).
class RecordFunction {
 public:
  explicit RecordFunction(std::string name);
  ~RecordFunction();
  RecordFunction(const RecordFunction&) = delete;
  RecordFunction& operator=(const RecordFunction&) = delete;

 private:
  std::string name_;
  int64_t startNs_ = -1;
};
// `auto range = dt::recordFunction("data loading");`
[[nodiscard]] inline RecordFunction recordFunction(std::string name) { return RecordFunction(std::move(name)); }

// Writes the DT_PROFILE trace and table now and ends that profile (later
// calls, and the one at exit, do nothing). No-op without DT_PROFILE.
void flushProcessProfile();

namespace profiler {

namespace internal {
// True while at least one Profiler records. Read relaxed on every op.
extern std::atomic<bool> gRecording;
}  // namespace internal

inline bool recording() { return internal::gRecording.load(std::memory_order_relaxed); }
int64_t nowNs();  // steady clock

// Records a finished event on the calling thread's buffer (or, with track > 0,
// on a named track of its own: spans that overlap others, such as DDP buckets
// in flight, go there so that every track nests). `rank` < 0: the process's.
// Call only when recording() (it checks again, so a race only loses the event).
void recordEvent(const char* name, EventCategory category, int64_t startNs, int64_t endNs, std::string args = {},
                 int rank = -1, uint64_t track = 0, std::string trackName = {});
// The op the calling thread is in (innermost OpScope), or nullptr. Maintained only while recording.
const char* currentOp();
// True while a profiler with profileMemory records.
bool profilingMemory();

}  // namespace profiler
}  // namespace dt

