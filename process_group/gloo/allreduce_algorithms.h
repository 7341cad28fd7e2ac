// Allreduce algorithms of the Gloo backend, and the per-size choice among them.
//
// Contract:
//  * Every function here runs on the backend's collective worker thread and
//    blocks until the buffer holds the reduction over all ranks of `context`,
//    or throws what Gloo's transport throws (gloo::IoException on a timeout
//    or a lost peer). `timeout` bounds the whole call, not each transfer.
//  * The buffer is reduced in place; `scratch` is grown as needed and may be
//    reused across calls (it is the caller's, and only one call runs at a time).
//  * Every rank gets bitwise identical results: each element is combined by
//    commutative pairwise steps in the same tree on every rank.
//  * The choice depends only on what every rank of a collective agrees on
//    (byte count, group size, the configured algorithm), never on timing or
//    per-rank options, so all ranks always run the same algorithm.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "collectives/reduce_kernels.h"

namespace gloo {
class Context;
}

namespace dt {

enum class GlooAllreduceAlgorithm {
  Auto,               // by size: see chooseAllreduceAlgorithm
  Ring,               // Gloo's segmented ring (bandwidth-optimal, 2(n-1) steps)
  HalvingDoubling,    // reduce-scatter by recursive halving, allgather by doubling (2 log n steps)
  RecursiveDoubling,  // whole-buffer exchange with log n partners (latency-optimal)
};

// "auto", "ring", "halving_doubling", "recursive_doubling"; anything else is
// an InvalidArgument naming `source` (e.g. "DT_GLOO_ALLREDUCE") and the value.
GlooAllreduceAlgorithm parseGlooAllreduceAlgorithm(std::string_view text, std::string_view source);
const char* algorithmName(GlooAllreduceAlgorithm algorithm);

// Auto: recursive doubling below kRecursiveDoublingMaxBytes (with two ranks
// below kRecursiveDoublingMaxBytesTwoRanks), Gloo's ring from there: the
// ring's 2(n-1) steps cost latency on small buffers, its pipelining of the
// reduction with the transfers pays on large ones. Halving-doubling measured
// no better than either on the hosts tried (docs/process_group.md), so only
// DT_GLOO_ALLREDUCE selects it.
inline constexpr size_t kRecursiveDoublingMaxBytes = size_t{256} << 10;
inline constexpr size_t kRecursiveDoublingMaxBytesTwoRanks = size_t{2} << 20;
// Gloo's ring splits chunks into segments of at most this many bytes; its
// default (1 MiB) measured 10-15% slower at 16 and 64 MiB here.
inline constexpr size_t kRingSegmentBytes = size_t{4} << 20;

GlooAllreduceAlgorithm chooseAllreduceAlgorithm(GlooAllreduceAlgorithm configured, size_t bytes, int groupSize);

struct AllreduceCall {
  const std::shared_ptr<gloo::Context>& context;
  void* data;
  size_t count;  // elements
  size_t width;  // bytes per element
  ReduceFn reduce;
  std::chrono::milliseconds timeout;
  uint32_t tag;  // distinguishes this collective's messages from others'
  std::vector<uint8_t>& scratch;
};

// Runs `algorithm` (not Auto) on the call.
void runAllreduce(GlooAllreduceAlgorithm algorithm, const AllreduceCall& call);

}  // namespace dt
