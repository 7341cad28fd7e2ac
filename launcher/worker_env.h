// The environment each worker starts with (DESIGN.md, "The launcher's
// contract with a worker").
//
// Contract: buildWorkerEnv is pure: it starts from `base` (dtrun's own
// environment as NAME=VALUE strings), overrides the launcher's variables and
// returns the list in a stable order. OMP_NUM_THREADS and DT_NUM_THREADS are
// set to 1 only when several workers share the node and the user has not set
// them; `threadsDefaulted` reports it so dtrun can say so once.
// Thread safety: pure, thread-safe.
#pragma once

#include <string>
#include <vector>

namespace dt::launcher {

struct WorkerIdentity {
  int rank = 0;
  int worldSize = 1;
  int localRank = 0;
  int localWorldSize = 1;
  int groupRank = 0;  // node rank
  int numNodes = 1;
  std::string masterAddr;
  int masterPort = 0;      // the port kept free for the workers (torchrun's MASTER_PORT)
  std::string storeAddr;   // host:port of the launcher's store
  std::string storeStandby;  // host:port of its hot standby (DT_STORE_STANDBY; "" none)
  std::string storeToken;
  std::string runId;
  int restartCount = 0;
  int maxRestarts = 0;
  bool elastic = false;  // DT_ELASTIC=1 and DT_MIN_NPROC for the workers' ElasticGroup
  int minNproc = 1;
  // --elastic: a replacement's fresh member id (DT_ELASTIC_JOIN=1, DT_ELASTIC_MEMBER); -1: a
  // worker of the attempt's start, whose member id is its rank.
  int joiningMember = -1;
  // --rdzv-backend etcd: the workers' store is etcd (DT_ETCD_*); storeAddr is empty then.
  // DT_FLIGHT_RECORDER_DIR for the workers ("" : left as inherited).
  std::string flightRecorderDir;
  std::string etcdEndpoints, etcdPrefix, etcdCa, etcdCert, etcdKey, etcdUser, etcdPassword;
};

struct WorkerEnv {
  std::vector<std::string> entries;  // NAME=VALUE
  bool threadsDefaulted = false;
};

WorkerEnv buildWorkerEnv(const std::vector<std::string>& base, const WorkerIdentity& id);

// The value of NAME in a NAME=VALUE list, or "" (for tests and messages).
std::string lookupEntry(const std::vector<std::string>& entries, const std::string& name);

}  // namespace dt::launcher
