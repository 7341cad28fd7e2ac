// The agent's store side: everything dtrun exchanges with the other nodes
// through the job's store while workers run, on one background thread so that
// a slow or unreachable store never stalls the monitor loop.
//
// Keys (all under "dtrun/"; attempt k = restart count):
//   dtrun/hb/<node>            heartbeat counter, add(1) every tick (not with leaseLiveness)
//   dtrun/a<k>/failed          first failure of attempt k (compareSet: first one wins):
//                              "<exit code>\t<epoch ms>\t<node>\t<description>"
//   dtrun/a<k>/done/<node>     the node's workers all succeeded
//   dtrun/a<k>/late            "<node>,<node>,...": nodes that joined attempt k while it ran
//                              (dtrun --elastic --nnodes MIN:MAX); watched like the others
//   dtrun/exit/<node>          node <node> saw the final outcome and is leaving
//   dt/progress/<rank>         "<seq> <op>": written by each rank's process group
//                              after a collective (read by the hang watchdog)
//
// Contract:
//  * Every tick (the monitor interval, or at once when the monitor loop asks
//    for something) it flushes requests, bumps its heartbeat, watches the other
//    nodes' heartbeats and the failure key, and (when asked) the progress keys.
//  * What it learns becomes an Event that the monitor loop takes with
//    takeEvents(); each new event writes to `wakeFd` (an eventfd) so the loop's
//    poll() wakes up.
//  * lastContactMs() is when a tick last finished talking to the store: a
//    store call that hangs (a cut link) shows up as a stale contact.
//  * The destructor stops the thread; if the thread is stuck in a store call,
//    it is detached (it holds its own references) rather than waited for.
// Thread safety: all public methods may be called from the monitor thread
// while the coordinator thread runs.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "launcher/options.h"
#include "store/store.h"

namespace dt::launcher {

struct CoordinatorEvent {
  enum class Kind { RemoteFailure, FailurePublished, NodeLost, StoreLost, Hang, AllDone, ExitsSeen, ExitPublished };
  Kind kind;
  std::string text;
  int code = 1;
  int attempt = -1;  // the attempt being watched when it was posted
  int node = -1;     // NodeLost: the node
};

// "<code>\t<ms>\t<node>\t<description>" and back.
std::string encodeFailure(int code, int64_t timeMs, int node, const std::string& description);
struct DecodedFailure {
  int code = 1;
  int64_t timeMs = 0;
  int node = -1;
  std::string description;
};
DecodedFailure decodeFailure(const std::string& value);

// Hang watchdog report from each rank's last progress value ("" when none):
// "rank 0: #12 allreduce; rank 1: #11 allreduce; rank 2: none. Behind: ranks 1-2 (furthest: #12)".
std::string formatHangReport(const std::vector<std::string>& progress);

class Coordinator {
 public:
  struct Config {
    int nodeRank = 0;
    int nnodes = 1;
    Millis interval{500};
    Millis nodeTimeout{10000};
    Millis hangTimeout{0};  // 0: no watchdog
    // etcd (--rdzv-backend etcd): each node's claim on the attempt,
    // dtrun/a<k>/node/<i>, is bound to its dtrun's lease, and that is its
    // heartbeat: every node (none is special) watches the others' claims and
    // reports NodeLost when one vanishes without an exit record. No
    // dtrun/hb counters then.
    bool leaseLiveness = false;
    // --elastic --nnodes MIN:MAX: nodes may join the attempt (dtrun/a<k>/late is read every tick).
    bool nodesMayJoin = false;
  };
  Coordinator(StorePtr store, Config config, int wakeFd);
  ~Coordinator();

  // Starts watching attempt k with `worldSize` ranks (startMs: when its workers began) on
  // `nodes` (empty: 0..nnodes-1; and any node that joins it later).
  void beginAttempt(int attempt, int worldSize, int64_t startMs, const std::vector<int>& nodes = {});
  // Stops failure/hang watching (between attempts).
  void endAttempt();
  void publishFailure(const std::string& encoded);
  void publishDone();
  void publishExit();
  // Node 0: report ExitsSeen once every other node has published its exit.
  void awaitExits();
  // A node the agent found lost by itself (a watch connection): not watched,
  // nor waited for, any more.
  void markLost(int node);
  // This node's dtrun now hosts the job's store (its standby took over from
  // node 0's): it watches the other nodes' heartbeats, as node 0 did.
  void hostStore();

  std::vector<CoordinatorEvent> takeEvents();
  int64_t lastContactMs() const;

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;
  std::thread thread_;
};

}  // namespace dt::launcher
