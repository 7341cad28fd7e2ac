#include "data/idx.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <zlib.h>

#include "common/errors.h"
#include "common/strings.h"

namespace dt::data {
namespace {

constexpr uint8_t kUnsignedByte = 0x08;
constexpr int kMaxDims = 4;
constexpr uint64_t kMaxBytes = uint64_t{1} << 34;  // 16 GiB: far above any image set, below overflow

const char* typeName(uint8_t type) {
  switch (type) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    default: return "unknown";
  }
}

std::string hex(const uint8_t* bytes, size_t n) {
  std::string out = "0x";
  char buf[3];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(buf, sizeof(buf), "%02x", bytes[i]);
    out += buf;
  }
  return out;
}

// gzFile that closes itself; reads report zlib's own error text.
class GzReader {
 public:
  explicit GzReader(const std::filesystem::path& path) : path_(path.string()) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) throw InvalidArgument(str("IDX file ", path_, " does not exist"));
    if (std::filesystem::is_directory(path, ec)) throw InvalidArgument(str("IDX file ", path_, " is a directory"));
    file_ = gzopen(path_.c_str(), "rb");
    if (file_ == nullptr) {
      throw InvalidArgument(str("IDX file ", path_, " cannot be opened: ", errno ? std::strerror(errno) : "out of memory"));
    }
    gzbuffer(file_, 1 << 18);
  }
  ~GzReader() {
    if (file_ != nullptr) gzclose(file_);
  }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  // Reads up to n bytes; returns how many. Throws on a corrupt stream.
  size_t read(void* out, size_t n, const char* what) {
    size_t done = 0;
    auto* p = static_cast<uint8_t*>(out);
    while (done < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - done, size_t{1} << 30));
      const int got = gzread(file_, p + done, chunk);
      if (got < 0) failStream(what);
      if (got == 0) break;
      done += static_cast<size_t>(got);
    }
    // A gzip stream cut short reads as a short count plus Z_BUF_ERROR.
    int code = Z_OK;
    gzerror(file_, &code);
    if (code != Z_OK && code != Z_STREAM_END) failStream(what);
    return done;
  }

 private:
  [[noreturn]] void failStream(const char* what) {
    int code = Z_OK;
    const char* message = gzerror(file_, &code);
    if (code == Z_BUF_ERROR) {
      throw InvalidArgument(str("IDX file ", path_, " is truncated: its gzip stream ends in the middle of the ", what,
                                " (zlib: ", message ? message : "unexpected end of file", ")"));
    }
    throw InvalidArgument(str("IDX file ", path_, " is corrupt: reading the ", what, " failed (zlib: ",
                              message ? message : "unknown error", ")"));
  }

  std::string path_;
  gzFile file_ = nullptr;
};

}  // namespace

int64_t IdxArray::itemBytes() const {
  int64_t n = 1;
  for (size_t i = 1; i < dims.size(); ++i) n *= dims[i];
  return n;
}

