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
// and come back contiguous. Thread-compatible (no shared state).
#pragma once

#include <filesystem>
#include <map>
#include <string>
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

// fsync(2) of a file or folder; throws InvalidArgument naming `who` and the path.
void syncPath(const std::filesystem::path& path, const std::string& who);

// "F32", "BF16", ... and back.
std::string safetensorsDType(DType dtype);
DType dtypeFromSafetensors(const std::string& name);

}  // namespace dt
