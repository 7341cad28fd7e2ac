// IDX files: the format of MNIST and Fashion-MNIST (http://yann.lecun.com/exdb/mnist/, "FILE
// FORMATS"): two zero bytes, a type byte (0x08 = unsigned byte), a dimension count, one
// big-endian uint32 per dimension, then the data, row-major. Usually gzip'd (*.gz).
//
// Contract:
//  * readIdx reads a gzip'd or plain file (zlib tells them apart) holding unsigned bytes, the
//    only element type the image data sets use. Every problem throws InvalidArgument (a
//    missing file, wrong magic, a dimension count of 0 or more than 4, truncated header or
//    data, bytes after the data, a corrupt gzip stream) or NotSupportedError (another element
//    type), naming the file and the values found.
//  * writeIdx writes one (gzip'd when `gzip`), to a temporary file renamed into place; tests
//    and tools make small data sets with it.
//  * Blocking file I/O on the calling thread; the result owns its bytes. No shared state: safe
//    to call from any thread.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace dt::data {

struct IdxArray {
  std::vector<int64_t> dims;  // e.g. {60000, 28, 28}
  std::vector<uint8_t> data;  // prod(dims) bytes, row-major
  std::string path;           // where it came from, for messages

  int64_t count() const { return dims.empty() ? 0 : dims[0]; }
  // Bytes per item (product of the dimensions after the first).
  int64_t itemBytes() const;
};

IdxArray readIdx(const std::filesystem::path& path);

void writeIdx(const std::filesystem::path& path, const std::vector<int64_t>& dims, std::span<const uint8_t> data,
              bool gzip = true);

}  // namespace dt::data
