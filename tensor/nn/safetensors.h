// The safetensors file format (https://github.com/huggingface/safetensors),
// written from its specification: 8-byte little-endian header length N, N
// bytes of JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]},
// "__metadata__": {"k": "v"}}, then the raw little-endian tensor bytes.
//
// Contract: save writes to a temporary file, fsyncs it, renames it and fsyncs
// the folder, so a crash never leaves a truncated checkpoint under the final
// name. load validates the header
// (offsets in range and matching dtype x shape, no overlaps beyond the buffer)
// and throws InvalidArgument naming the file and the problem. Tensors are CPU
// and come back contiguous. encode/decode are the same format in memory (what
// a process sends another one). SafetensorsReader reads the header once and
// then single tensors, or element ranges of them, with pread(2): what a
// checkpoint loader needs to take one rank's piece out of another rank's file
// without reading the rest. Thread-compatible (no shared state; a reader's
// reads may run on several threads at once, pread has no file position).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace dt {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

void saveSafetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                     const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  NamedTensors tensors;  // in file data order
  std::map<std::string, std::string> metadata;
};
SafetensorsFile loadSafetensors(const std::filesystem::path& path);

// The bytes saveSafetensors writes, in memory; decode checks them as load checks a file
// (`what` names them in errors).
std::string encodeSafetensors(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata = {});
SafetensorsFile decodeSafetensors(std::string_view bytes, const std::string& what = "safetensors bytes");

// One tensor's entry in a file's header; begin/end are byte offsets into the data section.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::Float32;
  Shape shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

class SafetensorsReader {
 public:
  // Opens the file and validates its header (InvalidArgument naming the file otherwise).
  explicit SafetensorsReader(const std::filesystem::path& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::filesystem::path& path() const { return path_; }
  uint64_t fileBytes() const { return fileBytes_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }  // in data order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsEntry* find(const std::string& name) const;
  const SafetensorsEntry& entry(const std::string& name) const;  // InvalidArgument naming file and tensor

  // The whole tensor (cpu, contiguous).
  Tensor read(const SafetensorsEntry& entry) const;
  // Elements [offset, offset + count) of the row-major flattened tensor, as raw bytes of its
  // dtype, into dst (count x item size bytes).
  void readElements(const SafetensorsEntry& entry, int64_t offset, int64_t count, void* dst) const;

 private:
  void readAt(uint64_t position, void* out, uint64_t bytes) const;
  std::filesystem::path path_;
  int fd_ = -1;
  uint64_t fileBytes_ = 0;
  uint64_t dataStart_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// fsync(2) of a file or folder; throws InvalidArgument naming `who` and the path.
void syncPath(const std::filesystem::path& path, const std::string& who);

// "F32", "BF16", ... and back.
std::string safetensorsDType(DType dtype);
DType dtypeFromSafetensors(const std::string& name);

}  // namespace dt
