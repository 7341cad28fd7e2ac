// What dtrun's live status page shows (`dtrun --status-port`, docs/debugging.md "The live
// status page"): the job's members, its events and its curves, read from the job's store.
//
// Sources (all in the job's store, so the dtrun of any node sees the whole job):
//   * the ranks' records (store/status_records.h): each member's step, loss, throughput, RSS and
//     host at every logged step; rank 0's curve points and events (recoveries, admissions,
//     checkpoints), written by the training loop (train/loop.h);
//   * the process groups' dt/progress/<member> ("<seq> <op>"): the last collective completed;
//   * the elastic records (store/membership.h): deaths and their reasons, joiner registrations,
//     heartbeats, members that left with their replica;
//   * the straggler reports dt/straggler/<n> (train/straggler.h).
// A program that is not on the training loop shows its members with what the launcher and its
// process group know (state, last op, heartbeat) and no step or curve.
//
// Contract:
//  * StatusCollector::poll() reads the store once (a few calls per member, and only the new
//    entries of the counted lists) and replaces the view; start() runs poll() on a thread of
//    its own every `interval`, on a clone of the store whose calls time out after at most a
//    second, so an unreachable store shows as an error on the page and never blocks dtrun.
//    The destructor stops the thread (it waits for at most one poll).
//  * view() returns a copy of the latest view; it never touches the store. Thread-safe: view(),
//    beginAttempt() and finish() may be called from any thread while the poller runs.
//  * Events are kept in the order they were read (the newest kEventLimit), curve points the
//    newest kCurveLimit: a long job's page stays small.
//  * statusJson() and prometheusText() are pure functions of a view (the formats are in
//    docs/debugging.md).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "launcher/options.h"
#include "store/status_records.h"
#include "store/store.h"

namespace dt::launcher {

struct MemberView {
  int member = -1;
  int rank = -1;          // its rank in the job now (the last it reported); -1 before it knows one
  std::string host;
  // "starting" (no record yet), "joining" (a registered joiner not yet admitted), "running",
  // "dead", "left" (dropped with its replica), "finished" (the job ended while it ran).
  std::string state;
  std::string reason;     // dead/left: why
  int64_t step = -1;      // -1: no record yet
  double loss = 0;        // NaN when unknown
  double rate = 0;        // the job's units per second as this member last saw it (NaN: unknown)
  int64_t rssBytes = -1;
  std::string lastOp;     // "#41 allreduce" ("" : none yet)
  double heartbeatAgeS = -1;  // since its heartbeat (elastic) or its record last changed; -1: never seen
};

struct JobEvent {
  int64_t timeMs = 0;
  std::string kind;  // start, death, join, recovery, admission, straggler, checkpoint, finish
  std::string text;
};

struct JobView {
  std::string runId;
  bool elastic = false;
  int attempt = -1;        // -1: no workers started yet
  int initialWorld = 0;
  int64_t startMs = 0;     // when this dtrun began watching the job
  int64_t nowMs = 0;       // when this view was made
  std::string state = "starting";  // starting, running, finished (the outcome follows)
  std::string outcome;     // finish()'s text
  std::string storeError;  // the last poll's failure ("" : it read everything)
  int64_t step = -1, steps = 0;
  double loss = 0, rate = 0;  // the newest curve point's (NaN without one)
  std::string unit = "samples";
  std::vector<MemberView> members;
  std::vector<JobEvent> events;
  std::vector<status::CurvePoint> curve;
  std::vector<std::pair<std::string, int64_t>> eventCounts;  // per kind, over the whole job
};

constexpr size_t kEventLimit = 1000;
constexpr size_t kCurveLimit = 5000;

std::string statusJson(const JobView& view);
// Prometheus' text exposition format (version 0.0.4): HELP and TYPE for every metric,
// labels member/rank/host on the members' figures.
std::string prometheusText(const JobView& view);

class StatusCollector {
 public:
  struct Config {
    std::string runId;
    bool elastic = false;
    Millis interval{1000};
  };
  StatusCollector(StorePtr store, Config config);
  ~StatusCollector();
  StatusCollector(const StatusCollector&) = delete;
  StatusCollector& operator=(const StatusCollector&) = delete;

  // Polls every interval on a thread of its own (the store is cloned first).
  void start();
  // The job's workers of `attempt` started: `world` members of the start (ids 0..world-1).
  void beginAttempt(int attempt, int world);
  // The job is over (dtrun's exit): the members still running show as finished.
  void finish(const std::string& outcome);
  // One read of the store; the view is replaced when it returns (also on an error, which the
  // view then names).
  void poll();
  JobView view() const;

 private:
  struct State;
  StorePtr store_;
  Config config_;
  std::unique_ptr<State> state_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dt::launcher
