#include "tensor/profiler.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_set>

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/autograd.h"
#include "tensor/internal/op_scope.h"

namespace dt {

namespace profiler::internal {
std::atomic<bool> gRecording{false};
}  // namespace profiler::internal

namespace {

using profiler::internal::gRecording;

// An event as the recording thread stores it: op names are string literals,
// so the common case copies a pointer, not a string.
struct RawEvent {
  const char* literalName = nullptr;
  std::string ownedName;
  EventCategory category = EventCategory::Op;
  int rank = 0;
  uint64_t track = 0;
  std::string trackName;
  int64_t startNs = 0;
  int64_t endNs = 0;
  std::string shapes;
  std::string args;
};

struct ThreadBuffer {
  std::mutex mutex;  // the owning thread appends; stop() reads. Uncontended while recording.
  uint64_t threadId = 0;
  std::vector<RawEvent> events;
};

struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  std::vector<int64_t> activeStarts;  // start time of every profiler recording now
  int shapeRecorders = 0;
  int memoryProfilers = 0;
  uint64_t nextThreadId = 1;
};

Registry& registry() {
  // Leaked: threads and the DT_PROFILE flush at exit may record after static destruction began.
  static Registry* instance = new Registry();
  return *instance;
}

std::atomic<bool> gRecordShapes{false};
std::atomic<bool> gProfileMemory{false};
std::atomic<int> gRank{-1};  // -1: not set, read RANK on first use
thread_local std::shared_ptr<ThreadBuffer> tBuffer;
thread_local const char* tCurrentOp = nullptr;

ThreadBuffer& threadBuffer() {
  if (!tBuffer) [[unlikely]] {
    auto buffer = std::make_shared<ThreadBuffer>();
    Registry& reg = registry();
    std::lock_guard lock(reg.mutex);
    buffer->threadId = reg.nextThreadId++;
    buffer->events.reserve(1024);
    reg.buffers.push_back(buffer);
    tBuffer = std::move(buffer);
  }
  return *tBuffer;
}

void append(RawEvent&& event) {
  ThreadBuffer& buffer = threadBuffer();
  std::lock_guard lock(buffer.mutex);
  buffer.events.push_back(std::move(event));
}

// Node names are computed strings; the thread's current op and the memory
// snapshot keep a pointer to the name past the node's lifetime, so each
// distinct name is stored once for the life of the process (a few dozen).
const char* internName(std::string name) {
  static std::mutex* mutex = new std::mutex();
  static auto* names = new std::unordered_set<std::string>();
  std::lock_guard lock(*mutex);
  return names->insert(std::move(name)).first->c_str();
}

// The end of an op or backward scope: `name` is a literal or interned.
void appendScopeEvent(const char* name, EventCategory category, int64_t startNs, std::string shapes) {
  RawEvent event;
  event.endNs = profiler::nowNs();
  event.startNs = startNs;
  event.literalName = name;
  event.category = category;
  event.rank = Profiler::rank();
  event.shapes = std::move(shapes);
  append(std::move(event));
}

std::string formatShapes(const Tensor* const* inputs, size_t count) {
  std::string out;
  for (size_t i = 0; i < count; ++i) {
    if (i > 0) out += ", ";
    if (!inputs[i]->defined()) {
      out += "undefined";
      continue;
    }
    out += '[';
    const Shape& sizes = inputs[i]->sizes();
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (d > 0) out += ", ";
      out += std::to_string(sizes[d]);
    }
    out += ']';
  }
  return out;
}

