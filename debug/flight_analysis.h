// Reading flight recorder dumps (process_group/flight_recorder.h; the format is
// in docs/debugging.md) and telling the story of a failed job from them: per
// group, the first collective where the ranks differ, who never finished it,
// what each of those was doing instead, and the last op each rank completed.
// `dtrun analyze DIR` prints it, and dtrun prints it after a failed job's
// summary when the attempt's log folder holds dumps.
//
// Contract:
//  * Depends on common/ only (the launcher links it and no tensor code).
//  * parseFlightDump throws InvalidArgument naming the file and the member
//    for a document that is not a dump; readFlightDumps never throws for a
//    bad file: it skips it and says why in `problems`, so one truncated dump
//    does not hide the others. It reads every flight_rank*.json in the folder
//    (not below it); a `runId` other than "" keeps only that job's dumps.
//  * analyzeFlightDumps is pure: the same dumps give the same text. Where a
//    rank wrote several dumps (a failure, then SIGUSR2), the latest is used.
//  * Thread safety: pure functions over values; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dt::debug {

struct FlightEntry {
  uint64_t id = 0;
  std::string group;
  int instance = 0;  // which creation of the group's name (a group made again counts up)
  int groupRank = 0;
  int groupSize = 0;
  bool p2p = false;
  uint64_t seq = 0;  // the group's collective number, or its p2p number
  std::string op;
  std::string dtype;           // "" for ops without tensors
  std::vector<int64_t> shape;  // of the first tensor
  int tensors = 0;
  uint64_t bytes = 0;
  std::string reduceOp;
  int peer = -1;                                        // a collective's root or a p2p op's peer
  std::string state;                                    // queued, running, done, failed, aborted
  std::optional<int64_t> issuedUs, startedUs, endedUs;  // Unix microseconds
  int thread = 0;
  std::string context;

  // "allreduce #3 (float32[4,1024], sum)", "send #2 to rank 1 (float32[8])".
  std::string describe() const;
  // What ranks compare: op, dtype, shape (not for allToAll*: sizes may differ), reduce op, root.
  std::string signature() const;
};

struct FlightDump {
  std::string path;
  int rank = -1;  // global rank (RANK), -1 when unknown
  int worldSize = 0;
  int pid = 0;
  std::string host;
  std::string runId;
  std::string reason;
  std::string detail;
  int64_t dumpedUs = 0;
  uint64_t capacity = 0;
  uint64_t recorded = 0;
  std::vector<FlightEntry> entries;  // oldest first
};

FlightDump parseFlightDump(const std::string& text, const std::string& path);
std::vector<FlightDump> readFlightDumps(const std::string& dir, const std::string& runId,
                                        std::vector<std::string>* problems);
// Whether `dir` holds at least one flight_rank*.json (of `runId`, when not "").
bool hasFlightDumps(const std::string& dir, const std::string& runId = "");
// The story, several lines, each ending with a newline.
std::string analyzeFlightDumps(const std::vector<FlightDump>& dumps);

}  // namespace dt::debug
