#include "tensor/nn/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <fcntl.h>
#include <unistd.h>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "common/errors.h"
#include "common/strings.h"

namespace dt {

std::string safetensorsDType(DType dtype) {
  switch (dtype) {
    case DType::Float32: return "F32";
    case DType::Float64: return "F64";
    case DType::Float16: return "F16";
    case DType::BFloat16: return "BF16";
    case DType::Int32: return "I32";
    case DType::Int64: return "I64";
    case DType::Bool: return "BOOL";
  }
  throw InvalidArgument("safetensors: unknown dtype");
}

DType dtypeFromSafetensors(const std::string& name) {
  static const std::pair<const char*, DType> table[] = {{"F32", DType::Float32}, {"F64", DType::Float64},
                                                        {"F16", DType::Float16}, {"BF16", DType::BFloat16},
                                                        {"I32", DType::Int32},   {"I64", DType::Int64},
                                                        {"BOOL", DType::Bool}};
  for (auto& [n, t] : table) {
    if (name == n) return t;
  }
  throw InvalidArgument(str("safetensors: dtype \"", name, "\" is not supported by dtrain (F32, F64, F16, BF16, I32, I64, BOOL)"));
}

namespace {

// Minimal JSON reader for the header: objects, arrays, strings, integers.
struct Json {
  enum Kind { Object, Array, String, Number, Other } kind = Other;
  std::vector<std::pair<std::string, Json>> object;
  std::vector<Json> array;
  std::string string;
  int64_t number = 0;
  const Json* find(const std::string& key) const {
    for (auto& [k, v] : object) {
      if (k == key) return &v;
    }
    return nullptr;
  }
};

class JsonParser {
 public:
  JsonParser(const std::string& text, const std::string& file) : s_(text), file_(file) {}
  Json parse() {
    Json j = value(0);
    ws();
    if (i_ != s_.size()) fail("trailing characters after the header object");
    return j;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw InvalidArgument(str("safetensors: bad header in ", file_, " at byte ", i_, ": ", what));
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  char peek() {
    ws();
    if (i_ >= s_.size()) fail("unexpected end");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail(str("expected '", c, "'"));
    ++i_;
  }
  std::string stringValue() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c == '\\') {
        if (i_ >= s_.size()) fail("bad escape");
        char e = s_[i_++];
        switch (e) {
          case 'n': out += '\n'; break;
          case 't': out += '\t'; break;
          case 'r': out += '\r'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'u': {
            if (i_ + 4 > s_.size()) fail("bad \\u escape");
            const unsigned code = static_cast<unsigned>(std::stoul(s_.substr(i_, 4), nullptr, 16));
            i_ += 4;
            if (code < 0x80) {
              out += static_cast<char>(code);
            } else if (code < 0x800) {
              out += static_cast<char>(0xc0 | (code >> 6));
              out += static_cast<char>(0x80 | (code & 0x3f));
            } else {
              out += static_cast<char>(0xe0 | (code >> 12));
              out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
              out += static_cast<char>(0x80 | (code & 0x3f));
            }
            break;
          }
          default: out += e;
        }
      } else {
        out += c;
      }
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;
    return out;
  }
  Json value(int depth) {
    if (depth > 16) fail("nesting too deep");
    Json j;
    const char c = peek();
    if (c == '{') {
      ++i_;
      j.kind = Json::Object;
      if (peek() == '}') {
        ++i_;
        return j;
      }
      for (;;) {
        std::string k = stringValue();
        expect(':');
        j.object.emplace_back(std::move(k), value(depth + 1));
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect('}');
        return j;
      }
    }
    if (c == '[') {
      ++i_;
      j.kind = Json::Array;
      if (peek() == ']') {
        ++i_;
        return j;
      }
      for (;;) {
        j.array.push_back(value(depth + 1));
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect(']');
        return j;
      }
    }
    if (c == '"') {
      j.kind = Json::String;
      j.string = stringValue();
      return j;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      size_t start = i_;
      if (s_[i_] == '-') ++i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      if (i_ < s_.size() && (s_[i_] == '.' || s_[i_] == 'e' || s_[i_] == 'E')) fail("non-integer number");
      j.kind = Json::Number;
      try {
        j.number = std::stoll(s_.substr(start, i_ - start));
      } catch (const std::exception&) {
        fail("number out of range");
      }
      return j;
    }
    // true/false/null are not used by the format; skip the word.
    while (i_ < s_.size() && std::isalpha(static_cast<unsigned char>(s_[i_]))) ++i_;
    j.kind = Json::Other;
    return j;
  }
  const std::string& s_;
  std::string file_;
  size_t i_ = 0;
};

}  // namespace