std::string formatNs(int64_t ns) {
  char buf[32];
  if (ns >= 1'000'000'000) std::snprintf(buf, sizeof buf, "%.3f s", static_cast<double>(ns) / 1e9);
  else if (ns >= 1'000'000) std::snprintf(buf, sizeof buf, "%.3f ms", static_cast<double>(ns) / 1e6);
  else std::snprintf(buf, sizeof buf, "%.3f us", static_cast<double>(ns) / 1e3);
  return buf;
}

// For each event, the time of the events directly nested inside it on the
// same rank and thread. `events` must be sorted by (rank, thread, start,
// longer first), as stop() leaves them.
std::vector<int64_t> childTimes(const std::vector<ProfileEvent>& events) {
  std::vector<int64_t> children(events.size(), 0);
  std::vector<size_t> open;
  for (size_t i = 0; i < events.size(); ++i) {
    const ProfileEvent& e = events[i];
    if (i > 0 && (events[i - 1].rank != e.rank || events[i - 1].threadId != e.threadId)) open.clear();
    while (!open.empty()) {
      const ProfileEvent& top = events[open.back()];
      if (top.startNs + top.durationNs <= e.startNs) open.pop_back();
      else break;
    }
    if (!open.empty()) {
      const ProfileEvent& parent = events[open.back()];
      if (e.startNs + e.durationNs <= parent.startNs + parent.durationNs) children[open.back()] += e.durationNs;
    }
    open.push_back(i);
  }
  return children;
}

struct ProcessProfile {
  std::mutex mutex;
  std::unique_ptr<Profiler> profiler;
  std::string path;
};

ProcessProfile& processProfile() {
  static ProcessProfile* instance = new ProcessProfile();  // leaked: flushed from atexit
  return *instance;
}

std::string tracePathFor(std::string path, int rank) {
  const std::string placeholder = "{rank}";
  const auto worldSize = env::getRaw("WORLD_SIZE");
  if (path.find(placeholder) == std::string::npos && worldSize && worldSize != "1" && !worldSize->empty()) {
    const size_t slash = path.rfind('/');
    const size_t dot = path.rfind('.');
    const size_t at = dot != std::string::npos && (slash == std::string::npos || dot > slash) ? dot : path.size();
    path.insert(at, ".rank" + placeholder);
  }
  for (size_t at = path.find(placeholder); at != std::string::npos; at = path.find(placeholder)) {
    path.replace(at, placeholder.size(), std::to_string(rank));
  }
  return path;
}

bool startProcessProfile() {
  const auto path = env::getRaw("DT_PROFILE");
  if (!path || path->empty()) return false;
  ProcessProfile& profile = processProfile();
  profile.path = *path;
  profile.profiler = std::make_unique<Profiler>();
  std::atexit([] { flushProcessProfile(); });
  return true;
}

// Static initialisation of this file (pulled in by every op) starts the process profile.
[[maybe_unused]] const bool kProcessProfileStarted = startProcessProfile();

}  // namespace

const char* categoryName(EventCategory category) {
  switch (category) {
    case EventCategory::Op: return "op";
    case EventCategory::Backward: return "backward";
    case EventCategory::User: return "user";
    case EventCategory::Collective: return "collective";
    case EventCategory::Ddp: return "ddp";
    case EventCategory::Sharded: return "sharded";
  }
  return "?";
}

namespace profiler {

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void recordEvent(const char* name, EventCategory category, int64_t startNs, int64_t endNs, std::string args, int rank,
                 uint64_t track, std::string trackName) {
  if (!recording()) return;
  RawEvent event;
  event.literalName = name;
  event.category = category;
  event.rank = rank >= 0 ? rank : Profiler::rank();
  event.track = track;
  event.trackName = std::move(trackName);
  event.startNs = startNs;
  event.endNs = endNs;
  event.args = std::move(args);
  append(std::move(event));
}

const char* currentOp() { return tCurrentOp; }
bool profilingMemory() { return gProfileMemory.load(std::memory_order_relaxed); }

}  // namespace profiler

// ---- scopes --------------------------------------------------------------------------------------

namespace detail {

OpScope::OpScope(const char* name, const std::vector<Tensor>& inputs) {
  if (profiler::recording()) [[unlikely]] {
    std::vector<const Tensor*> pointers;
    for (const Tensor& t : inputs) pointers.push_back(&t);
    begin(name, pointers.data(), pointers.size());
  }
}

void OpScope::begin(const char* name, const Tensor* const* inputs, size_t count) {
  name_ = name;
  outerOp_ = tCurrentOp;
  tCurrentOp = name;
  if (gRecordShapes.load(std::memory_order_relaxed)) shapes_ = formatShapes(inputs, count);
  startNs_ = profiler::nowNs();
}

void OpScope::end() {
  tCurrentOp = outerOp_;
  appendScopeEvent(name_, EventCategory::Op, startNs_, std::move(shapes_));
}

void BackwardScope::begin(const Node& node) {
  name_ = internName(node.name());
  outerOp_ = tCurrentOp;
  tCurrentOp = name_;
  startNs_ = profiler::nowNs();
}

void BackwardScope::end() {
  tCurrentOp = outerOp_;
  appendScopeEvent(name_, EventCategory::Backward, startNs_, {});
}

}  // namespace detail

RecordFunction::RecordFunction(std::string name) {
  if (profiler::recording()) [[unlikely]] {
    name_ = std::move(name);
    startNs_ = profiler::nowNs();
  }
}

RecordFunction::~RecordFunction() {
  if (startNs_ < 0) return;
  RawEvent event;
  event.endNs = profiler::nowNs();
  event.startNs = startNs_;
  event.ownedName = std::move(name_);
  event.category = EventCategory::User;
  event.rank = Profiler::rank();
  append(std::move(event));
}

