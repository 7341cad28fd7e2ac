#include "common/strings.h"

#include <cstdio>

namespace dt {

std::string formatRanges(const std::vector<int>& values) {
  std::ostringstream out;
  size_t i = 0;
  bool first = true;
  while (i < values.size()) {
    size_t j = i;
    while (j + 1 < values.size() && values[j + 1] == values[j] + 1) ++j;
    if (!first) out << ", ";
    first = false;
    if (j == i) {
      out << values[i];
    } else {
      out << values[i] << "-" << values[j];
    }
    i = j + 1;
  }
  return out.str();
}

std::string formatDuration(std::chrono::milliseconds duration) {
  const auto ms = duration.count();
  if (ms < 10000 || ms % 1000 != 0) return str(ms, " ms");
  const auto seconds = ms / 1000;
  if (seconds % 60 != 0 || seconds < 600) return str(seconds, " s");
  return str(seconds / 60, " min");
}

std::string jsonEscape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out;
}

std::string quoteBytes(std::string_view bytes, size_t maxChars) {
  std::string out = "\"";
  size_t shown = 0;
  for (char c : bytes) {
    if (shown >= maxChars) {
      out += "...";
      break;
    }
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f && c != '"' && c != '\\') {
      out += c;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", u);
      out += buf;
    }
    ++shown;
  }
  out += "\"";
  if (shown < bytes.size()) out += str(" (", bytes.size(), " bytes)");
  return out;
}

std::vector<std::string> split(std::string_view text, char separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(separator, start);
    parts.emplace_back(text.substr(start, end == std::string_view::npos ? text.npos : end - start));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return parts;
}

std::string trim(std::string_view text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return {};
  const auto last = text.find_last_not_of(" \t\r\n");
  return std::string(text.substr(first, last - first + 1));
}

std::string safeNameComponent(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-';
    out.push_back(ok ? c : '_');
  }
  return out.empty() ? std::string("_") : out;
}

}  // namespace dt
