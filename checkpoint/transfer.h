// The training state (checkpoint/state.h) sent to other processes instead of a file: what a
// rank that joins a running job receives from a member, in the same definition a checkpoint
// holds.
//
//   // every member and the joiner, on the new group, at the same point:
//   dt::TrainingState state(group->rank(), group->size());
//   ... add the same parts on every rank ...
//   dt::broadcastState(state, *group, /*root=*/0, /*restoreHere=*/isJoiner);
//
// Contract:
//  * encodeState: this rank's state as one byte string (a safetensors file in memory: every
//    tensor this rank holds, with its placement, global shape and offset, the step and the
//    metadata in the header). stateFromBytes makes a StateSource of it; decodeState restores
//    a TrainingState from it. A sharded tensor carries only the sender's elements, so bytes
//    restore replicated parts fully and sharded parts only where the receiver's elements
//    are the sender's (the same rank at the same world size).
//  * broadcastState is a collective over `group`: rank `root` sends its replicated tensors,
//    step and metadata to every rank (in buckets of one dtype, up to bucketBytes each, on
//    options.device: a CUDA device makes NCCL carry them), every rank contributes its own
//    per-rank values (so each rank restores its own, and a joiner keeps the one it was built
//    with), and the ranks with restoreHere restore their state from what arrived; the
//    others only take part. Sharded tensors are refused (InvalidArgument naming one): a
//    sharded state moves by redistributeState, or by a checkpoint, after the wrapper has
//    been rebound to the new group. Every rank must have added the same parts.
//  * redistributeState is a collective over `group`: `held` lists the tensors each rank holds
//    now (collect() of the old layout, taken before the wrappers were rebound to `group`;
//    a rank that joined holds nothing), `state` the layout the ranks hold after rebinding;
//    every rank's new elements are fetched from the ranks that hold them (one allToAll per
//    dtype of the needed runs) and restored into `state`. Held pieces may be strided (a
//    tensor-parallel block) and a rank may hold several pieces of one tensor. Every element needed must be held
//    by some rank (else InvalidArgument naming the tensor and the first missing element: a
//    lost rank's shards have no other copy, load them from the newest checkpoint instead).
//  * Memory: a restoring rank receives straight into its own tensors where they are
//    contiguous host tensors of the stored dtype and size (restore then finds the bytes in
//    place: no second copy), and into new memory for the rest, which a part that makes new
//    tensors (an optimizer without state yet) keeps instead of copying; tensors of at least
//    1 MiB travel alone, from the root's tensor into the receiver's, smaller ones in
//    reused buckets. A rank that only takes part reuses one buffer and keeps nothing. A
//    transfer that fails leaves a restoring rank's tensors partly written: transfer again.
//    Redistribution holds the runs it moves.
//  * Blocking; errors are the group's (a lost member fails the collective).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/state.h"
#include "process_group/process_group.h"

namespace dt {

std::string encodeState(const TrainingState& state);
std::unique_ptr<StateSource> stateFromBytes(std::string bytes, const std::string& description = "state bytes");
void decodeState(std::string bytes, TrainingState& state);

struct BroadcastStateOptions {
  Device device = Device::cpu();  // where the buffers travel (every rank's own device of this type)
  size_t bucketBytes = size_t{32} << 20;
};

void broadcastState(TrainingState& state, ProcessGroup& group, int root, bool restoreHere,
                    const BroadcastStateOptions& options = {});

void redistributeState(const std::vector<StateTensor>& held, TrainingState& state, ProcessGroup& group);

}  // namespace dt
