#include "process_group/flight_recorder.h"

#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <set>

#include "common/env.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"

namespace dt {
namespace flight {
namespace {

constexpr size_t kMaxDims = 6;
constexpr size_t kContextWords = FlightContext::kBytes / 8;
constexpr size_t kPreciseAboveBytes = size_t{1} << 20;

enum class Kind : uint8_t { Collective = 0, P2P = 1 };

// Every field is an atomic written with relaxed stores (plain moves on x86): a dump reads a
// slot while its op may still update it, and the sequence counter around each write tells
// the reader whether what it copied is whole.
struct Slot {
  std::atomic<uint64_t> version{0};  // odd while a write is under way
  std::atomic<uint64_t> id{0};
  std::atomic<const std::string*> group{nullptr};
  std::atomic<const char*> op{nullptr};
  std::atomic<uint64_t> seq{0};
  std::atomic<int32_t> instance{0};
  std::atomic<int32_t> rank{0};
  std::atomic<int32_t> size{0};
  std::atomic<int32_t> tid{0};
  std::atomic<int32_t> peer{-1};  // a collective's root or a p2p op's peer; -1 none
  std::atomic<int32_t> tensors{0};
  std::atomic<uint8_t> kind{0};
  std::atomic<uint8_t> state{0};
  std::atomic<uint8_t> ndim{0};
  std::atomic<int8_t> dtype{-1};
  std::atomic<int8_t> reduceOp{-1};
  std::atomic<uint64_t> bytes{0};
  std::atomic<int64_t> issueNs{0};
  std::atomic<int64_t> startNs{0};
  std::atomic<int64_t> endNs{0};
  std::atomic<int64_t> dims[kMaxDims];
  std::atomic<uint64_t> context[kContextWords];
};

struct Ring {
  size_t capacity = 0;  // a power of two
  size_t mask = 0;
  std::unique_ptr<Slot[]> slots;
  std::atomic<uint64_t> next{0};  // ids handed out so far
  Slot& slot(uint64_t id) { return slots[(id - 1) & mask]; }
};

Ring* makeRing() {
  int64_t entries = 0;
  try {
    entries = env::getInt("DT_FLIGHT_RECORDER_ENTRIES");
  } catch (const std::exception& e) {
    logger("process_group")->warn("flight recorder off: {}", e.what());
    return nullptr;
  }
  if (entries <= 0) return nullptr;
  size_t capacity = 1;
  while (capacity < static_cast<size_t>(std::min<int64_t>(entries, int64_t{1} << 24))) capacity <<= 1;
  auto* ring = new Ring();  // never freed: threads may record while the process exits
  ring->capacity = capacity;
  ring->mask = capacity - 1;
  ring->slots.reset(new Slot[capacity]);
  return ring;
}

Ring* ring() {
  static Ring* const instance = makeRing();
  return instance;
}

thread_local char tlsContext[FlightContext::kBytes] = {};
thread_local int32_t tlsTid = 0;

int32_t threadId() {
  if (tlsTid == 0) tlsTid = static_cast<int32_t>(::syscall(SYS_gettid));
  return tlsTid;
}

// Opens a write: the counter goes odd. A counter left odd by two writers that raced on a
// reused slot is put right by the next write.
uint64_t beginWrite(Slot& s) {
  uint64_t v = s.version.load(std::memory_order_relaxed);
  v += (v & 1);
  s.version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  return v;
}

void endWrite(Slot& s, uint64_t v) { s.version.store(v + 2, std::memory_order_release); }

void storeContext(Slot& s) {
  if (tlsContext[0] == '\0') {
    s.context[0].store(0, std::memory_order_relaxed);
    return;
  }
  uint64_t words[kContextWords];
  std::memcpy(words, tlsContext, sizeof(words));
  for (size_t i = 0; i < kContextWords; ++i) s.context[i].store(words[i], std::memory_order_relaxed);
}

Slot* claim(Ring& r, uint64_t& id) {
  id = r.next.fetch_add(1, std::memory_order_relaxed) + 1;
  return &r.slot(id);
}

void fillCommon(Slot& s, uint64_t id, Kind kind, const std::string* group, int instance, int rank, int size,
                uint64_t seq, const char* op, State state, int64_t issueNs) {
  s.id.store(id, std::memory_order_relaxed);
  s.kind.store(static_cast<uint8_t>(kind), std::memory_order_relaxed);
  s.group.store(group, std::memory_order_relaxed);
  s.instance.store(instance, std::memory_order_relaxed);
  s.rank.store(rank, std::memory_order_relaxed);
  s.size.store(size, std::memory_order_relaxed);
  s.seq.store(seq, std::memory_order_relaxed);
  s.op.store(op, std::memory_order_relaxed);
  s.state.store(static_cast<uint8_t>(state), std::memory_order_relaxed);
  s.issueNs.store(issueNs, std::memory_order_relaxed);
  s.startNs.store(state == State::Running ? issueNs : 0, std::memory_order_relaxed);
  s.endNs.store(state == State::Failed || state == State::Aborted || state == State::Done ? issueNs : 0,
                std::memory_order_relaxed);
  s.tid.store(threadId(), std::memory_order_relaxed);
  storeContext(s);
}

int64_t readClock(clockid_t clock) {
  timespec ts{};
  ::clock_gettime(clock, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// ---- dumps ---------------------------------------------------------------------------------------

// What a dump copied out of one slot.
struct Record {
  uint64_t id = 0;
  Kind kind = Kind::Collective;
  const std::string* group = nullptr;
  const char* op = nullptr;
  uint64_t seq = 0;
  int32_t instance = 0, rank = 0, size = 0, tid = 0, peer = -1, tensors = 0;
  State state = State::Queued;
  uint8_t ndim = 0;
  int8_t dtype = -1, reduceOp = -1;
  uint64_t bytes = 0;
  int64_t issueNs = 0, startNs = 0, endNs = 0;
  int64_t dims[kMaxDims] = {};
  char context[FlightContext::kBytes + 1] = {};
};

bool readSlot(Slot& s, uint64_t id, Record& out) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    const uint64_t v1 = s.version.load(std::memory_order_acquire);
    if (v1 & 1) continue;
    out.id = s.id.load(std::memory_order_relaxed);
    out.kind = static_cast<Kind>(s.kind.load(std::memory_order_relaxed));
    out.group = s.group.load(std::memory_order_relaxed);
    out.op = s.op.load(std::memory_order_relaxed);
    out.seq = s.seq.load(std::memory_order_relaxed);
    out.instance = s.instance.load(std::memory_order_relaxed);
    out.rank = s.rank.load(std::memory_order_relaxed);
    out.size = s.size.load(std::memory_order_relaxed);
    out.tid = s.tid.load(std::memory_order_relaxed);
    out.peer = s.peer.load(std::memory_order_relaxed);
    out.tensors = s.tensors.load(std::memory_order_relaxed);
    out.state = static_cast<State>(s.state.load(std::memory_order_relaxed));
    out.ndim = s.ndim.load(std::memory_order_relaxed);
    out.dtype = s.dtype.load(std::memory_order_relaxed);
    out.reduceOp = s.reduceOp.load(std::memory_order_relaxed);
    out.bytes = s.bytes.load(std::memory_order_relaxed);
    out.issueNs = s.issueNs.load(std::memory_order_relaxed);
    out.startNs = s.startNs.load(std::memory_order_relaxed);
    out.endNs = s.endNs.load(std::memory_order_relaxed);
    for (size_t i = 0; i < kMaxDims; ++i) out.dims[i] = s.dims[i].load(std::memory_order_relaxed);
    uint64_t words[kContextWords];
    words[0] = s.context[0].load(std::memory_order_relaxed);
    const bool hasContext = (words[0] & 0xff) != 0;
    for (size_t i = 1; i < kContextWords; ++i)
      words[i] = hasContext ? s.context[i].load(std::memory_order_relaxed) : 0;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s.version.load(std::memory_order_relaxed) != v1) continue;
    if (out.id != id) return false;  // overwritten by a newer op
    std::memcpy(out.context, words, sizeof(words));
    out.context[FlightContext::kBytes] = '\0';
    if (out.ndim > kMaxDims) out.ndim = kMaxDims;
    return out.op != nullptr && out.group != nullptr;
  }
  return false;  // written all the while: skip it rather than wait
}

void appendEscaped(std::string& out, std::string_view text) {
  out += '"';
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

// Monotonic nanoseconds as Unix microseconds, or null for "not yet".
void appendTime(std::string& out, int64_t monoNs, int64_t offsetNs) {
  if (monoNs == 0) {
    out += "null";
    return;
  }
  out += std::to_string((monoNs + offsetNs) / 1000);
}

void appendRecord(std::string& out, const Record& r, int64_t offsetNs) {
  out += "{\"id\": " + std::to_string(r.id);
  out += ", \"group\": ";
  appendEscaped(out, *r.group);
  out +=
      str(", \"group_instance\": ", r.instance, ", \"group_rank\": ", r.rank, ", \"group_size\": ", r.size);
  out += r.kind == Kind::P2P ? ", \"kind\": \"p2p\", \"p2p_seq\": " : ", \"kind\": \"collective\", \"seq\": ";
  out += std::to_string(r.seq);
  out += ", \"op\": ";
  appendEscaped(out, r.op);
  if (r.dtype >= 0) {
    out += ", \"dtype\": ";
    appendEscaped(out, toString(static_cast<DType>(r.dtype)));
    out += ", \"shape\": [";
    for (size_t i = 0; i < r.ndim; ++i) out += (i ? ", " : "") + std::to_string(r.dims[i]);
    out += "]";
  }
  out += str(", \"tensors\": ", r.tensors, ", \"bytes\": ", r.bytes);
  if (r.reduceOp >= 0) {
    out += ", \"reduce_op\": ";
    appendEscaped(out, toString(static_cast<ReduceOp>(r.reduceOp)));
  }
  if (r.peer >= 0) out += str(r.kind == Kind::P2P ? ", \"peer\": " : ", \"root\": ", r.peer);
  out += ", \"state\": ";
  appendEscaped(out, stateName(r.state));
  out += ", \"issued_us\": ";
  appendTime(out, r.issueNs, offsetNs);
  out += ", \"started_us\": ";
  appendTime(out, r.startNs, offsetNs);
  out += ", \"ended_us\": ";
  appendTime(out, r.endNs, offsetNs);
  out += str(", \"thread\": ", r.tid, ", \"context\": ");
  appendEscaped(out, r.context);
  out += "}";
}

std::string envOr(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value && *value ? value : fallback;
}

std::mutex& dumpMutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::set<std::string>& failureDumpsWritten() {
  static auto* written = new std::set<std::string>();
  return *written;
}

bool isFailureReason(const std::string& reason) { return reason != "request" && reason != "signal"; }

std::atomic<int> signalArrived{0};
static_assert(std::atomic<int>::is_always_lock_free, "the SIGUSR2 handler needs a lock-free flag");

void onSignal(int) { signalArrived.store(1, std::memory_order_relaxed); }

std::string safeReason(const std::string& reason) {
  std::string out;
  for (const char c : reason)
    out += std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' ? c : '_';
  return out.empty() ? "request" : out;
}

std::string writeDump(const std::string& reason, const std::string& detail) {
  Ring* r = ring();
  if (r == nullptr) return "";
  const std::string dir = env::getString("DT_FLIGHT_RECORDER_DIR");
  if (dir.empty()) return "";
  std::lock_guard<std::mutex> lock(dumpMutex());
  if (isFailureReason(reason) && !failureDumpsWritten().insert(reason).second) return "";

  const int64_t monoNow = readClock(CLOCK_MONOTONIC);
  const int64_t unixNow = readClock(CLOCK_REALTIME);
  const int64_t offsetNs = unixNow - monoNow;
  const uint64_t last = r->next.load(std::memory_order_acquire);
  const uint64_t first = last > r->capacity ? last - r->capacity + 1 : 1;
  const std::string rankText = envOr("RANK", "-1");
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);

  std::string out;
  out.reserve(256 + (last - first + 1) * 400);
  out += "{\"format\": \"dtrain-flight-recorder\", \"version\": 1";
  out += ", \"rank\": " + std::to_string(std::atoi(rankText.c_str()));
  out += ", \"world_size\": " + std::to_string(std::atoi(envOr("WORLD_SIZE", "0").c_str()));
  out += ", \"pid\": " + std::to_string(::getpid());
  out += ", \"host\": ";
  appendEscaped(out, host);
  out += ", \"run_id\": ";
  appendEscaped(out, envOr("DT_RUN_ID", ""));
  out += ", \"reason\": ";
  appendEscaped(out, reason);
  out += ", \"detail\": ";
  appendEscaped(out, detail);
  out += ", \"dumped_us\": " + std::to_string(unixNow / 1000);
  out += ", \"capacity\": " + std::to_string(r->capacity);
  out += ", \"recorded\": " + std::to_string(last);
  out += ", \"entries\": [";
  Record record;
  size_t written = 0;
  for (uint64_t id = first; id <= last && last > 0; ++id) {
    if (!readSlot(r->slot(id), id, record)) continue;
    out += written++ ? ",\n  " : "\n  ";
    appendRecord(out, record, offsetNs);
  }
  out += "\n]}\n";

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string name = str("flight_rank", rankText == "-1" ? str("pid", ::getpid()) : rankText, "_",
                               safeReason(reason), ".json");
  const std::filesystem::path path = std::filesystem::path(dir) / name;
  const std::filesystem::path tmp = std::filesystem::path(dir) / str(".", name, ".", ::getpid(), ".tmp");
  {
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    file << out;
    file.close();
    if (!file) {
      logger("process_group")
          ->warn("flight recorder: cannot write {}: {}", tmp.string(), std::strerror(errno));
      std::filesystem::remove(tmp, ec);
      return "";
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    logger("process_group")
        ->warn("flight recorder: cannot rename {} to {}: {}", tmp.string(), path.string(), ec.message());
    std::filesystem::remove(tmp, ec);
    return "";
  }
  logger("process_group")
      ->log(isFailureReason(reason) ? spdlog::level::warn : spdlog::level::info,
            "flight recorder: {} ops written to {} ({})", written, path.string(), reason);
  return path.string();
}

}  // namespace

const char* stateName(State state) {
  switch (state) {
    case State::Queued:
      return "queued";
    case State::Running:
      return "running";
    case State::Done:
      return "done";
    case State::Failed:
      return "failed";
    case State::Aborted:
      return "aborted";
  }
  return "unknown";
}

bool enabled() { return ring() != nullptr; }
size_t capacity() { return ring() ? ring()->capacity : 0; }

int64_t clockNs(size_t bytes) {
  return readClock(bytes > kPreciseAboveBytes ? CLOCK_MONOTONIC : CLOCK_MONOTONIC_COARSE);
}

uint64_t recordCollective(const std::string* group, int instance, int rank, int size, uint64_t seq,
                          const char* op, const CollectiveFingerprint& fingerprint, size_t bytes, State state,
                          int64_t nowNs) {
  Ring* r = ring();
  if (r == nullptr) [[unlikely]]
    return 0;
  uint64_t id = 0;
  Slot& s = *claim(*r, id);
  const uint64_t v = beginWrite(s);
  fillCommon(s, id, Kind::Collective, group, instance, rank, size, seq, op, state, nowNs);
  const auto& tensors = fingerprint.tensors;
  s.tensors.store(static_cast<int32_t>(tensors.size()), std::memory_order_relaxed);
  if (tensors.empty()) {
    s.dtype.store(-1, std::memory_order_relaxed);
    s.ndim.store(0, std::memory_order_relaxed);
  } else {
    const TensorSignature& t = tensors[0];
    s.dtype.store(static_cast<int8_t>(t.dtype), std::memory_order_relaxed);
    const size_t n = std::min(t.sizes.size(), kMaxDims);
    s.ndim.store(static_cast<uint8_t>(n), std::memory_order_relaxed);
    for (size_t i = 0; i < n; ++i) s.dims[i].store(t.sizes[i], std::memory_order_relaxed);
  }
  s.reduceOp.store(fingerprint.reduceOp ? static_cast<int8_t>(*fingerprint.reduceOp) : int8_t{-1},
                   std::memory_order_relaxed);
  s.peer.store(fingerprint.root.value_or(-1), std::memory_order_relaxed);
  s.bytes.store(bytes, std::memory_order_relaxed);
  endWrite(s, v);
  return id;
}

uint64_t recordP2P(const std::string* group, int instance, int rank, int size, uint64_t p2pSeq,
                   const char* op, const std::vector<Tensor>& tensors, int peer) {
  Ring* r = ring();
  if (r == nullptr) [[unlikely]]
    return 0;
  size_t bytes = 0;
  for (const Tensor& t : tensors) bytes += t.defined() ? t.nbytes() : 0;
  uint64_t id = 0;
  Slot& s = *claim(*r, id);
  const uint64_t v = beginWrite(s);
  fillCommon(s, id, Kind::P2P, group, instance, rank, size, p2pSeq, op, State::Running, clockNs(bytes));
  s.tensors.store(static_cast<int32_t>(tensors.size()), std::memory_order_relaxed);
  if (tensors.empty() || !tensors[0].defined()) {
    s.dtype.store(-1, std::memory_order_relaxed);
    s.ndim.store(0, std::memory_order_relaxed);
  } else {
    const Tensor& t = tensors[0];
    s.dtype.store(static_cast<int8_t>(t.dtype()), std::memory_order_relaxed);
    const auto& sizes = t.sizes();
    const size_t n = std::min(sizes.size(), kMaxDims);
    s.ndim.store(static_cast<uint8_t>(n), std::memory_order_relaxed);
    for (size_t i = 0; i < n; ++i) s.dims[i].store(sizes[i], std::memory_order_relaxed);
  }
  s.reduceOp.store(-1, std::memory_order_relaxed);
  s.peer.store(peer, std::memory_order_relaxed);
  s.bytes.store(bytes, std::memory_order_relaxed);
  endWrite(s, v);
  return id;
}

void started(uint64_t id, int64_t nowNs) {
  if (id == 0) return;
  Slot& s = ring()->slot(id);
  if (s.id.load(std::memory_order_relaxed) != id) return;
  const uint64_t v = beginWrite(s);
  s.state.store(static_cast<uint8_t>(State::Running), std::memory_order_relaxed);
  s.startNs.store(nowNs, std::memory_order_relaxed);
  endWrite(s, v);
}

void finished(uint64_t id, State state, int64_t nowNs) {
  if (id == 0) return;
  Slot& s = ring()->slot(id);
  if (s.id.load(std::memory_order_relaxed) != id) return;
  const uint64_t v = beginWrite(s);
  s.state.store(static_cast<uint8_t>(state), std::memory_order_relaxed);
  s.endNs.store(nowNs, std::memory_order_relaxed);
  endWrite(s, v);
}

void dumpOnFailure(const std::exception_ptr& cause, const char* fallback) {
  if (!enabled()) return;
  try {
    std::string reason = fallback;
    std::string detail;
    try {
      std::rethrow_exception(cause);
    } catch (const DesyncError& e) {
      reason = "desync";
      detail = describe(e);
    } catch (const TimeoutError& e) {
      reason = "timeout";
      detail = describe(e);
    } catch (const MemberLostError& e) {
      reason = "member_loss";
      detail = describe(e);
    } catch (const std::exception& e) {
      detail = describe(e);
    } catch (...) {
      detail = "(not a std::exception)";
    }
    writeDump(reason, detail);
  } catch (const std::exception& e) {
    try {
      logger("process_group")->warn("flight recorder: dump failed: {}", e.what());
    } catch (...) {
    }
  } catch (...) {
  }
}

void installSignalHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction old {};
    if (::sigaction(SIGUSR2, nullptr, &old) != 0) return;
    if ((old.sa_flags & SA_SIGINFO) != 0 || old.sa_handler != SIG_DFL) return;  // the program's own
    struct sigaction action {};
    action.sa_handler = onSignal;
    ::sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    ::sigaction(SIGUSR2, &action, nullptr);
  });
}

void pollSignal() {
  if (signalArrived.load(std::memory_order_relaxed) == 0) return;
  if (signalArrived.exchange(0, std::memory_order_relaxed) == 0) return;
  try {
    writeDump("signal", "SIGUSR2");
  } catch (...) {
  }
}

}  // namespace flight

// ---- FlightContext -------------------------------------------------------------------------------

FlightContext::FlightContext(const char* format, ...) {
  std::memcpy(saved_, flight::tlsContext, kBytes);
  va_list args;
  va_start(args, format);
  const int n = std::vsnprintf(flight::tlsContext, kBytes, format, args);
  va_end(args);
  if (n < 0) flight::tlsContext[0] = '\0';
}

FlightContext::~FlightContext() { std::memcpy(flight::tlsContext, saved_, kBytes); }

const char* FlightContext::current() { return flight::tlsContext; }

std::string dumpFlightRecorder(const std::string& reason, const std::string& detail) {
  try {
    return flight::writeDump(reason, detail);
  } catch (const std::exception& e) {
    try {
      logger("process_group")->warn("flight recorder: dump failed: {}", e.what());
    } catch (...) {
    }
    return "";
  } catch (...) {
    return "";
  }
}

}  // namespace dt
