#include "examples/checkpoint.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <functional>
#include <regex>
#include <zlib.h>

#include "common/errors.h"
#include "common/strings.h"

namespace trainer {
namespace {

using dt::InvalidArgument;
using dt::str;
namespace fs = std::filesystem;

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

std::string stepName(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

// Writes bytes to path via path.tmp + fsync + rename.
void writeFileAtomically(const fs::path& path, const std::string& bytes) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InvalidArgument(str("checkpoint: cannot create ", tmp.string(), ": ", std::strerror(errno)));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) throw InvalidArgument(str("checkpoint: writing ", tmp.string(), " failed (disk full?)"));
  }
  dt::syncPath(tmp, "checkpoint");
  fs::rename(tmp, path);
}

class FlatJsonParser {
 public:
  FlatJsonParser(const std::string& text, const std::string& file) : s_(text), file_(file) {}

  void parse(const std::function<void(const std::string&, const std::string&, bool)>& field) {
    expect('{');
    if (peek() == '}') {
      ++i_;
    } else {
      for (;;) {
        const std::string key = string();
        expect(':');
        if (peek() == '"') {
          field(key, string(), true);
        } else {
          field(key, literal(), false);
        }
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect('}');
        break;
      }
    }
    ws();
    if (i_ != s_.size()) fail("text after the closing brace");
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw InvalidArgument(str("checkpoint manifest ", file_, " is corrupt at byte ", i_, ": ", what,
                              " (a flat JSON object was expected)"));
  }
  void ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  char peek() {
    ws();
    if (i_ >= s_.size()) fail("unexpected end of file");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail(str("expected '", c, "'"));
    ++i_;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c == '\\') {
        if (i_ >= s_.size()) fail("unterminated escape");
        const char e = s_[i_++];
        if (e == 'n') {
          out += '\n';
        } else if (e == 't') {
          out += '\t';
        } else if (e == 'u') {
          if (i_ + 4 > s_.size()) fail("short \\u escape");
          out += static_cast<char>(std::strtol(s_.substr(i_, 4).c_str(), nullptr, 16));
          i_ += 4;
        } else {
          out += e;
        }
      } else if (static_cast<unsigned char>(c) < 0x20) {
        fail("control character in a string");
      } else {
        out += c;
      }
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;
    return out;
  }
  std::string literal() {
    const size_t start = i_;
    while (i_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[i_])) || s_[i_] == '-' || s_[i_] == '+' ||
                              s_[i_] == '.')) {
      ++i_;
    }
    if (i_ == start) fail("expected a value");
    return s_.substr(start, i_ - start);
  }
  const std::string& s_;
  std::string file_;
  size_t i_ = 0;
};

}  // namespace

std::string Manifest::text(const std::string& key) const {
  if (auto it = strings_.find(key); it != strings_.end()) return it->second;
  if (auto it = numbers_.find(key); it != numbers_.end()) return it->second;
  throw InvalidArgument(str("checkpoint manifest ", file.empty() ? "(in memory)" : file, " has no \"", key, "\""));
}

int64_t Manifest::integer(const std::string& key) const {
  const std::string t = text(key);
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), value);
  if (ec != std::errc() || end != t.data() + t.size()) {
    throw InvalidArgument(str("checkpoint manifest ", file, ": \"", key, "\" is \"", t, "\", not an integer"));
  }
  return value;
}

std::string Manifest::toJson() const {
  std::map<std::string, std::string> all;  // sorted keys, one per line
  for (auto& [k, v] : strings_) all[k] = str("\"", escape(v), "\"");
  for (auto& [k, v] : numbers_) all[k] = v;
  std::string out = "{\n";
  size_t i = 0;
  for (auto& [k, v] : all) out += str("  \"", escape(k), "\": ", v, ++i < all.size() ? ",\n" : "\n");
  return out + "}\n";
}

Manifest Manifest::parse(const std::string& json, const std::string& file) {
  Manifest m;
  m.file = file;
  FlatJsonParser(json, file).parse([&](const std::string& k, const std::string& v, bool isString) {
    if (isString) {
      m.strings_[k] = v;
    } else {
      m.numbers_[k] = v;
    }
  });
  return m;
}

uint32_t fileCrc32(const fs::path& path, uint64_t* size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument(str("checkpoint: cannot read ", path.string(), ": ", std::strerror(errno)));
  uLong crc = crc32(0L, Z_NULL, 0);
  uint64_t total = 0;
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const auto got = in.gcount();
    if (got <= 0) break;
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buffer.data()), static_cast<uInt>(got));
    total += static_cast<uint64_t>(got);
  }
  if (in.bad()) throw InvalidArgument(str("checkpoint: reading ", path.string(), " failed"));
  if (size) *size = total;
  return static_cast<uint32_t>(crc);
}

CheckpointDir::CheckpointDir(fs::path dir, int keep) : dir_(std::move(dir)), keep_(keep) {
  if (keep_ < 1) throw InvalidArgument(str("checkpoint: keep ", keep_, " must be at least 1"));
}