// ---- Profiler -------------------------------------------------------------------------------------

struct Profiler::Session {
  int64_t startNs = 0;
};

Profiler::Profiler(ProfilerOptions options) : session_(std::make_shared<Session>()), options_(options) {
  Registry& reg = registry();
  std::lock_guard lock(reg.mutex);
  session_->startNs = profiler::nowNs();
  reg.activeStarts.push_back(session_->startNs);
  if (options_.recordShapes && reg.shapeRecorders++ == 0) gRecordShapes.store(true, std::memory_order_relaxed);
  if (options_.profileMemory && reg.memoryProfilers++ == 0) gProfileMemory.store(true, std::memory_order_relaxed);
  gRecording.store(true, std::memory_order_relaxed);
}

Profiler::~Profiler() { stop(); }

void Profiler::stop() {
  if (!session_) return;
  const int64_t startNs = session_->startNs;
  const int64_t stopNs = profiler::nowNs();
  session_.reset();
  struct Taken {
    RawEvent event;
    uint64_t threadId;
  };
  std::vector<Taken> taken;
  {
    Registry& reg = registry();
    std::lock_guard lock(reg.mutex);
    reg.activeStarts.erase(std::find(reg.activeStarts.begin(), reg.activeStarts.end(), startNs));
    if (options_.recordShapes && --reg.shapeRecorders == 0) gRecordShapes.store(false, std::memory_order_relaxed);
    if (options_.profileMemory && --reg.memoryProfilers == 0) gProfileMemory.store(false, std::memory_order_relaxed);
    const bool last = reg.activeStarts.empty();
    if (last) gRecording.store(false, std::memory_order_relaxed);
    // Events that began before every remaining profiler started are no one's any more.
    const int64_t keepFrom = last ? INT64_MAX : *std::min_element(reg.activeStarts.begin(), reg.activeStarts.end());
    for (auto& buffer : reg.buffers) {
      std::lock_guard bufferLock(buffer->mutex);
      for (const RawEvent& e : buffer->events) {
        if (e.startNs >= startNs && e.endNs <= stopNs) taken.push_back({e, buffer->threadId});
      }
      std::erase_if(buffer->events, [&](const RawEvent& e) { return e.startNs < keepFrom; });
    }
    // A buffer whose thread has ended (only the registry holds it) and that holds nothing is done.
    std::erase_if(reg.buffers, [](const std::shared_ptr<ThreadBuffer>& b) { return b.use_count() == 1 && b->events.empty(); });
  }
  events_.clear();
  events_.reserve(taken.size());
  for (Taken& t : taken) {
    ProfileEvent e;
    e.name = t.event.literalName != nullptr ? std::string(t.event.literalName) : std::move(t.event.ownedName);
    e.category = t.event.category;
    e.threadId = t.event.track != 0 ? t.event.track : t.threadId;
    e.rank = t.event.rank;
    e.startNs = t.event.startNs;
    e.durationNs = t.event.endNs - t.event.startNs;
    e.shapes = std::move(t.event.shapes);
    e.args = std::move(t.event.args);
    e.trackName = std::move(t.event.trackName);
    events_.push_back(std::move(e));
  }
  std::sort(events_.begin(), events_.end(), [](const ProfileEvent& a, const ProfileEvent& b) {
    return std::tuple(a.rank, a.threadId, a.startNs, -a.durationNs) <
           std::tuple(b.rank, b.threadId, b.startNs, -b.durationNs);
  });
}

std::vector<ProfileRow> Profiler::rows(bool groupByShapes) const {
  const std::vector<int64_t> children = childTimes(events_);
  std::map<std::tuple<std::string, EventCategory, std::string>, ProfileRow> byKey;
  for (size_t i = 0; i < events_.size(); ++i) {
    const ProfileEvent& e = events_[i];
    ProfileRow& row = byKey[{e.name, e.category, groupByShapes ? e.shapes : std::string()}];
    if (row.calls == 0) {
      row.name = e.name;
      row.category = e.category;
      if (groupByShapes) row.shapes = e.shapes;
    }
    ++row.calls;
    row.totalNs += e.durationNs;
    row.selfNs += e.durationNs - children[i];
  }
  std::vector<ProfileRow> rows;
  for (auto& [key, row] : byKey) rows.push_back(std::move(row));
  std::stable_sort(rows.begin(), rows.end(), [](const ProfileRow& a, const ProfileRow& b) { return a.selfNs > b.selfNs; });
  return rows;
}

