#include "launcher/options.h"

#include <algorithm>
#include <cctype>
#include <csignal>
#include <cstring>

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"

namespace dt::launcher {
namespace {

struct SignalEntry {
  const char* name;
  int number;
};

constexpr SignalEntry kSignals[] = {
    {"HUP", SIGHUP},   {"INT", SIGINT},   {"QUIT", SIGQUIT}, {"ILL", SIGILL},   {"TRAP", SIGTRAP},
    {"ABRT", SIGABRT}, {"BUS", SIGBUS},   {"FPE", SIGFPE},   {"KILL", SIGKILL}, {"USR1", SIGUSR1},
    {"SEGV", SIGSEGV}, {"USR2", SIGUSR2}, {"PIPE", SIGPIPE}, {"ALRM", SIGALRM}, {"TERM", SIGTERM},
    {"CHLD", SIGCHLD}, {"CONT", SIGCONT}, {"STOP", SIGSTOP}, {"TSTP", SIGTSTP}, {"TTIN", SIGTTIN},
    {"TTOU", SIGTTOU}, {"URG", SIGURG},   {"XCPU", SIGXCPU}, {"XFSZ", SIGXFSZ}, {"VTALRM", SIGVTALRM},
    {"PROF", SIGPROF}, {"WINCH", SIGWINCH}, {"IO", SIGIO},   {"SYS", SIGSYS},
};

std::string upper(std::string text) {
  for (char& c : text) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return text;
}

int parseCount(const std::string& text, const std::string& what, int min, int max, const char* accepted) {
  int64_t value = 0;
  try {
    value = env::parseInt(text, what);
  } catch (const InvalidArgument&) {
    throw InvalidArgument(str(what, "=", quoteBytes(text), " is not valid; accepted: ", accepted));
  }
  if (value < min || value > max) {
    throw InvalidArgument(str(what, "=", quoteBytes(text), " is out of range; accepted: ", accepted));
  }
  return static_cast<int>(value);
}

Millis parseDurationOption(const std::string& text, const std::string& what) {
  try {
    return env::parseDuration(text, what);
  } catch (const InvalidArgument&) {
    throw InvalidArgument(str(what, "=", quoteBytes(text),
                              " is not a duration; accepted: e.g. 250ms, 30s, 30 (seconds), 5min, 1h"));
  }
}

bool parseBoolOption(const std::string& text, const std::string& what) {
  try {
    return env::parseBool(text, what);
  } catch (const InvalidArgument&) {
    throw InvalidArgument(str(what, "=", quoteBytes(text), " is not a boolean; accepted: 1/0, true/false, yes/no, on/off"));
  }
}

// One option: its long name, its environment fallback, whether it takes a
// value, the default as --help shows it, and what it does.
struct OptionSpec {
  const char* name;
  const char* envName;
  bool takesValue;
  const char* defaultText;
  const char* help;
  std::function<void(LaunchOptions&, const std::string& value, const std::string& what)> apply;
};

const std::vector<OptionSpec>& optionSpecs() {
  static const std::vector<OptionSpec> specs = {
      {"nproc", "DT_NPROC", true, "1", "workers on this node: N, cpu (usable cores), gpu (CUDA devices), auto (gpu if any, else cpu)",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         const std::string lower = upper(v) == "CPU" ? "cpu" : upper(v) == "GPU" ? "gpu" : upper(v) == "AUTO" ? "auto" : v;
         if (lower != "cpu" && lower != "gpu" && lower != "auto") {
           parseCount(v, what, 1, 1 << 20, "a positive integer, cpu, gpu or auto");
         }
         o.nprocSpec = lower;
       }},
      {"nnodes", "DT_NNODES", true, "1", "number of nodes (one dtrun per node), or MIN:MAX with --elastic: the job starts once MIN nodes are there (waiting up to --rdzv-timeout; all MAX start it at once) and later nodes join it while it runs",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         const auto colon = v.find(':');
         const char* accepted = "a positive integer, or MIN:MAX with 1 <= MIN <= MAX";
         if (colon == std::string::npos) {
           o.nnodes = o.minNodes = parseCount(v, what, 1, 1 << 20, accepted);
         } else {
           o.minNodes = parseCount(v.substr(0, colon), what, 1, 1 << 20, accepted);
           o.nnodes = parseCount(v.substr(colon + 1), what, 1, 1 << 20, accepted);
           if (o.minNodes > o.nnodes) throw InvalidArgument(str(what, "=", quoteBytes(v), " has MIN above MAX; accepted: ", accepted));
         }
         o.nnodesSet = true;
       }},
      {"node-rank", "DT_NODE_RANK", true, "0", "this node's rank, 0..nnodes-1; node 0 hosts the store (with --rdzv-backend etcd: optional, nodes get ranks in the order they join)",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         o.nodeRank = parseCount(v, what, 0, 1 << 20, "an integer from 0 to nnodes-1");
         o.nodeRankSet = true;
       }},
      {"master-addr", "DT_MASTER_ADDR", true, "127.0.0.1", "address of node 0 (its store and the workers' MASTER_ADDR)",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         if (v.empty()) throw InvalidArgument(str(what, " is empty; accepted: a host name or IP address"));
         o.masterAddr = v;
         o.masterAddrSet = true;
       }},
      {"master-port", "DT_MASTER_PORT", true, "29500", "port of the job's store on node 0; 0 picks a free one (single node only; there a busy default port also falls back to a free one)",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         o.masterPort = parseCount(v, what, 0, 65535, "a port number from 0 to 65535 (0: any free port)");
         o.masterPortSet = true;
       }},
      {"worker-port", "DT_WORKER_PORT", true, "0", "MASTER_PORT given to the workers (kept free for their rank 0); 0 picks a free one",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         o.workerPort = parseCount(v, what, 0, 65535, "a port number from 0 to 65535 (0: any free port)");
       }},
      {"max-restarts", "DT_MAX_RESTARTS", true, "0", "restarts of the whole worker group after a failure; with --elastic: replacements per local rank (a worker that died is started again and joins the running job while the others train)",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         o.maxRestarts = parseCount(v, what, 0, 1 << 20, "a non-negative integer");
       }},
      {"elastic", "DT_ELASTIC", false, "off", "keep training when a worker dies: the others go on without it, in place (no restart, no lost step; the program uses dt::elastic::ElasticGroup, docs/elastic.md)",
       [](LaunchOptions& o, const std::string& v, const std::string& what) { o.elastic = v.empty() ? true : parseBoolOption(v, what); }},
      {"min-nproc", "DT_MIN_NPROC", true, "1", "with --elastic: the job stops when fewer workers than this are left (over all nodes)",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         o.minNproc = parseCount(v, what, 1, 1 << 20, "a positive integer");
       }},
      {"evict-stragglers", "DT_EVICT_STRAGGLERS", false, "off", "with --elastic: a rank the training loop reports as a straggler (docs/debugging.md) is killed by dtrun and not replaced; the others go on in place without it",
       [](LaunchOptions& o, const std::string& v, const std::string& what) { o.evictStragglers = v.empty() ? true : parseBoolOption(v, what); }},
      {"liveness-timeout", "DT_LIVENESS_TIMEOUT", true, "5s", "with --elastic: a worker whose heartbeat stopped this long (frozen, hung) is declared dead and killed",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         o.livenessTimeout = parseDurationOption(v, what);
         if (o.livenessTimeout.count() < 100) throw InvalidArgument(str(what, "=", quoteBytes(v), " is too small; accepted: a duration of at least 100ms"));
       }},
      {"monitor-interval", "DT_MONITOR_INTERVAL", true, "500ms", "how often the store is polled (other nodes, heartbeats, hang watchdog); local workers are watched without polling",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         o.monitorInterval = parseDurationOption(v, what);
         if (o.monitorInterval.count() < 1) throw InvalidArgument(str(what, "=", quoteBytes(v), " is too small; accepted: a duration of at least 1ms"));
       }},
      {"log-dir", "DT_LOG_DIR", true, "(none)", "write each rank's stdout/stderr to <dir>/<run-id>/attempt<k>/rank<r>.{stdout,stderr}",
       [](LaunchOptions& o, const std::string& v, const std::string&) { o.logDir = v; }},
      {"tee", "DT_TEE", false, "off", "with --log-dir, also print the workers' output on the console",
       [](LaunchOptions& o, const std::string& v, const std::string& what) { o.tee = v.empty() ? true : parseBoolOption(v, what); }},
      {"local-ranks-filter", "DT_LOCAL_RANKS_FILTER", true, "(all)", "local ranks whose output reaches the console, e.g. 0 or 0,2-3",
       [](LaunchOptions& o, const std::string& v, const std::string& what) { o.localRanksFilter = parseRankList(v, what); }},
      {"kill-grace", "DT_KILL_GRACE", true, "30s", "delay between SIGTERM and SIGKILL when stopping workers",
       [](LaunchOptions& o, const std::string& v, const std::string& what) { o.killGrace = parseDurationOption(v, what); }},
      {"signals", "DT_SIGNALS", true, "INT,TERM,HUP,QUIT,USR1,USR2", "signals forwarded to every worker's process group",
       [](LaunchOptions& o, const std::string& v, const std::string& what) { o.signals = parseSignalList(v, what); }},
      {"run-id", "DT_RUN_ID", true, "(random)", "the job's id (DT_RUN_ID for the workers, log-dir folder)",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         for (char c : v) {
           if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
             throw InvalidArgument(str(what, "=", quoteBytes(v), " is not valid; accepted: letters, digits, '-', '_', '.'"));
           }
         }
         o.runId = v;
       }},
      {"standalone", "DT_STANDALONE", false, "off", "single node on loopback with a free store port (sets --nnodes 1 --master-addr 127.0.0.1 --master-port 0)",
       [](LaunchOptions& o, const std::string& v, const std::string& what) { o.standalone = v.empty() ? true : parseBoolOption(v, what); }},
      {"bind", "DT_BIND", true, "(loopback for a loopback master-addr, else all)", "address node 0's store listens on",
       [](LaunchOptions& o, const std::string& v, const std::string&) { o.bind = v; }},
      {"hang-timeout", "DT_HANG_TIMEOUT", true, "0 (off)", "fail the job when no rank completes a collective for this long",
       [](LaunchOptions& o, const std::string& v, const std::string& what) { o.hangTimeout = parseDurationOption(v, what); }},
      {"status-port", "DT_STATUS_PORT", true, "(none)", "serve the job's live status page and /metrics (Prometheus text) on this port; 0 picks a free one (dtrun prints the address; docs/debugging.md)",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         o.statusPort = parseCount(v, what, 0, 65535, "a port number from 0 to 65535 (0: any free port)");
       }},
      {"status-bind", "DT_STATUS_BIND", true, "127.0.0.1", "address the status page listens on; any address but loopback requires the random token dtrun prints with the page's address",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         if (v.empty()) throw InvalidArgument(str(what, " is empty; accepted: an address of this machine (127.0.0.1, 0.0.0.0, a host name)"));
         o.statusBind = v;
       }},
      {"node-timeout", "DT_NODE_TIMEOUT", true, "10s", "a node (or the store) silent for this long counts as failed",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         o.nodeTimeout = parseDurationOption(v, what);
         if (o.nodeTimeout.count() < 100) throw InvalidArgument(str(what, "=", quoteBytes(v), " is too small; accepted: a duration of at least 100ms"));
       }},
      {"rdzv-timeout", "DT_RDZV_TIMEOUT", true, "300s", "how long nodes wait for each other at start and at each restart",
       [](LaunchOptions& o, const std::string& v, const std::string& what) { o.rdzvTimeout = parseDurationOption(v, what); }},
      {"prefix", "DT_PREFIX", true, "\"[rank %r] \"", "console line prefix: %r rank, %l local rank, %n node rank, %h host, %% percent; none disables",
       [](LaunchOptions& o, const std::string& v, const std::string&) { o.prefix = v == "none" ? "" : v; }},
      {"slurm", "DT_SLURM", true, "auto", "read nodes from SLURM: auto (inside an srun step with one task per node), on, off",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         if (v != "auto" && v != "on" && v != "off") throw InvalidArgument(str(what, "=", quoteBytes(v), " is not valid; accepted: auto, on, off"));
         o.slurm = v;
       }},
      {"rdzv-backend", "DT_RDZV_BACKEND", true, "static", "how nodes meet: static (node 0's dtrun hosts the store) or etcd (an etcd v3 cluster, --rdzv-endpoint, is the store; no node is special)",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         if (v == "static" || v == "c10d") {
           o.rdzvBackend = "static";
         } else if (v == "etcd" || v == "etcd-v3") {
           o.rdzvBackend = "etcd";
         } else if (v == "etcd-v2") {
           throw InvalidArgument(str(what, "=etcd-v2 is not supported (etcd 3.6 removed the v2 API); accepted: etcd (the v3 API) or static"));
         } else {
           throw InvalidArgument(str(what, "=", quoteBytes(v), " is not valid; accepted: static, etcd"));
         }
       }},
      {"rdzv-endpoint", "DT_RDZV_ENDPOINT", true, "(none)", "with --rdzv-backend etcd: the etcd members' client URLs, host:port[,host:port...] (https://host:port for TLS)",
       [](LaunchOptions& o, const std::string& v, const std::string&) { o.rdzvEndpoint = v; }},
      {"rdzv-id", "DT_RDZV_ID", true, "(--run-id)", "with --rdzv-backend etcd: the job's id, the same on every node (its keys live under /dtrain/<id>)",
       [](LaunchOptions& o, const std::string& v, const std::string& what) {
         for (char c : v) {
           if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
             throw InvalidArgument(str(what, "=", quoteBytes(v), " is not valid; accepted: letters, digits, '-', '_', '.'"));
           }
         }
         o.rdzvId = v;
       }},
      {"rdzv-ca", "DT_RDZV_CA", true, "(system CAs)", "etcd TLS: the CA file (PEM) that signed the members' certificates",
       [](LaunchOptions& o, const std::string& v, const std::string&) { o.rdzvCa = v; }},
      {"rdzv-cert", "DT_RDZV_CERT", true, "(none)", "etcd TLS: this node's client certificate (PEM), for members run with --client-cert-auth",
       [](LaunchOptions& o, const std::string& v, const std::string&) { o.rdzvCert = v; }},
      {"rdzv-key", "DT_RDZV_KEY", true, "(none)", "etcd TLS: the client certificate's key (PEM)",
       [](LaunchOptions& o, const std::string& v, const std::string&) { o.rdzvKey = v; }},
      {"rdzv-user", "DT_RDZV_USER", true, "(none)", "etcd authentication: user name (it needs read-write permission on /dtrain/<rdzv id>/)",
       [](LaunchOptions& o, const std::string& v, const std::string&) { o.rdzvUser = v; }},
      {"rdzv-password", "DT_RDZV_PASSWORD", true, "(none)", "etcd authentication: password (prefer the environment variable: a command line is visible to every user)",
       [](LaunchOptions& o, const std::string& v, const std::string&) { o.rdzvPassword = v; }},
  };
  return specs;
}

