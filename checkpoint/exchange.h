// Small collectives for agreeing: text (descriptions, reports, errors: DDP's and the sharded
// wrapper's model checks, the checkpoint writers' reports, a failed load on one rank) and
// one rank's tensors copied to all.
//
// Contract: every rank of the group calls them at the same point (collectives: the text ones
// on the group's CPU backend, two allgathers or two broadcasts of bytes). Strings may hold any
// bytes. With a group of one they return at once. Blocking; errors are the group's.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include "process_group/process_group.h"

namespace dt {

// Every rank's string, in rank order.
std::vector<std::string> allgatherStrings(ProcessGroup& group, const std::string& mine);
// Rank root's string on every rank.
void broadcastString(ProcessGroup& group, std::string& text, int root);

// Every rank learns whether any rank failed a step that all of them ran: with `failure`
// null on every rank, it returns; otherwise it throws on every rank: the failing rank its own
// exception, the others an InvalidArgument "<what> failed on rank R: <its message>" naming
// the lowest failing rank, so no rank goes on to the next collective alone.
void agreeOnFailure(ProcessGroup* group, std::exception_ptr failure, const std::string& what);

// Every rank's list of lines (one per parameter, say) must be the same: a cheap allgather of
// (count, hash) first, and only when they differ the lists themselves; then every rank throws
// the same InvalidArgument "<prefix> <item> #i: rank 0 has <line>; rank(s) R have <line>.
// <hint>" for the first differing line.
void requireSameOnAllRanks(ProcessGroup& group, const std::vector<std::string>& lines, const std::string& prefix,
                           const std::string& item, const std::string& hint);

// Rank root's values copied into `tensors` on every rank (one broadcast per dtype and device).
void broadcastTensors(ProcessGroup& group, const std::vector<Tensor>& tensors, int root);

}  // namespace dt
