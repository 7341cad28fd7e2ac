#include "launcher/coordinator.h"

#include <algorithm>
#include <set>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/errors.h"
#include "common/strings.h"
#include "common/thread_name.h"
#include "launcher/machine.h"

namespace dt::launcher {

std::string encodeFailure(int code, int64_t timeMs, int node, const std::string& description) {
  return str(code, "\t", timeMs, "\t", node, "\t", description);
}

DecodedFailure decodeFailure(const std::string& value) {
  DecodedFailure out;
  const auto parts = split(value, '\t');
  if (parts.size() < 4) {
    out.description = value;
    return out;
  }
  try {
    out.code = std::stoi(parts[0]);
    out.timeMs = std::stoll(parts[1]);
    out.node = std::stoi(parts[2]);
  } catch (const std::exception&) {
    out.description = value;
    return out;
  }
  out.description = value.substr(parts[0].size() + parts[1].size() + parts[2].size() + 3);
  return out;
}

namespace {

// Leading sequence number of a "<seq> <op>" progress value; -1 when absent.
int64_t progressSeq(const std::string& value) {
  if (value.empty()) return -1;
  try {
    return std::stoll(value);
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace

std::string formatHangReport(const std::vector<std::string>& progress) {
  std::string out;
  int64_t furthest = -1;
  for (const auto& value : progress) furthest = std::max(furthest, progressSeq(value));
  for (size_t r = 0; r < progress.size(); ++r) {
    if (r) out += "; ";
    out += str("rank ", r, ": ");
    if (progress[r].empty()) {
      out += "no collective completed";
    } else {
      out += '#';
      out += progress[r];
    }
  }
  std::vector<int> behind;
  for (size_t r = 0; r < progress.size(); ++r) {
    if (progressSeq(progress[r]) < furthest) behind.push_back(static_cast<int>(r));
  }
  if (behind.empty()) {
    out += ". No rank is behind: all stopped after the same collective (a hang inside the next one, or outside collectives)";
  } else {
    out += str(". Behind: rank(s) ", formatRanges(behind), " (the furthest rank completed #", furthest, ")");
  }
  return out;
}

struct Coordinator::Shared {
  StorePtr store;
  Config config;
  int wakeFd;
  std::mutex mutex;
  std::condition_variable cv;
  bool stop = false;
  bool kick = false;
  // Requests from the monitor loop.
  std::vector<std::pair<std::string, std::string>> outboxSets;
  std::string failureToPublish;
  bool exitToPublish = false;
  bool watchingExits = false;
  bool waitingDone = false;
  // Attempt being watched.
  int attempt = -1;
  int worldSize = 0;
  // The nodes of the attempt: its participants, then the nodes that joined it
  // (dtrun/a<k>/late; read every tick). Before the first attempt: 0..nnodes-1.
  std::set<int> nodes;
  int64_t attemptStartMs = 0;
  uint64_t epoch = 0;  // bumped by beginAttempt (under the mutex)
  // Owned by the coordinator thread; reset when it sees a new epoch.
  uint64_t seenEpoch = 0;
  bool failureSeen = false;
  bool hangReported = false;
  std::vector<std::string> lastProgress;
  int64_t lastProgressChangeMs = 0;
  // Node heartbeats: last value and when it changed.
  std::map<int, std::pair<int64_t, int64_t>> heartbeats;
  std::map<int, bool> lost;
  std::set<int> lostElsewhere;  // markLost(), under the mutex; merged into `lost` each tick
  bool hostsStore = false;      // node 0, or hostStore() (under the mutex)
  bool storeLost = false;
  std::vector<CoordinatorEvent> events;
  std::atomic<int64_t> lastContact{0};

  void post(CoordinatorEvent event) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      event.attempt = attempt;
      events.push_back(std::move(event));
    }
    const uint64_t one = 1;
    ssize_t ignored = ::write(wakeFd, &one, sizeof(one));
    (void)ignored;
  }

  std::string key(const std::string& suffix) const { return "dtrun/" + suffix; }

  void tick() {
    std::vector<std::pair<std::string, std::string>> sets;
    std::string failure;
    bool publishExit = false, exits = false, done = false;
    int k = -1, world = 0;
    int64_t startMs = 0;
    std::set<int> active;
    bool host = false;
    {
      std::lock_guard<std::mutex> lock(mutex);
      active = nodes;
      host = hostsStore;
      for (int node : lostElsewhere) lost[node] = true;
      sets.swap(outboxSets);
      failure.swap(failureToPublish);
      publishExit = exitToPublish;
      exitToPublish = false;
      exits = watchingExits;
      done = waitingDone;
      k = attempt;
      world = worldSize;
      startMs = attemptStartMs;
      if (epoch != seenEpoch) {
        seenEpoch = epoch;
        failureSeen = false;
        hangReported = false;
        lastProgress.clear();
        lastProgressChangeMs = startMs;
      }
    }
    const int64_t now = wallMs();
    for (const auto& [name, value] : sets) store->set(name, value);
    if (!failure.empty() && k >= 0) {
      const std::string stored = store->compareSet(key(str("a", k, "/failed")), "", failure);
      failureSeen = true;
      if (stored == failure) {
        post({CoordinatorEvent::Kind::FailurePublished, failure, decodeFailure(failure).code});
      } else {
        post({CoordinatorEvent::Kind::RemoteFailure, stored, decodeFailure(stored).code});
      }
    }
    if (publishExit) {
      store->set(key(str("exit/", config.nodeRank)), "1");
      post({CoordinatorEvent::Kind::ExitPublished, "", 0});
    }
    if (config.nnodes > 1) {
      if (config.nodesMayJoin && k >= 0 && store->check({key(str("a", k, "/late"))})) {  // nodes that joined the running attempt
        for (const auto& id : split(store->get(key(str("a", k, "/late"))), ',')) {
          if (id.empty()) continue;
          const int node = std::stoi(id);
          if (active.insert(node).second) {
            std::lock_guard<std::mutex> lock(mutex);
            nodes.insert(node);
          }
        }
      }
      if (config.leaseLiveness) {
        watchRegistrations(k, exits, active);
      } else {
        store->add(key(str("hb/", config.nodeRank)), 1);
        // The store's host (node 0, or the node whose standby took over)
        // watches everyone's heartbeats (one multiGet per tick) and records a
        // lost node as the attempt's failure; the other nodes learn it from
        // there, and notice the host's own death as a store failure (or, with
        // a standby, by its watch connection).
        if (host) watchHeartbeats(k, exits, now, active);
      }
      if (k >= 0 && !failureSeen) {
        const std::string failedKey = key(str("a", k, "/failed"));
        if (store->check({failedKey})) {
          failureSeen = true;
          const std::string value = store->get(failedKey);
          post({CoordinatorEvent::Kind::RemoteFailure, value, decodeFailure(value).code});
        }
      }
      if (done && k >= 0) {
        std::vector<std::string> keys;
        for (int node : active) keys.push_back(key(str("a", k, "/done/", node)));
        if (store->check(keys)) {
          {
            std::lock_guard<std::mutex> lock(mutex);
            waitingDone = false;
          }
          post({CoordinatorEvent::Kind::AllDone, "", 0});
        }
      }
      if (exits) {
        std::vector<std::string> keys;
        for (int node : active) {
          if (node != config.nodeRank && !lost[node]) keys.push_back(key(str("exit/", node)));
        }
        if (keys.empty() || store->check(keys)) {
          {
            std::lock_guard<std::mutex> lock(mutex);
            watchingExits = false;
          }
          post({CoordinatorEvent::Kind::ExitsSeen, "", 0});
        }
      }
    }
    if (config.hangTimeout.count() > 0 && host && k >= 0 && !hangReported && world > 0) {
      std::vector<std::string> progress(static_cast<size_t>(world));
      std::vector<std::string> names;
      for (int r = 0; r < world; ++r) names.push_back(str("dt/progress/", r));
      if (store->check(names)) {
        progress = store->multiGet(names);  // the usual case once every rank has run a collective
      } else {
        for (int r = 0; r < world; ++r) {
          if (store->check({names[static_cast<size_t>(r)]})) progress[static_cast<size_t>(r)] = store->get(names[static_cast<size_t>(r)]);
        }
      }
      if (progress != lastProgress) {
        lastProgress = progress;
        lastProgressChangeMs = now;
      }
      const int64_t since = std::max(lastProgressChangeMs, startMs);
      if (now - since > config.hangTimeout.count()) {
        hangReported = true;
        post({CoordinatorEvent::Kind::Hang,
              str("hang watchdog: no rank completed a collective for ", formatDuration(Millis(now - since)),
                  " (--hang-timeout ", formatDuration(config.hangTimeout), "). Last completed collective: ",
                  formatHangReport(progress)),
              124});
      }
    }
    lastContact.store(wallMs());
  }

  // leaseLiveness: the other nodes' lease-bound claims on attempt k (one
  // check per tick while all are there).
  void watchRegistrations(int k, bool exits, const std::set<int>& active) {
    if (k < 0 || exits) return;
    std::vector<std::string> keys;
    std::vector<int> watched;
    for (int node : active) {
      if (node == config.nodeRank || lost[node]) continue;
      keys.push_back(key(str("a", k, "/node/", node)));
      watched.push_back(node);
    }
    if (keys.empty() || store->check(keys)) return;
    for (size_t i = 0; i < keys.size(); ++i) {
      const int node = watched[i];
      if (store->check({keys[i]}) || store->check({key(str("exit/", node))})) continue;
      lost[node] = true;
      post({CoordinatorEvent::Kind::NodeLost,
            str("node ", node, "'s registration in etcd (", keys[i], ", bound to its dtrun's lease) vanished: its dtrun ",
                "died, or could not reach etcd for longer than the lease's TTL (--node-timeout ",
                formatDuration(config.nodeTimeout), ")"),
            1, -1, node});
    }
  }

  void watchHeartbeats(int k, bool exits, int64_t now, const std::set<int>& active) {
    std::vector<std::string> keys;
    std::vector<int> watched;
    for (int node : active) {
      if (node == config.nodeRank || lost[node]) continue;
      keys.push_back(key(str("hb/", node)));
      watched.push_back(node);
    }
    if (keys.empty()) return;
    std::vector<int64_t> values(keys.size(), -1);
    if (store->check(keys)) {
      const auto raw = store->multiGet(keys);
      for (size_t i = 0; i < raw.size(); ++i) values[i] = std::stoll(raw[i]);
    } else {
      // Before the first rendezvous a node may not have started; after it, a
      // node that joined but never beat is tracked like one whose beats stopped.
      if (k < 0) return;
      for (size_t i = 0; i < keys.size(); ++i) {
        if (store->check({keys[i]})) values[i] = std::stoll(store->get(keys[i]));
      }
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      const int node = watched[i];
      auto it = heartbeats.find(node);
      if (it == heartbeats.end() || it->second.first != values[i]) {
        heartbeats[node] = {values[i], now};
      } else if (now - it->second.second > config.nodeTimeout.count() && !exits &&
                 !store->check({key(str("exit/", node))})) {
        lost[node] = true;
        post({CoordinatorEvent::Kind::NodeLost,
              str("node ", node, " stopped sending heartbeats to the store (none for ",
                  formatDuration(Millis(now - it->second.second)), ", node timeout ",
                  formatDuration(config.nodeTimeout),
                  "): its dtrun died, its machine is down, or the network to it is cut"),
              1, -1, node});
      }
    }
  }

  void run() {
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mutex);
        // At the end of a job nodes wait on each other: poll faster then.
        const Millis wait = (waitingDone || watchingExits) ? std::min(config.interval, Millis(50)) : config.interval;
        cv.wait_for(lock, wait, [&] { return stop || kick; });
        if (stop) return;
        kick = false;
      }
      try {
        tick();
      } catch (const std::exception& e) {
        if (!storeLost) {
          storeLost = true;
          post({CoordinatorEvent::Kind::StoreLost,
                str("lost the job's store (", store->describe(), "): ", e.what(),
                    config.nodeRank == 0 ? "" : "; node 0's dtrun died, or the network to it is cut"),
                1});
        }
        // Back off: a dead store fails every call at once.
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait_for(lock, config.interval * 4, [&] { return stop; });
        if (stop) return;
      }
    }
  }
};

