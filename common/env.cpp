#include "common/env.h"

#include <array>
#include <cctype>
#include <charconv>
#include <cstdlib>

#include "common/errors.h"
#include "common/strings.h"

namespace dt::env {
namespace {

// The one table of DT_* knobs. Add new knobs here (and regenerate docs/env.md).
constexpr std::array kKnobs = {
    // common
    Knob{"DT_LOG_LEVEL", "warn", "Log level for every dtrain logger: trace, debug, info, warn, error, off.", "user"},
    Knob{"DT_NUM_THREADS", "", "Intra-op threads for tensor ops. Default: the machine's cores, or 1 when dtrun runs several ranks on one machine.", "user, dtrun"},
    Knob{"DT_MATMUL_BACKEND", "auto", "Which library runs float32 CPU matrix products (mm, bmm, matmul, linear): auto (per shape, by the measured rule of docs/tensor.md), openblas or onednn (every product). bfloat16 products run on oneDNN unless openblas. Read at the first product.", "user"},
    Knob{"DT_BF16_MATMUL", "auto", "Where the CPU has bf16 instructions, whether bfloat16 products (autocast, bf16 tensors) use them: auto (where they are faster than float32: AMX, or AVX512_BF16 dot products measured faster than float32 FMAs at the first bf16 product) or native (wherever they are). Read at the first bf16 product.", "user"},
    Knob{"DT_AUTOCAST_ATTENTION", "0", "1: inside dt::autocast(BFloat16) the fused attention core (scaledDotProductAttention, selfAttention) also multiplies bf16 operands with fp32 accumulation (softmax, statistics, dropout and outputs stay fp32); 0: it stays fp32, the default (measured no faster here, docs/tensor.md). Read at the first attention op.", "user"},
    Knob{"DT_DEBUG", "off", "Debug checks: off, info, or detail (detail compares collective fingerprints across ranks before every collective).", "user"},
    Knob{"DT_DETECT_ANOMALY", "0", "Anomaly mode for every thread without a dt::AnomalyMode guard: 1 finds the first backward function that returns a NaN or Inf, forward also checks every op's forward output; 0 off. Read once, at the first tensor op.", "user"},
    Knob{"DT_PROFILE", "", "Profile the whole process (tensor ops, backward, collectives, DDP buckets) and write a Chrome trace to this path at exit, {rank} replaced by the rank (without it and with WORLD_SIZE > 1, .rank<r> goes before the extension), plus the table to <path>.txt. See docs/profiling.md.", "user"},
    // store
    Knob{"DT_STORE_TIMEOUT", "300s", "Default timeout of blocking store calls (get, wait, queuePop, barriers). Per-call timeouts override it.", "user"},
    Knob{"DT_STORE_CONNECT_TIMEOUT", "60s", "How long a store client keeps retrying to reach a server that is not up yet.", "user"},
    Knob{"DT_STORE_TOKEN", "", "Authentication token a TcpStore server requires and its clients present. dtrun generates one per job.", "user, dtrun"},
    Knob{"DT_STORE_ADDR", "", "host:port of the launcher's rendezvous store; when set, every rank is a client of it.", "dtrun"},
    Knob{"DT_STORE_STANDBY", "", "host:port of the hot standby of the store at DT_STORE_ADDR (dtrun --elastic on several nodes: hosted by node 1's dtrun); a client fails over to it when the store's connection is closed by its peer.", "dtrun"},
    Knob{"DT_STORE_MAX_KEY_BYTES", "4096", "Largest key a TcpStore server accepts.", "user"},
    Knob{"DT_STORE_STALL_TIMEOUT", "30s", "A TcpStore server disconnects a client that has sent part of a request (or no handshake) and nothing more for this long.", "user"},
    Knob{"DT_STORE_MAX_VALUE_BYTES", "67108864", "Largest value (and largest request) a TcpStore server accepts.", "user"},
    Knob{"DT_STORE_HANDSHAKE_TIMEOUT", "5s", "A TcpStore server closes a connection that has not completed its handshake this long after connecting (or after DT_STORE_STALL_TIMEOUT, if shorter).", "user"},
    Knob{"DT_STORE_MAX_UNAUTHENTICATED", "64", "Connections a TcpStore server lets wait for their handshake at once; one more closes the oldest of them.", "user"},
    Knob{"DT_ETCD_ENDPOINTS", "", "Client URLs of an etcd v3 cluster (host:port[,host:port...], https://host:port for TLS): initProcessGroup's store is then an EtcdStore there. dtrun --rdzv-backend etcd sets it for its workers.", "dtrun, user"},
    Knob{"DT_ETCD_PREFIX", "/dtrain", "Key prefix of the EtcdStore that initProcessGroup opens (dtrun: /dtrain/<rdzv id>/r<round>).", "dtrun, user"},
    Knob{"DT_ETCD_CA", "", "CA file (PEM) that signed the etcd members' certificates; empty: the system's CAs.", "dtrun, user"},
    Knob{"DT_ETCD_CERT", "", "Client certificate (PEM) for etcd members run with --client-cert-auth.", "dtrun, user"},
    Knob{"DT_ETCD_KEY", "", "Key (PEM) of DT_ETCD_CERT.", "dtrun, user"},
    Knob{"DT_ETCD_USER", "", "etcd user name (authentication); it needs read-write permission on the prefix.", "dtrun, user"},
    Knob{"DT_ETCD_PASSWORD", "", "Password of DT_ETCD_USER.", "dtrun, user"},
    Knob{"DT_STORE_MAX_BUFFERED_BYTES", "268435456", "Input a TcpStore server buffers for large requests (over 64 KiB) across all connections; a request that does not fit is not read until earlier ones complete.", "user"},
    // process groups
    Knob{"DT_PG_TIMEOUT", "10min", "Default timeout of collectives and of process-group set-up. Overridable per group and per op.", "user"},
    Knob{"DT_GLOO_HOSTNAME", "", "Address Gloo's TCP transport binds and advertises. Default: 127.0.0.1 when the store is on loopback, else this machine's host name.", "user"},
    Knob{"DT_GLOO_ALLREDUCE", "auto", "Allreduce algorithm of the Gloo backend: auto (recursive_doubling below 256 KiB, or below 2 MiB with two ranks; ring from there), ring, halving_doubling or recursive_doubling. Must be the same on every rank.", "user"},
    Knob{"DT_GLOO_BATCH_LOOP", "1", "Run Gloo's event-loop thread under SCHED_BATCH so it never preempts the thread it waits for; set 0 to keep the default policy.", "user"},
    Knob{"DT_BACKEND", "", "Backend override for initProcessGroup: gloo, shm or nccl. Default: CPU tensors on shm when the group shares a host, gloo when every rank has its own host, both (hierarchical) otherwise; CUDA tensors on nccl.", "user"},
    Knob{"DT_HOST_ID", "", "This process's host identity for backend routing (ranks with equal ids share memory). Default: the kernel's boot id plus the network namespace.", "user"},
    Knob{"DT_FLIGHT_RECORDER_ENTRIES", "4096", "Flight recorder: how many of its last process-group operations (collectives, send, recv) each process keeps, rounded up to a power of two; 0 turns it off. Read once, at the first operation. See docs/debugging.md.", "user"},
    Knob{"DT_FLIGHT_RECORDER_DIR", "", "Flight recorder: folder each rank writes its dump to (flight_rank<R>_<reason>.json) on a timeout, desync, failed op, abort, member loss, SIGUSR2 or dt::dumpFlightRecorder(); unset: no dumps. dtrun --log-dir sets it to the attempt's log folder.", "dtrun, user"},
    // ddp
    Knob{"DT_DDP_LOG", "0", "DistributedDataParallel: rank 0 prints the bucket table once and a one-line summary (forward, backward, communication and exposed communication time) every DT_DDP_LOG_EVERY iterations to stderr.", "user"},
    Knob{"DT_DDP_LOG_EVERY", "100", "With DT_DDP_LOG=1: synchronised iterations between two DDP summary lines.", "user"},
    // launcher (set by dtrun for its workers)
    Knob{"DT_RUN_ID", "", "The job's run id (also dtrun's --run-id fallback; default: random, or slurm-<job id>.<step id> under SLURM).", "dtrun, user"},
    Knob{"DT_RESTART_COUNT", "0", "How many times dtrun has restarted the worker group.", "dtrun"},
    Knob{"DT_MAX_RESTARTS", "0", "How many restarts dtrun allows (also dtrun's --max-restarts fallback).", "dtrun, user"},
    // dtrun's options (each DT_<NAME> is the fallback of --<name>; see dtrun --help and docs/launcher.md)
    Knob{"DT_NPROC", "1", "dtrun --nproc: workers per node: N, cpu, gpu or auto.", "user"},
    Knob{"DT_NNODES", "1", "dtrun --nnodes: number of nodes, one dtrun each.", "user"},
    Knob{"DT_NODE_RANK", "0", "dtrun --node-rank: this node's rank; node 0 hosts the store.", "user"},
    Knob{"DT_MASTER_ADDR", "127.0.0.1", "dtrun --master-addr: address of node 0 (its store and the workers' MASTER_ADDR).", "user"},
    Knob{"DT_MASTER_PORT", "29500", "dtrun --master-port: port of node 0's store; 0 picks a free one (one node only).", "user"},
    Knob{"DT_WORKER_PORT", "0", "dtrun --worker-port: the MASTER_PORT given to workers (kept free for them); 0 picks a free one.", "user"},
    Knob{"DT_ELASTIC", "off", "dtrun --elastic: keep training when a worker dies (the others go on in place); set 1 for the workers of such a job.", "dtrun, user"},
    Knob{"DT_ELASTIC_JOIN", "0", "Set 1 by dtrun --elastic for a replacement worker: its ElasticGroup joins the running job (admitted at a step boundary) instead of starting it.", "dtrun"},
    Knob{"DT_ELASTIC_MEMBER", "-1", "With DT_ELASTIC_JOIN=1: the replacement's member id (a fresh one, at least the initial world size), set by dtrun.", "dtrun"},
    // the training loop's test switches (train/loop.h, TestSwitches): to exercise failure paths of any program on it
    Knob{"DT_TEST_FAIL_AT", "", "Tests only: MEMBER:STEP:PHASE[,...] (forward, backward, commit, checkpoint): that member of a program on dt::train::Loop SIGKILLs itself there.", "tests"},
    Knob{"DT_TEST_RECORD_SAMPLES", "", "Tests only: PREFIX: each member of a program on dt::train::Loop appends the examples of every attempt at a step to PREFIX.<member>.", "tests"},
    Knob{"DT_TEST_WAIT_FOR_JOINER_AT", "", "Tests only: STEP: the members of an elastic program on dt::train::Loop wait (up to 2 minutes) at the start of that step for a replacement to ask to join, unless one joined already.", "tests"},
    Knob{"DT_TEST_STEP_PAUSE_MS", "0", "Tests only: a program on dt::train::Loop sleeps this many ms at the start of every step, so that kills and joins land mid-run.", "tests"},
    Knob{"DT_TEST_SLOW_RANK", "", "Tests only: MEMBER:MS[:forward|data]: that member of a program on dt::train::Loop sleeps MS ms inside the forward phase of every step (data: in its wait for each batch), a straggler on purpose.", "tests"},
    Knob{"DT_STRAGGLER_EVERY", "", "dt::train::Loop: steps between two gathers of the ranks' step figures on the control all-reduce (default LoopOptions::stragglers.every, 10); 0 turns straggler detection off. See docs/debugging.md.", "user"},
    Knob{"DT_STRAGGLER_THRESHOLD", "", "dt::train::Loop: a rank whose own time (its step less its communication wait) exceeds this many times the median is slow (default LoopOptions::stragglers.threshold, 1.5).", "user"},
    Knob{"DT_STRAGGLER_WINDOW", "", "dt::train::Loop: steps a rank must stay slow to be reported as a straggler (default LoopOptions::stragglers.window, 40).", "user"},
    Knob{"DT_MIN_NPROC", "1", "dtrun --min-nproc: an elastic job stops when fewer workers are left; the workers' ElasticGroup reads it too.", "dtrun, user"},
    Knob{"DT_EVICT_STRAGGLERS", "off", "dtrun --evict-stragglers: with --elastic, a rank the training loop reports as a straggler is killed and not replaced; the others go on without it.", "user"},
    Knob{"DT_LIVENESS_TIMEOUT", "5s", "dtrun --liveness-timeout: an elastic worker whose heartbeat stopped this long is declared dead and killed.", "user"},
    Knob{"DT_MONITOR_INTERVAL", "500ms", "dtrun --monitor-interval: how often dtrun polls the store (other nodes, heartbeats, hang watchdog).", "user"},
    Knob{"DT_LOG_DIR", "", "dtrun --log-dir: folder for per-rank, per-attempt stdout/stderr files.", "user"},
    Knob{"DT_TEE", "off", "dtrun --tee: with --log-dir, also show worker output on the console.", "user"},
    Knob{"DT_LOCAL_RANKS_FILTER", "", "dtrun --local-ranks-filter: local ranks whose output reaches the console (e.g. 0,2-3); unset: all.", "user"},
    Knob{"DT_KILL_GRACE", "30s", "dtrun --kill-grace: delay between SIGTERM and SIGKILL when stopping workers.", "user"},
    Knob{"DT_SIGNALS", "INT,TERM,HUP,QUIT,USR1,USR2", "dtrun --signals: signals dtrun forwards to every worker's process group.", "user"},
    Knob{"DT_STANDALONE", "off", "dtrun --standalone: one node on loopback with a free store port.", "user"},
    Knob{"DT_BIND", "", "dtrun --bind: address node 0's store listens on (default: loopback for a loopback master address, else all).", "user"},
    Knob{"DT_HANG_TIMEOUT", "0", "dtrun --hang-timeout: fail the job when no rank completes a collective for this long; 0 = off.", "user"},
    Knob{"DT_STATUS_PORT", "", "dtrun --status-port: serve the job's live status page and /metrics (Prometheus) on this port; 0 = any free port; unset = no page. See docs/debugging.md.", "user"},
    Knob{"DT_STATUS_BIND", "127.0.0.1", "dtrun --status-bind: address the status page listens on; any other than loopback requires the random token dtrun prints with the page's address.", "user"},
    Knob{"DT_NODE_TIMEOUT", "10s", "dtrun --node-timeout: a node (or the store) silent for this long counts as failed.", "user"},
    Knob{"DT_RDZV_TIMEOUT", "300s", "dtrun --rdzv-timeout: how long nodes wait for each other at start and at each restart.", "user"},
    Knob{"DT_PREFIX", "[rank %r] ", "dtrun --prefix: console line prefix (%r rank, %l local rank, %n node, %h host); none disables.", "user"},
    Knob{"DT_RDZV_BACKEND", "static", "dtrun --rdzv-backend: static (node 0's dtrun hosts the store) or etcd (an etcd v3 cluster is the store; no node is special).", "user"},
    Knob{"DT_RDZV_ENDPOINT", "", "dtrun --rdzv-endpoint: the etcd members' client URLs, host:port[,host:port...].", "user"},
    Knob{"DT_RDZV_ID", "", "dtrun --rdzv-id: the job's id in etcd, the same on every node (default: --run-id).", "user"},
    Knob{"DT_RDZV_CA", "", "dtrun --rdzv-ca: CA file (PEM) of the etcd members' certificates.", "user"},
    Knob{"DT_RDZV_CERT", "", "dtrun --rdzv-cert: client certificate (PEM) for etcd.", "user"},
    Knob{"DT_RDZV_KEY", "", "dtrun --rdzv-key: key (PEM) of the client certificate.", "user"},
    Knob{"DT_RDZV_USER", "", "dtrun --rdzv-user: etcd user name.", "user"},
    Knob{"DT_RDZV_PASSWORD", "", "dtrun --rdzv-password: etcd password (set it here rather than on the command line, which every user can read).", "user"},
    Knob{"DT_SLURM", "auto", "dtrun --slurm: take nodes from SLURM: auto (inside an srun step with one task per node), on, off.", "user"},
};

std::string_view trimView(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  return text;
}

void requireDeclared(std::string_view name) {
  if (name.starts_with("DT_") && findKnob(name) == nullptr) {
    throw Error(str("environment variable ", name,
                    " is read but not declared in common/env.cpp (internal error, please report)"));
  }
}

}  // namespace

std::span<const Knob> knobs() { return kKnobs; }

const Knob* findKnob(std::string_view name) {
  for (const auto& knob : kKnobs) {
    if (knob.name == name) return &knob;
  }
  return nullptr;
}

std::optional<std::string> getRaw(std::string_view name) {
  requireDeclared(name);
  const char* value = std::getenv(std::string(name).c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

std::string getString(std::string_view name) {
  auto value = getRaw(name);
  if (value && !value->empty()) return *value;
  const Knob* knob = findKnob(name);
  return knob ? std::string(knob->defaultValue) : std::string();
}

int64_t getInt(std::string_view name) { return parseInt(getString(name), name); }
bool getBool(std::string_view name) { return parseBool(getString(name), name); }
std::chrono::milliseconds getDuration(std::string_view name) {
  return parseDuration(getString(name), name);
}

int64_t parseInt(std::string_view text, std::string_view what) {
  const auto trimmed = trimView(text);
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(trimmed.data(), trimmed.data() + trimmed.size(), value);
  if (trimmed.empty() || ec != std::errc() || end != trimmed.data() + trimmed.size()) {
    throw InvalidArgument(str(what, "=", quoteBytes(text), " is not an integer"));
  }
  return value;
}

bool parseBool(std::string_view text, std::string_view what) {
  std::string lower;
  for (char c : trimView(text)) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower == "0" || lower == "false" || lower == "no" || lower == "off" || lower.empty()) return false;
  throw InvalidArgument(str(what, "=", quoteBytes(text), " is not a boolean; use 1/0, true/false, yes/no or on/off"));
}

std::chrono::milliseconds parseDuration(std::string_view text, std::string_view what) {
  const auto trimmed = trimView(text);
  size_t digits = 0;
  while (digits < trimmed.size() &&
         (std::isdigit(static_cast<unsigned char>(trimmed[digits])) || trimmed[digits] == '.')) {
    ++digits;
  }
  const auto number = trimmed.substr(0, digits);
  const auto unit = trimView(trimmed.substr(digits));
  double value = 0;
  const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
  double scale = 0;
  if (unit.empty() || unit == "s" || unit == "sec") scale = 1000;
  else if (unit == "ms") scale = 1;
  else if (unit == "m" || unit == "min") scale = 60'000;
  else if (unit == "h") scale = 3'600'000;
  if (number.empty() || ec != std::errc() || end != number.data() + number.size() || scale == 0 ||
      value < 0) {
    throw InvalidArgument(str(what, "=", quoteBytes(text),
                              " is not a duration; use e.g. 250ms, 30s, 30 (seconds), 5min or 1h"));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(value * scale));
}

std::string markdownListing() {
  std::string out =
      "# Environment variables\n\n"
      "Every `DT_*` variable dtrain reads, with its default. Generated from `common/env.cpp` by\n"
      "`dt_env_doc`; a test keeps this page in sync. Durations accept `250ms`, `30s`, `30` (seconds),\n"
      "`5min`, `1h`.\n\n"
      "| variable | default | set by | meaning |\n|---|---|---|---|\n";
  for (const auto& knob : kKnobs) {
    out += str("| `", knob.name, "` | ", knob.defaultValue.empty() ? "(unset)" : str("`", knob.defaultValue, "`"),
               " | ", knob.setBy, " | ", knob.meaning, " |\n");
  }
  return out;
}

}  // namespace dt::env
