// Small string helpers used to build one-line error and log messages.
// Pure functions; thread-safe.
#pragma once

#include <chrono>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace dt {

// Concatenates anything that has operator<< into one string.
template <typename... Args>
std::string str(const Args&... args) {
  if constexpr (sizeof...(Args) == 0) {
    return {};
  } else {
    std::ostringstream out;
    (out << ... << args);
    return out.str();
  }
}

// "a, b, c" (or with another separator) from any range of streamable items.
template <typename Range>
std::string join(const Range& items, std::string_view separator = ", ") {
  std::ostringstream out;
  bool first = true;
  for (const auto& item : items) {
    if (!first) out << separator;
    out << item;
    first = false;
  }
  return out.str();
}

// Compresses a sorted list of integers into "0-3, 5, 7-8": how rank lists
// are printed in errors.
std::string formatRanges(const std::vector<int>& sortedValues);

// "1500 ms", "30 s", "10 min" - for timeouts in messages.
std::string formatDuration(std::chrono::milliseconds duration);

// Quotes and escapes a possibly binary string for a log line, truncated to
// maxChars ("\"abc\\x00...\" (40 bytes)").
std::string quoteBytes(std::string_view bytes, size_t maxChars = 64);

// `text` escaped for the inside of a JSON string (quotes, backslashes and
// control characters); UTF-8 passes through unchanged.
std::string jsonEscape(std::string_view text);

std::vector<std::string> split(std::string_view text, char separator);
std::string trim(std::string_view text);

// `text` with every character outside [A-Za-z0-9._-] replaced by '_' (and
// "_" for empty text): safe inside file and shared-memory object names.
std::string safeNameComponent(std::string_view text);

}  // namespace dt
