#include "launcher/slurm.h"

#include "common/env.h"
#include "common/errors.h"
#include "common/hostlist.h"
#include "common/strings.h"

namespace dt::launcher {

bool applySlurm(LaunchOptions& o, const EnvLookup& lookup) {
  if (o.slurm == "off") return false;
  auto get = [&](const char* name) -> std::string {
    auto value = lookup(name);
    return value ? *value : std::string();
  };
  if (o.slurm == "auto") {
    const std::string step = get("SLURM_STEP_ID");
    const std::string tasks = get("SLURM_STEP_NUM_TASKS");
    const std::string nodes = get("SLURM_STEP_NUM_NODES");
    if (step.empty() || tasks.empty() || tasks != nodes) return false;
  }
  auto require = [&](const char* name) {
    std::string value = get(name);
    if (value.empty()) {
      throw InvalidArgument(str("--slurm=", o.slurm, " but ", name,
                                " is not set; run dtrun inside an srun step (srun --ntasks-per-node=1 dtrun ...) or pass --slurm=off"));
    }
    return value;
  };
  const std::string nnodes = require("SLURM_NNODES");
  const std::string nodeId = require("SLURM_NODEID");
  std::string nodelist = get("SLURM_JOB_NODELIST");
  if (nodelist.empty()) nodelist = require("SLURM_NODELIST");
  const std::string jobId = require("SLURM_JOB_ID");
  // SLURM_NNODES is the allocation's node count; a step may use fewer.
  std::string stepNodes = get("SLURM_STEP_NUM_NODES");
  if (stepNodes.empty()) stepNodes = nnodes;

  if (!o.nnodesSet) o.nnodes = o.minNodes = static_cast<int>(env::parseInt(stepNodes, "SLURM_STEP_NUM_NODES"));
  if (!o.nodeRankSet) o.nodeRank = static_cast<int>(env::parseInt(nodeId, "SLURM_NODEID"));
  if (!o.masterAddrSet) {
    std::string steplist = get("SLURM_STEP_NODELIST");
    o.masterAddr = firstHostInHostlist(steplist.empty() ? nodelist : steplist);
  }
  if (!o.masterPortSet) o.masterPort = slurmDerivedPort(jobId);
  if (o.runId.empty()) o.runId = str("slurm-", jobId, get("SLURM_STEP_ID").empty() ? "" : str(".", get("SLURM_STEP_ID")));
  if (o.nodeRank >= o.nnodes) {
    throw InvalidArgument(str("SLURM node rank ", o.nodeRank, " is out of range for ", o.nnodes, " nodes"));
  }
  return true;
}

}  // namespace dt::launcher
