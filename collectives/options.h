// Per-op options of collectives and point-to-point calls.
//
// Contract: plain aggregates, copied into the backend at issue time.
//  * timeout: nullopt uses the group's timeout (DT_PG_TIMEOUT, 10 min, unless
//    the group was created with another). It bounds the whole op, queueing
//    on the backend's worker excluded.
//  * seq: the collective's sequence number in its process group. ProcessGroup
//    fills it; callers of a Backend directly may leave 0 and the backend then
//    numbers its calls itself (1, 2, ...). It appears in every error message
//    and in fingerprints.
//  * root / peer: group ranks (0 .. size-1).
//  * split sizes (allToAllSingle): rows along dim 0 sent to / received from
//    each rank; empty means equal splits.
//  * tag: distinguishes concurrent send/recv pairs between the same two ranks;
//    a send matches the recv with the same tag, in order.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

#include "collectives/reduce_op.h"

namespace dt {

using OpTimeout = std::optional<std::chrono::milliseconds>;

struct AllreduceOptions {
  ReduceOp reduceOp = ReduceOp::Sum;
  OpTimeout timeout;
  uint64_t seq = 0;
};

struct BroadcastOptions {
  int root = 0;
  OpTimeout timeout;
  uint64_t seq = 0;
};

struct AllgatherOptions {
  OpTimeout timeout;
  uint64_t seq = 0;
};

struct ReduceScatterOptions {
  ReduceOp reduceOp = ReduceOp::Sum;
  OpTimeout timeout;
  uint64_t seq = 0;
};

struct ReduceOptions {
  ReduceOp reduceOp = ReduceOp::Sum;
  int root = 0;
  OpTimeout timeout;
  uint64_t seq = 0;
};

struct BarrierOptions {
  OpTimeout timeout;
  uint64_t seq = 0;
};

struct SendOptions {
  uint32_t tag = 0;
  OpTimeout timeout;
  uint64_t seq = 0;
};

struct RecvOptions {
  uint32_t tag = 0;
  OpTimeout timeout;
  uint64_t seq = 0;
};

struct AllToAllOptions {
  OpTimeout timeout;
  uint64_t seq = 0;
};

struct GatherOptions {
  int root = 0;
  OpTimeout timeout;
  uint64_t seq = 0;
};

struct ScatterOptions {
  int root = 0;
  OpTimeout timeout;
  uint64_t seq = 0;
};

}  // namespace dt
