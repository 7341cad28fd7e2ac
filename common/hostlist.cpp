#include "common/hostlist.h"

#include <cctype>
#include <charconv>

#include "common/errors.h"
#include "common/strings.h"

namespace dt {
namespace {

struct RangeValue {
  uint64_t value;
  size_t width;  // zero padding: digits of the lower bound when it has a leading zero
};

[[noreturn]] void malformed(std::string_view expression, size_t pos, std::string_view what) {
  throw InvalidArgument(str("hostlist ", quoteBytes(expression, 200), " is malformed at position ", pos,
                            ": ", what,
                            ". Expected e.g. \"node[01-04,07],other3\" (what SLURM_JOB_NODELIST holds)"));
}

uint64_t parseNumber(std::string_view expression, std::string_view digits, size_t pos) {
  if (digits.empty()) malformed(expression, pos, "expected a number");
  for (char c : digits) {
    if (!std::isdigit(static_cast<unsigned char>(c))) malformed(expression, pos, "expected digits");
  }
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (ec != std::errc() || end != digits.data() + digits.size()) malformed(expression, pos, "number too large");
  return value;
}

std::string pad(uint64_t value, size_t width) {
  std::string text = std::to_string(value);
  if (text.size() < width) text.insert(0, width - text.size(), '0');
  return text;
}

// One bracket body "01-04,07" -> its strings, in order.
std::vector<std::string> expandRanges(std::string_view expression, std::string_view body, size_t bodyPos,
                                      size_t maxHosts) {
  std::vector<std::string> out;
  if (body.empty()) malformed(expression, bodyPos, "empty brackets");
  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    if (comma == std::string_view::npos) comma = body.size();
    const std::string_view range = body.substr(start, comma - start);
    const size_t pos = bodyPos + start;
    const size_t dash = range.find('-');
    if (dash == std::string_view::npos) {
      parseNumber(expression, range, pos);
      out.emplace_back(range);
    } else {
      const auto loText = range.substr(0, dash);
      const auto hiText = range.substr(dash + 1);
      const uint64_t lo = parseNumber(expression, loText, pos);
      const uint64_t hi = parseNumber(expression, hiText, pos + dash + 1);
      if (hi < lo) malformed(expression, pos, str("range ", range, " runs backwards"));
      if (hi - lo + 1 > maxHosts) malformed(expression, pos, str("range ", range, " has more than ", maxHosts, " hosts"));
      const size_t width = loText.size() > 1 && loText[0] == '0' ? loText.size() : 0;
      for (uint64_t v = lo; v <= hi; ++v) out.push_back(pad(v, width));
    }
    if (out.size() > maxHosts) malformed(expression, pos, str("more than ", maxHosts, " hosts"));
    if (comma == body.size()) break;
    start = comma + 1;
  }
  return out;
}

// Expands one comma-free (outside brackets) item.
void expandItem(std::string_view expression, std::string_view item, size_t itemPos, size_t maxHosts,
                std::vector<std::string>& out) {
  std::vector<std::string> partial{""};
  size_t i = 0;
  while (i < item.size()) {
    const char c = item[i];
    if (c == '[') {
      const size_t close = item.find(']', i);
      if (close == std::string_view::npos) malformed(expression, itemPos + i, "'[' without ']'");
      const auto values = expandRanges(expression, item.substr(i + 1, close - i - 1), itemPos + i + 1, maxHosts);
      if (partial.size() * values.size() > maxHosts) {
        malformed(expression, itemPos + i, str("more than ", maxHosts, " hosts"));
      }
      std::vector<std::string> next;
      next.reserve(partial.size() * values.size());
      for (const auto& prefix : partial) {
        for (const auto& v : values) next.push_back(prefix + v);
      }
      partial = std::move(next);
      i = close + 1;
    } else if (c == ']') {
      malformed(expression, itemPos + i, "']' without '['");
    } else {
      size_t end = i;
      while (end < item.size() && item[end] != '[' && item[end] != ']') ++end;
      for (auto& p : partial) p.append(item.substr(i, end - i));
      i = end;
    }
  }
  if (out.size() + partial.size() > maxHosts) malformed(expression, itemPos, str("more than ", maxHosts, " hosts"));
  for (auto& p : partial) out.push_back(std::move(p));
}

// Splits at commas outside brackets; returns (item, position) pairs.
std::vector<std::pair<std::string_view, size_t>> splitItems(std::string_view expression) {
  std::vector<std::pair<std::string_view, size_t>> items;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= expression.size(); ++i) {
    const char c = i < expression.size() ? expression[i] : ',';
    if (c == '[') {
      if (depth > 0) malformed(expression, i, "nested '['");
      ++depth;
    } else if (c == ']') {
      if (depth == 0) malformed(expression, i, "']' without '['");
      --depth;
    } else if (c == ',' && depth == 0) {
      const auto item = expression.substr(start, i - start);
      if (item.empty()) malformed(expression, start, "empty host name");
      items.emplace_back(item, start);
      start = i + 1;
    } else if (std::isspace(static_cast<unsigned char>(c))) {
      malformed(expression, i, "whitespace inside a hostlist");
    }
  }
  if (depth != 0) malformed(expression, expression.size(), "'[' without ']'");
  return items;
}

}  // namespace