// torchrun spellings accepted as aliases so that command lines carry over.
std::string canonicalName(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  if (name == "nproc-per-node") return "nproc";
  if (name == "max-restart") return "max-restarts";
  if (name == "rdzv-endpoints") return "rdzv-endpoint";
  return name;
}

const OptionSpec* findSpec(const std::string& name) {
  for (const auto& spec : optionSpecs()) {
    if (name == spec.name) return &spec;
  }
  return nullptr;
}

}  // namespace

std::string signalName(int signo) {
  for (const auto& entry : kSignals) {
    if (entry.number == signo) return str("SIG", entry.name);
  }
  return str("signal ", signo);
}

std::vector<int> parseSignalList(const std::string& text, const std::string& what) {
  std::vector<int> out;
  if (trim(text).empty() || upper(trim(text)) == "NONE") return out;
  for (const auto& raw : split(text, ',')) {
    std::string name = upper(trim(raw));
    if (name.starts_with("SIG")) name = name.substr(3);
    int number = 0;
    for (const auto& entry : kSignals) {
      if (name == entry.name) number = entry.number;
    }
    if (number == 0 && !name.empty() && std::all_of(name.begin(), name.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
      number = std::atoi(name.c_str());
      if (number <= 0 || number >= NSIG) number = 0;
    }
    if (number == 0 || number == SIGKILL || number == SIGSTOP || number == SIGCHLD) {
      throw InvalidArgument(str(what, "=", quoteBytes(text), ": ", quoteBytes(trim(raw)),
                                " is not a forwardable signal; accepted: a comma list of names or numbers such as INT,TERM,HUP,QUIT,USR1,USR2 (not KILL, STOP, CHLD), or none"));
    }
    if (std::find(out.begin(), out.end(), number) == out.end()) out.push_back(number);
  }
  return out;
}

std::vector<int> parseRankList(const std::string& text, const std::string& what) {
  std::vector<int> out;
  const char* accepted = "a comma list of ranks and ranges such as 0 or 0,2-3";
  for (const auto& raw : split(text, ',')) {
    const std::string part = trim(raw);
    const auto dash = part.find('-');
    try {
      if (dash == std::string::npos) {
        out.push_back(parseCount(part, what, 0, 1 << 20, accepted));
      } else {
        const int lo = parseCount(part.substr(0, dash), what, 0, 1 << 20, accepted);
        const int hi = parseCount(part.substr(dash + 1), what, 0, 1 << 20, accepted);
        if (hi < lo) throw InvalidArgument("reversed range");
        for (int r = lo; r <= hi; ++r) out.push_back(r);
      }
    } catch (const InvalidArgument&) {
      throw InvalidArgument(str(what, "=", quoteBytes(text), " is not valid; accepted: ", accepted));
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

ParseResult parseCommandLine(const std::vector<std::string>& args, const EnvLookup& lookup) {
  ParseResult result;
  LaunchOptions& o = result.options;
  o.signals = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};

  // Environment fallbacks first, so that the command line overrides them.
  for (const auto& spec : optionSpecs()) {
    const auto value = lookup(spec.envName);
    if (value && !value->empty()) spec.apply(o, *value, spec.envName);
  }

  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      result.help = true;
      return result;
    }
    if (arg == "--version") {
      result.version = true;
      return result;
    }
    if (!arg.starts_with("-") || arg == "-") break;
    const std::string body = arg.substr(arg.starts_with("--") ? 2 : 1);
    const auto eq = body.find('=');
    const std::string name = canonicalName(body.substr(0, eq));
    const OptionSpec* spec = findSpec(name);
    if (spec == nullptr) {
      throw InvalidArgument(str("unknown option ", quoteBytes(arg), "; accepted: the options listed by dtrun --help"));
    }
    const std::string what = str("--", spec->name);
    std::string value;
    if (eq != std::string::npos) {
      value = body.substr(eq + 1);
    } else if (spec->takesValue) {
      if (i + 1 >= args.size()) throw InvalidArgument(str(what, " needs a value; see dtrun --help"));
      value = args[++i];
    }
    spec->apply(o, value, what);
  }
  o.program.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());

  if (o.standalone) {
    o.nnodes = o.minNodes = 1;
    o.nodeRank = 0;
    o.masterAddr = "127.0.0.1";
    o.masterPort = 0;
    o.nnodesSet = o.nodeRankSet = o.masterAddrSet = o.masterPortSet = true;
  }
  if (o.program.empty()) {
    throw InvalidArgument("no program given; usage: dtrun [options] program [args...] (see dtrun --help)");
  }
  if (o.minNodes < o.nnodes && !o.elastic) {
    throw InvalidArgument(str("--nnodes=", o.minNodes, ":", o.nnodes, " needs --elastic: nodes join a running job only in an "
                              "elastic job; accepted: --nnodes N, or --elastic --nnodes MIN:MAX"));
  }
  if (o.evictStragglers && !o.elastic) {
    throw InvalidArgument("--evict-stragglers needs --elastic: only an elastic job goes on without the evicted rank; accepted: "
                          "--elastic --evict-stragglers, or neither (stragglers are still reported)");
  }
  if (o.nodeRank >= o.nnodes && o.slurm != "on") {
    throw InvalidArgument(str("--node-rank=", o.nodeRank, " is out of range for --nnodes=", o.nnodes,
                              "; accepted: 0 to ", o.nnodes - 1));
  }
  if (o.etcd()) {
    if (o.rdzvEndpoint.empty()) {
      throw InvalidArgument("--rdzv-backend etcd needs --rdzv-endpoint host:port[,host:port...] (the etcd members' client URLs)");
    }
    if (o.rdzvId.empty()) o.rdzvId = o.runId;
    if (o.rdzvId.empty()) {
      throw InvalidArgument("--rdzv-backend etcd needs --rdzv-id JOB (or --run-id), the same on every node of the job");
    }
    if (o.rdzvCert.empty() != o.rdzvKey.empty()) {
      throw InvalidArgument("--rdzv-cert and --rdzv-key go together (a client certificate and its key)");
    }
  } else if (!o.rdzvEndpoint.empty()) {
    throw InvalidArgument("--rdzv-endpoint is given but --rdzv-backend is static; accepted: --rdzv-backend etcd with it, or neither");
  }
  if (o.nnodes > 1 && o.masterPort == 0 && !o.etcd()) {
    throw InvalidArgument("--master-port=0 needs --nnodes=1 (other nodes could not find the port); accepted: a fixed port for several nodes");
  }
  return result;
}

