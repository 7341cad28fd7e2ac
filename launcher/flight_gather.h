// Moving flight recorder dumps between the nodes of a job through its store: after a failed
// attempt every node's dtrun posts the dumps its workers wrote and copies the others' into its
// own log folder, so each prints the whole job's story (docs/debugging.md, "Under dtrun").
//
// Contract: pure file and byte functions, no store or network; thread-safe (no shared state).
// Only files named flight_rank*.json directly in the folder take part; names with a path
// separator or "..", and files of more than maxBytes in all, are left out (and counted).
#pragma once

#include <cstddef>
#include <string>

namespace dt::launcher {

struct PackedFlightFiles {
  std::string bytes;   // "<name>\n<size>\n<contents>" for each file, one after another
  int files = 0;       // how many went in
  int leftOut = 0;     // how many did not fit in maxBytes
};

// The flight_rank*.json files of `dir`, packed (smallest first, up to maxBytes in all).
PackedFlightFiles packFlightFiles(const std::string& dir, size_t maxBytes);

// Writes the files of `packed` into `dir` (created if missing), leaving any that exists there
// already as it is; returns how many it wrote. InvalidArgument naming `from` and the offset for
// bytes that are not such a pack.
int unpackFlightFiles(const std::string& packed, const std::string& dir, const std::string& from);

}  // namespace dt::launcher