std::vector<std::string> expandHostlist(std::string_view expression, size_t maxHosts) {
  const std::string trimmed = trim(expression);
  if (trimmed.empty()) malformed(expression, 0, "empty hostlist");
  std::vector<std::string> hosts;
  for (const auto& [item, pos] : splitItems(trimmed)) expandItem(trimmed, item, pos, maxHosts, hosts);
  return hosts;
}

std::string firstHostInHostlist(std::string_view expression) {
  const std::string trimmed = trim(expression);
  if (trimmed.empty()) malformed(expression, 0, "empty hostlist");
  const auto items = splitItems(trimmed);
  // The first host takes the first value of every bracket group: the lower
  // bound of its first range, exactly as written (so zero padding is kept).
  // Every range is still validated, without expanding anything.
  const auto [item, itemPos] = items.front();
  std::string host;
  size_t i = 0;
  while (i < item.size()) {
    if (item[i] == '[') {
      const size_t close = item.find(']', i);
      const auto body = item.substr(i + 1, close - i - 1);
      if (body.empty()) malformed(trimmed, itemPos + i + 1, "empty brackets");
      size_t start = 0;
      bool first = true;
      while (true) {
        size_t comma = body.find(',', start);
        if (comma == std::string_view::npos) comma = body.size();
        const auto range = body.substr(start, comma - start);
        const size_t dash = range.find('-');
        const auto lo = range.substr(0, dash);
        const size_t pos = itemPos + i + 1 + start;
        const uint64_t loValue = parseNumber(trimmed, lo, pos);
        if (dash != std::string_view::npos &&
            parseNumber(trimmed, range.substr(dash + 1), pos + dash + 1) < loValue) {
          malformed(trimmed, pos, str("range ", range, " runs backwards"));
        }
        if (first) host.append(lo);
        first = false;
        if (comma == body.size()) break;
        start = comma + 1;
      }
      i = close + 1;
    } else {
      size_t end = i;
      while (end < item.size() && item[end] != '[') ++end;
      host.append(item.substr(i, end - i));
      i = end;
    }
  }
  return host;
}

uint16_t slurmDerivedPort(std::string_view jobId) {
  const std::string trimmed = trim(jobId);
  uint64_t id = 0;
  auto [end, ec] = std::from_chars(trimmed.data(), trimmed.data() + trimmed.size(), id);
  if (trimmed.empty() || ec != std::errc() || end != trimmed.data() + trimmed.size()) {
    throw InvalidArgument(str("SLURM_JOB_ID=", quoteBytes(jobId),
                              " is not a non-negative integer; cannot derive the rendezvous port from it "
                              "(set MASTER_PORT to choose one)"));
  }
  return static_cast<uint16_t>(20000 + id % 10000);
}

}  // namespace dt
