#include "debug/flight_analysis.h"

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "common/errors.h"
#include "common/json.h"
#include "common/strings.h"

namespace dt::debug {
namespace {

std::optional<int64_t> optionalInt(const json::Value& object, std::string_view key, const std::string& what) {
  const json::Value* v = object.find(key);
  if (v == nullptr || v->isNull()) return std::nullopt;
  return v->asInt(what, key);
}

std::string optionalString(const json::Value& object, std::string_view key, const std::string& what) {
  const json::Value* v = object.find(key);
  return v == nullptr || v->isNull() ? std::string() : v->asString(what, key);
}

FlightEntry parseEntry(const json::Value& e, const std::string& what) {
  FlightEntry out;
  out.id = static_cast<uint64_t>(e.get("id", what).asInt(what, "id"));
  out.group = e.get("group", what).asString(what, "group");
  out.instance = static_cast<int>(optionalInt(e, "group_instance", what).value_or(0));
  out.groupRank = static_cast<int>(e.get("group_rank", what).asInt(what, "group_rank"));
  out.groupSize = static_cast<int>(e.get("group_size", what).asInt(what, "group_size"));
  const std::string kind = e.get("kind", what).asString(what, "kind");
  if (kind != "collective" && kind != "p2p") {
    throw InvalidArgument(str(what, ": \"kind\" is \"", kind, "\", not \"collective\" or \"p2p\""));
  }
  out.p2p = kind == "p2p";
  const char* seqKey = out.p2p ? "p2p_seq" : "seq";
  out.seq = static_cast<uint64_t>(e.get(seqKey, what).asInt(what, seqKey));
  out.op = e.get("op", what).asString(what, "op");
  out.dtype = optionalString(e, "dtype", what);
  if (const json::Value* shape = e.find("shape")) {
    for (const auto& d : shape->items(what, "shape")) out.shape.push_back(d.asInt(what, "shape"));
  }
  out.tensors = static_cast<int>(optionalInt(e, "tensors", what).value_or(0));
  out.bytes = static_cast<uint64_t>(optionalInt(e, "bytes", what).value_or(0));
  out.reduceOp = optionalString(e, "reduce_op", what);
  out.peer = static_cast<int>(optionalInt(e, out.p2p ? "peer" : "root", what).value_or(-1));
  out.state = e.get("state", what).asString(what, "state");
  out.issuedUs = optionalInt(e, "issued_us", what);
  out.startedUs = optionalInt(e, "started_us", what);
  out.endedUs = optionalInt(e, "ended_us", what);
  out.thread = static_cast<int>(optionalInt(e, "thread", what).value_or(0));
  out.context = optionalString(e, "context", what);
  return out;
}

std::string rankList(const std::vector<int>& ranks) {
  if (ranks.size() == 1) return str("rank ", ranks[0]);
  if (ranks.size() == 2) return str("ranks ", ranks[0], " and ", ranks[1]);
  return str("ranks ", formatRanges(ranks));
}

// "08:15:02.123" (UTC): the dumps of one job share a day, and the summary above gives the date.
std::string clockTime(int64_t unixUs) {
  const std::time_t seconds = static_cast<std::time_t>(unixUs / 1000000);
  std::tm tm{};
  gmtime_r(&seconds, &tm);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%03d", tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>((unixUs / 1000) % 1000));
  return buf;
}

std::string seconds(int64_t us) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f s", static_cast<double>(us) / 1e6);
  return buf;
}

std::string firstLine(const std::string& text, size_t maxChars) {
  std::string line = text.substr(0, text.find('\n'));
  if (line.size() > maxChars) line = line.substr(0, maxChars) + "...";
  return line;
}

// An op as its rank's dump saw it: state and times, relative to the dump.
std::string stateText(const FlightEntry& e, int64_t dumpedUs) {
  if (e.state == "running" && e.startedUs) {
    return str("running since ", clockTime(*e.startedUs), " (", seconds(dumpedUs - *e.startedUs),
               " before its dump)");
  }
  if (e.state == "queued" && e.issuedUs) {
    return str("queued since ", clockTime(*e.issuedUs), " (", seconds(dumpedUs - *e.issuedUs),
               " before its dump)");
  }
  if ((e.state == "failed" || e.state == "aborted") && e.endedUs && e.issuedUs) {
    return str(e.state, " at ", clockTime(*e.endedUs), ", ", seconds(*e.endedUs - *e.issuedUs),
               " after issue");
  }
  if (e.state == "done" && e.endedUs) return str("done at ", clockTime(*e.endedUs));
  return e.state;
}

std::string withContext(const FlightEntry& e) {
  std::string text = e.describe();
  if (e.group != "default") text += str(" in group ", e.group);
  if (!e.context.empty()) text += str(" [", e.context, "]");
  return text;
}

// One rank's collectives of one group (one creation of its name), by sequence number.
struct Member {
  const FlightDump* dump = nullptr;
  int groupRank = -1;
  int groupSize = 0;
  std::map<uint64_t, const FlightEntry*> bySeq;
  uint64_t lowest = 0;  // the oldest seq the ring still holds
};

std::string rankName(const Member& m, const std::string& group) {
  if (group == "default" || m.dump->rank < 0 || m.dump->rank == m.groupRank) return str(m.groupRank);
  return str(m.groupRank, " (global ", m.dump->rank, ")");
}

// The op a rank was in at its dump: its newest running op, else its newest queued one.
const FlightEntry* inFlight(const FlightDump& d) {
  for (const char* state : {"running", "queued"}) {
    for (auto it = d.entries.rbegin(); it != d.entries.rend(); ++it) {
      if (it->state == state) return &*it;
    }
  }
  return nullptr;
}

// The newest completed collective of the group (by sequence number: entries of one group may
// come from two queues, the hierarchical backend's and its Gloo backend's).
const FlightEntry* lastCompleted(const Member& m) {
  for (auto it = m.bySeq.rbegin(); it != m.bySeq.rend(); ++it) {
    if (it->second->state == "done") return it->second;
  }
  return nullptr;
}

void analyzeGroup(const std::string& group, int instance, const std::vector<const FlightDump*>& dumps,
                  std::string& out) {
  std::map<int, Member> members;  // by group rank
  int groupSize = 0;
  for (const FlightDump* d : dumps) {
    Member m;
    m.dump = d;
    for (const auto& e : d->entries) {
      if (e.group != group || e.instance != instance || e.p2p) continue;
      m.bySeq[e.seq] = &e;
      m.groupRank = e.groupRank;
      m.groupSize = e.groupSize;
    }
    if (m.bySeq.empty()) continue;
    m.lowest = d->recorded > d->capacity ? m.bySeq.begin()->first : 1;
    groupSize = std::max(groupSize, m.groupSize);
    members[m.groupRank] = std::move(m);
  }
  if (members.empty()) return;
  std::vector<int> missing;
  for (int r = 0; r < groupSize; ++r) {
    if (!members.count(r)) missing.push_back(r);
  }
  uint64_t lo = 1, hi = 0;
  for (const auto& [r, m] : members) {
    lo = std::max(lo, m.lowest);
    hi = std::max(hi, m.bySeq.rbegin()->first);
  }
  auto at = [](const Member& m, uint64_t seq) -> const FlightEntry* {
    auto it = m.bySeq.find(seq);
    return it == m.bySeq.end() ? nullptr : it->second;
  };
  // The first number the ranks issued differently (or some did not issue), and the first one
  // some rank did not finish.
  std::optional<uint64_t> differ, unfinished;
  for (uint64_t s = lo; s <= hi && !(differ && unfinished); ++s) {
    std::set<std::string> signatures;
    bool absent = false, open = false;
    for (const auto& [r, m] : members) {
      const FlightEntry* e = at(m, s);
      if (!e) {
        absent = true;
        open = true;
        continue;
      }
      signatures.insert(e->signature());
      open |= e->state != "done";
    }
    if (!differ && (absent || signatures.size() > 1)) differ = s;
    if (!unfinished && open) unfinished = s;
  }

  out += str(
      "group ", group, instance > 0 ? str(" (made again: creation ", instance + 1, ")") : std::string(), " (",
      groupSize, " rank", groupSize == 1 ? "" : "s", ", collectives #", lo, "-#", hi, " in the dumps):\n");
  if (!missing.empty()) {
    out += str("  ", rankList(missing), " of the group left no dump: ", missing.size() == 1 ? "its" : "their",
               " side is unknown (killed, frozen, or never got to write one)\n");
  }
  const std::optional<uint64_t> focus = differ ? differ : unfinished;
  if (!focus) {
    out += str("  every rank with a dump issued and completed #", lo, "-#", hi, " alike\n");
  } else {
    const uint64_t s = *focus;
    out += differ ? str("  first difference at #", s, ":\n")
                  : str("  the ranks agree on every op; #", s, " is the first not completed everywhere:\n");
    std::map<std::string, std::vector<int>> bySignature;
    std::map<std::string, const FlightEntry*> example;
    std::vector<int> notIssued;
    for (const auto& [r, m] : members) {
      if (const FlightEntry* e = at(m, s)) {
        bySignature[e->describe()].push_back(r);
        example[e->describe()] = e;
      } else {
        notIssued.push_back(r);
      }
    }
    for (const auto& [description, ranks] : bySignature) {
      out += str("    ", rankList(ranks), " issued ", description, "\n");
    }
    for (int r : notIssued) {
      const Member& m = members.at(r);
      const FlightEntry* lastIssued = m.bySeq.empty() ? nullptr : m.bySeq.rbegin()->second;
      out += str("    rank ", rankName(m, group), " never issued #", s);
      if (lastIssued && lastIssued->seq < s) {
        out += str(" (its last issued: ", withContext(*lastIssued), ", ",
                   stateText(*lastIssued, m.dump->dumpedUs), ")");
      }
      out += "\n";
    }
    std::vector<int> notFinished;
    for (const auto& [r, m] : members) {
      const FlightEntry* e = at(m, s);
      if (!e || e->state != "done") notFinished.push_back(r);
    }
    for (int r : missing) notFinished.push_back(r);
    std::sort(notFinished.begin(), notFinished.end());
    if (!notFinished.empty()) {
      out += str("  #", s, " never finished on ", rankList(notFinished), ":\n");
      for (int r : notFinished) {
        auto it = members.find(r);
        if (it == members.end()) {
          out += str("    rank ", r, ": no dump\n");
          continue;
        }
        const Member& m = it->second;
        const FlightEntry* e = at(m, s);
        std::string line = str("    rank ", rankName(m, group), ": ");
        if (e)
          line += str("#", s, " ", stateText(*e, m.dump->dumpedUs));
        else
          line += str("#", s, " not issued");
        const FlightEntry* busy = inFlight(*m.dump);
        if (busy && busy != e) {
          line += str("; doing instead: ", withContext(*busy), ", ", stateText(*busy, m.dump->dumpedUs));
        } else if (!busy && !e) {
          line += "; nothing in flight at its dump";
        }
        out += line + "\n";
      }
    }
  }
  out += "  last completed:";
  bool firstRank = true;
  for (const auto& [r, m] : members) {
    const FlightEntry* done = lastCompleted(m);
    out += str(
        firstRank ? " " : "; ", "rank ", rankName(m, group), " ",
        done ? str(withContext(*done), " at ", clockTime(done->endedUs.value_or(0))) : std::string("none"));
    firstRank = false;
  }
  out += "\n";
}

}  // namespace

