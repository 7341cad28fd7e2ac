// Collective fingerprints: what a rank believes collective #seq is, so ranks
// can compare before running it (DT_DEBUG=detail) and errors can say what
// each side called.
//
// Contract: plain value type, thread-safe to read. serialize()/parse()
// round-trip exactly; two ranks agree on a collective iff their fingerprints
// compare equal.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "collectives/reduce_op.h"
#include "tensor/dtype.h"

namespace dt {

struct TensorSignature {
  DType dtype = DType::Float32;
  std::vector<int64_t> sizes;
  bool operator==(const TensorSignature&) const = default;
};

struct CollectiveFingerprint {
  std::string op;                   // "allreduce", "broadcast", ...
  uint64_t seq = 0;                 // sequence number in the group
  std::vector<TensorSignature> tensors;
  std::optional<ReduceOp> reduceOp;
  std::optional<int> root;          // broadcast/reduce root, or send/recv peer

  // "allreduce(float32[1048576], sum)", "broadcast(float32[4096], root 0)",
  // "allgather(int64[2,3] x2)", "barrier()".
  std::string describe() const;
  // One line, no spaces in the encoding of sizes: "<seq>;<op>;<tensors>;<reduce>;<root>".
  std::string serialize() const;
  // Throws InvalidArgument for text serialize() could not have produced.
  static CollectiveFingerprint parse(const std::string& text);

  // Ranks of one allToAll may pass different sizes (uneven splits); for
  // those ops only the dtypes must agree.
  bool sizesMayDiffer() const { return op == "allToAll" || op == "allToAllSingle"; }
  // Whether two ranks' fingerprints describe the same collective.
  bool agreesWith(const CollectiveFingerprint& other) const;

  bool operator==(const CollectiveFingerprint&) const = default;
};

}  // namespace dt
