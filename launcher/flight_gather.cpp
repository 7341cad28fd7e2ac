#include "launcher/flight_gather.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "common/errors.h"
#include "common/strings.h"

namespace dt::launcher {
namespace {

namespace fs = std::filesystem;

bool isDumpName(const std::string& name) {
  return name.starts_with("flight_rank") && name.ends_with(".json") && name.find('/') == std::string::npos &&
         name.find("..") == std::string::npos;
}

}  // namespace

PackedFlightFiles packFlightFiles(const std::string& dir, size_t maxBytes) {
  PackedFlightFiles out;
  std::vector<std::pair<uintmax_t, fs::path>> files;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code sizeError;
    const uintmax_t size = it->file_size(sizeError);
    if (isDumpName(name) && it->is_regular_file(sizeError) && !sizeError) files.emplace_back(size, it->path());
  }
  // Smallest first: when the budget runs out, as many ranks' stories as fit still travel.
  std::sort(files.begin(), files.end());
  for (const auto& [size, path] : files) {
    std::ifstream in(path, std::ios::binary);
    if (!in) continue;  // vanished or unreadable: nothing to send
    std::stringstream contents;
    contents << in.rdbuf();
    const std::string text = contents.str();
    const std::string header = str(path.filename().string(), "\n", text.size(), "\n");
    if (out.bytes.size() + header.size() + text.size() > maxBytes) {
      ++out.leftOut;
      continue;
    }
    out.bytes += header;
    out.bytes += text;
    ++out.files;
  }
  return out;
}

int unpackFlightFiles(const std::string& packed, const std::string& dir, const std::string& from) {
  int written = 0;
  size_t at = 0;
  const auto line = [&](const char* what) {
    const size_t end = packed.find('\n', at);
    if (end == std::string::npos) {
      throw InvalidArgument(str("flight records from ", from, ": no ", what, " at byte ", at, " of ", packed.size()));
    }
    std::string text = packed.substr(at, end - at);
    at = end + 1;
    return text;
  };
  std::error_code ec;
  fs::create_directories(dir, ec);
  while (at < packed.size()) {
    const std::string name = line("file name");
    const std::string sizeText = line("size");
    size_t size = 0;
    try {
      size = std::stoull(sizeText);
    } catch (const std::exception&) {
      throw InvalidArgument(str("flight records from ", from, ": size \"", sizeText, "\" of ", name, " is not a number"));
    }
    if (!isDumpName(name) || size > packed.size() - at) {
      throw InvalidArgument(str("flight records from ", from, ": entry \"", name, "\" of ", size, " bytes at byte ", at,
                                " does not fit the ", packed.size(), " received"));
    }
    const fs::path path = fs::path(dir) / name;
    if (!fs::exists(path, ec)) {
      // Through a temporary name: a reader of the folder never sees half a dump.
      const fs::path tmp = fs::path(dir) / str(".", name, ".gathered.tmp");
      std::ofstream(tmp, std::ios::binary | std::ios::trunc).write(packed.data() + at, static_cast<std::streamsize>(size));
      fs::rename(tmp, path, ec);
      if (!ec) ++written;
    }
    at += size;
  }
  return written;
}

}  // namespace dt::launcher