std::string FlightEntry::describe() const {
  std::string args;
  if (!dtype.empty()) {
    args = str(dtype, "[", join(shape, ","), "]");
    if (tensors > 1) args += str(" x", tensors);
  }
  if (!reduceOp.empty()) args += str(args.empty() ? "" : ", ", reduceOp);
  if (!p2p && peer >= 0) args += str(args.empty() ? "" : ", ", "root ", peer);
  if (p2p) {
    const char* dir = op == "recv" ? " from rank " : " to rank ";
    return str(op, " p2p#", seq, peer >= 0 ? str(dir, peer) : std::string(), args.empty() ? "" : " (", args,
               args.empty() ? "" : ")");
  }
  return str(op, " #", seq, " (", args, ")");
}

std::string FlightEntry::signature() const {
  const bool sizesMayDiffer = op == "allToAll" || op == "allToAllSingle";
  return str(op, "|", dtype, "|", sizesMayDiffer ? std::string() : join(shape, ","), "|", tensors, "|",
             reduceOp, "|", peer);
}

FlightDump parseFlightDump(const std::string& text, const std::string& path) {
  const std::string what = str("flight recorder dump ", path);
  const json::Value doc = json::parse(text, what);
  if (!doc.isObject())
    throw InvalidArgument(str(what, " is ", json::kindName(doc.kind()), ", not an object"));
  const std::string format = optionalString(doc, "format", what);
  if (format != "dtrain-flight-recorder") {
    throw InvalidArgument(str(what, ": \"format\" is \"", format, "\", not \"dtrain-flight-recorder\""));
  }
  FlightDump d;
  d.path = path;
  d.rank = static_cast<int>(doc.get("rank", what).asInt(what, "rank"));
  d.worldSize = static_cast<int>(optionalInt(doc, "world_size", what).value_or(0));
  d.pid = static_cast<int>(optionalInt(doc, "pid", what).value_or(0));
  d.host = optionalString(doc, "host", what);
  d.runId = optionalString(doc, "run_id", what);
  d.reason = doc.get("reason", what).asString(what, "reason");
  d.detail = optionalString(doc, "detail", what);
  d.dumpedUs = doc.get("dumped_us", what).asInt(what, "dumped_us");
  d.capacity = static_cast<uint64_t>(optionalInt(doc, "capacity", what).value_or(0));
  d.recorded = static_cast<uint64_t>(optionalInt(doc, "recorded", what).value_or(0));
  for (const auto& e : doc.get("entries", what).items(what, "entries"))
    d.entries.push_back(parseEntry(e, what));
  return d;
}

