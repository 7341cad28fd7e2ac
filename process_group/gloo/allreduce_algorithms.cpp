#include "process_group/gloo/allreduce_algorithms.h"

#include <gloo/allreduce.h>
#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <algorithm>

#include "common/errors.h"
#include "common/strings.h"
#include "process_group/gloo/transfer_type.h"

namespace dt {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// Gloo's own collectives use slot prefixes 0x01-0x08, the backend's p2p 0x10.
constexpr uint8_t kRecursiveSlotPrefix = 0x11;

void ring(const AllreduceCall& call) {
  withTransferType(call.width, [&](auto typeTag) {
    using T = decltype(typeTag);
    gloo::AllreduceOptions opts(call.context);
    opts.setOutput(static_cast<T*>(call.data), call.count);
    opts.setReduceFunction(call.reduce);
    opts.setTag(call.tag);
    opts.setTimeout(call.timeout);
    opts.setMaxSegmentSize(kRingSegmentBytes);
    gloo::allreduce(opts);
  });
}

// One collective's point-to-point transfers over two unbound buffers: the
// user's data and the scratch space that receives what gets reduced into it.
class Transfers {
 public:
  explicit Transfers(const AllreduceCall& call)
      : call_(call),
        deadline_(Clock::now() + call.timeout),
        slot_(gloo::Slot::build(kRecursiveSlotPrefix, call.tag)) {
    const size_t bytes = call.count * call.width;
    if (call.scratch.size() < bytes) call.scratch.resize(bytes);
    data_ = call.context->createUnboundBuffer(call.data, bytes);
    scratch_ = call.context->createUnboundBuffer(call.scratch.data(), bytes);
  }

  // Sends elements [sendFrom, sendFrom + sendCount) of the data to `peer` and
  // receives `recvCount` elements from it, into the scratch space (toScratch)
  // or into the data at `recvFrom`. Returns when both are done.
  void exchange(int peer, size_t sendFrom, size_t sendCount, size_t recvFrom, size_t recvCount, bool toScratch) {
    const size_t w = call_.width;
    auto& into = toScratch ? *scratch_ : *data_;
    if (recvCount > 0) into.recv(peer, slot_, toScratch ? 0 : recvFrom * w, recvCount * w);
    if (sendCount > 0) data_->send(peer, slot_, sendFrom * w, sendCount * w);
    if (recvCount > 0) check(into.waitRecv(left()), "receive from", peer);
    if (sendCount > 0) check(data_->waitSend(left()), "send to", peer);
  }

  // data[from, from + count) = reduce(data[from, ...), scratch[0, count)).
  void reduceFromScratch(size_t from, size_t count) {
    if (count == 0) return;
    auto* out = static_cast<uint8_t*>(call_.data) + from * call_.width;
    call_.reduce(out, out, call_.scratch.data(), count);
  }

 private:
  Millis left() const {
    return std::max(Millis(1), std::chrono::duration_cast<Millis>(deadline_ - Clock::now()));
  }
  static void check(bool done, const char* what, int peer) {
    // false: the wait was aborted, which only happens when the connections close.
    if (!done) throw gloo::IoException(str("allreduce ", what, " rank ", peer, " aborted"));
  }

