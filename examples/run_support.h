// What the example training programs (trainer, gpt) share: flags and their --help, the test
// switches, --bench's clock, the final fingerprint lines and main()'s error handling. Stop
// signals, fingerprints and the like are the training library's (train/support.h), re-exported
// here; checkpoints are checkpoint/checkpoint_dir.h's.
//
// Contract: parse helpers and Flags::parse throw dt::InvalidArgument "<program>: <flag> ..."
// naming the value and what was expected. Flags keeps references to the variables bound
// to it and BenchWindow::attach leaves `this` in the loop's hooks: both must outlive their use.
// Everything here is for main()'s thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_dir.h"
#include "process_group/process_group.h"
#include "tensor/tensor.h"
#include "train/loop.h"
#include "train/support.h"

namespace examples {

int64_t parsePositive(const std::string& program, const std::string& value, const std::string& flag,
                      int64_t minimum = 1);
double parseDouble(const std::string& program, const std::string& value, const std::string& flag, double minimum,
                   double maximum);
std::string choice(const std::string& program, const std::string& value, const std::string& flag,
                   const std::vector<std::string>& allowed);

// --device cpu|cuda|cuda:N: `value` must parse (InvalidArgument "<program>: <flag> ..." otherwise).
std::string deviceName(const std::string& program, const std::string& value, const std::string& flag);
// The device `text` names: cuda is the GPU of this rank's local rank (as torchrun users write
// cuda:LOCAL_RANK), cuda:N one explicitly; NotSupportedError says why one is not usable here.
dt::Device deviceFor(const std::string& program, const std::string& text);

// Stop signals, time formatting, fingerprints, clearCheckpoints and parameterSpread are the
// training library's (train/support.h).
using dt::train::clearCheckpoints;
using dt::train::fingerprint;
using dt::train::formatSeconds;
using dt::train::installStopHandlers;
using dt::train::parameterSpread;
using dt::train::signalName;
using dt::train::stopSignal;

// A double with all 17 significant digits (checkpoint manifests compare them as text).
std::string exactText(double value);

// Flags bound to the program's variables, and the --help text made from them: a flag's default
// is its variable's value when it is bound (appended as "(default X)" unless the help names
// one), so the text cannot drift from the code.
//
//   examples::Flags flags("gpt", "usage: gpt [flags]\n\nWhat it does.\n");
//   flags.section("training").add("--steps", c.steps, "N", "optimizer steps");
//   if (!flags.parse(argc, argv)) return 0;  // --help: usage() printed
//
// "--flag value" and "--flag=value" both work. parse() throws InvalidArgument "<program>: <flag>
// ..." for an unknown flag, a bare word, a missing value, or a value out of range (naming it).
class Flags {
 public:
  Flags(std::string program, std::string intro);
  Flags& section(const std::string& title);
  // A whole number of at least `minimum`.
  Flags& add(const std::string& name, int64_t& target, const std::string& metavar, const std::string& help, int64_t minimum = 1);
  Flags& add(const std::string& name, int& target, const std::string& metavar, const std::string& help, int64_t minimum = 1);
  Flags& add(const std::string& name, uint64_t& target, const std::string& metavar, const std::string& help);
  Flags& add(const std::string& name, double& target, const std::string& metavar, const std::string& help, double minimum,
             double maximum);
  // Unset unless given (the help states the default).
  Flags& add(const std::string& name, std::optional<double>& target, const std::string& metavar, const std::string& help,
             double minimum, double maximum);
  // Text; with `allowed`, one of them (the metavar lists them when empty).
  Flags& add(const std::string& name, std::string& target, const std::string& metavar, const std::string& help,
             std::vector<std::string> allowed = {});
  // A switch: takes no value, sets `target`.
  Flags& add(const std::string& name, bool& target, const std::string& help, bool value = true);
  // Anything else: `set` parses the value (InvalidArgument naming it); the help states the default.
  Flags& add(const std::string& name, const std::string& metavar, const std::string& help,
             std::function<void(const std::string& value)> set);
  // Flags another parser takes (TestFlags): `take(flag, value)` returns whether it did; `switches`
  // take no value; `usage` is appended to the help as it is.
  Flags& alsoAccept(std::function<bool(const std::string& flag, const std::string& value)> take,
                    std::vector<std::string> switches, std::string usage);
  // False at --help/-h (after printing usage()).
  bool parse(int argc, char** argv);
  std::string usage() const;