void syncPath(const std::filesystem::path& path, const std::string& who) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InvalidArgument(str(who, ": cannot open ", path.string(), " to sync it: ", std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some file systems cannot sync a directory (EINVAL); the rename is then as durable as they allow.
  if (rc != 0 && !(err == EINVAL && std::filesystem::is_directory(path))) {
    throw InvalidArgument(str(who, ": fsync(", path.string(), ") failed: ", std::strerror(err)));
  }
}

void saveSafetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                     const std::map<std::string, std::string>& metadata) {
  std::ostringstream header;
  header << "{";
  bool first = true;
  if (!metadata.empty()) {
    header << "\"__metadata__\":{";
    bool f2 = true;
    for (auto& [k, v] : metadata) {
      header << (f2 ? "" : ",") << "\"" << jsonEscape(k) << "\":\"" << jsonEscape(v) << "\"";
      f2 = false;
    }
    header << "}";
    first = false;
  }
  uint64_t offset = 0;
  std::vector<Tensor> data;
  for (auto& [name, t] : tensors) {
    if (!t.defined()) throw InvalidArgument(str("saveSafetensors: tensor \"", name, "\" is undefined"));
    if (!t.device().isCpu()) {
      throw NotSupportedError(str("saveSafetensors: tensor \"", name, "\" is on ", t.device(), "; move it to cpu first"));
    }
    Tensor c = t.detach().contiguous();
    header << (first ? "" : ",") << "\"" << jsonEscape(name) << "\":{\"dtype\":\"" << safetensorsDType(c.dtype())
           << "\",\"shape\":[" << join(c.sizes(), ",") << "],\"data_offsets\":[" << offset << ","
           << offset + c.nbytes() << "]}";
    first = false;
    offset += c.nbytes();
    data.push_back(c);
  }
  header << "}";
  std::string h = header.str();
  while (h.size() % 8 != 0) h.push_back(' ');  // keeps the data 8-byte aligned
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InvalidArgument(str("saveSafetensors: cannot open ", tmp.string(), " for writing"));
    uint64_t n = h.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((n >> (8 * i)) & 0xff);
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(h.data(), static_cast<std::streamsize>(h.size()));
    for (const Tensor& t : data) {
      out.write(static_cast<const char*>(t.dataPtr()), static_cast<std::streamsize>(t.nbytes()));
    }
    out.flush();
    if (!out) throw InvalidArgument(str("saveSafetensors: writing ", tmp.string(), " failed"));
  }
  // The data reaches the disk before the name does: after a crash the final
  // name holds either the previous file or this one, never a torn one.
  syncPath(tmp, "saveSafetensors");
  std::filesystem::rename(tmp, path);
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  syncPath(dir, "saveSafetensors");
}

SafetensorsFile loadSafetensors(const std::filesystem::path& path) {
  const std::string file = path.string();
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument(str("loadSafetensors: cannot open ", file));
  in.seekg(0, std::ios::end);
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  unsigned char len[8];
  if (size < 8 || !in.read(reinterpret_cast<char*>(len), 8)) {
    throw InvalidArgument(str("loadSafetensors: ", file, " is too short to be a safetensors file (", size, " bytes)"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n > size - 8 || n > (100u << 20)) {
    throw InvalidArgument(str("loadSafetensors: ", file, " declares a header of ", n, " bytes but holds ", size, " bytes"));
  }
  std::string header(static_cast<size_t>(n), '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  const uint64_t dataSize = size - 8 - n;
  Json root = JsonParser(header, file).parse();
  if (root.kind != Json::Object) throw InvalidArgument(str("loadSafetensors: header of ", file, " is not an object"));
  SafetensorsFile result;
  struct Entry {
    std::string name;
    DType dtype;
    Shape shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (auto& [name, v] : root.object) {
    if (name == "__metadata__") {
      for (auto& [k, mv] : v.object) result.metadata[k] = mv.string;
      continue;
    }
    const Json* dt = v.find("dtype");
    const Json* shape = v.find("shape");
    const Json* offs = v.find("data_offsets");
    if (!dt || !shape || !offs || offs->array.size() != 2) {
      throw InvalidArgument(str("loadSafetensors: entry \"", name, "\" in ", file, " lacks dtype/shape/data_offsets"));
    }
    Entry e{name, dtypeFromSafetensors(dt->string), {}, 0, 0};
    for (auto& d : shape->array) {
      if (d.number < 0) throw InvalidArgument(str("loadSafetensors: negative dim for \"", name, "\" in ", file));
      e.shape.push_back(d.number);
    }
    e.begin = static_cast<uint64_t>(offs->array[0].number);
    e.end = static_cast<uint64_t>(offs->array[1].number);
    const uint64_t want = static_cast<uint64_t>(shapeNumel(e.shape)) * itemSize(e.dtype);
    if (e.end < e.begin || e.end > dataSize || e.end - e.begin != want) {
      throw InvalidArgument(str("loadSafetensors: entry \"", name, "\" in ", file, " has data_offsets [", e.begin, ", ",
                                e.end, "] but ", toString(e.dtype), describeShape(e.shape), " needs ", want,
                                " bytes within a data section of ", dataSize, " bytes"));
    }
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  for (auto& e : entries) {
    Tensor t = empty(e.shape, e.dtype);
    in.seekg(static_cast<std::streamoff>(8 + n + e.begin));
    if (t.nbytes() > 0 && !in.read(static_cast<char*>(t.dataPtr()), static_cast<std::streamsize>(t.nbytes()))) {
      throw InvalidArgument(str("loadSafetensors: short read for \"", e.name, "\" in ", file));
    }
    result.tensors.emplace_back(e.name, t);
  }
  return result;
}

}  // namespace dt