  const AllreduceCall& call_;
  const Clock::time_point deadline_;
  const uint64_t slot_;
  std::unique_ptr<gloo::transport::UnboundBuffer> data_;
  std::unique_ptr<gloo::transport::UnboundBuffer> scratch_;
};

// Recursive doubling (halve = false) or Rabenseifner's halving-doubling
// (halve = true) among the largest power of two of ranks; the ranks beyond it
// first hand their data to a partner below and get the result back at the end.
void recursive(const AllreduceCall& call, bool halve) {
  const int rank = call.context->rank;
  const int size = call.context->size;
  int powerOfTwo = 1;
  while (powerOfTwo * 2 <= size) powerOfTwo *= 2;
  const int extra = size - powerOfTwo;
  Transfers transfers(call);
  const size_t count = call.count;

  if (rank >= powerOfTwo) {
    transfers.exchange(rank - powerOfTwo, 0, count, 0, 0, false);
    transfers.exchange(rank - powerOfTwo, 0, 0, 0, count, false);
    return;
  }
  if (rank < extra) {
    transfers.exchange(rank + powerOfTwo, 0, 0, 0, count, true);
    transfers.reduceFromScratch(0, count);
  }

  if (!halve) {
    for (int mask = 1; mask < powerOfTwo; mask <<= 1) {
      transfers.exchange(rank ^ mask, 0, count, 0, count, true);
      transfers.reduceFromScratch(0, count);
    }
  } else {
    // Reduce-scatter: at each step keep one half of the current range (the
    // lower one where the step's bit is clear) and send the other to the
    // partner, which keeps that one. Partners always hold the same range.
    struct Range {
      size_t from, count;
    };
    std::vector<Range> parents;
    Range mine{0, count};
    for (int mask = 1; mask < powerOfTwo; mask <<= 1) {
      const Range lower{mine.from, mine.count / 2};
      const Range upper{mine.from + lower.count, mine.count - lower.count};
      const bool keepLower = (rank & mask) == 0;
      const Range keep = keepLower ? lower : upper;
      const Range give = keepLower ? upper : lower;
      transfers.exchange(rank ^ mask, give.from, give.count, 0, keep.count, true);
      transfers.reduceFromScratch(keep.from, keep.count);
      parents.push_back(mine);
      mine = keep;
    }
    // Allgather: retrace the steps, swapping halves with the same partners.
    for (size_t step = parents.size(); step-- > 0;) {
      const Range parent = parents[step];
      const bool mineIsLower = mine.from == parent.from;
      const Range theirs = mineIsLower ? Range{mine.from + mine.count, parent.count - mine.count}
                                       : Range{parent.from, parent.count - mine.count};
      transfers.exchange(rank ^ (1 << step), mine.from, mine.count, theirs.from, theirs.count, false);
      mine = parent;
    }
  }

  if (rank < extra) transfers.exchange(rank + powerOfTwo, 0, count, 0, 0, false);
}

}  // namespace

GlooAllreduceAlgorithm parseGlooAllreduceAlgorithm(std::string_view text, std::string_view source) {
  for (auto a : {GlooAllreduceAlgorithm::Auto, GlooAllreduceAlgorithm::Ring, GlooAllreduceAlgorithm::HalvingDoubling,
                 GlooAllreduceAlgorithm::RecursiveDoubling}) {
    if (text == algorithmName(a)) return a;
  }
  throw InvalidArgument(str(source, "=", quoteBytes(text),
                            " is not an allreduce algorithm; use auto, ring, halving_doubling or recursive_doubling"));
}

const char* algorithmName(GlooAllreduceAlgorithm algorithm) {
  switch (algorithm) {
    case GlooAllreduceAlgorithm::Auto: return "auto";
    case GlooAllreduceAlgorithm::Ring: return "ring";
    case GlooAllreduceAlgorithm::HalvingDoubling: return "halving_doubling";
    case GlooAllreduceAlgorithm::RecursiveDoubling: return "recursive_doubling";
  }
  return "?";
}

GlooAllreduceAlgorithm chooseAllreduceAlgorithm(GlooAllreduceAlgorithm configured, size_t bytes, int groupSize) {
  if (configured != GlooAllreduceAlgorithm::Auto) return configured;
  const size_t limit = groupSize <= 2 ? kRecursiveDoublingMaxBytesTwoRanks : kRecursiveDoublingMaxBytes;
  return bytes < limit ? GlooAllreduceAlgorithm::RecursiveDoubling : GlooAllreduceAlgorithm::Ring;
}

void runAllreduce(GlooAllreduceAlgorithm algorithm, const AllreduceCall& call) {
  if (call.count == 0 || call.context->size == 1) return;
  switch (algorithm) {
    case GlooAllreduceAlgorithm::Ring: return ring(call);
    case GlooAllreduceAlgorithm::HalvingDoubling: return recursive(call, true);
    case GlooAllreduceAlgorithm::RecursiveDoubling: return recursive(call, false);
    case GlooAllreduceAlgorithm::Auto: break;
  }
  throw InvalidArgument("runAllreduce: resolve Auto with chooseAllreduceAlgorithm first");
}

}  // namespace dt