 private:
  struct Flag {
    std::string name;
    bool isSwitch = false;
    std::function<void(const std::string&)> set;
  };
  void describe(const std::string& left, const std::string& help, const std::string& defaultText);
  Flags& bind(const std::string& name, const std::string& metavar, const std::string& help, const std::string& defaultText,
              bool isSwitch, std::function<void(const std::string&)> set);

  std::string program_;
  std::string text_;  // the help so far
  std::vector<Flag> flags_;
  std::vector<std::function<bool(const std::string&, const std::string&)>> others_;
  std::vector<std::string> otherSwitches_;
  std::string otherUsage_;
};

// The switches only tests and benchmarks use, shared by the example programs and carried out by
// the training loop's hooks (train/loop.h): kUsage lists them for --help.
struct TestFlags {
  static constexpr const char* kUsage = R"(  --fail-at M:STEP:WHERE[,...]  to test recovery: member M SIGKILLs itself during step STEP, WHERE =
                          forward, backward, commit (after its commit vote) or checkpoint (while writing
                          one); a replacement that joined after STEP does it during its first step
  --record-samples PREFIX each rank appends "EPOCH STEP DATA_EPOCH ids..." to PREFIX.<member> for each attempt at
                          a step, before its commit vote (a redone step appears again with a later EPOCH)
  --step-log FILE         rank 0 (of the current membership) appends "STEP EPOCH WORLD NS" to FILE for each step
                          it commits (STEP from 0; EPOCH: the membership epoch, or the restart count without
                          --elastic; NS: CLOCK_REALTIME in ns), written at once; --fail-at's member appends
                          "kill STEP MEMBER NS" just before it kills itself (for bench/run_recovery_bench.sh); a
                          replacement appends "join MEMBER START_NS STEP BYTES TRANSFER_NS BROADCAST_NS NS" once
                          it has the state (START_NS: its start; BROADCAST_NS: with --measure-transfer)
  --measure-transfer      every rank waits for the others before a state transfer (so TRANSFER_NS is the
                          transfer alone), then broadcasts as many bytes in one plain broadcast, timed, to
                          compare the transfer with the group's bandwidth
  --step-pause MS         sleep MS ms at the start of every step, so that a test's kills and joins happen
                          mid-run (the trajectory is the same)
  --dump-at S1,S2,...     after these steps rank 0 writes the parameters to --dump-dir DIR
  --dump-dir DIR          (default <program>-dumps)
)";

  std::vector<std::string> failAt;
  std::string recordSamples, stepLog, dumpDir;
  bool measureTransfer = false;
  int64_t stepPauseMs = 0;
  std::vector<int64_t> dumpAt;

  // Takes `flag` if it is one of these (false otherwise); InvalidArgument names a bad value.
  bool parse(const std::string& program, const std::string& flag, const std::string& value);
  // Carries them out through `options` (test switches, hooks): the step log (its epoch outside
  // --elastic: DT_RESTART_COUNT) and rank 0's dumps of `model`'s parameters. Opens the step log.
  // `model` gives the model once it exists.
  void apply(dt::train::LoopOptions& options, std::function<std::shared_ptr<dt::nn::Module>()> model,
             const std::string& program) const;
};

// --bench's clock, through the loop's hooks (chained after those already set): from the start
// of the step `warmup` steps into this run to the end of the job's last step. `onFirstStep`
// runs at the start of this run's first step (to reset peak-memory counters). attach() keeps
// `this`: the window must stay where it is while the loop runs.
class BenchWindow {
 public:
  void attach(dt::train::LoopOptions& options, int64_t warmup, std::function<void()> onFirstStep = {});
  bool measured() const { return start_.has_value() && end_.has_value(); }
  int64_t firstMeasuredStep() const { return from_; }
  int64_t steps() const { return steps_; }
  double seconds() const;

 private:
  int64_t from_ = -1, steps_ = 0;
  std::optional<std::chrono::steady_clock::time_point> start_, end_;
};

// After run(): every rank's "<program>: rank R/W final parameters fingerprint ..." line (unless
// quiet); 1 (with a line on stderr) when the ranks' parameters differ, else 0.
int reportParameters(const std::string& program, const dt::train::Loop& loop, const dt::train::LoopResult& result, bool quiet);

// main()'s body: line-buffered stdout (whole lines reach dtrun and SLURM's files), and an
// exception printed as "<program> (rank R/W): <what>" with exit code 1.
int runMain(const std::string& program, const std::function<int()>& body);

}  // namespace examples