Coordinator::Coordinator(StorePtr store, Config config, int wakeFd) : shared_(std::make_shared<Shared>()) {
  shared_->store = std::move(store);
  shared_->config = config;
  shared_->hostsStore = config.nodeRank == 0;
  for (int node = 0; node < config.nnodes; ++node) shared_->nodes.insert(node);
  shared_->wakeFd = wakeFd;
  shared_->lastContact.store(wallMs());
  auto shared = shared_;
  thread_ = std::thread([shared] {
    setThreadName("dtrun-coord");
    shared->run();
  });
}

Coordinator::~Coordinator() {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->stop = true;
  }
  shared_->cv.notify_all();
  // A thread stuck in a store call (cut link) would block exit; it owns a
  // reference to everything it touches, so it can be left behind.
  if (wallMs() - shared_->lastContact.load() > 2 * shared_->config.interval.count() + 1000) {
    thread_.detach();
  } else {
    thread_.join();
  }
}

void Coordinator::beginAttempt(int attempt, int worldSize, int64_t startMs, const std::vector<int>& nodes) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  if (!nodes.empty()) shared_->nodes = std::set<int>(nodes.begin(), nodes.end());
  shared_->attempt = attempt;
  shared_->worldSize = worldSize;
  shared_->attemptStartMs = startMs;
  ++shared_->epoch;
  shared_->waitingDone = false;
}

