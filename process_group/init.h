// initProcessGroup: the default group from the launcher's environment.
//
// Contract:
//  * Fields the options leave empty come from the environment, in this order:
//      1. dtrun / torchrun: RANK, WORLD_SIZE (LOCAL_RANK), MASTER_ADDR,
//         MASTER_PORT; plus dtrun's DT_STORE_ADDR ("host:port") and
//         DT_STORE_TOKEN. With DT_STORE_ADDR every rank is a client of the
//         launcher's store; without it rank 0 hosts a TcpStore at
//         MASTER_ADDR:MASTER_PORT and the others connect (torch's env://).
//      2. SLURM without a launcher (RANK unset, SLURM_PROCID set):
//         SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the first host of
//         SLURM_JOB_NODELIST as the store host, and the port
//         slurmDerivedPort(SLURM_JOB_ID) = 20000 + SLURM_JOB_ID mod 10000
//         (MASTER_ADDR / MASTER_PORT still win when set).
//    A missing variable throws InvalidArgument naming it and what sets it.
//    With DT_ETCD_ENDPOINTS set (dtrun --rdzv-backend etcd sets it), the
//    store is an EtcdStore on that cluster (EtcdStoreOptions::fromEnvironment:
//    DT_ETCD_PREFIX, TLS files, credentials) and every rank is its client.
//  * resolveInit() does only that parsing (no network), so it is testable.
//  * initProcessGroup() blocks until every rank joined (group timeout:
//    options.timeout or DT_PG_TIMEOUT). With DT_STORE_ADDR it also makes the
//    group write the launcher's hang-watchdog key dt/progress/<rank>.
//  * With DT_RESTART_COUNT > 0 (dtrun restarted the workers) the group's keys
//    live under "restart<n>/" in the store, apart from the crashed incarnation's.
//  * No global state: the caller owns the returned group (destroy() it, or
//    let it go, before initialising again in the same process).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "process_group/process_group.h"
#include "store/store.h"

namespace dt {

struct InitOptions {
  std::optional<int> rank;
  std::optional<int> worldSize;
  std::string masterAddr;
  std::optional<uint16_t> masterPort;
  // Use this store instead of connecting to one (rank/worldSize still needed).
  StorePtr store;
  // "" (by device and host), "gloo", "shm" or "nccl"; "" also reads DT_BACKEND.
  std::string backend;
  std::optional<std::chrono::milliseconds> timeout;
  std::string name = "default";
  // Address for Gloo's TCP transport; "" -> DT_GLOO_HOSTNAME, else 127.0.0.1
  // when the store is on loopback, else this machine's host name.
  std::string glooHostname;
};

struct ResolvedInit {
  int rank = -1;
  int worldSize = 0;
  int localRank = 0;
  std::string storeHost;
  uint16_t storePort = 0;
  bool launcherStore = false;  // DT_STORE_ADDR or DT_ETCD_ENDPOINTS: everyone is a client
  std::string etcdEndpoints;   // DT_ETCD_ENDPOINTS: the store is etcd
  bool hostStore = false;      // this rank runs the TcpStore server
  std::string token;           // DT_STORE_TOKEN ("" = none)
  std::string source;          // "options", "env", "dtrun", "slurm"
};

ResolvedInit resolveInit(const InitOptions& options);
std::shared_ptr<ProcessGroup> initProcessGroup(InitOptions options = {});

// What initProcessGroup() reads and connects before it makes the group: the
// job's store (scoped to this restart), this rank, the world size, and the
// options the group would be made with. For code that makes its own groups
// from the launcher's environment (an elastic job: elastic/elastic_group.h).
struct JobConnection {
  StorePtr store;
  int rank = -1;
  int worldSize = 0;
  int localRank = 0;
  ProcessGroupOptions group;
};
JobConnection connectJob(InitOptions options = {});

}  // namespace dt