std::vector<FlightDump> readFlightDumps(const std::string& dir, const std::string& runId,
                                        std::vector<std::string>* problems) {
  std::vector<FlightDump> out;
  std::error_code ec;
  std::vector<std::filesystem::path> paths;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("flight_rank") && name.ends_with(".json")) paths.push_back(entry.path());
  }
  if (ec && problems) problems->push_back(str("cannot list ", dir, ": ", ec.message()));
  std::sort(paths.begin(), paths.end());
  for (const auto& path : paths) {
    try {
      std::ifstream file(path, std::ios::binary);
      std::stringstream text;
      text << file.rdbuf();
      if (!file) throw InvalidArgument(str("cannot read ", path.string()));
      FlightDump d = parseFlightDump(text.str(), path.string());
      if (!runId.empty() && d.runId != runId) continue;
      out.push_back(std::move(d));
    } catch (const std::exception& e) {
      if (problems) problems->push_back(e.what());
    }
  }
  return out;
}

bool hasFlightDumps(const std::string& dir, const std::string& runId) {
  if (runId.empty()) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.starts_with("flight_rank") && name.ends_with(".json")) return true;
    }
    return false;
  }
  return !readFlightDumps(dir, runId, nullptr).empty();
}

std::string analyzeFlightDumps(const std::vector<FlightDump>& all) {
  // The latest dump of each rank (of each process where the rank is unknown).
  std::map<std::pair<int, int>, const FlightDump*> latest;
  int world = 0;
  for (const auto& d : all) {
    const auto key = std::make_pair(d.rank, d.rank < 0 ? d.pid : 0);
    auto& slot = latest[key];
    if (!slot || d.dumpedUs > slot->dumpedUs) slot = &d;
    world = std::max({world, d.worldSize, d.rank + 1});
  }
  std::string out;
  if (latest.empty()) return "flight recorder: no dumps\n";
  std::vector<const FlightDump*> dumps;
  std::vector<int> ranks;
  for (const auto& [key, d] : latest) {
    dumps.push_back(d);
    if (d->rank >= 0) ranks.push_back(d->rank);
  }
  std::vector<int> silent;
  for (int r = 0; r < world; ++r) {
    if (!std::binary_search(ranks.begin(), ranks.end(), r)) silent.push_back(r);
  }
  out += str("flight recorder: dumps of ", rankList(ranks), " (world ", world, ")");
  if (!silent.empty())
    out += str("; ", rankList(silent), " left none (killed, frozen, or never got to write one)");
  out += "\n";
  // Every dump a rank wrote, oldest first: a failure's dump says why, a later one on request
  // (dtrun's SIGUSR2) holds the most history.
  std::vector<const FlightDump*> everyDump;
  for (const auto& d : all) everyDump.push_back(&d);
  std::sort(everyDump.begin(), everyDump.end(), [](const FlightDump* a, const FlightDump* b) {
    return std::make_tuple(a->rank, a->pid, a->dumpedUs) < std::make_tuple(b->rank, b->pid, b->dumpedUs);
  });
  for (const FlightDump* d : everyDump) {
    out += str("  rank ", d->rank, " (", d->host, ", pid ", d->pid, "): ", d->reason, " dump at ",
               clockTime(d->dumpedUs));
    if (!d->detail.empty()) out += str(": ", firstLine(d->detail, 240));
    out += "\n";
  }
  std::set<std::pair<std::string, int>> seen;
  std::vector<std::pair<std::string, int>> groups;
  for (const FlightDump* d : dumps) {
    for (const auto& e : d->entries) {
      if (!e.p2p && seen.emplace(e.group, e.instance).second) groups.emplace_back(e.group, e.instance);
    }
  }
  // The default group first, then by name; creations of one name in order.
  std::sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) {
    const bool aDefault = a.first == "default", bDefault = b.first == "default";
    return aDefault != bDefault ? aDefault : a < b;
  });
  for (const auto& [name, instance] : groups) analyzeGroup(name, instance, dumps, out);
  // Point-to-point ops have no common numbering across ranks; what each rank had in flight says enough.
  for (const FlightDump* d : dumps) {
    const FlightEntry* busy = inFlight(*d);
    if (busy && busy->p2p) {
      out += str("rank ", d->rank, " was in ", withContext(*busy), ", ", stateText(*busy, d->dumpedUs), "\n");
    }
  }
  return out;
}

}  // namespace dt::debug