std::string helpText() {
  std::string out =
      "usage: dtrun [options] program [args...]\n"
      "       dtrun [options] -- program [args...]\n"
      "       dtrun analyze DIR   (the flight recorder's story of a job from the ranks' dumps in DIR)\n\n"
      "Starts --nproc copies of program on this node (one dtrun per node), hosts the job's store on\n"
      "node 0 (or meets the other nodes in etcd: --rdzv-backend etcd), watches the workers, and tears\n"
      "everything down when one fails.\n\n"
      "Workers get RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,\n"
      "DT_STORE_ADDR, DT_STORE_TOKEN, DT_RUN_ID, DT_RESTART_COUNT, DT_MAX_RESTARTS (with etcd: DT_ETCD_ENDPOINTS,\n"
      "DT_ETCD_PREFIX and the DT_ETCD_* TLS and credential variables instead of DT_STORE_ADDR/TOKEN).\n"
      "With --log-dir they also get DT_FLIGHT_RECORDER_DIR (the attempt's log folder): after a failure dtrun asks\n"
      "them for their flight records (SIGUSR2) and prints the analysis after its summary.\n\n"
      "options (each also read from the environment variable shown):\n";
  for (const auto& spec : optionSpecs()) {
    std::string left = str("  --", spec.name, spec.takesValue ? " VALUE" : "");
    const std::string gap = left.size() < 26 ? std::string(26 - left.size(), ' ') : "\n" + std::string(26, ' ');
    out += str(left, gap, spec.help, "\n",
               std::string(26, ' '), "[", spec.envName, "; default: ", spec.defaultText, "]\n");
  }
  out +=
      "  --help, --version\n\n"
      "Under SLURM (srun --ntasks-per-node=1 dtrun ...), --nnodes, --node-rank, --master-addr and\n"
      "--master-port default to SLURM_NNODES, SLURM_NODEID, the first host of SLURM_JOB_NODELIST and\n"
      "a port derived from SLURM_JOB_ID.\n"
      "Exit status: 0 when every worker succeeded; else the first failed worker's exit code\n"
      "(128 + signal number when a signal ended it); 124 when the hang watchdog fired; 3 when an --elastic\n"
      "job fell below --min-nproc (the death that brought it there is named as the cause); 2 for usage errors.\n";
  return out;
}

int resolveNproc(const std::string& spec, const std::function<int()>& gpuCount, const std::function<int()>& cpuCount) {
  if (spec == "cpu") return std::max(1, cpuCount());
  if (spec == "gpu") {
    const int gpus = gpuCount();
    if (gpus <= 0) {
      throw InvalidArgument("--nproc=gpu but no CUDA device was found (no /proc/driver/nvidia/gpus entries, nvidia-smi -L lists none, or CUDA_VISIBLE_DEVICES hides them); accepted: a number, cpu, or auto");
    }
    return gpus;
  }
  if (spec == "auto") {
    const int gpus = gpuCount();
    return gpus > 0 ? gpus : std::max(1, cpuCount());
  }
  return static_cast<int>(env::parseInt(spec, "--nproc"));
}

}  // namespace dt::launcher
