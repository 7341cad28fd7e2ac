#include "launcher/agent.h"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/config.h"
#include "common/errors.h"
#include "common/strings.h"
#include "debug/flight_analysis.h"
#include "launcher/coordinator.h"
#include "launcher/flight_gather.h"
#include "launcher/machine.h"
#include "launcher/output.h"
#include "launcher/status.h"
#include "launcher/status_server.h"
#include "launcher/summary.h"
#include "launcher/worker_env.h"
#include "store/membership.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"
#if DT_HAVE_ETCD
#include "launcher/etcd_rendezvous.h"
#include "store/etcd_store.h"
#endif

namespace dt::launcher {
namespace {

bool isTermination(int sig) { return sig == SIGINT || sig == SIGTERM || sig == SIGHUP || sig == SIGQUIT; }

struct Worker {
  int rank = 0;
  int member = 0;  // --elastic: its member id (the rank, or a replacement's fresh id)
  int replacements = 0;  // --elastic: how many times this local rank was started again
  int localRank = 0;
  pid_t pid = -1;
  bool reaped = false;
  int fds[2] = {-1, -1};  // stdout, stderr read ends
  std::unique_ptr<OutputStream> streams[2];
  WorkerOutcome outcome;
  // --elastic: posted dead (the others go on without it), and its heartbeat.
  bool lost = false;
  // --elastic: it exited 0 after the job dropped it with its replica (store/membership.h's
  // elastic/left): not the job finishing; replaced under --max-restarts.
  bool leftJob = false;
  std::string killedBecause;  // dtrun sent this worker alone SIGKILL, and why
  bool evicted = false;       // --evict-stragglers killed it: it is not replaced
  int64_t oomKillsAtStart = -1;  // oomKillCount() when it started
  std::optional<uint64_t> beat;
  int64_t beatSeenMs = 0;
};

// Whether `pid` has a handler for `sig` (/proc's SigCgt): dtrun asks a worker for its
// flight record with SIGUSR2 only where that cannot kill it.
bool catchesSignal(pid_t pid, int sig) {
  std::ifstream status(str("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (!line.starts_with("SigCgt:")) continue;
    try {
      const uint64_t mask = std::stoull(line.substr(7), nullptr, 16);
      return (mask >> (sig - 1)) & 1;
    } catch (const std::exception&) {
      return false;
    }
  }
  return false;
}

struct Rendezvous {
  int worldSize = 1;
  int rankOffset = 0;
  std::map<int, std::pair<int, int>> nodeRanks;  // per node of the attempt's start: first rank, count
  std::vector<int> nodes;  // the nodes the attempt started with (empty: 0..nnodes-1)
  // --elastic --nnodes MIN:MAX: this node joined the attempt while it ran; its workers join
  // the job's membership (fresh member ids) instead of being ranks of its start.
  bool late = false;
};

// How long a job of --nnodes MIN:MAX waits for more nodes once MIN are there (all MAX start it at once).
constexpr int64_t kLastCallMs = 2000;
// After a failed attempt, how long a node waits for the other nodes' flight records, and how
// many bytes of its own it posts (a store value; the TcpStore takes up to 64 MiB).
constexpr int64_t kFlightGatherMs = 5000;
constexpr size_t kFlightGatherBytes = size_t{32} << 20;

struct AttemptResult {
  bool success = false;
  int exitCode = 0;
};

}  // namespace

struct Agent::Impl {
  AgentConfig cfg;
  LaunchOptions& o;
  SignalChannel& signals;
  std::string tag;
  StorePtr store;
  std::unique_ptr<Coordinator> coord;
  int wakeFd = -1;
  std::string token, runId, storeAddr;
  int workerPort = 0;
  int terminationSignal = 0;
  int sigintCount = 0;
  bool threadsNoticePrinted = false;
  bool storeGone = false;
  const std::string nonce = randomHex(4);  // tells this dtrun from another claiming the same node rank  // the store is unreachable: skip waits that need it
  std::vector<CoordinatorEvent> pendingEvents;  // taken while waiting, handled later
  // --status-port: the live page (launcher/status.h). The server, which calls the collector,
  // is declared after it and so destroyed first.
  std::unique_ptr<StatusCollector> statusCollector;
  std::unique_ptr<StatusServer> statusServer;
  // Straggler reports read so far (the training loop's dt/straggler/<n>, train/straggler.h),
  // over every attempt of an elastic job (the keys outlive an attempt); a restarted worker
  // group's own keys count again from 1.
  int64_t stragglersSeen = 0;
  // Watch connections between dtruns. The kernel closes a dead process's
  // sockets at once, even after SIGKILL: the peer's read returns end-of-file
  // within milliseconds, which is proof that the dtrun is gone (its workers go
  // with it: guardian.h), where a silent heartbeat is only suspicion (a cut
  // link, a frozen machine) and needs --node-timeout. With the TCP store every
  // node k keeps one connection to node 0's dtrun (the store's host, without
  // which nothing goes on). With etcd no node is special: every pair of nodes
  // keeps one, opened by the higher node id, so any node's loss is seen by all.
  int watchListenFd = -1;                // node 0 (TCP store); every node (etcd)
  std::map<int, std::pair<int, std::string>> watchPeers;  // accepted: fd -> (node or -1, partial line)
  std::map<int, int> watchOut;           // opened by this node: fd -> the node it watches
  std::string watchPort;                 // TCP store, node k: where node 0 listens
  bool watchTried = false;
  // --elastic on several nodes with the TCP store: node 1's dtrun hosts the store's hot
  // standby (store/tcp_store_server.h), so that node 0 is lost like any other node: the
  // standby takes over when node 0's dtrun is gone, and every client (agents, workers) fails
  // over to it. Node 1 also listens for watch connections then, and nodes 2+ open one to it.
  std::shared_ptr<TcpStoreServer> standbyServer;  // node 1
  std::string standbyAddr;                        // "host:port" once known ("" : none)
  bool withStandby() const { return !o.etcd() && o.elastic && o.nnodes > 1; }

  void addWatchFds(std::vector<pollfd>& fds) const {
    if (watchListenFd >= 0) fds.push_back({watchListenFd, POLLIN, 0});
    for (const auto& [fd, peer] : watchPeers) fds.push_back({fd, POLLIN, 0});
    for (const auto& [fd, node] : watchOut) fds.push_back({fd, POLLIN, 0});
  }

  // A watched dtrun closed its connection: lost, unless it recorded a normal exit first.
  void watchedNodeClosed(int node) {
    if (!o.etcd() && node == 0 && standbyAddr.empty()) {
      pendingEvents.push_back({CoordinatorEvent::Kind::StoreLost,
                               "node 0's dtrun closed its watch connection: it died or was killed", 1});
      return;
    }
    if (node < 0 || nodeExited(node)) return;
    pendingEvents.push_back({CoordinatorEvent::Kind::NodeLost,
                             str("node ", node, "'s dtrun closed its watch connection without finishing: its process is "
                                 "gone (SIGKILL, OOM killer, a crash), as its kernel closed the connection"),
                             1, -1, node});
  }

  bool nodeExited(int node) {
    try {
      return store->check({str("dtrun/exit/", node)});
    } catch (const std::exception&) {
      return false;
    }
  }

  // Handles a readable watch descriptor; what it learns goes to pendingEvents.
  void onWatchFd(int fd) {
    char buf[256];
    if (fd == watchListenFd) {
      const int peer = ::accept4(watchListenFd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (peer >= 0) watchPeers[peer] = {-1, ""};
      return;
    }
    if (const auto out = watchOut.find(fd); out != watchOut.end()) {
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        const int node = out->second;
        ::close(fd);
        watchOut.erase(out);
        watchedNodeClosed(node);
      }
      return;
    }
    auto it = watchPeers.find(fd);
    if (it == watchPeers.end()) return;
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n > 0) {
      auto& [node, line] = it->second;
      line.append(buf, static_cast<size_t>(n));
      const auto nl = line.find('\n');
      if (node < 0 && nl != std::string::npos) {
        // "<token> <node>": a stranger must not be able to fake a node's death.
        const auto parts = split(line.substr(0, nl), ' ');
        if (parts.size() == 2 && parts[0] == (token.empty() ? "-" : token)) {
          node = std::atoi(parts[1].c_str());
        } else {
          ::close(fd);
          watchPeers.erase(it);
        }
      }
      return;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    const int node = it->second.first;
    ::close(fd);
    watchPeers.erase(it);
    if (node >= 0) watchedNodeClosed(node);
  }

  // Opens a watch connection to `node`'s dtrun at host:port (false: none, and why is said).
  bool watchNode(int node, const std::string& host, uint16_t port) {
    std::string error;
    const int fd = connectTcp(host, port, error);
    if (fd < 0) {
      say(str("warning: no watch connection to node ", node, " (", error, "); its loss is seen by ",
              o.etcd() ? "its lease" : "the store's heartbeats", " only (--node-timeout ", formatDuration(o.nodeTimeout), ")"));
      return false;
    }
    writeAll(fd, str(token.empty() ? "-" : token, " ", o.nodeRank, "\n"));
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    watchOut[fd] = node;
    return true;
  }

  // TCP store, node k, once its node rank is its own: opens the watch connection to node 0.
  void setupWatch() {
    if (o.nnodes == 1 || o.nodeRank == 0 || watchTried) return;
    watchTried = true;
    watchNode(0, o.masterAddr, static_cast<uint16_t>(std::stoi(watchPort)));
  }