void Coordinator::endAttempt() {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->attempt = -1;
  shared_->waitingDone = false;
}

void Coordinator::publishFailure(const std::string& encoded) {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->failureToPublish = encoded;
    shared_->kick = true;
  }
  shared_->cv.notify_all();
}

void Coordinator::publishDone() {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    if (shared_->attempt >= 0) {
      shared_->outboxSets.emplace_back(str("dtrun/a", shared_->attempt, "/done/", shared_->config.nodeRank), "1");
    }
    shared_->waitingDone = true;
    shared_->kick = true;
  }
  shared_->cv.notify_all();
}

void Coordinator::publishExit() {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->exitToPublish = true;
    shared_->kick = true;
  }
  shared_->cv.notify_all();
}

void Coordinator::awaitExits() {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->watchingExits = true;
    shared_->kick = true;
  }
  shared_->cv.notify_all();
}

void Coordinator::markLost(int node) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->lostElsewhere.insert(node);
}

void Coordinator::hostStore() {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->hostsStore = true;
    shared_->kick = true;
  }
  shared_->cv.notify_all();
}

std::vector<CoordinatorEvent> Coordinator::takeEvents() {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  std::vector<CoordinatorEvent> out;
  out.swap(shared_->events);
  return out;
}

int64_t Coordinator::lastContactMs() const { return shared_->lastContact.load(); }

}  // namespace dt::launcher