IdxArray readIdx(const std::filesystem::path& path) {
  IdxArray out;
  out.path = path.string();
  GzReader in(path);
  uint8_t magic[4];
  const size_t got = in.read(magic, 4, "header");
  if (got < 4) {
    throw InvalidArgument(str("IDX file ", out.path, " is truncated: ", got, " of the 4 header bytes"));
  }
  if (magic[0] != 0 || magic[1] != 0) {
    throw InvalidArgument(str("IDX file ", out.path, " is not an IDX file: it starts with ", hex(magic, 4),
                              " (expected two zero bytes, the type and the dimension count, e.g. 0x00000803)"));
  }
  if (magic[2] != kUnsignedByte) {
    throw NotSupportedError(str("IDX file ", out.path, " holds element type ", hex(magic + 2, 1), " (", typeName(magic[2]),
                                "); dtrain reads unsigned-byte IDX files (type 0x08) only"));
  }
  const int ndims = magic[3];
  if (ndims < 1 || ndims > kMaxDims) {
    throw InvalidArgument(str("IDX file ", out.path, " declares ", ndims, " dimensions (header ", hex(magic, 4),
                              "); expected 1 to ", kMaxDims));
  }
  uint8_t dimBytes[4 * kMaxDims];
  const size_t dimsGot = in.read(dimBytes, 4 * static_cast<size_t>(ndims), "header");
  if (dimsGot < 4 * static_cast<size_t>(ndims)) {
    throw InvalidArgument(str("IDX file ", out.path, " is truncated: its header ends after ", 4 + dimsGot, " of ",
                              4 + 4 * ndims, " bytes"));
  }
  uint64_t total = 1;
  for (int d = 0; d < ndims; ++d) {
    const uint8_t* b = dimBytes + 4 * d;
    const uint64_t size = (uint64_t{b[0]} << 24) | (uint64_t{b[1]} << 16) | (uint64_t{b[2]} << 8) | b[3];
    out.dims.push_back(static_cast<int64_t>(size));
    total *= size;
    if (total > kMaxBytes) {
      throw InvalidArgument(str("IDX file ", out.path, " declares dimensions [", join(out.dims, ", "),
                                "...], more than ", kMaxBytes, " bytes"));
    }
  }
  out.data.resize(total);
  const size_t dataGot = in.read(out.data.data(), total, "data");
  if (dataGot < total) {
    throw InvalidArgument(str("IDX file ", out.path, " is truncated: it holds ", dataGot, " of the ", total,
                              " data bytes its header declares (dimensions [", join(out.dims, ", "), "])"));
  }
  uint8_t extra[64];
  const size_t extraGot = in.read(extra, sizeof(extra), "data");
  if (extraGot > 0) {
    throw InvalidArgument(str("IDX file ", out.path, " has bytes after the ", total,
                              " data bytes its header declares (dimensions [", join(out.dims, ", "),
                              "]): a wrong header or two files joined"));
  }
  return out;
}

void writeIdx(const std::filesystem::path& path, const std::vector<int64_t>& dims, std::span<const uint8_t> data,
              bool gzip) {
  if (dims.empty() || dims.size() > static_cast<size_t>(kMaxDims)) {
    throw InvalidArgument(str("writeIdx(", path.string(), "): ", dims.size(), " dimensions; expected 1 to ", kMaxDims));
  }
  uint64_t total = 1;
  std::string header{'\0', '\0', static_cast<char>(kUnsignedByte), static_cast<char>(dims.size())};
  for (int64_t d : dims) {
    if (d < 0 || d > 0xffffffffLL) throw InvalidArgument(str("writeIdx(", path.string(), "): dimension ", d, " out of range"));
    total *= static_cast<uint64_t>(d);
    for (int shift = 24; shift >= 0; shift -= 8) header.push_back(static_cast<char>((d >> shift) & 0xff));
  }
  if (total != data.size()) {
    throw InvalidArgument(str("writeIdx(", path.string(), "): dimensions [", join(dims, ", "), "] need ", total,
                              " bytes but ", data.size(), " were given"));
  }
  const std::string tmp = path.string() + ".tmp";
  gzFile f = gzopen(tmp.c_str(), gzip ? "wb6" : "wbT");  // "T": plain, no gzip wrapper
  if (f == nullptr) throw InvalidArgument(str("writeIdx: cannot create ", tmp, ": ", std::strerror(errno)));
  bool ok = gzwrite(f, header.data(), static_cast<unsigned>(header.size())) == static_cast<int>(header.size());
  size_t done = 0;
  while (ok && done < data.size()) {
    const unsigned chunk = static_cast<unsigned>(std::min<size_t>(data.size() - done, size_t{1} << 30));
    ok = gzwrite(f, data.data() + done, chunk) == static_cast<int>(chunk);
    done += chunk;
  }
  ok = (gzclose(f) == Z_OK) && ok;
  if (!ok) {
    std::filesystem::remove(tmp);
    throw InvalidArgument(str("writeIdx: writing ", tmp, " failed"));
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace dt::data