  // etcd, once this node's id is its own: listens for the watch connections of higher node ids
  // and publishes where (dtrun/watch/<node>).
  void publishWatchAddress() {
    if (o.nnodes == 1) return;
    if (watchListenFd < 0) {
      uint16_t port = 0;
      watchListenFd = listenTcp(o.bind, port);
      watchPort = std::to_string(port);
    }
    store->set(str("dtrun/watch/", o.nodeRank), str(cfg.hostname, "\t", watchPort, "\t", nonce));
  }

  // etcd, once the attempt's nodes are known: a watch connection to each lower node id not
  // watched yet (each published its address right after claiming its id, before the attempt
  // could fill).
  void watchLowerNodes(const std::vector<int>& nodes) {
    if (o.nnodes == 1) return;
    std::set<int> watched;
    for (const auto& [fd, node] : watchOut) watched.insert(node);
    for (int node : nodes) {
      if (node >= o.nodeRank || watched.count(node)) continue;
      try {
        const auto where = split(store->get(str("dtrun/watch/", node), std::chrono::seconds(10)), '\t');
        watchNode(node, where.at(0), static_cast<uint16_t>(std::stoi(where.at(1))));
      } catch (const std::exception& e) {
        say(str("warning: no watch connection to node ", node, " (its address: ", e.what(), "); its loss is seen by "
                "its lease only (--node-timeout ", formatDuration(o.nodeTimeout), ")"));
      }
    }
  }

  Guardian* guardian;

  // --rdzv-backend etcd: the job's store (/dtrain/<id>), this dtrun's lease
  // and the round it joined; `store` is the round's store then.
#if DT_HAVE_ETCD
  std::shared_ptr<EtcdStore> etcdJob;
  std::unique_ptr<EtcdRendezvous> etcdRdzv;
#endif
  std::string workerMasterAddr;  // MASTER_ADDR for the workers

  Impl(AgentConfig config, SignalChannel& channel, Guardian* guard)
      : cfg(std::move(config)), o(cfg.options), signals(channel), guardian(guard) {
    tag = o.nnodes > 1 ? str("dtrun (node ", o.nodeRank, "/", o.nnodes, "): ") : std::string("dtrun: ");
    wakeFd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wakeFd < 0) throw Error(str("dtrun: eventfd failed: ", std::strerror(errno)));
  }

  void say(const std::string& line) const { writeAll(2, tag + line + "\n"); }

  // ---- store ---------------------------------------------------------------

  void setupEtcd() {
#if DT_HAVE_ETCD
    EtcdStoreOptions eo;
    eo.endpoints = o.rdzvEndpoint;
    eo.prefix = "/dtrain/" + o.rdzvId;
    eo.timeout = o.rdzvTimeout;
    eo.connectTimeout = o.rdzvTimeout;
    eo.caFile = o.rdzvCa;
    eo.certFile = o.rdzvCert;
    eo.keyFile = o.rdzvKey;
    eo.user = o.rdzvUser;
    eo.password = o.rdzvPassword;
    try {
      etcdJob = std::make_shared<EtcdStore>(eo);
      etcdRdzv = std::make_unique<EtcdRendezvous>(etcdJob, etcdJob->grantLease(o.nodeTimeout));
      store = etcdRdzv->enterRound(/*joinRunning=*/o.elastic && o.minNodes < o.nnodes);
    } catch (const InvalidArgument&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(str("dtrun: cannot use the rendezvous etcd at ", o.rdzvEndpoint, " (--rdzv-endpoint, job ",
                      o.rdzvId, "): ", e.what()));
    }
    runId = o.rdzvId;
    storeAddr = etcdJob->endpoints();
#else
    throw InvalidArgument("dtrun: --rdzv-backend etcd, but this dtrun was built without the etcd store "
                          "(DT_USE_ETCD=OFF, or libcurl/nlohmann-json missing when it was built: run scripts/setup.sh)");
#endif
  }

  void startCoordinator(bool leaseLiveness) {
    if (coord || (o.nnodes == 1 && o.hangTimeout.count() == 0)) return;
    Coordinator::Config cc;
    cc.nodeRank = o.nodeRank;
    cc.nnodes = o.nnodes;
    cc.interval = o.monitorInterval;
    cc.nodeTimeout = o.nodeTimeout;
    cc.hangTimeout = o.hangTimeout;
    cc.leaseLiveness = leaseLiveness;
    cc.nodesMayJoin = o.elastic && o.minNodes < o.nnodes;
    coord = std::make_unique<Coordinator>(store->clone(), cc, wakeFd);
  }

  void setupStore() {
    if (o.etcd()) {
      setupEtcd();  // the coordinator starts once this node knows its rank
      return;
    }
    workerMasterAddr = o.masterAddr;
    token = !cfg.userToken.empty() ? cfg.userToken : (o.nnodes == 1 ? randomHex(16) : std::string());
    if (o.nnodes > 1 && token.empty() && o.nodeRank == 0) {
      say("note: DT_STORE_TOKEN is not set, so the job's store accepts any client that reaches it; "
          "set the same DT_STORE_TOKEN for every node's dtrun to require it");
    }
    TcpStoreOptions so;
    so.token = token;
    so.timeout = o.rdzvTimeout;
    so.connectTimeout = o.rdzvTimeout;
    if (o.nodeRank == 0) {
      so.isServer = true;
      so.waitForWorkers = false;
      // A standby silent for half the node timeout is retired, not waited for: the writes it holds
      // up must resume before the nodes take the store itself for lost (--node-timeout).
      so.standbyTimeout = std::max(o.nodeTimeout / 2, Millis(100));
      so.bindAddress = o.bind;
      std::string failure;
      try {
        store = std::make_shared<TcpStore>(o.masterAddr, static_cast<uint16_t>(o.masterPort), so);
      } catch (const std::exception& e) {
        failure = e.what();
      }
      // One node on the default port, which another job on this machine
      // holds: nobody else needs to find this store, so any free port will do.
      if (!store && o.nnodes == 1 && !o.masterPortSet && o.masterPort != 0) {
        try {
          store = std::make_shared<TcpStore>(o.masterAddr, 0, so);
          say(str("note: the default store port ", o.masterPort, " is busy (another job?); using free port ",
                  static_cast<TcpStore&>(*store).port(), " instead (pass --master-port to insist on one)"));
        } catch (const std::exception&) {
        }
      }
      if (!store) {
        throw Error(str("dtrun: cannot host the job's store on ", o.masterAddr, ":", o.masterPort, ": ", failure,
                        ". Is another job using port ", o.masterPort,
                        "? Pass --master-port with a free port, or --master-port 0 / --standalone on one node"));
      }
      const int storePort = static_cast<TcpStore&>(*store).port();
      runId = o.runId.empty() ? randomHex(6) : o.runId;
      workerPort = o.workerPort != 0 ? o.workerPort : pickFreePort("");
      if (workerPort == storePort) workerPort = pickFreePort("");
      storeAddr = str(o.masterAddr, ":", storePort);
      uint16_t watchPort = 0;
      if (o.nnodes > 1) watchListenFd = listenTcp(o.bind, watchPort);
      store->set("dtrun/meta", str(runId, "\t", workerPort, "\t", watchPort));
    } else {
      try {
        store = std::make_shared<TcpStore>(o.masterAddr, static_cast<uint16_t>(o.masterPort), so);
        const auto meta = split(store->get("dtrun/meta"), '\t');
        runId = meta.at(0);
        workerPort = std::stoi(meta.at(1));
        watchPort = meta.at(2);
      } catch (const std::exception& e) {
        throw Error(str("dtrun: cannot join the job's store at ", o.masterAddr, ":", o.masterPort,
                        " (hosted by node 0's dtrun): ", e.what(),
                        ". Is node 0's dtrun running with the same --master-addr/--master-port and DT_STORE_TOKEN?"));
      }
      if (!o.runId.empty() && o.runId != runId) {
        say(str("note: using node 0's run id ", runId, " instead of ", o.runId));
      }
      storeAddr = str(o.masterAddr, ":", o.masterPort);
      hostStandby();
    }
    // A node of --nnodes MIN:MAX may get another node id when it joins a running job: its
    // coordinator starts once the id is known (rendezvous).
    if (o.minNodes == o.nnodes || o.nodeRank == 0) startCoordinator(false);
  }

  // Node 1 (withStandby): starts the standby and has node 0's store replicate to it before this
  // node claims its slot, so that every node learns it at the rendezvous (learnStandby).
  void hostStandby() {
    if (!withStandby() || o.nodeRank != 1) return;
    try {
      if (o.minNodes < o.nnodes && store->check({nodesKey(0)})) return;  // it joins a running job instead
      TcpStoreServerOptions so;
      const bool loopback = o.masterAddr == "localhost" || o.masterAddr.starts_with("127.") || o.masterAddr == "::1";
      so.bindAddress = !o.bind.empty() ? o.bind : loopback ? "127.0.0.1" : "0.0.0.0";
      so.token = token;
      so.standby = true;
      standbyServer = TcpStoreServer::start(so);
      auto& tcp = static_cast<TcpStore&>(*store);
      standbyAddr = tcp.attachStandby(standbyServer->port());
      uint16_t port = 0;
      watchListenFd = listenTcp(o.bind, port);
      store->set("dtrun/standby", str(standbyAddr, "\t", port));
      tcp.setStandby(standbyAddr);
      say(str("this node hosts the hot standby of the job's store at ", standbyAddr, ": it takes over if node 0 is lost"));
    } catch (const std::exception& e) {
      say(str("warning: the job's store has no standby (", e.what(), "): losing node 0 will end the job"));
      standbyServer.reset();
      standbyAddr.clear();
    }
  }

