// Checkpoints of a TrainingState (checkpoint/state.h) in one folder, written by every rank of
// a group at once and loadable at any world size.
//
//   step-00000500.json                    the manifest: format, step, world size, the user's
//                                         metadata, every tensor's global shape and dtype and
//                                         where its pieces are, each file's size and CRC-32
//   step-00000500.safetensors             rank 0's file: the replicated tensors, every rank's
//                                         per-rank values, and rank 0's shards
//   step-00000500.rank00003.safetensors   rank 3's shards (only ranks that hold shards)
//
// The data files are ordinary safetensors files: a tensor sharded along dim 0 appears in each
// rank's file under its full name with the rank's rows (a strided shard, a tensor-parallel
// block of a later dimension, as its local tensor: the manifest's piece [file, offset, count,
// stride, repeats] says where its runs go); consolidate() (and `dtckpt
// consolidate`) writes one file of whole tensors for inference or other tools.
//
// Contract:
//  * save() is a collective over the group (or a single process without one): every rank
//    writes its own file (temporary name, fsync, rename), the ranks exchange their files'
//    sizes, CRC-32s and pieces, then rank 0 writes the manifest the same way, fsyncs the
//    folder and deletes all but the newest `keep` checkpoints. The manifest is written last,
//    so a checkpoint exists exactly when its manifest does: a crash at any point leaves the
//    complete new checkpoint or none (plus *.tmp files or data files without a manifest, which
//    removeTemporaries()/removeAll() delete). A write that fails on any rank throws on every
//    rank, naming the rank and the reason, and no manifest is written.
//  * load() is a collective too: every rank reads the manifest and the pieces it holds now
//    (resharding: a tensor written at world 4 loads at world 2 or 3, by a sharded wrapper or
//    by a replicated model), checking each file it opens against the manifest's size and
//    CRC-32. Any problem throws InvalidArgument naming the file and what is wrong, on every
//    rank (the others name the rank that failed); nothing is written or deleted.
//  * latest() is the highest step with a manifest; latestAgreed() and clear() are the
//    collective forms (rank 0 decides, so every rank uses the same checkpoint).
//  * The folder must be the same folder for every rank (one host, or a shared file system).
//  * Blocking file I/O on the calling thread. Not thread-safe: one thread of each process.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/state.h"
#include "process_group/process_group.h"

namespace dt {

struct CheckpointRef {
  int64_t step = 0;
  std::filesystem::path manifest;
  std::filesystem::path tensors;  // rank 0's data file
};

struct CheckpointFile {
  std::string name;  // in the checkpoint's folder
  int rank = 0;
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};

struct CheckpointPiece {
  size_t file = 0;     // index into files
  int rank = -1;       // per-rank tensors: whose value (stored as "<name>.rank<r>")
  int64_t offset = 0;  // first element held (row-major over the global shape)
  int64_t count = 0;
  int64_t stride = 0;  // a strided piece (StateTensor's): count / repeats elements every stride
  int64_t repeats = 1;
};

struct CheckpointTensor {
  StateTensorInfo info;
  std::vector<CheckpointPiece> pieces;
};

class CheckpointManifest {
 public:
  static constexpr const char* kFormat = "dtrain-checkpoint/2";

  std::filesystem::path path;  // where it was read from (empty when built in memory)
  int64_t step = 0;
  int worldSize = 1;
  std::map<std::string, std::string> metadata;
  std::vector<CheckpointFile> files;
  std::vector<CheckpointTensor> tensors;

  // Metadata by key; InvalidArgument "checkpoint manifest <path> has no "<key>"" when absent.
  bool has(const std::string& key) const { return metadata.count(key) != 0; }
  const std::string& text(const std::string& key) const;
  int64_t integer(const std::string& key) const;

  // The first of `settings` whose metadata value ("<keyPrefix><key>") differs from the value
  // given (or is missing) throws InvalidArgument "checkpoint <path> was written with <key> =
  // <saved> but this run has <key> = <value>. <hint>".
  void requireSame(const std::vector<std::pair<std::string, std::string>>& settings, const std::string& keyPrefix,
                   const std::string& hint) const;

  std::string toJson() const;
  // InvalidArgument "checkpoint manifest <path> is corrupt at byte N: ..." for bad JSON, or
  // naming the missing or malformed field.
  static CheckpointManifest parse(const std::string& json, const std::filesystem::path& path);
};

class CheckpointDir {
 public:
  CheckpointDir(std::filesystem::path dir, int keep = 3);
  const std::filesystem::path& path() const { return dir_; }
  int keep() const { return keep_; }

  std::vector<CheckpointRef> list() const;  // by step, oldest first
  std::optional<CheckpointRef> latest() const;
  CheckpointRef refFor(int64_t step) const;

  // Writes state.step's checkpoint (see the contract); `group` null: this process alone.
  CheckpointRef save(const TrainingState& state, ProcessGroup* group = nullptr) const;
  CheckpointManifest readManifest(const CheckpointRef& ref) const;
  // The checkpoint as a StateSource (files opened and checked when first read).
  std::unique_ptr<StateSource> open(const CheckpointRef& ref) const;
  // Every data file against the manifest's size and CRC-32, and every tensor covered by its
  // pieces (InvalidArgument naming the first problem); returns the manifest.
  CheckpointManifest verify(const CheckpointRef& ref) const;
  // Restores `state` from the checkpoint (see the contract); returns its manifest.
  CheckpointManifest load(const CheckpointRef& ref, TrainingState& state, ProcessGroup* group = nullptr) const;

  // Rank 0's latest(), the same on every rank (a collective).
  std::optional<CheckpointRef> latestAgreed(ProcessGroup& group) const;
  // Rank 0 removes every checkpoint before any rank looks, then a barrier; the count removed
  // on rank 0, 0 elsewhere (a collective).
  int clear(ProcessGroup& group) const;
  // Leftovers of writes a crash interrupted; returns how many files were removed.
  int removeTemporaries() const;
  // Every checkpoint in the folder (and data files without a manifest); returns how many
  // checkpoints.
  int removeAll() const;

 private:
  void prune() const;
  std::filesystem::path dir_;
  int keep_;
};

// Every tensor under `prefix` ("model": "model.*", the prefix and its dot removed from the
// names) assembled whole from its pieces into one ordinary safetensors file at `out`, with
// the checkpoint's step and source in its metadata. Per-rank tensors are left out.
// Returns how many tensors it wrote.
size_t consolidateCheckpoint(const CheckpointDir& dir, const CheckpointRef& ref, const std::filesystem::path& out,
                             const std::string& prefix = "model");

// CRC-32 (zlib's) of a whole file; InvalidArgument naming it when unreadable.
uint32_t fileCrc32(const std::filesystem::path& path, uint64_t* size = nullptr);

}  // namespace dt
