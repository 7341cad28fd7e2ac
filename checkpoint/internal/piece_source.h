// A StateSource over pieces: runs of elements of a tensor (or one rank's value of a per-rank
// tensor), each with a function that reads its raw bytes. The checkpoint reader (pieces in
// files) and the in-memory sources of checkpoint/transfer.cpp are built on it.
//
// Contract: addTensor once per name, then addPiece for its pieces (in any order; pieces of one
// tensor must not overlap). read() copies from every piece that overlaps the range asked for
// and throws InvalidArgument naming the tensor and the first element no piece holds. The
// A strided piece's runs may interleave with other ranks' pieces. The ReadBytes functions are called on the thread calling read(), with counts in elements of the
// stored dtype. Not thread-safe.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/state.h"
#include "common/json.h"

namespace dt::detail {

// One rank's piece of a state tensor as the ranks describe it to each other (checkpoint
// reports, the header of encoded state, redistribution): the tensor's global description,
// whose piece it is, and which elements.
struct PieceDescriptor {
  StateTensorInfo info;
  int rank = 0;
  int64_t offset = 0;
  int64_t count = 0;  // elements held, in all runs
  int64_t stride = 0;  // a strided piece: `repeats` runs of count / repeats, run i at offset + i * stride
  int64_t repeats = 1;
};
PieceDescriptor descriptorOf(const StateTensor& tensor, int rank);
json::Value toJson(const PieceDescriptor& piece);
// InvalidArgument naming `what` and the field when a member is missing or malformed.
PieceDescriptor pieceFromJson(const json::Value& value, const std::string& what);

class PieceSource : public StateSource {
 public:
  using ReadBytes = std::function<void(int64_t elementOffset, int64_t count, void* dst)>;
  struct Piece {
    int rank = -1;        // PerRank: whose value
    int64_t offset = 0;   // first element of the tensor (flattened) it holds
    int64_t count = 0;
    ReadBytes read;       // element offsets relative to the piece (its runs one after another)
    Tensor adoptable;     // flat host memory holding the piece that a restore may keep (see adoptable())
    // A strided piece (StateTensor's): `repeats` runs of count / repeats elements, run i at
    // offset + i * stride of the tensor; repeats 1: the one run [offset, offset + count).
    int64_t stride = 0;
    int64_t repeats = 1;
  };

  PieceSource(std::string description, int64_t step, int worldSize, std::map<std::string, std::string> metadata);

  void addTensor(StateTensorInfo info);
  void addPiece(const std::string& name, Piece piece);
  // Throws InvalidArgument naming the first tensor whose pieces leave elements (or, per rank,
  // ranks below worldSize) uncovered.
  void checkCoverage() const;

  std::string describe() const override { return description_; }
  int64_t step() const override { return step_; }
  int worldSize() const override { return worldSize_; }
  const std::map<std::string, std::string>& metadata() const override { return metadata_; }
  std::vector<StateTensorInfo> tensors() const override;
  std::optional<StateTensorInfo> find(const std::string& name) const override;
  void read(const std::string& name, int64_t offset, Tensor& dst, int rank = 0) const override;
  // The piece's `adoptable` memory when one piece holds the whole (non per-rank) tensor.
  Tensor adoptable(const std::string& name) const override;

 private:
  struct Entry {
    StateTensorInfo info;
    std::vector<Piece> pieces;  // sorted by offset (PerRank: by rank) in checkCoverage/read
  };
  const Entry& entry(const std::string& name) const;
  // The piece holding element `at` of the tensor, and how many elements from `at` it holds in
  // one run (*local: where `at` is among the piece's elements); null when none does.
  static const Piece* holding(const Entry& e, int64_t at, int64_t* local, int64_t* inRun);

  std::string description_;
  int64_t step_;
  int worldSize_;
  std::map<std::string, std::string> metadata_;
  std::vector<std::string> order_;  // names in addTensor order
  std::map<std::string, Entry> entries_;
};

}  // namespace dt::detail
