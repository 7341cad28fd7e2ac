#include "process_group/init.h"

#include <unistd.h>

#include <cstdlib>

#include "common/check.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/hostlist.h"
#include "common/strings.h"
#include "common/config.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"
#if DT_HAVE_ETCD
#include "store/etcd_store.h"
#endif

namespace dt {
namespace {

std::optional<std::string> getVar(const char* name) {
  if (std::string_view(name).starts_with("DT_")) {
    auto v = env::getRaw(name);
    if (v && v->empty()) return std::nullopt;
    return v;
  }
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

[[noreturn]] void missing(const char* name, const char* setBy) {
  throw InvalidArgument(str("initProcessGroup: environment variable ", name, " is not set (", setBy,
                            "). Start the program with dtrun or torchrun, under srun, or pass it in InitOptions"));
}

int requireInt(const char* name, const char* setBy) {
  auto v = getVar(name);
  if (!v) missing(name, setBy);
  return static_cast<int>(env::parseInt(*v, name));
}

uint16_t parsePort(const std::string& text, const std::string& what) {
  const int64_t port = env::parseInt(text, what);
  if (port < 1 || port > 65535) {
    throw InvalidArgument(str(what, "=", quoteBytes(text), " is not a TCP port (1-65535)"));
  }
  return static_cast<uint16_t>(port);
}

bool isLoopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.starts_with("127.");
}

}  // namespace

ResolvedInit resolveInit(const InitOptions& options) {
  ResolvedInit out;
  const bool slurm = !options.rank && !getVar("RANK") && getVar("SLURM_PROCID");
  out.source = slurm ? "slurm" : "env";
  if (slurm) {
    out.rank = options.rank.value_or(requireInt("SLURM_PROCID", "srun sets it for each task"));
    out.worldSize = options.worldSize.value_or(requireInt("SLURM_NTASKS", "sbatch/srun set it from --ntasks"));
    out.localRank = getVar("SLURM_LOCALID") ? requireInt("SLURM_LOCALID", "srun") : 0;
  } else {
    out.rank = options.rank ? *options.rank : requireInt("RANK", "dtrun and torchrun set it for each worker");
    out.worldSize = options.worldSize ? *options.worldSize
                                      : requireInt("WORLD_SIZE", "dtrun and torchrun set it for each worker");
    if (auto lr = getVar("LOCAL_RANK")) out.localRank = static_cast<int>(env::parseInt(*lr, "LOCAL_RANK"));
  }
  DT_REQUIRE(out.worldSize >= 1, "initProcessGroup: world size must be >= 1, got ", out.worldSize);
  DT_REQUIRE(out.rank >= 0 && out.rank < out.worldSize, "initProcessGroup: rank ", out.rank,
           " is outside [0, ", out.worldSize, ")");
  if (options.store) {
    out.source = "options";
    return out;
  }
  if (auto endpoints = getVar("DT_ETCD_ENDPOINTS")) {
    // The host of the first member, for choosing Gloo's address (loopback or not).
    std::string host = endpoints->substr(0, endpoints->find(','));
    if (const auto scheme = host.find("://"); scheme != std::string::npos) host = host.substr(scheme + 3);
    if (host.starts_with("[")) {
      host = host.substr(1, host.find(']') - 1);
    } else if (const auto colon = host.rfind(':'); colon != std::string::npos) {
      host = host.substr(0, colon);
    }
    out.storeHost = host;
    out.etcdEndpoints = *endpoints;
    out.launcherStore = true;
    out.source = "etcd";
    return out;
  }
  if (auto token = getVar("DT_STORE_TOKEN")) out.token = *token;
  if (auto addr = getVar("DT_STORE_ADDR")) {
    // "host:port" or "[v6]:port"
    const auto colon = addr->rfind(':');
    if (colon == std::string::npos || colon == 0) {
      throw InvalidArgument(str("DT_STORE_ADDR=", quoteBytes(*addr), " is not host:port (dtrun sets it)"));
    }
    std::string host = addr->substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    out.storeHost = host;
    out.storePort = parsePort(addr->substr(colon + 1), "DT_STORE_ADDR port");
    out.launcherStore = true;
    out.source = "dtrun";
    return out;
  }
  if (!options.masterAddr.empty()) {
    out.storeHost = options.masterAddr;
  } else if (auto a = getVar("MASTER_ADDR")) {
    out.storeHost = *a;
  } else if (slurm) {
    auto nodes = getVar("SLURM_JOB_NODELIST");
    if (!nodes) nodes = getVar("SLURM_NODELIST");
    if (!nodes) missing("SLURM_JOB_NODELIST", "SLURM sets it in every job; or set MASTER_ADDR");
    out.storeHost = firstHostInHostlist(*nodes);
  } else {
    missing("MASTER_ADDR", "dtrun and torchrun set it to the host of rank 0's store");
  }
  if (options.masterPort) {
    out.storePort = *options.masterPort;
  } else if (auto p = getVar("MASTER_PORT")) {
    out.storePort = parsePort(*p, "MASTER_PORT");
  } else if (slurm) {
    auto job = getVar("SLURM_JOB_ID");
    if (!job) missing("SLURM_JOB_ID", "SLURM sets it in every job; or set MASTER_PORT");
    out.storePort = slurmDerivedPort(*job);
  } else {
    missing("MASTER_PORT", "dtrun and torchrun set it to a free port on MASTER_ADDR");
  }
  out.hostStore = out.rank == 0;
  return out;
}

std::shared_ptr<ProcessGroup> initProcessGroup(InitOptions options) {
  JobConnection job = connectJob(std::move(options));
  return ProcessGroup::create(job.store, job.rank, job.worldSize, std::move(job.group));
}

JobConnection connectJob(InitOptions options) {
  const ResolvedInit init = resolveInit(options);
  const auto timeout = options.timeout.value_or(env::getDuration("DT_PG_TIMEOUT"));
  StorePtr store = options.store;
  if (!store && !init.etcdEndpoints.empty()) {
#if DT_HAVE_ETCD
    EtcdStoreOptions etcd = EtcdStoreOptions::fromEnvironment();
    etcd.timeout = timeout;
    etcd.rank = init.rank;
    store = std::make_shared<EtcdStore>(etcd);
#else
    throw InvalidArgument("initProcessGroup: DT_ETCD_ENDPOINTS is set but this dtrain was built without the etcd store "
                          "(DT_USE_ETCD=OFF, or libcurl/nlohmann-json missing at build time: run scripts/setup.sh)");
#endif
  }
  if (!store) {
    TcpStoreOptions storeOptions;
    storeOptions.isServer = init.hostStore;
    storeOptions.numWorkers = init.worldSize;
    storeOptions.waitForWorkers = false;
    storeOptions.timeout = timeout;
    storeOptions.rank = init.rank;
    if (!init.token.empty()) storeOptions.token.emplace(init.token);
    if (init.launcherStore) storeOptions.standby = env::getString("DT_STORE_STANDBY");
    store = std::make_shared<TcpStore>(init.storeHost, init.storePort, storeOptions);
  }
  ProcessGroupOptions pg;
  pg.name = options.name;
  pg.timeout = timeout;
  pg.backend = options.backend.empty() ? env::getString("DT_BACKEND") : options.backend;
  pg.glooHostname = options.glooHostname;
  if (pg.glooHostname.empty()) pg.glooHostname = env::getString("DT_GLOO_HOSTNAME");
  if (pg.glooHostname.empty()) {
    if (init.storeHost.empty() || isLoopback(init.storeHost)) {
      pg.glooHostname = "127.0.0.1";
    } else {
      char name[256] = {};
      pg.glooHostname = ::gethostname(name, sizeof name - 1) == 0 ? std::string(name) : "127.0.0.1";
    }
  }
  if (init.launcherStore) {
    pg.watchdogStore = store->clone();
    pg.watchdogKey = str("dt/progress/", init.rank);
  }
  // The launcher's store outlives a restart of the workers; each incarnation
  // gets its own key space so counters of a crashed one cannot misalign it.
  const int64_t restart = env::getInt("DT_RESTART_COUNT");
  if (restart > 0) store = std::make_shared<PrefixStore>(str("restart", restart), store);
  return JobConnection{std::move(store), init.rank, init.worldSize, init.localRank, std::move(pg)};
}

}  // namespace dt