std::string Profiler::table(const ProfileTableOptions& options) const {
  const std::vector<ProfileRow> all = rows(options.groupByShapes);
  const size_t count = options.rowLimit == 0 ? all.size() : std::min(all.size(), options.rowLimit);
  int64_t selfSum = 0;
  for (const auto& row : all) selfSum += row.selfNs;
  size_t nameWidth = 4;
  for (size_t i = 0; i < count; ++i) nameWidth = std::max(nameWidth, std::min<size_t>(all[i].name.size(), 48));
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "%-*s  %-10s %8s %14s %14s %7s %14s", static_cast<int>(nameWidth), "name", "category",
                "calls", "total", "self", "self %", "mean");
  out += line;
  if (options.groupByShapes) out += "  shapes";
  out += '\n';
  for (size_t i = 0; i < count; ++i) {
    const ProfileRow& row = all[i];
    const double share = selfSum > 0 ? 100.0 * static_cast<double>(row.selfNs) / static_cast<double>(selfSum) : 0.0;
    std::snprintf(line, sizeof line, "%-*.*s  %-10s %8lld %14s %14s %6.1f%% %14s", static_cast<int>(nameWidth),
                  static_cast<int>(nameWidth), row.name.c_str(), categoryName(row.category),
                  static_cast<long long>(row.calls), formatNs(row.totalNs).c_str(), formatNs(row.selfNs).c_str(), share,
                  formatNs(row.totalNs / row.calls).c_str());
    out += line;
    if (options.groupByShapes) out += "  " + row.shapes;
    out += '\n';
  }
  if (count < all.size()) out += str("(", all.size() - count, " more rows)\n");
  out += str("self time of all rows: ", formatNs(selfSum), ", events: ", events_.size(), "\n");
  return out;
}

std::string Profiler::chromeTrace() const {
  std::string out = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  bool first = true;
  auto add = [&](const std::string& record) {
    if (!first) out += ",\n";
    first = false;
    out += record;
  };
  char time[80];
  std::map<int, bool> ranks;
  std::map<std::pair<int, uint64_t>, std::string> tracks;
  for (const ProfileEvent& e : events_) {
    ranks[e.rank] = true;
    tracks.emplace(std::pair(e.rank, e.threadId), e.trackName.empty() ? str("thread ", e.threadId) : e.trackName);
    std::snprintf(time, sizeof time, "\"ts\": %.3f, \"dur\": %.3f", static_cast<double>(e.startNs) / 1e3,
                  static_cast<double>(e.durationNs) / 1e3);
    std::string args = e.args;
    if (!e.shapes.empty()) args = str("\"shapes\": \"", jsonEscape(e.shapes), "\"", args.empty() ? "" : ", ", args);
    add(str("{\"name\": \"", jsonEscape(e.name), "\", \"cat\": \"", categoryName(e.category), "\", \"ph\": \"X\", ",
            time, ", \"pid\": ", e.rank, ", \"tid\": ", e.threadId, ", \"args\": {", args, "}}"));
  }
  for (const auto& [rank, unused] : ranks) {
    add(str("{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": ", rank, ", \"tid\": 0, \"args\": {\"name\": \"rank ",
            rank, "\"}}"));
  }
  for (const auto& [key, name] : tracks) {
    add(str("{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": ", key.first, ", \"tid\": ", key.second,
            ", \"args\": {\"name\": \"", jsonEscape(name), "\"}}"));
  }
  out += "\n]}\n";
  return out;
}

void Profiler::writeChromeTrace(const std::string& path) const {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) throw Error(str("profiler: cannot open trace file ", path, " for writing: ", std::strerror(errno)));
  file << chromeTrace();
  if (!file.flush()) throw Error(str("profiler: writing trace file ", path, " failed: ", std::strerror(errno)));
}

void Profiler::setRank(int rank) { gRank.store(rank, std::memory_order_relaxed); }

int Profiler::rank() {
  int rank = gRank.load(std::memory_order_relaxed);
  if (rank < 0) [[unlikely]] {
    const auto fromEnv = env::getRaw("RANK");
    rank = fromEnv && !fromEnv->empty() ? static_cast<int>(env::parseInt(*fromEnv, "RANK")) : 0;
    gRank.store(rank, std::memory_order_relaxed);
  }
  return rank;
}

void flushProcessProfile() {
  ProcessProfile& profile = processProfile();
  std::lock_guard lock(profile.mutex);
  if (!profile.profiler) return;
  std::unique_ptr<Profiler> profiler = std::move(profile.profiler);
  try {
    profiler->stop();
    const std::string path = tracePathFor(profile.path, Profiler::rank());
    profiler->writeChromeTrace(path);
    std::ofstream table(path + ".txt", std::ios::trunc);
    table << profiler->table();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain: DT_PROFILE: %s\n", e.what());
  }
}

}  // namespace dt