  // Every other node, once the nodes met: the standby's address for this node's store clients
  // and its workers, and (nodes 2+) a watch connection to node 1's dtrun.
  void learnStandby() {
    if (!withStandby() || !standbyAddr.empty()) return;
    try {
      if (!store->check({"dtrun/standby"})) return;
      const auto parts = split(store->get("dtrun/standby"), '\t');
      static_cast<TcpStore&>(*store).setStandby(parts.at(0));
      standbyAddr = parts.at(0);
      if (o.nodeRank == 0) return;  // node 1 watches node 0, and node 0 accepts its watch
      std::string host = standbyAddr.substr(0, standbyAddr.rfind(':'));
      if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
      watchNode(1, host, static_cast<uint16_t>(std::stoi(parts.at(1))));
    } catch (const std::exception& e) {
      say(str("warning: cannot use the standby of the job's store (", e.what(), "): losing node 0 will end the job"));
    }
  }

  // Waits on the signal channel and the coordinator for up to `ms`; handles
  // termination signals by recording them. Returns false when dtrun must stop.
  bool idleWait(int ms) {
    std::vector<pollfd> fds = {{signals.fd(), POLLIN, 0}, {wakeFd, POLLIN, 0}};
    addWatchFds(fds);
    ::poll(fds.data(), fds.size(), ms);
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents) onWatchFd(fds[i].fd);
    }
    std::vector<int> sigs;
    signals.drain(sigs);
    for (int sig : sigs) {
      if (isTermination(sig) && terminationSignal == 0) terminationSignal = sig;
    }
    uint64_t counter = 0;
    ssize_t ignored = ::read(wakeFd, &counter, sizeof(counter));
    (void)ignored;
    if (coord) {
      for (auto& event : coord->takeEvents()) pendingEvents.push_back(std::move(event));
    }
    return terminationSignal == 0;
  }

#if DT_HAVE_ETCD
  // --rdzv-backend etcd: claim a node slot bound to this dtrun's lease, mark
  // the attempt full when ours was the last claim, and wait (in slices, so
  // signals and lost nodes are noticed) for it to be full.
  std::optional<Rendezvous> rendezvousInEtcd(int attempt) {
    if (o.minNodes < o.nnodes && store->check({nodesKey(attempt)})) {
      const auto meta = split(store->get("dtrun/meta", o.rdzvTimeout), '\t');
      workerPort = std::stoi(meta.at(1));
      workerMasterAddr = meta.at(2);
      return joinRunning(attempt, -1);
    }
    const std::string mine = str(cfg.nproc, "\t", cfg.hostname, "\t", nonce);
    const int wanted = attempt == 0 && !o.nodeRankSet ? -1 : o.nodeRank;
    std::string holder;
    const auto slot = etcdRdzv->claim(attempt, wanted, o.nnodes, mine, holder);
    if (!slot) {
      const auto parts = split(holder, '\t');
      if (wanted >= 0) {
        throw InvalidArgument(str("dtrun: --node-rank ", wanted, " of job ", runId, " is already taken by another dtrun (host ",
                                  parts.size() > 1 ? parts[1] : "?", "); give each node its own --node-rank"));
      }
      throw InvalidArgument(str("dtrun: job ", runId, " in etcd at ", storeAddr, " already has its ", o.nnodes,
                                " nodes; is --nnodes the same on every node, and is this node one too many?"));
    }
    if (o.nodeRank != *slot) o.nodeRank = *slot;
    tag = o.nnodes > 1 ? str("dtrun (node ", o.nodeRank, "/", o.nnodes, "): ") : std::string("dtrun: ");
    publishWatchAddress();
    if (attempt == 0 && o.nodeRank == 0) {
      workerPort = o.workerPort != 0 ? o.workerPort : pickFreePort("");
      workerMasterAddr = o.masterAddrSet ? o.masterAddr : cfg.hostname;
      store->set("dtrun/meta", str(runId, "\t", workerPort, "\t", workerMasterAddr));
    }
    startCoordinator(true);
    if (o.minNodes < o.nnodes) return decideParticipants(attempt);
    const std::string full = EtcdRendezvous::fullKey(attempt);
    std::vector<std::string> keys;
    for (int node = 0; node < o.nnodes; ++node) keys.push_back(EtcdRendezvous::nodeKey(attempt, node));
    etcdRdzv->markIfFull(attempt, o.nnodes);
    const int64_t deadline = wallMs() + o.rdzvTimeout.count();
    while (true) {
      try {
        store->wait({full}, Millis(500));
        break;
      } catch (const TimeoutError&) {
      }
      if (!idleWait(0)) return std::nullopt;
      for (const auto& event : pendingEvents) {
        if (event.kind == CoordinatorEvent::Kind::StoreLost) {
          throw Error(str("dtrun: while waiting for the other nodes: ", event.text));
        }
      }
      pendingEvents.clear();  // a node lost before the attempt is full: its slot waits for another dtrun
      if (wallMs() > deadline) {
        const auto claims = etcdRdzv->roundStore()->list(str("dtrun/a", attempt, "/node/"));
        std::vector<std::string> joined;
        for (const auto& entry : claims.entries) {
          const auto parts = split(entry.value, '\t');
          joined.push_back(str("node ", entry.key.substr(entry.key.rfind('/') + 1), " on ", parts.size() > 1 ? parts[1] : "?"));
        }
        throw TimeoutError(str("dtrun: ", claims.entries.size(), " of ", o.nnodes, " nodes joined job ", runId,
                               " (attempt ", attempt + 1, ", round ", etcdRdzv->round(), ") in etcd at ", storeAddr,
                               " within ", formatDuration(o.rdzvTimeout), " (--rdzv-timeout)", joined.empty() ? "" : ": ",
                               join(joined), ". Are the other nodes' dtruns running with --rdzv-backend etcd, the same ",
                               "--rdzv-endpoint and --rdzv-id ", runId, ", and --nnodes ", o.nnodes, "?"));
      }
    }
    const auto values = store->multiGet(keys, o.rdzvTimeout);
    if (attempt == 0) {
      if (o.nodeRank != 0) {
        const auto meta = split(store->get("dtrun/meta", o.rdzvTimeout), '\t');
        workerPort = std::stoi(meta.at(1));
        workerMasterAddr = meta.at(2);
      }
      store->set("dtrun/started", "1");
    }
    Rendezvous out;
    out.worldSize = 0;
    for (int node = 0; node < o.nnodes; ++node) {
      const int n = std::stoi(values[static_cast<size_t>(node)]);
      if (node < o.nodeRank) out.rankOffset += n;
      out.nodeRanks[node] = {out.worldSize, n};
      out.worldSize += n;
    }
    return out;
  }
