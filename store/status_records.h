// The records a job's ranks publish in its store for dtrun's live status page
// (launcher/status.h, docs/debugging.md "The live status page"), shared by the writer (the
// training loop, train/loop.cpp) and the reader (dtrun), as store/membership.h is for deaths.
//
//   dt/status/rank/<member>  every rank, at each logged step (LoopOptions::logEvery):
//                            "<ms>\t<step>\t<steps>\t<loss>\t<rate>\t<unit>\t<rss bytes>\t<rank>\t<world>\t<host>"
//   dt/status/curve/count    curve points posted so far (a counter)
//   dt/status/curve/<n>      rank 0, the n-th logged step (1, 2, ...):
//                            "<step>\t<loss>\t<rate>[\t<name>=<value>...]" (the step function's and
//                            the evaluation's figures; an evaluation name only where it ran)
//   dt/status/event/count    events posted so far (a counter)
//   dt/status/event/<n>      rank 0, the n-th event: "<ms>\t<kind>\t<text>" (kind: recovery, admission,
//                            checkpoint)
//
// <ms> is the writer's wall clock (ms since the epoch); <loss> and <rate> are the window's means
// over the ranks ("nan" when none yet). Tabs and newlines inside texts become spaces.
//
// Contract: the encoders and decoders are pure (decoders return nullopt for a value they cannot
// read: the reader skips it rather than failing a status page). post*() are one or two store
// calls each; the store's errors propagate (the writer catches them: a status record is never
// worth a training step). Thread safety: the store's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "store/store.h"

namespace dt::status {

struct RankRecord {
  int64_t timeMs = 0;
  int64_t step = 0;
  int64_t steps = 0;
  double loss = 0;
  double rate = 0;          // units per second of the whole job over the window
  std::string unit;         // "samples", "tokens"
  int64_t rssBytes = -1;    // the process's resident set (-1: unknown)
  int rank = -1;
  int world = 0;
  std::string host;
};

struct CurvePoint {
  int64_t step = 0;
  double loss = 0;
  double rate = 0;
  std::vector<std::pair<std::string, double>> metrics;
};

struct EventRecord {
  int64_t timeMs = 0;
  std::string kind;
  std::string text;
};

std::string rankKey(int member);
std::string curveKey(int64_t n);
std::string eventKey(int64_t n);
inline constexpr const char* kCurveCount = "dt/status/curve/count";
inline constexpr const char* kEventCount = "dt/status/event/count";

std::string encode(const RankRecord& record);
std::string encode(const CurvePoint& point);
std::string encode(const EventRecord& event);
std::optional<RankRecord> decodeRankRecord(const std::string& value);
std::optional<CurvePoint> decodeCurvePoint(const std::string& value);
std::optional<EventRecord> decodeEvent(const std::string& value);

void postRank(Store& store, int member, const RankRecord& record);
void postCurvePoint(Store& store, const CurvePoint& point);
void postEvent(Store& store, const EventRecord& event);

// This process's resident set in bytes (/proc/self/statm), or -1.
int64_t residentBytes();

}  // namespace dt::status
