// Checkpoints for examples/trainer: one folder, one pair of files per checkpoint.
//
//   step-00000500.safetensors   every tensor (model, optimizer state, RNG states)
//   step-00000500.json          the manifest: step, sampler position, configuration, and the
//                               size and CRC-32 of the tensors file
//
// Contract:
//  * write() writes the tensors file (temporary name, fsync, rename), then the manifest the
//    same way, then fsyncs the folder. The manifest is written last, so a checkpoint exists
//    exactly when its manifest does: a crash at any point leaves either the complete new
//    checkpoint or none (plus *.tmp files, which removeTemporaries() deletes). It then deletes
//    all but the newest `keep` checkpoints.
//  * latest() is the highest step with a manifest. load() checks the manifest's format, that
//    the tensors file has the recorded size and CRC-32, and parses it; any problem throws
//    dt::InvalidArgument naming the file and what is wrong, and nothing is written or deleted.
//  * Blocking file I/O (write() ends with fsyncs) on the calling thread; loaded tensors are
//    fresh and owned by the caller. Not thread-safe: one thread of one process uses a
//    CheckpointDir (rank 0 writes; every rank may read, when the folder is shared).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tensor/nn/safetensors.h"

namespace trainer {

// A flat JSON object of strings, integers and decimals (values kept as text).
class Manifest {
 public:
  void set(const std::string& key, const std::string& value) { strings_[key] = value; }
  void set(const std::string& key, int64_t value) { numbers_[key] = std::to_string(value); }
  void setNumberText(const std::string& key, const std::string& text) { numbers_[key] = text; }
  bool has(const std::string& key) const { return strings_.count(key) || numbers_.count(key); }
  // The value as text (string or number); throws InvalidArgument naming `file` if absent.
  std::string text(const std::string& key) const;
  int64_t integer(const std::string& key) const;
  std::string toJson() const;
  static Manifest parse(const std::string& json, const std::string& file);
  std::string file;  // where it was read from ("" when built in memory)

 private:
  std::map<std::string, std::string> strings_;
  std::map<std::string, std::string> numbers_;
};

struct CheckpointRef {
  int64_t step = 0;
  std::filesystem::path manifest;
  std::filesystem::path tensors;
};

struct LoadedCheckpoint {
  CheckpointRef ref;
  Manifest manifest;
  dt::NamedTensors tensors;
};

class CheckpointDir {
 public:
  CheckpointDir(std::filesystem::path dir, int keep);
  const std::filesystem::path& path() const { return dir_; }

  std::vector<CheckpointRef> list() const;  // by step, oldest first
  std::optional<CheckpointRef> latest() const;
  CheckpointRef refFor(int64_t step) const;

  // Adds format, step, tensors_file, tensors_bytes and tensors_crc32 to the manifest.
  CheckpointRef write(int64_t step, const dt::NamedTensors& tensors, Manifest manifest);
  LoadedCheckpoint load(const CheckpointRef& ref) const;

  // Leftovers of writes a crash interrupted; returns how many were removed.
  int removeTemporaries() const;
  // Every checkpoint in the folder (for a fresh start); returns how many.
  int removeAll() const;

  static constexpr const char* kFormat = "dtrain-trainer-checkpoint/1";

 private:
  void prune() const;
  std::filesystem::path dir_;
  int keep_;
};

// CRC-32 (zlib's) of a whole file; throws InvalidArgument naming it when unreadable.
uint32_t fileCrc32(const std::filesystem::path& path, uint64_t* size = nullptr);

}  // namespace trainer