#endif

  // ---- --elastic --nnodes MIN:MAX ----------------------------------------------
  // dtrun/a<k>/nodes   the nodes the attempt starts with ("0,1,3"): decided once (compareSet)
  //                    when all MAX claimed a slot, or MIN did and kLastCallMs passed after that
  // dtrun/a<k>/world   its world size (for nodes that join later)
  // dtrun/late_nodes   node ids handed to nodes that came after the start (MAX, MAX+1, ...)

  static std::string nodesKey(int attempt) { return str("dtrun/a", attempt, "/nodes"); }

  // Every node once its slot is claimed: waits for the decision (or makes it), then starts
  // with it, or joins the running attempt when it was left out.
  std::optional<Rendezvous> decideParticipants(int attempt) {
    const int64_t deadline = wallMs() + o.rdzvTimeout.count();
    int64_t minReachedMs = 0;
    while (!store->check({nodesKey(attempt)})) {
      std::vector<int> claimed;
      for (int node = 0; node < o.nnodes; ++node) {
        if (store->check({str("dtrun/a", attempt, "/node/", node)})) claimed.push_back(node);
      }
      const int64_t now = wallMs();
      if (static_cast<int>(claimed.size()) >= o.minNodes && minReachedMs == 0) minReachedMs = now;
      if (static_cast<int>(claimed.size()) < o.minNodes) minReachedMs = 0;
      // With the static backend node 0 decides (it hosts the store); with etcd any node may.
      const bool decider = o.etcd() || o.nodeRank == 0;
      const bool ready = static_cast<int>(claimed.size()) == o.nnodes || (minReachedMs != 0 && now - minReachedMs >= kLastCallMs);
      if (decider && ready) {
        int world = 0;
        std::vector<std::string> ids;
        for (int node : claimed) {
          world += std::stoi(split(store->get(str("dtrun/a", attempt, "/node/", node)), '\t').at(0));
          ids.push_back(std::to_string(node));
        }
        store->set(str("dtrun/a", attempt, "/world"), std::to_string(world));
        store->compareSet(nodesKey(attempt), "", join(ids, ","));
        break;
      }
      if (!idleWait(50)) return std::nullopt;
      for (const auto& event : pendingEvents) {
        if (event.kind == CoordinatorEvent::Kind::StoreLost) throw Error(str("dtrun: while waiting for the other nodes: ", event.text));
      }
      pendingEvents.clear();  // a claimant lost before the start: it is not counted any more
      if (now > deadline) {
        throw TimeoutError(str("dtrun: ", claimed.size(), " of at least ", o.minNodes, " node(s) (--nnodes ", o.minNodes, ":",
                               o.nnodes, ") joined attempt ", attempt + 1, " within ", formatDuration(o.rdzvTimeout),
                               " (--rdzv-timeout; store ", storeAddr, ", run id ", runId, ")", claimed.empty() ? "" : ": nodes ",
                               formatRanges(claimed), ". Are the other nodes' dtruns running with the same --nnodes?"));
      }
    }
    Rendezvous out;
    for (const auto& id : split(store->get(nodesKey(attempt)), ',')) out.nodes.push_back(std::stoi(id));
    if (std::find(out.nodes.begin(), out.nodes.end(), o.nodeRank) == out.nodes.end()) {
      return joinRunning(attempt, o.nodeRank);  // claimed too late for the start: join it as it runs
    }
    out.worldSize = 0;
    for (int node : out.nodes) {
      const int n = std::stoi(split(store->get(str("dtrun/a", attempt, "/node/", node)), '\t').at(0));
      if (node < o.nodeRank) out.rankOffset += n;
      out.nodeRanks[node] = {out.worldSize, n};
      out.worldSize += n;
    }
    if (attempt == 0) store->set("dtrun/started", "1");
    startCoordinator(o.etcd());
    return out;
  }

  // A node that came after the attempt started: it takes node id `id` (-1: a fresh one),
  // registers as a late node (watched like the others) and its workers join the job.
  std::optional<Rendezvous> joinRunning(int attempt, int id) {
    if (id < 0) id = o.nnodes + static_cast<int>(store->add("dtrun/late_nodes", 1)) - 1;
    o.nodeRank = id;
    tag = str("dtrun (node ", id, ", joined): ");
    const std::string mine = str(cfg.nproc, "\t", cfg.hostname, "\t", nonce);
#if DT_HAVE_ETCD
    if (o.etcd()) {
      std::string holder;
      if (!etcdRdzv->claim(attempt, id, id + 1, mine, holder)) throw Error(str("dtrun: node id ", id, " is taken (", holder, ")"));
      publishWatchAddress();
    } else
#endif
    {
      store->set(str("dtrun/a", attempt, "/node/", id), mine);
      store->add(str("dtrun/hb/", id), 1);
    }
    Rendezvous out;
    out.late = true;
    out.worldSize = std::stoi(store->get(str("dtrun/a", attempt, "/world")));
    for (const auto& node : split(store->get(nodesKey(attempt)), ',')) out.nodes.push_back(std::stoi(node));
    out.nodes.push_back(id);
    startCoordinator(o.etcd());
    // Node 0 already lost (this dtrun was pointed at the standby that took over): nothing to watch there.
    const std::string node0 = str("dtrun/a", attempt, "/done/0");
    if (!o.etcd() && !(store->check({node0}) && store->get(node0) == "lost")) setupWatch();
    store->append(str("dtrun/a", attempt, "/late"), str(id, ","));
    say(str("the job is running: this node joins it as node ", id, " (its workers are admitted at a step boundary)"));
    return out;
  }

  std::optional<Rendezvous> rendezvous(int attempt) {
#if DT_HAVE_ETCD
    if (o.etcd()) {
      auto out = rendezvousInEtcd(attempt);
      if (out) {
        std::vector<int> nodes = out->nodes;
        for (int node = 0; nodes.empty() && node < o.nnodes; ++node) nodes.push_back(node);
        watchLowerNodes(nodes);
      }
      return out;
    }
#endif
    if (o.nnodes == 1) return Rendezvous{cfg.nproc, 0};
    if (o.minNodes < o.nnodes && o.nodeRank != 0 && store->check({nodesKey(attempt)})) return joinRunning(attempt, -1);
    store->add(str("dtrun/hb/", o.nodeRank), 1);  // beating before anyone can count on us
    // compareSet: a second dtrun claiming the same --node-rank is caught here
    // instead of silently duplicating ranks.
    const std::string mine = str(cfg.nproc, "\t", cfg.hostname, "\t", nonce);
    const std::string claimed = store->compareSet(str("dtrun/a", attempt, "/node/", o.nodeRank), "", mine);
    if (claimed != mine) {
      const auto parts = split(claimed, '\t');
      throw InvalidArgument(str("dtrun: --node-rank ", o.nodeRank, " is already taken by another dtrun (host ",
                                parts.size() > 1 ? parts[1] : "?", "); give each node its own --node-rank"));
    }
    setupWatch();
    if (o.minNodes < o.nnodes) return decideParticipants(attempt);
    std::vector<std::string> keys;
    for (int node = 0; node < o.nnodes; ++node) keys.push_back(str("dtrun/a", attempt, "/node/", node));
    const int64_t deadline = wallMs() + o.rdzvTimeout.count();
    while (!store->check(keys)) {
      if (!idleWait(50)) return std::nullopt;
      for (const auto& event : pendingEvents) {
        if (event.kind == CoordinatorEvent::Kind::StoreLost || event.kind == CoordinatorEvent::Kind::NodeLost) {
          throw Error(str("dtrun: while waiting for the other nodes: ", event.text));
        }
      }
      if (wallMs() > deadline) {
        std::vector<int> missing;
        for (int node = 0; node < o.nnodes; ++node) {
          if (!store->check({keys[static_cast<size_t>(node)]})) missing.push_back(node);
        }
        throw TimeoutError(str("dtrun: node(s) ", formatRanges(missing), " did not join attempt ", attempt + 1,
                               " within ", formatDuration(o.rdzvTimeout), " (--rdzv-timeout; store ", storeAddr,
                               ", run id ", runId, "). Are their dtruns running with --nnodes ", o.nnodes, "?"));
      }
    }
    pendingEvents.clear();
    const auto values = store->multiGet(keys);
    Rendezvous out;
    out.worldSize = 0;
    for (int node = 0; node < o.nnodes; ++node) {
      const int n = std::stoi(values[static_cast<size_t>(node)]);
      if (node < o.nodeRank) out.rankOffset += n;
      out.nodeRanks[node] = {out.worldSize, n};
      out.worldSize += n;
    }
    return out;
  }

  // ---- one attempt -----------------------------------------------------------

  int openLog(int attempt, const std::string& rank, const char* stream) {
    if (o.logDir.empty()) return -1;
    const std::filesystem::path dir = std::filesystem::path(o.logDir) / runId / str("attempt", attempt);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const auto path = dir / str("rank", rank, ".", stream);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) say(str("warning: cannot write ", path.string(), ": ", std::strerror(errno)));
    return fd;
  }

  // Where the workers of `attempt` write their flight records: the user's
  // DT_FLIGHT_RECORDER_DIR, else the attempt's log folder (--log-dir), else none.
  std::string flightDirOf(int attempt) const {
    const std::string own = lookupEntry(cfg.baseEnv, "DT_FLIGHT_RECORDER_DIR");
    if (!own.empty()) return own;
    if (o.logDir.empty()) return {};
    return (std::filesystem::path(o.logDir) / runId / str("attempt", attempt)).string();
  }

  // The flight recorder's analysis of this job's dumps in `dir`, or "" when there are none.
  std::string flightStory(const std::string& dir) const {
    try {
      std::vector<std::string> problems;
      const auto dumps = debug::readFlightDumps(dir, runId, &problems);
      if (dumps.empty()) return {};
      std::string text = str("dtrun: what the ranks' flight records say (dtrun analyze ", dir, "):\n");
      for (const auto& line : split(debug::analyzeFlightDumps(dumps), '\n')) {
        if (!line.empty()) text += str("  ", line, "\n");
      }
      for (const auto& p : problems) text += str("  (skipped: ", p, ")\n");
      return text;
    } catch (const std::exception& e) {
      return str("dtrun: cannot analyze the flight records in ", dir, ": ", e.what(), "\n");
    }
  }

  // Every node's flight records into every node's folder (launcher/flight_gather.h), so that
  // each dtrun tells the whole job's story: this node's dumps go to the store, the others'
  // come back, waiting at most kFlightGatherMs for the nodes that have not posted yet (a lost
  // node never does; the story then lacks its ranks, and says so).
  void gatherFlightRecords(const std::string& dir, int attempt, const Rendezvous& rdv) {
    const std::string prefix = str("dtrun/flight/", attempt, "/");
    const size_t expected = rdv.nodes.empty() ? static_cast<size_t>(o.nnodes) : rdv.nodes.size();
    try {
      const PackedFlightFiles mine = packFlightFiles(dir, kFlightGatherBytes);
      if (mine.leftOut > 0) {
        say(str("warning: ", mine.leftOut, " flight record(s) in ", dir, " do not fit the ", kFlightGatherBytes >> 20,
                " MiB posted to the other nodes; they stay here only"));
      }
      store->set(str(prefix, "node", o.nodeRank), mine.bytes);
      store->append(prefix + "posted", str(o.nodeRank, ","));
      const int64_t until = wallMs() + kFlightGatherMs;
      std::vector<std::string> posted;
      for (;;) {
        posted.clear();
        for (const auto& node : split(store->get(prefix + "posted"), ',')) {
          if (!node.empty()) posted.emplace_back(node);
        }
        if (posted.size() >= expected || wallMs() >= until || !idleWait(100)) break;
      }
      for (const auto& node : posted) {
        if (node == std::to_string(o.nodeRank)) continue;
        unpackFlightFiles(store->get(str(prefix, "node", node)), dir, str("node ", node));
      }
      // Stay until the others have read too (node 0's dtrun holds the store they read from),
      // for at most kFlightGatherMs more.
      store->add(prefix + "fetched", 1);
      const int64_t readUntil = wallMs() + kFlightGatherMs;
      while (store->add(prefix + "fetched", 0) < static_cast<int64_t>(posted.size()) && wallMs() < readUntil && idleWait(50)) {
      }
      if (posted.size() < expected) {
        say(str("the flight records of ", expected - posted.size(), " node(s) did not arrive within ",
                formatDuration(Millis(kFlightGatherMs)), ": the story below lacks their ranks"));
      }
    } catch (const std::exception& e) {
      say(str("warning: cannot gather the other nodes' flight records through the job's store: ", e.what()));
    }
  }

  AttemptResult runAttempt(int attempt, const Rendezvous& rdv) {
    learnStandby();
    std::vector<Worker> workers(static_cast<size_t>(cfg.nproc));
    for (int i = 0; i < cfg.nproc; ++i) {
      Worker& w = workers[static_cast<size_t>(i)];
      w.localRank = w.outcome.localRank = i;
      w.rank = w.outcome.rank = rdv.rankOffset + i;
      w.outcome.host = cfg.hostname;
    }
    const bool multiNode = o.nnodes > 1;

    if (o.hangTimeout.count() > 0 && o.nodeRank == 0) {
      for (int r = 0; r < rdv.worldSize; ++r) store->deleteKey(str("dt/progress/", r));
    }

    bool stopping = false, killSent = false;
    // The flight recorder's folder for this attempt's workers ("" : none), and a stop signal
    // held back while the workers write their flight records (SIGUSR2).
    const std::string flightDir = flightDirOf(attempt);
    int heldStopSignal = 0;
    int64_t heldStopUntil = 0;
    std::vector<Worker*> askedForDumps;
    std::string killAllReason;  // why dtrun sent every worker SIGKILL (once killSent)
    int64_t killAt = 0;
    std::string externalCause;
    int externalCode = 1;
    bool published = false;       // we asked the coordinator to publish a failure
    bool publishResolved = false;  // ... and heard back
    bool waitingAllDone = false, allDone = false;
    std::optional<DecodedFailure> globalFailure;

    auto signalAll = [&](int sig, bool includeReaped) {
      for (auto& w : workers) {
        if (w.pid > 0 && (includeReaped || !w.reaped)) signalGroup(w.pid, sig);
      }
    };
    auto beginStop = [&](int sig) {
      if (stopping) return;
      stopping = true;
      killAt = wallMs() + o.killGrace.count();
      if (sig != 0 && !flightDir.empty()) {
        // A failure: every worker still running writes its flight record first (those whose
        // recorder listens for SIGUSR2; a progress thread answers within its 1 s interval).
        for (auto& w : workers) {
          if (w.pid > 0 && !w.reaped && catchesSignal(w.pid, SIGUSR2) && ::kill(w.pid, SIGUSR2) == 0) {
            askedForDumps.push_back(&w);
          }
        }
        if (!askedForDumps.empty()) {
          heldStopSignal = sig;
          heldStopUntil = wallMs() + 3000;
          killAt += 3000;
          sig = 0;
        }
      }
      if (sig != 0) signalAll(sig, true);
      if (multiNode && (attempt >= o.maxRestarts || o.elastic || terminationSignal != 0)) coord->publishExit();
    };
    auto publish = [&](int code, int64_t timeMs, const std::string& description) {
      if (!multiNode || published) return;
      published = true;
      coord->publishFailure(encodeFailure(code, timeMs, o.nodeRank, description));
    };
    auto external = [&](const std::string& cause, int code) {
      if (stopping) return;
      externalCause = cause;
      externalCode = code;
      publish(code, wallMs(), cause);
      beginStop(SIGTERM);
    };

    // Spawn. `joiningMember` >= 0: a replacement under --elastic (a fresh member id).
    const int64_t startMs = wallMs();
    if (coord) coord->beginAttempt(attempt, rdv.worldSize, startMs, rdv.nodes);
    // Returns why the worker could not be started ("" when it was).
    auto spawn = [&](Worker& w, int joiningMember) -> std::string {
      const int i = w.localRank;
      WorkerIdentity id;
      id.rank = w.rank;
      id.worldSize = rdv.worldSize;
      id.localRank = i;
      id.localWorldSize = cfg.nproc;
      id.groupRank = o.nodeRank;
      id.numNodes = o.nnodes;
      id.masterAddr = workerMasterAddr;
      id.masterPort = workerPort;
#if DT_HAVE_ETCD
      if (o.etcd()) {
        // The workers' store is etcd itself, under this round's prefix.
        id.etcdEndpoints = storeAddr;
        id.etcdPrefix = etcdRdzv->roundStore()->prefix();
        id.etcdCa = o.rdzvCa;
        id.etcdCert = o.rdzvCert;
        id.etcdKey = o.rdzvKey;
        id.etcdUser = o.rdzvUser;
        id.etcdPassword = o.rdzvPassword;
      } else
#endif
      {
        id.storeAddr = storeAddr;
        id.storeStandby = standbyAddr;
        id.storeToken = token;
      }
      id.runId = runId;
      id.restartCount = attempt;
      id.maxRestarts = o.maxRestarts;
      id.elastic = o.elastic;
      id.minNproc = o.minNproc;
      id.joiningMember = joiningMember;
      id.flightRecorderDir = flightDir;
      const WorkerEnv env = buildWorkerEnv(cfg.baseEnv, id);
      if (env.threadsDefaulted && !threadsNoticePrinted) {
        threadsNoticePrinted = true;
        say(str(cfg.nproc, " workers share this machine: OMP_NUM_THREADS and DT_NUM_THREADS default to 1 (set them to override)"));
      }
      const bool console = (o.logDir.empty() || o.tee) &&
                           (!o.localRanksFilter || std::binary_search(o.localRanksFilter->begin(), o.localRanksFilter->end(), i));
      const std::string prefix = expandPrefix(o.prefix, w.rank, i, o.nodeRank, cfg.hostname);
      const std::string logName = joiningMember >= 0 ? str(w.rank, ".member", joiningMember) : std::to_string(w.rank);
      w.streams[0] = std::make_unique<OutputStream>(StreamTarget{console ? 1 : -1, openLog(attempt, logName, "stdout"), prefix, false}, 20);
      w.streams[1] = std::make_unique<OutputStream>(StreamTarget{console ? 2 : -1, openLog(attempt, logName, "stderr"), prefix, true}, 20);
      try {
        const SpawnedWorker sw = spawnWorker(cfg.programPath, o.program, env.entries, signals.originalMask());
        w.pid = sw.pid;
        if (guardian) guardian->watch(w.pid);
        w.fds[0] = sw.stdoutFd;
        w.fds[1] = sw.stderrFd;
      } catch (const std::exception& e) {
        say(str("cannot start rank ", w.rank, ": ", e.what()));
        w.reaped = true;
        w.outcome = WorkerOutcome{w.rank, i, cfg.hostname, -1, false, 127, wallMs(), false, false, {}};
        return e.what();
      }
      w.outcome.pid = w.pid;
      w.oomKillsAtStart = oomKillCount();
      return {};
    };
    // --elastic: which members run on this node, so that its loss posts them dead (loseNode).
    auto recordNodeMembers = [&] {
      if (!o.elastic || o.nnodes == 1) return;
      std::vector<std::string> ids;
      for (const auto& w : workers) ids.push_back(std::to_string(w.member));
      try {
        store->set(str("elastic/node_members/", o.nodeRank), join(ids, ","));
      } catch (const std::exception& e) {
        say(str("warning: cannot record this node's members in the store: ", e.what()));
      }
    };
    for (auto& w : workers) {
      w.member = w.rank;
      int joining = -1;
      if (rdv.late) {  // a node that joined the running job: its workers join its membership
        joining = membership::newMemberId(*store, rdv.worldSize);
        w.rank = w.member = w.outcome.rank = joining;
      }
      if (const std::string why = spawn(w, joining); !why.empty()) {
        external(str("rank ", w.rank, " could not be started: ", why), 127);
        break;
      }
    }
    recordNodeMembers();
    for (auto& w : workers) {
      if (w.pid < 0 && !w.reaped) {  // never started (the spawn loop broke off)
        w.reaped = true;
        w.outcome.stoppedByLauncher = true;
        w.outcome.timeMs = wallMs();
      }
    }

    // --elastic: a worker that died is posted dead (store/membership.h) and
    // the others go on without it; its death is no reason to stop them.
    auto nameOf = [](const Worker& w) { return w.member == w.rank ? str("rank ", w.rank) : str("rank ", w.rank, " (member ", w.member, ")"); };
    auto loseWorker = [&](Worker& w, const std::string& reason) {
      if (w.lost) return;
      w.lost = true;
      try {
        membership::postDeath(*store, w.member, reason);
      } catch (const std::exception& e) {
        say(str("cannot post the death of ", nameOf(w), " to the store: ", e.what()));
      }
      int left = 0;
      for (const auto& other : workers) left += other.lost ? 0 : 1;
      say(str(nameOf(w), " (pid ", w.pid, ") ", reason,
              left > 0 ? str("; the elastic job goes on without it (", left, " worker(s) left on this node)")
                       : std::string("; no worker is left on this node")));
    };
    // --elastic --max-restarts: a dead worker's place gets a new process with a fresh member
    // id, which joins the running job; the old one's outcome is kept for the summary.
    bool jobFinishing = false;  // a worker finished: nothing is replaced any more
    std::vector<std::string> replaced;
    auto replaceWorker = [&](Worker& w) {
      if (!o.elastic || stopping || jobFinishing || w.evicted || w.replacements >= o.maxRestarts) return;
      for (int s = 0; s < 2; ++s) {  // what the dead process wrote and was not read yet
        if (w.fds[s] < 0) continue;
        char chunk[4096];
        ssize_t n;
        while ((n = ::read(w.fds[s], chunk, sizeof(chunk))) > 0) w.streams[s]->write(std::string_view(chunk, static_cast<size_t>(n)));
        ::close(w.fds[s]);
        w.fds[s] = -1;
        w.streams[s]->finish();
      }
      int member = -1;
      try {
        member = membership::newMemberId(*store, rdv.worldSize);
      } catch (const std::exception& e) {
        say(str("cannot replace ", nameOf(w), ": the store did not answer: ", e.what()));
        return;
      }
      replaced.push_back(str(nameOf(w), " (", describeOutcome(w.outcome), ")"));
      if (guardian && w.pid > 0) guardian->release(w.pid);
      ++w.replacements;
      const std::string before = nameOf(w);
      w.member = member;
      w.reaped = w.lost = w.leftJob = false;
      w.killedBecause.clear();
      w.beat.reset();
      w.beatSeenMs = 0;
      w.pid = -1;
      w.outcome = WorkerOutcome{};
      w.outcome.rank = w.rank;
      w.outcome.localRank = w.localRank;
      w.outcome.host = cfg.hostname;
      if (const std::string why = spawn(w, member); !why.empty()) {
        say(str("cannot start a replacement for ", before, ": ", why));
        w.lost = true;
        return;
      }
      say(str(before, " is replaced by member ", member, " (pid ", w.pid, "; replacement ", w.replacements, " of ",
              o.maxRestarts, " for local rank ", w.localRank, "): it joins the running job at a step boundary"));
      recordNodeMembers();
    };
    // --elastic: the workers found the job below --min-nproc (store/membership.h). Every worker
    // is stopped, and that, with the deaths that brought the job there, is the cause: not the
    // survivors' exits, nor the first death (which the job survived).
    auto checkJobStop = [&]() -> bool {
      if (!o.elastic || stopping) return false;
      std::optional<std::string> why;
      try {
        why = membership::jobStopOf(*store);
      } catch (const std::exception&) {
        return false;  // the store's loss is handled elsewhere
      }
      if (!why) return false;
      say(str(*why, ": stopping the job"));
      externalCause = str("the elastic job stopped: ", *why);
      externalCode = kExitBelowMinNproc;
      publish(externalCode, wallMs(), externalCause);
      // The workers read the same record and end by themselves (saying so); SIGKILL follows
      // after --kill-grace for any that does not.
      beginStop(0);
      return true;
    };
    const int64_t livenessEvery = std::clamp<int64_t>(o.livenessTimeout.count() / 5, 10, 200);
    int64_t nextLivenessCheck = 0;
    // --elastic: a worker whose heartbeat stopped (frozen, hung) is posted
    // dead and killed; before its first beat it is still starting up.
    auto checkLiveness = [&](int64_t now) {
      if (!o.elastic || stopping || now < nextLivenessCheck) return;
      nextLivenessCheck = now + livenessEvery;
      if (checkJobStop()) return;
      for (auto& w : workers) {
        if (w.reaped || w.lost || w.pid <= 0) continue;
        std::optional<uint64_t> beat;
        try {
          beat = membership::heartbeatOf(*store, w.member);
        } catch (const std::exception&) {
          return;  // the store's loss is handled elsewhere
        }
        if (beat != w.beat) {
          w.beat = beat;
          w.beatSeenMs = now;
        } else if (w.beat && now - w.beatSeenMs > o.livenessTimeout.count()) {
          const std::string silence = str("no heartbeat for ", formatDuration(Millis(now - w.beatSeenMs)),
                                          " (--liveness-timeout ", formatDuration(o.livenessTimeout), ")");
          loseWorker(w, str("stopped responding: ", silence, "; frozen or hung: dtrun kills it (SIGKILL)"));
          w.killedBecause = silence;
          signalGroup(w.pid, SIGKILL);
        }
      }
    };
    // Straggler reports: the training loop's rank 0 adds dt/straggler/<n> = "<member>\t<rank>\t<line>"
    // (train/loop.cpp, docs/debugging.md). Node 0 prints each; with --evict-stragglers the node
    // that runs the member kills it, posts its death like any other (the others recover in
    // place) and never replaces it.
    // The reads go through a connection of their own with a short timeout, and wait while the
    // store looks unresponsive: this loop is also what notices a store that stopped answering
    // (a cut link drops packets, and a read on the job's connection would wait its whole timeout).
    int64_t nextStragglerCheck = 0;
    StorePtr stragglerStore;
    const Store* stragglerStoreOf = nullptr;
    // A restarted worker group (--max-restarts without --elastic) writes its keys under
    // "restart<k>/" (process_group/init.h), numbering its reports from 1 again.
    const std::string stragglerKeys = !o.elastic && attempt > 0 ? str("restart", attempt, "/dt/straggler/") : "dt/straggler/";
    if (!o.elastic && attempt > 0) stragglersSeen = 0;
    auto checkStragglers = [&](int64_t now) {
      if (stopping || storeGone || now < nextStragglerCheck) return;
      nextStragglerCheck = now + o.monitorInterval.count();
      if (coord && now - coord->lastContactMs() > 2 * o.monitorInterval.count()) return;
      std::vector<std::string> reports;
      try {
        if (stragglerStoreOf != store.get()) {
          stragglerStore = store->clone();
          stragglerStore->setTimeout(std::chrono::milliseconds(std::clamp<int64_t>(o.monitorInterval.count(), 200, 1000)));
          stragglerStoreOf = store.get();
        }
        while (stragglerStore->check({str(stragglerKeys, stragglersSeen + 1)})) {
          reports.push_back(stragglerStore->get(str(stragglerKeys, ++stragglersSeen)));
        }
      } catch (const std::exception&) {
        // The store's loss is handled elsewhere; what was read is still reported.
      }
      for (const std::string& report : reports) {
        const auto fields = split(report, '\t');
        if (fields.size() < 3) continue;
        const std::string line = join(std::vector<std::string>(fields.begin() + 2, fields.end()), "\t");
        if (o.nodeRank == 0) say(str("straggler: ", line));
        if (!o.evictStragglers) continue;
        int member = -1;
        try {
          member = std::stoi(fields[0]);
        } catch (const std::exception&) {
          continue;
        }
        for (auto& w : workers) {
          if (w.member != member || w.reaped || w.lost || w.pid <= 0) continue;
          w.evicted = true;
          w.killedBecause = "evicted as a straggler (--evict-stragglers)";
          loseWorker(w, "was evicted as a straggler (--evict-stragglers): dtrun kills it (SIGKILL) and does not replace it");
          signalGroup(w.pid, SIGKILL);
        }
      }
    };
    // --elastic, node 0: a lost node's workers are dead, and the node is done
    // as far as the others' end-of-job wait is concerned.
    // Its watch connection and its heartbeats may both report one loss: the first is told.
    std::set<int> lostNodes;
    auto loseNode = [&](int node, const std::string& why) {
      if (node < 0 || !lostNodes.insert(node).second) return;
      if (coord) {
        coord->markLost(node);
        // Node 0 is gone (its watch connection closed: proof), so the standby serves now.
        if (node == 0 && standbyServer) coord->hostStore();
      }
      // Its members: as it recorded them (replacements and a joined node's workers included),
      // else the ranks it started with.
      std::vector<int> members;
      try {
        const std::string key = str("elastic/node_members/", node);
        if (store->check({key})) {
          for (const auto& id : split(store->get(key), ',')) members.push_back(std::stoi(id));
        }
      } catch (const std::exception&) {
      }
      if (members.empty() && rdv.nodeRanks.count(node)) {
        const auto [first, count] = rdv.nodeRanks.at(node);
        for (int r = first; r < first + count; ++r) members.push_back(r);
      }
      for (int m : members) {
        try {
          membership::postDeath(*store, m, str("was lost with node ", node, " (", why, ")"));
        } catch (const std::exception& e) {
          say(str("cannot post the death of member ", m, " to the store: ", e.what()));
        }
      }
      try {
        store->set(str("dtrun/a", attempt, "/done/", node), "lost");
      } catch (const std::exception&) {
      }
      std::vector<std::string> names;
      for (int m : members) names.push_back(std::to_string(m));
      say(str("node ", node, " is lost (", why, "): its members ", join(names, ","),
              " are dead; the elastic job goes on without them"));
    };

    auto reapAll = [&] {
      std::vector<Worker*> failedNow;
      std::vector<Worker*> leftNow;  // --elastic: exited 0 after the job dropped them with their replica
      int status = 0;
      pid_t pid;
      while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
        for (auto& w : workers) {
          if (w.pid != pid || w.reaped) continue;
          w.reaped = true;
          WorkerOutcome& out = w.outcome;
          out.rank = w.rank;
          out.localRank = w.localRank;
          out.host = cfg.hostname;
          out.pid = pid;
          out.timeMs = wallMs();
          out.signaled = WIFSIGNALED(status);
          out.code = out.signaled ? WTERMSIG(status) : WEXITSTATUS(status);
          out.stoppedByLauncher = stopping;
          out.killedByLauncher = killSent || !w.killedBecause.empty();
          out.killReason = w.killedBecause.empty() ? killAllReason : w.killedBecause;
          if (out.signaled && out.code == SIGKILL && !out.killedByLauncher) {
            const int64_t oomKills = oomKillCount();
            out.oomKillsMeanwhile = oomKills >= 0 && w.oomKillsAtStart >= 0 ? oomKills - w.oomKillsAtStart : -1;
          }
          if (out.failed() && !stopping) failedNow.push_back(&w);
          if (!out.failed() && o.elastic && !stopping) {
            std::optional<std::string> why;
            try {
              why = membership::leftOf(*store, w.member);
            } catch (const std::exception&) {
              // The store is gone: the exit counts as the job finishing, as before.
            }
            if (why) {
              w.leftJob = true;
              leftNow.push_back(&w);
              say(str(nameOf(w), " (pid ", w.pid, ") left the job: ", *why));
            }
          }
        }
      }
      if (o.elastic && !stopping && !jobFinishing) {
        for (const auto& w : workers) {
          if (w.reaped && !w.outcome.failed() && w.pid > 0 && !w.leftJob) jobFinishing = true;
        }
        if (jobFinishing) {
          try {  // a replacement still waiting to be admitted gives up (ElasticGroup)
            membership::markFinished(*store);
          } catch (const std::exception&) {
          }
        }
      }
      // Its replica comes back whole only when every rank of it is replaced.
      for (Worker* w : leftNow) replaceWorker(*w);
      leftNow.clear();
      if (!failedNow.empty() && o.elastic && checkJobStop()) {
        for (Worker* w : failedNow) w->outcome.stoppedByLauncher = true;  // they ended because the job stops
        return;
      }
      if (!failedNow.empty() && !stopping && o.elastic) {
        for (Worker* w : failedNow) {
          const WorkerOutcome& out = w->outcome;
          loseWorker(*w, str("exited: ", out.signaled ? str("signal ", signalName(out.code)) : str("exit code ", out.code)));
          replaceWorker(*w);
        }
        return;
      }
      if (!failedNow.empty() && !stopping) {
        const Worker* first = failedNow.front();
        for (const Worker* w : failedNow) {
          if (w->outcome.timeMs < first->outcome.timeMs) first = w;
        }
        // Other nodes print this as their root cause: with its last stderr lines.
        std::string description = str("rank ", first->rank, " (host ", cfg.hostname, ", pid ", first->pid,
                                      ") ended with ", describeOutcome(first->outcome));
        const auto& tail = first->streams[1]->tail();
        const size_t from = tail.size() > 5 ? tail.size() - 5 : 0;
        for (size_t i = from; i < tail.size(); ++i) description += str("\n      | ", tail[i]);
        publish(exitCodeOf(first->outcome), first->outcome.timeMs, description);
        beginStop(SIGTERM);
      }
    };

    auto handleSignal = [&](int sig) {
      if (sig == SIGINT && sigintCount > 0) {
        say("second SIGINT: killing the workers (SIGKILL)");
        signalAll(SIGKILL, true);
        killSent = true;
        killAllReason = "a second SIGINT";
        return;
      }
      signalAll(sig, false);
      if (!isTermination(sig)) return;
      if (sig == SIGINT) ++sigintCount;
      say(str("received ", signalName(sig), ": forwarded to the workers; stopping",
              sig == SIGINT ? " (a second SIGINT kills them at once)" : ""));
      if (terminationSignal == 0) terminationSignal = sig;
      if (!stopping) {
        externalCause = str("dtrun received ", signalName(sig), " and forwarded it to the workers");
        externalCode = 128 + sig;
        publish(externalCode, wallMs(), str("node ", o.nodeRank, "'s dtrun received ", signalName(sig)));
        beginStop(0);  // the forwarded signal is the stop request; SIGKILL follows after the grace period
      }
    };

    auto handleEvent = [&](const CoordinatorEvent& event) {
      using K = CoordinatorEvent::Kind;
      const bool aboutAttempt = event.kind == K::RemoteFailure || event.kind == K::FailurePublished ||
                                event.kind == K::Hang || event.kind == K::AllDone;
      if (aboutAttempt && event.attempt != attempt) return;  // late news about an earlier attempt
      switch (event.kind) {
        case K::FailurePublished:
          publishResolved = true;
          globalFailure = decodeFailure(event.text);
          break;
        case K::RemoteFailure: {
          publishResolved = true;
          const DecodedFailure d = decodeFailure(event.text);
          globalFailure = d;
          if (d.node != o.nodeRank && !stopping) {
            externalCause = str("node ", d.node, " reported: ", d.description);
            externalCode = d.code;
            beginStop(SIGTERM);
          }
          break;
        }
        case K::StoreLost:
          storeGone = true;
          if (!allDone) external(event.text, event.code);
          break;
        case K::NodeLost:
          if (o.elastic && event.node >= 0) {
            loseNode(event.node, event.text);
            break;
          }
          if (!allDone) external(event.text, event.code);
          break;
        case K::Hang:
          if (!allDone) external(event.text, event.code);
          break;
        case K::AllDone:
          allDone = true;
          break;
        default:
          break;
      }
    };

    for (auto& event : pendingEvents) handleEvent(event);
    pendingEvents.clear();

    char buffer[65536];
    int64_t drainDeadline = 0;
    while (true) {
      const int64_t now = wallMs();
      const bool allReaped = std::all_of(workers.begin(), workers.end(), [](const Worker& w) { return w.reaped; });
      bool pipesOpen = false;
      for (auto& w : workers) pipesOpen |= (w.fds[0] >= 0 || w.fds[1] >= 0);
      if (allReaped && pipesOpen) {
        // A worker's own children may hold its pipes open; do not wait for them long.
        if (drainDeadline == 0) drainDeadline = now + 500;
        if (now >= drainDeadline) {
          for (auto& w : workers) {
            for (int s = 0; s < 2; ++s) {
              if (w.fds[s] >= 0) {
                ::close(w.fds[s]);
                w.fds[s] = -1;
                w.streams[s]->finish();
              }
            }
          }
          pipesOpen = false;
        }
      }
      if (allReaped && !pipesOpen) {
        if (stopping) break;
        if (!multiNode || allDone) break;
        if (!waitingAllDone) {
          waitingAllDone = true;
          coord->publishDone();
        }
      }

      std::vector<pollfd> fds;
      fds.push_back({signals.fd(), POLLIN, 0});
      fds.push_back({wakeFd, POLLIN, 0});
      std::vector<std::pair<Worker*, int>> owners;
      for (auto& w : workers) {
        for (int s = 0; s < 2; ++s) {
          if (w.fds[s] >= 0) {
            fds.push_back({w.fds[s], POLLIN, 0});
            owners.emplace_back(&w, s);
          }
        }
      }
      const size_t watchFrom = fds.size();
      addWatchFds(fds);
      int64_t timeout = -1;
      auto limit = [&](int64_t ms) { timeout = timeout < 0 ? std::max<int64_t>(ms, 0) : std::min(timeout, std::max<int64_t>(ms, 0)); };
      if (stopping && !killSent) limit(killAt - now);
      if (heldStopSignal != 0) limit(std::min<int64_t>(heldStopUntil - now, 50));
      if (drainDeadline != 0) limit(drainDeadline - now);
      if (coord) limit(o.monitorInterval.count());
      if (o.elastic && !stopping) limit(nextLivenessCheck - now);
      if (!stopping && !storeGone) limit(nextStragglerCheck - now);
      const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(timeout));
      if (ready < 0 && errno != EINTR) throw Error(str("dtrun: poll failed: ", std::strerror(errno)));

      // Output first: what a worker wrote before exiting is in its pipe by
      // the time its SIGCHLD arrives, and the failure report quotes it.
      for (size_t i = 0; i < owners.size(); ++i) {
        const short revents = fds[i + 2].revents;
        if (!revents) continue;
        auto [w, s] = owners[i];
        const ssize_t n = ::read(w->fds[s], buffer, sizeof(buffer));
        if (n > 0) {
          w->streams[s]->write(std::string_view(buffer, static_cast<size_t>(n)));
        } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
          ::close(w->fds[s]);
          w->fds[s] = -1;
          w->streams[s]->finish();
        }
      }
      if (fds[0].revents) {
        std::vector<int> sigs;
        signals.drain(sigs);
        bool child = false;
        for (int sig : sigs) {
          if (sig == SIGCHLD) child = true;
          else handleSignal(sig);
        }
        if (child) reapAll();
      }
      if (fds[1].revents) {
        uint64_t counter = 0;
        ssize_t ignored = ::read(wakeFd, &counter, sizeof(counter));
        (void)ignored;
        if (coord) {
          for (const auto& event : coord->takeEvents()) handleEvent(event);
        }
      }
      for (size_t i = watchFrom; i < fds.size(); ++i) {
        if (fds[i].revents) onWatchFd(fds[i].fd);
      }
      if (!pendingEvents.empty()) {
        std::vector<CoordinatorEvent> events;
        events.swap(pendingEvents);
        for (const auto& event : events) handleEvent(event);
      }
      const int64_t after = wallMs();
      checkLiveness(after);
      checkStragglers(after);
      if (coord && multiNode && !stopping && after - coord->lastContactMs() > o.nodeTimeout.count()) {
        storeGone = true;
        external(str("no answer from the job's store at ", storeAddr, " for ",
                     formatDuration(Millis(after - coord->lastContactMs())), " (node timeout ",
                     formatDuration(o.nodeTimeout), "): node 0's dtrun died, or the network to it is cut"),
                 1);
      }
      if (heldStopSignal != 0) {
        const bool answered = std::all_of(askedForDumps.begin(), askedForDumps.end(), [&](const Worker* w) {
          std::error_code ec;
          return w->reaped || std::filesystem::exists(std::filesystem::path(flightDir) / str("flight_rank", w->rank, "_signal.json"), ec);
        });
        if (answered || after >= heldStopUntil) {
          signalAll(heldStopSignal, true);
          heldStopSignal = 0;
        }
      }
      if (stopping && !killSent && after >= killAt) {
        bool any = false;
        for (auto& w : workers) any |= !w.reaped;
        if (any) say(str("workers still running ", formatDuration(o.killGrace), " after the stop request (--kill-grace): sending SIGKILL"));
        signalAll(SIGKILL, true);
        killSent = true;
        killAllReason = str("still running ", formatDuration(o.killGrace), " after the stop request (--kill-grace)");
      }
    }

    // Every worker is reaped and its group signalled where needed: nothing
    // left for the guardian to clean up should dtrun die from here on.
    if (guardian) {
      for (const auto& w : workers) {
        if (w.pid > 0) guardian->release(w.pid);
      }
    }
    if (!stopping && (!multiNode || allDone) && o.elastic) {
      // The job went on without its lost workers: it succeeded where one of
      // the others finished (not on a node whose workers all died).
      const bool finished = std::any_of(workers.begin(), workers.end(), [](const Worker& w) { return !w.outcome.failed(); });
      std::vector<std::string> lost;
      for (const auto& w : workers) {
        if (w.lost && w.outcome.failed()) lost.push_back(str("rank ", w.rank, " (", describeOutcome(w.outcome), ")"));
      }
      if (finished) {
        if (!replaced.empty()) say(str("replaced during the job: ", join(replaced, ", ")));
        if (!lost.empty()) say(str("the elastic job finished without ", join(lost, ", ")));
        return AttemptResult{true, 0};
      }
    } else if (!stopping && (!multiNode || allDone)) {
      return AttemptResult{true, 0};
    }

    // Failure. With several nodes, learn which failure the job records as
    // first (each node prints the same root cause and exits with its code).
    if (multiNode && published && !publishResolved && !storeGone) {
      const int64_t until = wallMs() + std::min<int64_t>(3000, o.nodeTimeout.count());
      while (!publishResolved && wallMs() < until) {
        idleWait(50);
        for (const auto& event : pendingEvents) {
          if (event.kind == CoordinatorEvent::Kind::FailurePublished || event.kind == CoordinatorEvent::Kind::RemoteFailure) {
            publishResolved = true;
            globalFailure = decodeFailure(event.text);
          }
        }
        pendingEvents.clear();
      }
    }

    SummaryInput summary;
    summary.runId = runId;
    summary.attempt = attempt;
    summary.maxRestarts = o.maxRestarts;
    summary.nodeRank = o.nodeRank;
    summary.startMs = startMs;
    for (auto& w : workers) {
      if (w.streams[1]) w.outcome.stderrTail.assign(w.streams[1]->tail().begin(), w.streams[1]->tail().end());
      summary.outcomes.push_back(w.outcome);
    }
    int code = externalCode;
    summary.externalCause = externalCause;
    if (globalFailure && globalFailure->node != o.nodeRank) {
      summary.externalCause = str("node ", globalFailure->node, " reported: ", globalFailure->description);
      code = globalFailure->code;
    } else if (externalCause.empty()) {
      const auto root = rootCause(summary.outcomes);
      code = root ? exitCodeOf(summary.outcomes[*root]) : 1;
    }
    if (code == 0) code = 1;
    writeAll(2, formatSummary(summary));
    if (!flightDir.empty()) {
      if (multiNode && !storeGone) gatherFlightRecords(flightDir, attempt, rdv);
      writeAll(2, flightStory(flightDir));
    }
    return AttemptResult{false, code};
  }

  // A worker killed while its shm group was being set up can leave the
  // group's segment name behind; names follow "dtrain-<run id>-..." (see
  // process_group/shm/shm_segment.h). Every worker of the attempt is gone now.
  void removeLeftoverSharedMemory() {
    const std::string prefix = str("dtrain-", safeNameComponent(runId), "-");
    std::error_code ec;
    int removed = 0;
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind(prefix, 0) == 0 && std::filesystem::remove(entry.path(), ec)) ++removed;
    }
    if (removed > 0) say(str("removed ", removed, " shared-memory segment(s) the workers left in /dev/shm"));
  }

  void finishJob() {
    if (o.etcd() && !storeGone) {
      try {  // a later job with the same --rdzv-id opens a new round
        store->set("dtrun/ended", "1");
      } catch (const std::exception& e) {
        say(str("warning: could not record the job's end in etcd: ", e.what()));
      }
    }
    if (!coord || o.nnodes == 1 || storeGone) return;
    const int64_t until = wallMs() + std::min<int64_t>(o.nodeTimeout.count(), 10000);
    const bool hostsStore = o.nodeRank == 0 || (standbyServer && standbyServer->role() == "primary");
    if (hostsStore && !o.etcd()) {
      // Keep the store up until every other node has seen the outcome (etcd stays up by itself).
      coord->awaitExits();
      bool seen = false;
      while (!seen && wallMs() < until) {
        idleWait(50);
        for (const auto& event : pendingEvents) seen |= event.kind == CoordinatorEvent::Kind::ExitsSeen;
        pendingEvents.clear();
      }
    } else {
      coord->publishExit();
      bool published = false;
      while (!published && wallMs() < until) {
        idleWait(50);
        for (const auto& event : pendingEvents) {
          published |= event.kind == CoordinatorEvent::Kind::ExitPublished || event.kind == CoordinatorEvent::Kind::StoreLost;
        }
        pendingEvents.clear();
      }
    }
  }

  void startStatusPage() {
    if (o.statusPort < 0) return;
    statusCollector = std::make_unique<StatusCollector>(
        store, StatusCollector::Config{runId, o.elastic, Millis(std::clamp<int64_t>(o.monitorInterval.count(), 200, 1000))});
    StatusServer::Config sc;
    sc.bind = o.statusBind;
    sc.port = o.statusPort;
    if (!isLoopbackAddress(o.statusBind)) sc.token = randomHex(16);  // others on the network see the job only with it
    sc.json = [c = statusCollector.get()] { return statusJson(c->view()); };
    sc.metrics = [c = statusCollector.get()] { return prometheusText(c->view()); };
    statusServer = std::make_unique<StatusServer>(std::move(sc));
    statusCollector->start();
    say(str("status page at ", statusServer->url(), " (Prometheus: /metrics)"));
  }

  int run() {
    setupStore();
    startStatusPage();
    for (int attempt = 0;; ++attempt) {
      if (coord) coord->endAttempt();
      const auto rdv = rendezvous(attempt);
      if (!rdv) {
        say(str("received ", signalName(terminationSignal), " while waiting for the other nodes; stopping"));
        return 128 + terminationSignal;
      }
      if (statusCollector) statusCollector->beginAttempt(attempt, rdv->worldSize);
      const AttemptResult result = runAttempt(attempt, *rdv);
      removeLeftoverSharedMemory();
      if (statusCollector && (result.success || terminationSignal != 0 || attempt >= o.maxRestarts || o.elastic)) {
        statusCollector->finish(result.success ? std::string("succeeded") : str("failed, exit code ", result.exitCode));
      }
      if (result.success) {
        finishJob();
        return 0;
      }
      // Under --elastic, --max-restarts counts replacements of single workers, not group restarts.
      if (terminationSignal != 0 || attempt >= o.maxRestarts || o.elastic) {
        say(str("exit code ", result.exitCode,
                terminationSignal != 0 ? "" : (o.maxRestarts > 0 && !o.elastic ? str(" (no restarts left of ", o.maxRestarts, ")") : std::string())));
        finishJob();
        return result.exitCode;
      }
      say(str("restarting the worker group (restart ", attempt + 1, " of ", o.maxRestarts, ")"));
    }
  }
};

Agent::Agent(AgentConfig config, SignalChannel& signals, Guardian* guardian)
    : impl_(std::make_unique<Impl>(std::move(config), signals, guardian)) {}
Agent::~Agent() = default;
int Agent::run() { return impl_->run(); }

}  // namespace dt::launcher
