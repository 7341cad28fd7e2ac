// dtrun's command line: parsing and --help.
//
// Contract:
//  * parseCommandLine is pure: it reads only its arguments and the `lookup`
//    function it is given for environment fallbacks (DT_<NAME>), so tests can
//    drive it without touching the process environment. Precedence per option:
//    command line, then DT_<NAME>, then the default shown in --help.
//  * Bad input throws dt::InvalidArgument whose message is one line naming the
//    option, the value and what is accepted.
//  * Options stop at the first argument that is not an option (or after "--");
//    everything from there on is the program and its arguments, untouched.
//  * --nproc cpu|gpu|auto is resolved later (resolveNproc) because it looks at
//    the machine; parsing keeps the keyword.
// Thread safety: pure functions, thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace dt::launcher {

using Millis = std::chrono::milliseconds;
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// Where the value of an option came from (for messages and SLURM defaults).
enum class Source { Default, Environment, CommandLine };

struct LaunchOptions {
  // --nproc: a number, or "cpu", "gpu", "auto" (resolved by resolveNproc).
  std::string nprocSpec = "1";
  int nnodes = 1;    // --nnodes N or MIN:MAX: the most nodes
  int minNodes = 1;  // --nnodes MIN:MAX: the job starts with MIN (others may join it later); else N
  int nodeRank = 0;
  std::string masterAddr = "127.0.0.1";
  int masterPort = 29500;       // the store's port; 0 = pick a free one
  int workerPort = 0;           // MASTER_PORT for the workers; 0 = pick a free one
  int maxRestarts = 0;
  // --elastic: a worker that dies is left behind and the others go on (elastic/elastic_group.h).
  bool elastic = false;
  int minNproc = 1;             // --min-nproc: fewer workers left than this stop an elastic job
  // --evict-stragglers (needs --elastic): a rank reported as a straggler is killed, not replaced.
  bool evictStragglers = false;
  Millis livenessTimeout{5000}; // --liveness-timeout: a worker silent this long is declared dead
  Millis monitorInterval{500};  // store polling: failures elsewhere, heartbeats, hang watchdog
  std::string logDir;           // empty: no files
  bool tee = false;             // with --log-dir: also print to the console
  std::optional<std::vector<int>> localRanksFilter;  // nullopt: all ranks reach the console
  Millis killGrace{30000};
  std::vector<int> signals;     // signal numbers forwarded to the workers
  std::string runId;            // empty: generated
  bool standalone = false;
  std::string bind;             // store listen address; empty: TcpStore's default
  Millis hangTimeout{0};        // 0: watchdog off
  int statusPort = -1;          // --status-port: the live status page's port (0: any free one); -1: no page
  std::string statusBind = "127.0.0.1";  // --status-bind: not loopback requires a token
  Millis nodeTimeout{10000};    // a node whose heartbeat is older than this is lost
  Millis rdzvTimeout{300000};   // how long nodes wait for each other at each (re)start
  std::string prefix = "[rank %r] ";  // "" disables; %r rank, %l local rank, %n node, %h host
  std::string slurm = "auto";   // auto, on, off
  // Rendezvous: "static" (node 0's dtrun hosts a TcpStore) or "etcd" (nodes
  // meet in etcd, which is also the workers' store; no node is special).
  std::string rdzvBackend = "static";
  std::string rdzvEndpoint;     // etcd: host:port[,host:port...]
  std::string rdzvId;           // etcd: the job's id, the same on every node (keys under /dtrain/<id>)
  std::string rdzvCa, rdzvCert, rdzvKey;  // etcd TLS: CA, client certificate and key files
  std::string rdzvUser, rdzvPassword;     // etcd authentication
  bool etcd() const { return rdzvBackend == "etcd"; }

  std::vector<std::string> program;  // program and its arguments

  // Which options the user set (command line or environment), for SLURM mode.
  bool nnodesSet = false, nodeRankSet = false, masterAddrSet = false, masterPortSet = false;
};

struct ParseResult {
  LaunchOptions options;
  bool help = false;     // --help: print helpText() and exit 0
  bool version = false;  // --version
};

ParseResult parseCommandLine(const std::vector<std::string>& args, const EnvLookup& lookup);

// The --help text: every option, its DT_* fallback and its default.
std::string helpText();

// "INT,TERM" / "SIGINT,15" -> signal numbers; throws InvalidArgument.
std::vector<int> parseSignalList(const std::string& text, const std::string& what);
// "0,2-3" -> {0,2,3}; throws InvalidArgument.
std::vector<int> parseRankList(const std::string& text, const std::string& what);
// "SIGTERM" for 15, "signal 77" for unknown numbers.
std::string signalName(int signo);

// Resolves --nproc: a positive number, or cpu (usable cores), gpu (CUDA
// devices, counted without CUDA), auto (gpu when there are GPUs, else cpu).
// gpuCount/cpuCount are passed in so tests can fake the machine.
int resolveNproc(const std::string& spec, const std::function<int()>& gpuCount,
                 const std::function<int()>& cpuCount);

}  // namespace dt::launcher
