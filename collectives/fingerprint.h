// Collective fingerprints: what a rank believes collective #seq is, so ranks
// can compare before running it (DT_DEBUG=detail) and errors can say what
// each side called.
//
// Contract: plain value type, thread-safe to read. serialize()/parse()
// round-trip exactly; two ranks agree on a collective iff their fingerprints
// compare equal.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "collectives/reduce_op.h"
#include "tensor/dtype.h"

namespace dt {

// A tensor's dimensions, kept in place up to kInline of them (the usual case costs no
// allocation: a signature is made for every collective), else on the heap.
class Dims {
 public:
  static constexpr size_t kInline = 6;
  Dims() = default;
  Dims(std::initializer_list<int64_t> dims) : Dims(dims.begin(), dims.end()) {}
  Dims(const std::vector<int64_t>& dims) : Dims(dims.data(), dims.data() + dims.size()) {}  // NOLINT: from Tensor::sizes()
  Dims(const int64_t* first, const int64_t* last) {
    for (; first != last; ++first) push_back(*first);
  }
  const int64_t* begin() const { return heap_.empty() ? inline_ : heap_.data(); }
  const int64_t* end() const { return begin() + size_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  int64_t operator[](size_t i) const { return begin()[i]; }
  void push_back(int64_t d) {
    if (size_ < kInline && heap_.empty()) {
      inline_[size_++] = d;
      return;
    }
    if (heap_.empty()) heap_.assign(inline_, inline_ + size_);
    heap_.push_back(d);
    ++size_;
  }
  bool operator==(const Dims& other) const { return std::equal(begin(), end(), other.begin(), other.end()); }

 private:
  int64_t inline_[kInline] = {};
  size_t size_ = 0;
  std::vector<int64_t> heap_;  // all of them, once there are more than kInline
};

struct TensorSignature {
  DType dtype = DType::Float32;
  Dims sizes;
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
