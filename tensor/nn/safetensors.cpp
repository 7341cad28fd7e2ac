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
#include "common/json.h"
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


namespace {

// The header JSON (padded with spaces to a multiple of 8, so the data stays 8-byte aligned)
// and the contiguous cpu tensors whose bytes follow it, in order.
std::string headerFor(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata,
                      std::vector<Tensor>& data) {
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
  while (h.size() % 8 != 0) h.push_back(' ');
  return h;
}

void lengthPrefix(uint64_t n, char out[8]) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
}

uint64_t readLengthPrefix(const unsigned char* len) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  return n;
}

// Checks the 8-byte length against the whole size (file or buffer) of `what`.
void checkHeaderLength(uint64_t n, uint64_t size, const std::string& what) {
  if (n > size - 8 || n > (100u << 20)) {
    throw InvalidArgument(str("loadSafetensors: ", what, " declares a header of ", n, " bytes but holds ", size, " bytes"));
  }
}

struct ParsedHeader {
  std::vector<SafetensorsEntry> entries;  // in data order
  std::map<std::string, std::string> metadata;
};

ParsedHeader parseHeader(const std::string& header, uint64_t dataSize, const std::string& what) {
  const json::Value root = json::parse(header, str("safetensors header of ", what));
  if (!root.isObject()) throw InvalidArgument(str("loadSafetensors: header of ", what, " is not an object"));
  ParsedHeader out;
  for (const auto& [name, v] : root.members()) {
    if (name == "__metadata__") {
      for (const auto& [k, mv] : v.members(what, name)) out.metadata[k] = mv.asString(what, k);
      continue;
    }
    const json::Value* dt = v.find("dtype");
    const json::Value* shape = v.find("shape");
    const json::Value* offs = v.find("data_offsets");
    if (!dt || !shape || !offs || !offs->isArray() || offs->items().size() != 2) {
      throw InvalidArgument(str("loadSafetensors: entry \"", name, "\" in ", what, " lacks dtype/shape/data_offsets"));
    }
    SafetensorsEntry e{name, dtypeFromSafetensors(dt->asString(what, "dtype")), {}, 0, 0};
    for (const auto& d : shape->items(what, "shape")) {
      const int64_t size = d.asInt(what, "shape");
      if (size < 0) throw InvalidArgument(str("loadSafetensors: negative dim for \"", name, "\" in ", what));
      e.shape.push_back(size);
    }
    const int64_t begin = offs->items()[0].asInt(what, "data_offsets");
    const int64_t end = offs->items()[1].asInt(what, "data_offsets");
    e.begin = static_cast<uint64_t>(std::max<int64_t>(begin, 0));
    e.end = static_cast<uint64_t>(std::max<int64_t>(end, 0));
    const uint64_t want = static_cast<uint64_t>(shapeNumel(e.shape)) * itemSize(e.dtype);
    if (begin < 0 || e.end < e.begin || e.end > dataSize || e.end - e.begin != want) {
      throw InvalidArgument(str("loadSafetensors: entry \"", name, "\" in ", what, " has data_offsets [", begin, ", ",
                                end, "] but ", toString(e.dtype), describeShape(e.shape), " needs ", want,
                                " bytes within a data section of ", dataSize, " bytes"));
    }
    out.entries.push_back(std::move(e));
  }
  std::sort(out.entries.begin(), out.entries.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) { return a.begin < b.begin; });
  return out;
}

}  // namespace

void saveSafetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                     const std::map<std::string, std::string>& metadata) {
  std::vector<Tensor> data;
  const std::string h = headerFor(tensors, metadata, data);
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InvalidArgument(str("saveSafetensors: cannot open ", tmp.string(), " for writing"));
    char len[8];
    lengthPrefix(h.size(), len);
    out.write(len, 8);
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

std::string encodeSafetensors(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  std::vector<Tensor> data;
  const std::string h = headerFor(tensors, metadata, data);
  size_t total = 8 + h.size();
  for (const Tensor& t : data) total += t.nbytes();
  std::string out;
  out.reserve(total);
  char len[8];
  lengthPrefix(h.size(), len);
  out.append(len, 8);
  out += h;
  for (const Tensor& t : data) out.append(static_cast<const char*>(t.dataPtr()), t.nbytes());
  return out;
}

SafetensorsFile decodeSafetensors(std::string_view bytes, const std::string& what) {
  if (bytes.size() < 8) {
    throw InvalidArgument(str("loadSafetensors: ", what, " is too short to be a safetensors file (", bytes.size(), " bytes)"));
  }
  const uint64_t n = readLengthPrefix(reinterpret_cast<const unsigned char*>(bytes.data()));
  checkHeaderLength(n, bytes.size(), what);
  const ParsedHeader header = parseHeader(std::string(bytes.substr(8, n)), bytes.size() - 8 - n, what);
  SafetensorsFile result;
  result.metadata = header.metadata;
  const char* data = bytes.data() + 8 + n;
  for (const auto& e : header.entries) {
    Tensor t = empty(e.shape, e.dtype);
    if (t.nbytes() > 0) std::memcpy(t.dataPtr(), data + e.begin, t.nbytes());
    result.tensors.emplace_back(e.name, t);
  }
  return result;
}

SafetensorsReader::SafetensorsReader(const std::filesystem::path& path) : path_(path) {
  const std::string file = path.string();
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw InvalidArgument(str("loadSafetensors: cannot open ", file, ": ", std::strerror(errno)));
  try {
    const off_t size = ::lseek(fd_, 0, SEEK_END);
    if (size < 0) throw InvalidArgument(str("loadSafetensors: cannot seek in ", file, ": ", std::strerror(errno)));
    fileBytes_ = static_cast<uint64_t>(size);
    unsigned char len[8];
    if (fileBytes_ < 8) {
      throw InvalidArgument(str("loadSafetensors: ", file, " is too short to be a safetensors file (", fileBytes_, " bytes)"));
    }
    readAt(0, len, 8);
    const uint64_t n = readLengthPrefix(len);
    checkHeaderLength(n, fileBytes_, file);
    std::string header(static_cast<size_t>(n), '\0');
    readAt(8, header.data(), n);
    dataStart_ = 8 + n;
    ParsedHeader parsed = parseHeader(header, fileBytes_ - dataStart_, file);
    entries_ = std::move(parsed.entries);
    metadata_ = std::move(parsed.metadata);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsReader::readAt(uint64_t position, void* out, uint64_t bytes) const {
  auto* dst = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t got = ::pread(fd_, dst, bytes, static_cast<off_t>(position));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      throw InvalidArgument(str("loadSafetensors: short read in ", path_.string(), " at byte ", position,
                                got < 0 ? str(": ", std::strerror(errno)) : std::string(" (end of file)")));
    }
    dst += got;
    position += static_cast<uint64_t>(got);
    bytes -= static_cast<uint64_t>(got);
  }
}

const SafetensorsEntry* SafetensorsReader::find(const std::string& name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

const SafetensorsEntry& SafetensorsReader::entry(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  if (e == nullptr) throw InvalidArgument(str("safetensors file ", path_.string(), " has no tensor \"", name, "\""));
  return *e;
}

Tensor SafetensorsReader::read(const SafetensorsEntry& e) const {
  Tensor t = empty(e.shape, e.dtype);
  if (t.nbytes() > 0) readAt(dataStart_ + e.begin, t.dataPtr(), t.nbytes());
  return t;
}

void SafetensorsReader::readElements(const SafetensorsEntry& e, int64_t offset, int64_t count, void* dst) const {
  const int64_t numel = shapeNumel(e.shape);
  if (offset < 0 || count < 0 || offset + count > numel) {
    throw InvalidArgument(str("safetensors file ", path_.string(), ": elements [", offset, ", ", offset + count,
                              ") of \"", e.name, "\" are out of its ", numel));
  }
  const uint64_t width = itemSize(e.dtype);
  if (count > 0) readAt(dataStart_ + e.begin + static_cast<uint64_t>(offset) * width, dst, static_cast<uint64_t>(count) * width);
}

SafetensorsFile loadSafetensors(const std::filesystem::path& path) {
  const SafetensorsReader reader(path);
  SafetensorsFile result;
  result.metadata = reader.metadata();
  for (const auto& e : reader.entries()) result.tensors.emplace_back(e.name, reader.read(e));
  return result;
}

}  // namespace dt
