// The per-node agent: hosts or joins the job's store, meets the other nodes,
// starts this node's workers, watches them, tears the job down on failure,
// restarts it, and reports.
//
// Contract:
//  * run() returns dtrun's exit code (0, the root-cause worker's code, 128 +
//    signal, 124 for a hang, kExitBelowMinNproc when an --elastic job fell
//    below --min-nproc, 1 for a lost node or store). It throws
//    dt::InvalidArgument / dt::Error for set-up failures (bad program, port in
//    use, rendezvous timeout) with a one-line message.
//  * The caller must have created the SignalChannel (blocking the forwarded
//    signals) before constructing the Agent, so that the store's threads
//    inherit the blocked mask.
//  * Single-threaded apart from the store's and the Coordinator's threads;
//    workers are forked from the thread that calls run().
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "launcher/guardian.h"
#include "launcher/options.h"
#include "launcher/process.h"

namespace dt::launcher {

// dtrun's exit status when an --elastic job fell below --min-nproc (documented in --help).
constexpr int kExitBelowMinNproc = 3;

struct AgentConfig {
  LaunchOptions options;       // with SLURM applied
  int nproc = 1;               // resolved --nproc
  std::string programPath;     // resolved executable
  std::vector<std::string> baseEnv;
  std::string hostname;
  std::string userToken;       // DT_STORE_TOKEN from dtrun's environment, if any
};

class Agent {
 public:
  // guardian may be null (no clean-up of worker process groups if dtrun dies).
  Agent(AgentConfig config, SignalChannel& signals, Guardian* guardian);
  ~Agent();
  int run();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dt::launcher
