#include "store/status_records.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <unistd.h>

#include "common/strings.h"

namespace dt::status {
namespace {

// A field never carries the separators: a host name or an event's text with a tab would shift
// every field after it.
std::string field(std::string_view text) {
  std::string out(text);
  for (char& c : out) {
    if (c == '\t' || c == '\n' || c == '\r') c = ' ';
  }
  return out;
}

std::string number(double v) {
  if (std::isnan(v)) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

std::optional<double> toDouble(const std::string& text) {
  if (text.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || errno == ERANGE) return std::nullopt;
  return v;
}

std::optional<int64_t> toInt(const std::string& text) {
  if (text.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (end != text.c_str() + text.size() || errno == ERANGE) return std::nullopt;
  return v;
}

}  // namespace

std::string rankKey(int member) { return str("dt/status/rank/", member); }
std::string curveKey(int64_t n) { return str("dt/status/curve/", n); }
std::string eventKey(int64_t n) { return str("dt/status/event/", n); }

std::string encode(const RankRecord& r) {
  return str(r.timeMs, "\t", r.step, "\t", r.steps, "\t", number(r.loss), "\t", number(r.rate), "\t", field(r.unit), "\t",
             r.rssBytes, "\t", r.rank, "\t", r.world, "\t", field(r.host));
}

std::string encode(const CurvePoint& p) {
  std::string out = str(p.step, "\t", number(p.loss), "\t", number(p.rate));
  for (const auto& [name, value] : p.metrics) {
    std::string key = field(name);
    for (char& c : key) {
      if (c == '=') c = '_';
    }
    out += str("\t", key, "=", number(value));
  }
  return out;
}

std::string encode(const EventRecord& e) { return str(e.timeMs, "\t", field(e.kind), "\t", field(e.text)); }

std::optional<RankRecord> decodeRankRecord(const std::string& value) {
  const auto f = split(value, '\t');
  if (f.size() != 10) return std::nullopt;
  RankRecord r;
  const auto time = toInt(f[0]), step = toInt(f[1]), steps = toInt(f[2]), rss = toInt(f[6]), rank = toInt(f[7]),
             world = toInt(f[8]);
  const auto loss = toDouble(f[3]), rate = toDouble(f[4]);
  if (!time || !step || !steps || !rss || !rank || !world || !loss || !rate) return std::nullopt;
  r.timeMs = *time;
  r.step = *step;
  r.steps = *steps;
  r.loss = *loss;
  r.rate = *rate;
  r.unit = f[5];
  r.rssBytes = *rss;
  r.rank = static_cast<int>(*rank);
  r.world = static_cast<int>(*world);
  r.host = f[9];
  return r;
}

std::optional<CurvePoint> decodeCurvePoint(const std::string& value) {
  const auto f = split(value, '\t');
  if (f.size() < 3) return std::nullopt;
  CurvePoint p;
  const auto step = toInt(f[0]);
  const auto loss = toDouble(f[1]), rate = toDouble(f[2]);
  if (!step || !loss || !rate) return std::nullopt;
  p.step = *step;
  p.loss = *loss;
  p.rate = *rate;
  for (size_t i = 3; i < f.size(); ++i) {
    const auto eq = f[i].find('=');
    if (eq == std::string::npos) return std::nullopt;
    const auto v = toDouble(f[i].substr(eq + 1));
    if (!v) return std::nullopt;
    p.metrics.emplace_back(f[i].substr(0, eq), *v);
  }
  return p;
}

std::optional<EventRecord> decodeEvent(const std::string& value) {
  const auto first = value.find('\t');
  const auto second = first == std::string::npos ? first : value.find('\t', first + 1);
  if (second == std::string::npos) return std::nullopt;
  const auto time = toInt(value.substr(0, first));
  if (!time) return std::nullopt;
  return EventRecord{*time, value.substr(first + 1, second - first - 1), value.substr(second + 1)};
}

void postRank(Store& store, int member, const RankRecord& record) { store.set(rankKey(member), encode(record)); }

void postCurvePoint(Store& store, const CurvePoint& point) {
  const int64_t n = store.add(kCurveCount, 1);
  store.set(curveKey(n), encode(point));
}

void postEvent(Store& store, const EventRecord& event) {
  const int64_t n = store.add(kEventCount, 1);
  store.set(eventKey(n), encode(event));
}

int64_t residentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return -1;
  const long page = ::sysconf(_SC_PAGESIZE);
  return page > 0 ? resident * page : -1;
}

}  // namespace dt::status
