#include "launcher/worker_env.h"

#include <map>

#include "common/strings.h"

namespace dt::launcher {

WorkerEnv buildWorkerEnv(const std::vector<std::string>& base, const WorkerIdentity& id) {
  // Keep the base order for inherited variables; ours replace theirs in place
  // or are appended, so the result is deterministic.
  std::vector<std::pair<std::string, std::string>> vars;
  std::map<std::string, size_t> index;
  auto put = [&](const std::string& name, const std::string& value) {
    auto it = index.find(name);
    if (it != index.end()) {
      vars[it->second].second = value;
    } else {
      index[name] = vars.size();
      vars.emplace_back(name, value);
    }
  };
  for (const auto& entry : base) {
    const auto eq = entry.find('=');
    if (eq == std::string::npos || eq == 0) continue;
    put(entry.substr(0, eq), entry.substr(eq + 1));
  }

  WorkerEnv out;
  if (id.localWorldSize > 1) {
    for (const char* name : {"OMP_NUM_THREADS", "DT_NUM_THREADS"}) {
      auto it = index.find(name);
      if (it == index.end() || vars[it->second].second.empty()) {
        put(name, "1");
        out.threadsDefaulted = true;
      }
    }
  }

  put("RANK", str(id.rank));
  put("WORLD_SIZE", str(id.worldSize));
  put("LOCAL_RANK", str(id.localRank));
  put("LOCAL_WORLD_SIZE", str(id.localWorldSize));
  put("GROUP_RANK", str(id.groupRank));
  put("GROUP_WORLD_SIZE", str(id.numNodes));
  put("ROLE_RANK", str(id.rank));
  put("ROLE_WORLD_SIZE", str(id.worldSize));
  put("MASTER_ADDR", id.masterAddr);
  put("MASTER_PORT", str(id.masterPort));
  put("TORCHELASTIC_RUN_ID", id.runId);
  put("TORCHELASTIC_RESTART_COUNT", str(id.restartCount));
  put("TORCHELASTIC_MAX_RESTARTS", str(id.maxRestarts));
  put("DT_STORE_ADDR", id.storeAddr);
  // Always set: an inherited one must not point a job's workers at another job's standby.
  put("DT_STORE_STANDBY", id.storeStandby);
  put("DT_STORE_TOKEN", id.storeToken);
  put("DT_RUN_ID", id.runId);
  put("DT_RESTART_COUNT", str(id.restartCount));
  put("DT_MAX_RESTARTS", str(id.maxRestarts));
  put("DT_ELASTIC", id.elastic ? "1" : "0");
  put("DT_MIN_NPROC", str(id.minNproc));
  put("DT_ELASTIC_JOIN", id.joiningMember >= 0 ? "1" : "0");
  put("DT_ELASTIC_MEMBER", str(id.joiningMember));
  if (!id.flightRecorderDir.empty()) put("DT_FLIGHT_RECORDER_DIR", id.flightRecorderDir);
  // Always set: a DT_ETCD_ENDPOINTS inherited from dtrun's environment must not
  // send the workers of a static job to etcd.
  put("DT_ETCD_ENDPOINTS", id.etcdEndpoints);
  if (!id.etcdEndpoints.empty()) {
    put("DT_ETCD_PREFIX", id.etcdPrefix);
    put("DT_ETCD_CA", id.etcdCa);
    put("DT_ETCD_CERT", id.etcdCert);
    put("DT_ETCD_KEY", id.etcdKey);
    put("DT_ETCD_USER", id.etcdUser);
    put("DT_ETCD_PASSWORD", id.etcdPassword);
  }

  out.entries.reserve(vars.size());
  for (const auto& [name, value] : vars) out.entries.push_back(name + "=" + value);
  return out;
}

std::string lookupEntry(const std::vector<std::string>& entries, const std::string& name) {
  const std::string prefix = name + "=";
  for (const auto& entry : entries) {
    if (entry.starts_with(prefix)) return entry.substr(prefix.size());
  }
  return {};
}

}  // namespace dt::launcher
