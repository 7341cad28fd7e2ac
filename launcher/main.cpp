// dtrun: the launcher's executable. Parses the command line, applies SLURM,
// and runs the agent. Usage errors exit 2 with one line; see dtrun --help.
#include <cstdio>
#include <memory>
#include <cstdlib>
#include <string>
#include <unistd.h>
#include <vector>

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "debug/flight_analysis.h"
#include "launcher/agent.h"
#include "launcher/guardian.h"
#include "launcher/machine.h"
#include "launcher/options.h"
#include "launcher/output.h"
#include "launcher/process.h"
#include "launcher/slurm.h"

extern char** environ;

namespace {

[[noreturn]] void finish(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  // A coordinator thread stuck in a store call (cut link) must not keep dtrun
  // alive; the kernel closes every socket.
  _exit(code);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace dt;
  using namespace dt::launcher;
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && args[0] == "analyze") {
    // dtrun analyze DIR: the flight recorder's story of a job from the ranks' dumps in DIR.
    if (args.size() != 2 || args[1].starts_with("-")) {
      writeAll(2, "dtrun: error: usage: dtrun analyze DIR (a folder of flight_rank*.json dumps)\n");
      finish(2);
    }
    std::vector<std::string> problems;
    const auto dumps = debug::readFlightDumps(args[1], "", &problems);
    for (const auto& p : problems) writeAll(2, str("dtrun analyze: skipped: ", p, "\n"));
    if (dumps.empty()) {
      writeAll(2, str("dtrun analyze: no flight recorder dumps (flight_rank*.json) in ", args[1], "\n"));
      finish(1);
    }
    writeAll(1, debug::analyzeFlightDumps(dumps));
    finish(0);
  }
  // Every DT_* fallback goes through the knob table, so undeclared names fail loudly.
  const EnvLookup lookup = [](const std::string& name) -> std::optional<std::string> {
    if (name.starts_with("DT_")) return env::getRaw(name);
    const char* value = std::getenv(name.c_str());
    return value ? std::optional<std::string>(value) : std::nullopt;
  };

  AgentConfig config;
  try {
    ParseResult parsed = parseCommandLine(args, lookup);
    if (parsed.help) {
      writeAll(1, helpText());
      finish(0);
    }
    if (parsed.version) {
      writeAll(1, "dtrun (dtrain) 0.1.0\n");
      finish(0);
    }
    config.options = std::move(parsed.options);
    applySlurm(config.options, lookup);
    if (config.options.nodeRank >= config.options.nnodes) {
      throw InvalidArgument(str("--node-rank=", config.options.nodeRank, " is out of range for --nnodes=",
                                config.options.nnodes, "; accepted: 0 to ", config.options.nnodes - 1));
    }
    config.nproc = resolveNproc(config.options.nprocSpec, countGpus, countCpus);
    const char* path = std::getenv("PATH");
    config.programPath = resolveExecutable(config.options.program[0], path ? path : "");
  } catch (const Error& e) {
    writeAll(2, str("dtrun: error: ", e.what(), "\n"));
    finish(2);
  }
  for (char** e = environ; *e != nullptr; ++e) config.baseEnv.emplace_back(*e);
  // Emulated SLURM nodes share one kernel hostname; SLURM's node name tells them apart.
  const char* slurmNode = std::getenv("SLURMD_NODENAME");
  config.hostname = slurmNode && *slurmNode ? slurmNode : hostName();
  if (auto token = env::getRaw("DT_STORE_TOKEN")) config.userToken = *token;

  // Before any thread exists: the guardian is forked, then the forwarded
  // signals are blocked (the store's threads inherit the mask), so they
  // arrive only through the channel.
  std::unique_ptr<Guardian> guardian = Guardian::start();
  int code = 1;
  try {
    SignalChannel signals(config.options.signals);
    Agent agent(std::move(config), signals, guardian.get());
    code = agent.run();
    // Every attempt released its groups; after an error the guardian still
    // cleans up whatever a dying attempt left.
    if (guardian) guardian->goodbye();
  } catch (const std::exception& e) {
    writeAll(2, str("dtrun: error: ", e.what(), "\n"));
    code = 1;
  }
  finish(code);
}