CheckpointRef CheckpointDir::refFor(int64_t step) const {
  const std::string name = stepName(step);
  return {step, dir_ / (name + ".json"), dir_ / (name + ".safetensors")};
}

std::vector<CheckpointRef> CheckpointDir::list() const {
  std::vector<CheckpointRef> out;
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) return out;
  static const std::regex pattern(R"(step-(\d{8,})\.json)");
  for (const auto& entry : fs::directory_iterator(dir_)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, m, pattern)) out.push_back(refFor(std::stoll(m[1].str())));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointRef& a, const CheckpointRef& b) { return a.step < b.step; });
  return out;
}

std::optional<CheckpointRef> CheckpointDir::latest() const {
  auto all = list();
  if (all.empty()) return std::nullopt;
  return all.back();
}

CheckpointRef CheckpointDir::write(int64_t step, const dt::NamedTensors& tensors, Manifest manifest) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw InvalidArgument(str("checkpoint: cannot create the folder ", dir_.string(), ": ", ec.message()));
  const CheckpointRef ref = refFor(step);
  dt::saveSafetensors(ref.tensors, tensors, {{"format", kFormat}, {"step", std::to_string(step)}});
  uint64_t bytes = 0;
  const uint32_t crc = fileCrc32(ref.tensors, &bytes);
  char crcText[16];
  std::snprintf(crcText, sizeof(crcText), "%08x", crc);
  manifest.set("format", kFormat);
  manifest.set("step", step);
  manifest.set("tensors_file", ref.tensors.filename().string());
  manifest.set("tensors_bytes", static_cast<int64_t>(bytes));
  manifest.set("tensors_crc32", crcText);
  writeFileAtomically(ref.manifest, manifest.toJson());
  dt::syncPath(dir_, "checkpoint");
  prune();
  return ref;
}

void CheckpointDir::prune() const {
  auto all = list();
  while (all.size() > static_cast<size_t>(keep_)) {
    // The manifest goes first: a crash in between leaves a tensors file no one reads.
    fs::remove(all.front().manifest);
    fs::remove(all.front().tensors);
    all.erase(all.begin());
  }
}

LoadedCheckpoint CheckpointDir::load(const CheckpointRef& ref) const {
  LoadedCheckpoint out;
  out.ref = ref;
  std::ifstream in(ref.manifest, std::ios::binary);
  if (!in) throw InvalidArgument(str("checkpoint manifest ", ref.manifest.string(), " cannot be read: ", std::strerror(errno)));
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  out.manifest = Manifest::parse(json, ref.manifest.string());
  const Manifest& m = out.manifest;
  if (m.text("format") != kFormat) {
    throw InvalidArgument(str("checkpoint manifest ", ref.manifest.string(), " has format \"", m.text("format"),
                              "\"; this trainer reads \"", kFormat, "\""));
  }
  if (m.integer("step") != ref.step) {
    throw InvalidArgument(str("checkpoint manifest ", ref.manifest.string(), " says step ", m.integer("step"),
                              " but its name says ", ref.step));
  }
  const fs::path tensors = dir_ / m.text("tensors_file");
  std::error_code ec;
  if (!fs::exists(tensors, ec)) {
    throw InvalidArgument(str("checkpoint ", ref.manifest.string(), " names ", tensors.string(), ", which does not exist"));
  }
  uint64_t bytes = 0;
  const uint32_t crc = fileCrc32(tensors, &bytes);
  char crcText[16];
  std::snprintf(crcText, sizeof(crcText), "%08x", crc);
  if (static_cast<int64_t>(bytes) != m.integer("tensors_bytes") || m.text("tensors_crc32") != crcText) {
    throw InvalidArgument(str("checkpoint file ", tensors.string(), " is corrupt: it has ", bytes, " bytes with CRC-32 ",
                              crcText, " but its manifest ", ref.manifest.string(), " recorded ", m.integer("tensors_bytes"),
                              " bytes with CRC-32 ", m.text("tensors_crc32"),
                              ". Remove this checkpoint's two files to resume from the one before, or start afresh with --resume never"));
  }
  out.tensors = dt::loadSafetensors(tensors).tensors;
  return out;
}

int CheckpointDir::removeTemporaries() const {
  int n = 0;
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) return 0;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("step-") && name.ends_with(".tmp")) n += fs::remove(entry.path()) ? 1 : 0;
  }
  return n;
}

int CheckpointDir::removeAll() const {
  int n = 0;
  for (const auto& ref : list()) {
    fs::remove(ref.manifest);
    fs::remove(ref.tensors);
    ++n;
  }
  // Tensors files whose manifest never got written.
  std::error_code ec;
  if (fs::is_directory(dir_, ec)) {
    static const std::regex orphan(R"(step-\d{8,}\.safetensors(\.tmp)?|step-\d{8,}\.json\.tmp)");
    for (const auto& entry : fs::directory_iterator(dir_)) {
      if (std::regex_match(entry.path().filename().string(), orphan)) fs::remove(entry.path());
    }
  }
  return n;
}

}  // namespace trainer
