// Loop: the training loop as a library. The user brings the model, the optimizer, the data and
// a step function (forward + loss on a batch); the loop owns everything else:
//
//   dt::train::Loop loop({.program = "mlp", .steps = 500, .globalBatch = 128,
//                         .checkpointDir = "ckpt", .checkpointEvery = 100});
//   auto model = makeModel();                        // the same initial values on every rank
//   dt::optim::AdamW adam(model->parameters(), {.lr = 1e-3});
//   loop.setModel(model);                            // wrapped in DDP on the loop's group
//   loop.setOptimizer(adam, [](int64_t step) { return cosine(step); });
//   loop.setData(trainSet, {.seed = 1});
//   const dt::train::LoopResult r = loop.run([&](const dt::data::Batch& b) {
//     return dt::train::StepOutput{dt::crossEntropy(loop.forward(b.inputs), b.targets)};
//   });
//
// What the loop does (docs/train.md):
//  * Joining: the constructor joins the job: the process group from the launcher's
//    environment, or under `dtrun --elastic` (DT_ELASTIC=1) the job's elastic membership; a
//    replacement process blocks there until the members admit it (elastic/elastic_group.h),
//    and run() then receives the whole training state before its first step.
//  * Each step: the learning rate for the step, zeroed gradients, the rank's share of the
//    global batch (a DistributedSampler over the dataset, prefetched), split into
//    `microBatches` micro-batches whose gradients accumulate under DDP's noSync, the loss
//    scaled so that the gradient is the mean over the global batch whatever the world size,
//    backward, optional clipping of the global gradient norm, the optimizer step.
//  * The commit vote: a small allreduce after backward carries the stop request (SIGTERM,
//    SIGUSR1, SIGINT on any rank), the previous step's loss and, elastic, the joiners waiting.
//    Elastic, no rank applies a step unless every rank voted; when a member dies the others
//    recover in place (ElasticGroup::recover), apply the step if some of them committed it,
//    rebind DDP to the new group, re-split the data (the same examples per step) and redo
//    the step. Joiners are admitted at a step boundary and receive the model, the optimizer
//    state, the user's extra state, the step and DDP's bucket layout from rank 0.
//  * Checkpoints (checkpoint/checkpoint_dir.h): every `checkpointEvery` steps, at the end,
//    and when stopped; the next run resumes from the newest one at any world size (bitwise
//    with the same world size), after checking that `config` matches what it was written
//    with. The model, the optimizer, the step and every addState() value are in it.
//  * Output (rank 0, stdout, unless quiet): a progress line every `logEvery` steps (loss,
//    samples or tokens per second of the whole job, elapsed, time left), the metrics of the
//    step function averaged over the window, and with `metricsFile` one JSON object per
//    logged step (scripts/plot_metrics.py reads it). Hooks (LoopHooks) see every step, every
//    phase and every log line; the example programs' test switches are made of them.
//  * Stragglers (train/straggler.h, docs/debugging.md): each step's data wait, forward, backward
//    and communication wait are timed; every stragglers.every steps the ranks' means ride on the
//    control all-reduce, and rank 0 reports a rank that stays slower than the others (stdout,
//    the metrics file, the job's store under dt/straggler/<n> for dtrun).
//
// Contract:
//  * One Loop per process, used from one thread. Every rank calls the same methods in the
//    same order; run() is collective over the job and returns on every rank.
//  * setModel, setOptimizer, setData and addState come before run(). Misuse throws
//    InvalidArgument naming the thing and the value: an optimizer over other tensors than
//    the model's parameters, a step whose loss no parameter reaches (no backward to run),
//    extra state whose shape changed since the checkpoint (named by restore).
//  * An exception from the step function is rethrown from run() with the program, rank and
//    step prepended; under --elastic a dt::Error of the group (a member lost) is recovered
//    from instead. A failure that cannot be recovered (a non-dt exception, fewer members
//    than --min-nproc) leaves run() on this rank; the others see the lost member and go on
//    or stop as the elastic rules say: nobody hangs.
//  * Tensor parallelism (LoopOptions::tensorParallel = t > 1, docs/parallel.md): the
//    constructor lays the group out as the mesh {dp: world / t, tp: t} (a collective); the
//    caller parallelizes the model over mesh() before setModel (dt::parallelize). DDP and the
//    data split run over mesh()["dp"] (the ranks of one TP group take the same batch), the
//    step function takes its loss through the model's own (nn::Gpt::nextTokenLoss), clipping
//    counts each shard once (clipTensorParallelGradNorm), and checkpoints place the shards by
//    global name and shape, so a run resumes at another t or without TP. With Sharding::Zero1,
//    Zero2 or Full the wrapper shards over mesh()["dp"] with TP inside (clipping through the
//    wrapper's leaves and reducer), and its checkpoints place each TP block's wrapper shards
//    in the global tensors (checkpoint/nested_state.h), so they too resume at another t,
//    sharding or world size; under --elastic it needs checkpointDir (refused in one line at
//    construction without one), as below.
//  * Elastic tensor parallelism: a replica is one TP group of t adjacent
//    ranks (ElasticOptions::replicaSize = t). A loss takes its whole replica out: the live
//    ranks of its TP group leave (run() prints one line on stderr and returns on them with
//    LoopResult::left, no group left: end the process, exit 0), the whole replicas keep their
//    tp coordinates and shards, rebuild the mesh {dp: n / t, tp: t}, move the TP layers onto
//    the new tp group (rebindTensorParallel), rebind DDP on mesh()["dp"], re-split the data
//    (the same global batch and examples) and redo the step. Joiners come t at a time, as a
//    replica, and receive their shards from rank 0 of their dp group (docs/parallel.md).
//    With Sharding::Zero1, Zero2 or Full (checkpointDir set; a checkpoint is written at step 0)
//    the lost replica's rows of the wrapper's shards have no other copy: the survivors drop the
//    interrupted step's whole gradients, rebind the TP layers and then the wrapper over the new
//    mesh()["dp"], and go back to the newest checkpoint (each rank's rows within its TP blocks'
//    places in the global tensors); the step's loss is averaged over dp, so the checkpoint's last
//    loss is the global batch's. Joiners build their wrapper empty and receive their rows and
//    optimizer state from the members (redistributeState over the whole group, no checkpoint).
//  * Pipeline parallelism (LoopOptions::pipeline.degree = p > 1, docs/parallel.md "Pipeline in
//    the loop"): the constructor lays the group out as the mesh {dp: world / p, pp: p} (pp ranks
//    adjacent; a collective), with tensorParallel t > 1 {dp: world / (p t), pp: p, tp: t}, and
//    makes the schedule (pipeline.schedule over p ranks and pipeline.microBatches, m), refusing
//    in one line what cannot run: a world that p t does not divide, a global batch whose share
//    per dp replica m does not divide, a schedule that refuses m (interleaved and zbv need a
//    multiple of p, zb1 m >= p), a Sharding other than None under --elastic without a
//    checkpointDir (its recovery reloads the lost shards from there), and microBatches > 1 (not
//    built: the pipeline's own micro-batches replace gradient accumulation). The caller builds the whole nn::Gpt from the same seed on every rank (with
//    t > 1 parallelized over mesh() first, pipeline.sequenceParallel saying whether with SP) and
//    hands it over with setPipelineModel (not setModel), which keeps this rank's stages
//    (pipeline::splitGpt, pipeline.split), frees the bytes of the other stages' parameters (the
//    tensors stay for names and shapes; gatherPipelineModel refills them) and prints the stages'
//    summary on dp replica 0. parameters() and paramGroups()
//    are then the stage's (paramGroups keeps, by name, the groups' tensors this rank holds, the
//    last stage's copy of the tied embedding standing for wte.weight), so the same optimizer
//    code serves both. run()'s step function must be empty: each step splits the dp replica's
//    share of the batch (the same on every pp rank of the replica) into m micro-batches,
//    PipelineRunner::step runs them (inputs on the first stage's rank, targets on the last's,
//    nn::Gpt::loss, the gradient the mean over the m), the stage's gradients are averaged over
//    mesh()["dp"] in one all-reduce (the tied weight's alone, so both copies stay equal),
//    clipping is pipeline::clipGradNorm over pp, and tp with t > 1 (the replicas hold equal
//    gradients by then) and the optimizer steps. The loss reported is the runner's (every pp rank returns it)
//    averaged over dp: the unsplit model's at the same global batch. forward() and ddp() are
//    refused (there is no whole model on a rank); LoopResult's fingerprint and spread are of
//    this rank's stage over its dp group. Checkpoints hold each stage's tensors and optimizer
//    state under the unsplit names and global shapes (train/pipeline_state.h), so a run resumes
//    at another pipeline or tensor-parallel degree or without either, and a plain run's
//    checkpoint resumes split. The runner leaves the first failing rank's error in the job's
//    store (the launcher's or the membership's, scoped to the group instance), so the others'
//    errors name it.
//  * Sharded pipeline replicas (pipeline.degree p > 1 with Sharding::Zero1, Zero2 or Full; with
//    t > 1 the wrapper shards each rank's TP blocks, clipping goes over tp too, and checkpoints
//    place the rows inside the TP blocks, parallel/checkpoint.h's tensorParallelPlacement):
//    setPipelineModel (then collective over mesh()["dp"]) wraps this rank's stages in the fully
//    sharded wrapper over dp (blocks as units; fullyShard's units are replaced), and
//    parameters() / paramGroups() are its shards. Each step gathers the stages once for all m
//    micro-batches (gatherFullParameters), lets their gradients accumulate whole, and
//    reduce-scatters them once, averaged over dp (FullyShardedDataParallel::reduceGradients):
//    one gather and one reduce-scatter per unit a step. Full frees the whole parameters after
//    the reduction; Zero1 and Zero2 gather again right after the optimizer step and keep them
//    until the next reduction. Clipping goes over the shards, dp then pp; checkpoints hold each
//    dp rank's rows under the unsplit names (any degree, or none, reads them). fullySharded()
//    is the stages' wrapper. Under --elastic (needs checkpointDir, and writes a checkpoint at
//    step 0) a loss takes its pipeline replica out as below, and the survivors, whose lost rows
//    have no other copy, cut their stages again for the new dp group (rebind; with t > 1 after
//    rebinding the TP layers) and go back to the newest checkpoint, as a plain sharded model does; the step's loss is averaged over dp
//    (the global batch's on every rank). Joiners come as a whole replica, their stages empty,
//    and receive their rows, optimizer state, step and extra state from the members
//    (redistributeState over the new group, no checkpoint).
//  * Elastic pipelines (--elastic with pipeline.degree p; sharded stages as above): a replica is one whole
//    pipeline, p t adjacent ranks (ElasticOptions::replicaSize = p t). A loss takes it out as
//    with TP (the live ranks leave with LoopResult::left); the whole replicas keep their (pp, tp)
//    coordinates and stages, rebuild the mesh {dp: n / (p t), pp: p[, tp: t]}, rebind the TP
//    layers (t > 1), build a new PipelineRunner on the new mesh()["pp"] (same schedule and
//    stages), re-split the data and redo the step. The global batch and m stay; each micro-batch
//    takes global batch / dp / m rows, and where that does not divide evenly every survivor
//    throws InvalidArgument from recover (out of run()). The step's loss is averaged over dp
//    with the gradients (elastic only), so the reported loss is the global batch's at any dp. Joiners come p t
//    at a time and receive their stage's tensors, optimizer state and the step from rank 0 of
//    their dp group (an old member at the same (pp, tp) coordinates).
//  * Timeouts are the group's (ProcessGroupOptions) and the elastic membership's.
//  * The loop keeps references to the model, optimizer and dataset: they must outlive it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/state.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "data/sampler.h"
#include "ddp/ddp.h"
#include "ddp/zero.h"
#include "fsdp/fully_shard.h"
#include "elastic/elastic_group.h"
#include "parallel/mesh.h"
#include "parallel/pipeline.h"
#include "process_group/process_group.h"
#include "tensor/nn/module.h"
#include "tensor/optim/optim.h"
#include "tensor/profiler.h"
#include "tensor/tensor.h"
#include "train/pipeline_state.h"
#include "train/straggler.h"
#include "train/support.h"

namespace dt::train {

// What the step function returns for one (micro-)batch: the loss, a scalar the loop runs
// backward on, and named values the progress line and the metrics file average over the
// log window (rank 0's).
struct StepOutput {
  Tensor loss;
  std::vector<std::pair<std::string, double>> metrics;
};
using StepFunction = std::function<StepOutput(const data::Batch& batch)>;
// Named values (a validation loss, an accuracy): collective, every rank calls it.
using EvalFunction = std::function<std::vector<std::pair<std::string, double>>()>;
class Loop;
// Makes the optimizer over loop.parameters() or loop.paramGroups(groups), once the loop has
// wrapped the model in run() (and again for each new group of an elastic ZeRO job).
using OptimizerFactory = std::function<std::unique_ptr<optim::Optimizer>(Loop& loop)>;

// Where a step is, for LoopHooks::at.
enum class Phase {
  Begin,       // the step begins (before its batch is taken)
  Forward,     // the step function returned
  Backward,    // the last gradient arrived (DDP's last bucket is on the wire; Sharding::Full:
               // backward returned): only with LoopHooks::atBackward (a hook on every
               // gradient costs about 2 % of a small step)
  Commit,      // this rank voted to commit the step
  Checkpoint,  // a checkpoint is about to be written at this step
};
const char* phaseName(Phase phase);

struct Progress {
  int64_t step = 0;   // steps applied so far
  int64_t steps = 0;  // of the whole job
  int64_t epoch = 0;  // data epoch of the last step, from 1
  int64_t epochs = 0;
  double loss = 0;          // mean over the ranks and the window's steps (NaN at step 0)
  double rate = 0;          // units (samples, tokens) per second of the whole job over the window
  double lr = 0;            // of the last step
  double gradNorm = 0;      // before clipping, of the last step (0 without clipping)
  double elapsed = 0;       // seconds of training, earlier runs included
  double left = 0;          // seconds, estimated from this run's pace
  // The step function's, window means, then evaluate()'s (NaN for setEvaluation's names at a
  // step without an evaluation).
  std::vector<std::pair<std::string, double>> metrics;
};

struct JoinInfo {
  int member = -1;       // this process's member id
  int64_t step = 0;      // the step it joined at
  int64_t bytes = 0;     // of the state received
  double seconds = 0;    // the transfer
  double broadcastSeconds = 0;  // LoopOptions::measureTransfer: one plain broadcast of as many bytes
};

struct StepDone {
  int64_t steps = 0;             // applied so far
  uint64_t membershipEpoch = 0;  // 0 when not elastic
  int rank = 0;                  // this process's rank and the world size now
  int worldSize = 1;
};

struct LoopHooks {
  // At each phase of each attempt at a step (a step redone after a loss is seen again).
  std::function<void(int64_t step, Phase phase)> at;
  bool atBackward = false;  // `at` sees Phase::Backward too
  // Each attempt at a step, before its commit vote: the examples this rank trained on (the
  // sampler's ids) and the membership epoch (0 when not elastic).
  std::function<void(int64_t step, uint64_t membershipEpoch, const data::SamplerPosition& position,
                     const std::vector<int64_t>& ids)>
      onBatch;
  // After each committed step (and a step a rank applies in recovery because the others
  // committed it).
  std::function<void(const StepDone& done)> afterStep;
  // A joiner, once it holds the whole state.
  std::function<void(const JoinInfo& info)> onJoined;
  // Replaces the default progress line (rank 0 only).
  std::function<void(const Progress& progress)> onLog;
};

// Switches only tests use, to exercise the failure paths of a real program: LoopOptions::test,
// or the environment for a program that sets nothing (DT_TEST_FAIL_AT, DT_TEST_RECORD_SAMPLES,
// DT_TEST_STEP_PAUSE_MS, DT_TEST_WAIT_FOR_JOINER_AT, DT_TEST_SLOW_RANK), so that any program on
// the loop can be killed, slowed and checked.
struct TestSwitches {
  // "MEMBER:STEP:PHASE" each (PHASE: forward, backward, commit or checkpoint): that member
  // (the elastic member id, else the rank) SIGKILLs itself there. A member that joined after
  // STEP meets it in its first step instead.
  std::vector<std::string> failAt;
  // PREFIX: each member appends "<membership epoch> <step> <data epoch> <ids...>" per attempt
  // at a step to PREFIX.<member> (before the commit vote: a redone step appears again).
  std::string recordSamples;
  // Sleep this long at the start of every step, so that kills and joins land mid-run.
  int64_t stepPauseMs = 0;
  // "MEMBER:MS[:SECTION]": that member (as in failAt) sleeps MS ms in every step, a straggler on
  // purpose: with SECTION forward (the default) inside the forward phase (after the step
  // function returns, before backward), with data while it waits for its batch; straggler
  // detection must name it and that section. Empty: none. fromEnvironment parses it into the
  // three fields below.
  std::string slowRank;
  int slowMember = -1;
  int64_t slowMs = 0;
  bool slowInData = false;
  // Elastic: at the start of this step the members wait (up to 2 minutes) for a replacement
  // to ask to join, unless one joined already, so that a test's join happens mid-run however
  // slow the machine. -1: never.
  int64_t waitForJoinerAt = -1;
  // Called just before a failAt kill (to log it somewhere).
  std::function<void(int64_t step, int member)> beforeKill;
  // Fills what is empty from the environment; InvalidArgument names a malformed value.
  static TestSwitches fromEnvironment(TestSwitches given);
};

// How the model is spread over the ranks (docs/sharded.md).
enum class Sharding {
  None,   // DDP: every rank holds everything
  Zero1,  // DDP + ZeRO-1: the optimizer state split (setOptimizer with a factory)
  Zero2,  // DDP + ZeRO-2: and the gradients (setOptimizer with a factory)
  Full,   // the fully sharded wrapper: parameters, gradients and optimizer state split
};

struct LoopOptions {
  std::string program = "train";  // prefixes every line and message
  int64_t steps = 0;              // the job's length, required
  int64_t globalBatch = 0;        // examples per step over all ranks, required
  int microBatches = 1;           // gradient accumulation: each rank's share in this many pieces
  double clipGradNorm = 0;        // clip the global gradient 2-norm to this (0: no clipping)
  // Data: each epoch a permutation of the dataset (seed, epoch), cut into global batches.
  uint64_t seed = 0;
  bool shuffle = true;
  bool dropLast = false;
  // Each slot of a global batch an independent draw instead of a permutation per epoch (for
  // overlapping windows of one text: data/sampler.h's replacement).
  bool replacement = false;
  int prefetch = 8;
  // Throughput unit: `unitsPerExample` (the context length) `unit` ("tokens") per example.
  std::string unit = "samples";
  int64_t unitsPerExample = 1;
  // Checkpoints: none when checkpointDir is empty.
  std::string checkpointDir;
  int64_t checkpointEvery = 0;  // 0: only at the end and when stopped
  int keep = 3;
  bool resume = true;  // false: a first attempt clears the folder (a restart still resumes)
  // Settings a checkpoint must share with the run that resumes it ("config.<key>").
  std::vector<std::pair<std::string, std::string>> config;
  // Output.
  int64_t logEvery = 10;
  bool quiet = false;
  std::string metricsFile;  // rank 0 writes one JSON object per logged step
  int64_t evalEvery = 0;    // run setEvaluation's function every this many steps and at the end
  bool evalAtStart = false;  // and before a fresh run's first step (a progress line at step 0, loss null)
  // Profile steps [profileFrom, profileFrom + profileSteps) (tensor/profiler.h): each rank
  // writes a Chrome trace to profileTrace with "{rank}" replaced by its rank, and rank 0
  // prints its busiest rows. -1: no profiling.
  int64_t profileFrom = -1;
  int64_t profileSteps = 5;
  std::string profileTrace = "profile-rank{rank}.json";
  // Autograd's anomaly mode for every step (tensor/autograd/anomaly.h): a NaN or infinity
  // made in backward is an AnomalyError naming the op that made it and where it was called.
  bool anomalyMode = false;
  // The DDP wrapper's options (bucketOrder and syncAtConstruction are the loop's).
  DdpOptions ddp;
  // Sharding::Full: the wrapper's options (its units, prefetch, mixed precision; `joining` is
  // the loop's). Under --elastic a lost rank's shards have no other copy: the others go back to
  // the newest checkpoint (needs checkpointDir); a joiner receives the members' shards.
  Sharding sharding = Sharding::None;
  FullyShardOptions fullyShard;
  // Tensor parallelism's degree (see the contract); 1: off. The world must be a multiple.
  int tensorParallel = 1;
  // Pipeline parallelism (see the contract): degree 1 is off.
  struct Pipeline {
    int degree = 1;                  // p, the ranks of one pipeline; the world must be a multiple
    std::string schedule = "1f1b";   // gpipe, 1f1b, interleaved, zb1 (ZB-H1) or zbv
    // A schedule of the user's own instead: a file in pipeline_schedule.h's text format, validated
    // before the first step (InvalidArgument naming the file, with the grid); its p must be the
    // degree, and its m and v are the step's (microBatches 0, or equal to its m).
    std::string scheduleFile;
    int microBatches = 0;            // m per step (0: p); each (global batch / dp) / m rows
    int virtualStages = 2;           // interleaved's chunks per rank (zbv has 2, the others 1)
    // zb1: deferred weight gradients waiting per rank at most, 1 to p (0: p). Each keeps about a
    // micro-batch's forward activations; fewer cost bubble: (2p - 1 - k) / (3m) with unit costs.
    int maxPendingWeightGrads = 0;
    dt::pipeline::SplitRule split = dt::pipeline::SplitRule::Layers;  // blocks per stage: count or parameters
    // With tensorParallel: the model was parallelized with sequence parallelism, so a stage
    // boundary carries this rank's T / tensorParallel tokens.
    bool sequenceParallel = false;
  } pipeline;
  // The elastic membership's options (under dtrun --elastic, DT_ELASTIC=1, or with forceElastic).
  elastic::ElasticOptions elastic;
  bool forceElastic = false;
  // Every rank waits for the others before a state transfer (so JoinInfo::seconds is the
  // transfer alone), then times one plain broadcast of as many bytes (JoinInfo::broadcastSeconds).
  bool measureTransfer = false;
  // Stop on SIGTERM, SIGUSR1 or SIGINT at the next step boundary (installs the handlers).
  bool stopOnSignals = true;
  // Straggler detection (train/straggler.h, docs/debugging.md "Stragglers"): every `every` steps
  // the ranks' step figures (data wait, forward, backward, communication wait) ride on the
  // control all-reduce; a rank whose own time stays over threshold x the median for `window`
  // steps is reported once per episode by rank 0: a line on stdout (even when quiet), the
  // job's store for dtrun (dt/straggler/<n>), the metrics file. DT_STRAGGLER_EVERY, _THRESHOLD
  // and _WINDOW override these; every = 0 turns it off.
  StragglerOptions stragglers;
  LoopHooks hooks;
  TestSwitches test;
};

struct LoopResult {
  int64_t steps = 0;         // applied when run() returned (the job's total unless stopped)
  int64_t firstStep = 0;     // where this run started (a resumed run: the checkpoint's step)
  bool stopped = false;      // by a signal (a checkpoint was written when there is a folder)
  // Elastic tensor or pipeline parallelism: this rank's replica lost a member and the others
  // went on without it; this process has no group any more (no collective; end it, exit 0).
  // stopReason says why (the line run() printed on stderr).
  bool left = false;
  std::string stopReason;    // "SIGTERM", "a stop request on another rank"
  double loss = 0;           // the last window's mean loss
  double seconds = 0;        // of training in this run
  double elapsed = 0;        // of training, earlier runs included (from the checkpoint)
  double dataWaitMs = 0;     // the training loop waited for batches (the loader's stats)
  double parameterSpread = 0;  // max - min of any parameter over the ranks (0: identical)
  // Of the final parameters (equal on every rank when spread is 0). Tensor parallelism: of this
  // rank's shards, the spread over its data-parallel group (the replicas of the same shards).
  uint64_t fingerprint = 0;
  std::vector<std::pair<std::string, double>> evaluation;  // the last evaluate()
};

class Loop {
 public:
  explicit Loop(LoopOptions options);
  ~Loop();
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;

  // This rank's group now (it changes when an elastic job's membership does).
  ProcessGroup& group() const;
  int rank() const { return group().rank(); }
  int worldSize() const { return group().size(); }
  // A replacement process that joined a running job (it receives the state in run()). A
  // replacement that finds the job finished has no group; its run() returns at once.
  bool joining() const { return joining_; }
  // A replacement that started after the job ended: why (its run() prints it and returns).
  std::optional<std::string> jobFinished() const {
    return group_ ? std::nullopt : std::optional<std::string>(finished_);
  }
  // DT_RESTART_COUNT: how many times dtrun restarted this rank.
  int64_t restartCount() const { return restartCount_; }
  const LoopOptions& options() const { return options_; }
  // LoopOptions::tensorParallel > 1: the {dp, tp} mesh over the group; pipeline.degree > 1: the
  // {dp, pp} mesh, {dp, pp, tp} with both (InvalidArgument otherwise).
  const DeviceMesh& mesh() const;
  // The group DDP and the data split run over: mesh()["dp"] under tensor or pipeline
  // parallelism, else group().
  ProcessGroup& dataParallelGroup() const;

  // Sharding::Full wraps at once (a collective), so that an optimizer can be made over the
  // shards; ZeRO wraps in run(), once it knows DDP's bucket layout (from the checkpoint, or
  // one settling iteration: the step function on the first batch in eval mode, not applied).
  void setModel(std::shared_ptr<nn::Module> model);
  // Sharding::Full with these wrapper options instead of LoopOptions::fullyShard (its units are
  // modules of the model, which usually exists only after the loop: rank-dependent streams).
  void setModel(std::shared_ptr<nn::Module> model, FullyShardOptions sharded);
  // Pipeline parallelism: the whole model, the same on every rank; this rank keeps its stages
  // (see the contract) and frees the bytes of the other stages' parameters (their tensors stay,
  // for names and shapes; do not read their values until gatherPipelineModel). Not collective,
  // except with a Sharding (the wrapper over dp). InvalidArgument without pipeline.degree > 1, for a
  // model of fewer blocks than stages, a model not parallelized under tensorParallel > 1, or twice.
  void setPipelineModel(std::shared_ptr<nn::Gpt> model);
  // This rank's stages (null without setPipelineModel).
  const pipeline::GptStages* pipelineStages() const { return stages_ ? &*stages_ : nullptr; }
  // What the optimizer updates: the model's own parameters with Sharding::None, the shards
  // otherwise (ZeRO's only inside setOptimizer's factory).
  std::vector<Tensor> parameters() const;
  std::vector<optim::ParamGroup> paramGroups(const std::vector<optim::ParamGroup>& groups) const;
  // `learningRate(step)` is set before each step; empty: the optimizer's own. The factory form
  // works with every Sharding and is the one ZeRO needs; the reference form keeps the optimizer
  // the caller made over parameters().
  void setOptimizer(optim::Optimizer& optimizer, std::function<double(int64_t)> learningRate = {});
  void setOptimizer(OptimizerFactory make, std::function<double(int64_t)> learningRate = {});
  void setData(std::shared_ptr<const data::Dataset> dataset);
  // `names`: what it returns, so that the metrics lines of steps without an evaluation carry
  // them as null (and Progress::metrics as NaN), and every line has the same keys.
  void setEvaluation(EvalFunction evaluate, std::vector<std::string> names = {});
  // Extra state, checkpointed and sent to joiners with the model: a tensor restored in place
  // (replicated: the same on every rank), a random stream per rank, or an integer value.
  void addState(const std::string& name, Tensor tensor);
  void addState(const std::string& name, Generator& perRankStream);
  void addState(const std::string& name, int64_t& value);

  // Pipeline parallelism: `batch` (this rank's share, as a step's: a multiple of the schedule's m
  // rows) through the stages without backward (PipelineRunner::evaluate), the stages in eval mode
  // meanwhile; the mean loss over its rows (the dp replica's, on every rank of it). Collective over
  // mesh()["pp"] (and "tp"); an evaluation callback's way to a validation loss. Only in run().
  double pipelineLoss(const data::Batch& batch);

  // Pipeline parallelism, after run(): the trained parameters of every stage into the whole
  // nn::Gpt given to setPipelineModel, on every rank of each pp group (each parameter broadcast
  // from the rank whose stage trains it; sharded stages gathered over dp first, and kept so), so
  // that one rank, or under tensor parallelism one tp group, can run the unsplit model alone: a
  // sample (Gpt::generate). Collective over every rank.
  void gatherPipelineModel();

  // The model as the step function calls it (the wrapper over the current group). Only in run().
  Tensor forward(const Tensor& input);
  DistributedDataParallel& ddp();
  // Sharding::Full's wrapper (gatherFullParameters() to sample from the whole model), under a
  // pipeline with any Sharding the stages' (its statistics; gatherPipelineModel to sample), else null.
  FullyShardedDataParallel* fullySharded() { return fsdp_.get(); }
  nn::Module& model() { return *model_; }
  optim::Optimizer& optimizer();
  // The step the loop is at (the next to apply).
  int64_t step() const { return step_; }

  LoopResult run(StepFunction step);

 private:
  struct Window;
  // replicaLocal: under TP this rank's shards as plain local tensors, over its dp group (what
  // a joiner at the same tp coordinate receives); else the checkpoint's state over the group.
  TrainingState trainingState(bool replicaLocal = false);
  void addExtraState(TrainingState& state);
  // The {dp, tp}, {dp, pp} or {dp, pp, tp} mesh over group_ (a collective).
  void makeMesh();
  bool pipelined() const { return options_.pipeline.degree > 1; }
  // The schedule LoopOptions::pipeline names over the world (InvalidArgument naming it).
  void makeSchedule();
  // The rows of one pipeline micro-batch at `world` ranks: the global batch over dp, over m.
  // InvalidArgument, prefixed with `when`, where they do not split evenly.
  int64_t microBatchRows(int world, const std::string& when) const;
  // The runner over mesh()["pp"] for this rank's stages, its store scoped to the group instance.
  void makeRunner();
  // "tensor-parallel group" or "pipeline replica": what one elastic replica is, for messages.
  std::string replicaName() const;
  // One step's pipeline over this rank's share of the batch; the loss of the dp replica (elastic:
  // of the global batch, averaged over dp).
  double pipelineStep(const data::Batch& batch);
  // Sharding under a pipeline: the fully sharded wrapper over mesh()["dp"] on this rank's stages
  // (blocks as units), and each stage parameter's shard.
  void shardStages();
  // Frees the bytes of the whole model's parameters that no local stage holds (released_).
  void releaseOtherStages();
  Tensor stageShard(const Tensor& parameter) const;
  StageShards stageShards() const;
  // The batch's m micro-batches: inputs where stage 0 is, targets where the last stage is.
  std::pair<std::vector<Tensor>, std::vector<Tensor>> pipelineMicroBatches(const data::Batch& batch) const;
  // The stage's gradients averaged over mesh()["dp"], and elastic `loss` (the replica's) with them.
  void averageStageGradients(double& loss);
  // The membership dropped this rank with its replica: say why and end run() on this rank.
  void leaveJob(const elastic::Membership& m);
  // "; member(s) 3 left with their tensor-parallel group (...)" when m dropped live members.
  std::string leftNote(const elastic::Membership& m) const;
  LoopResult leftResult() const;  // what run() returns on a rank that left
  void say(const std::string& line) const;
  void connect();
  void splitData();
  void startLoader();
  // The checkpoint to resume from (collective), after the config check; DDP's bucket order
  // from its manifest. None: a fresh start (the folder cleared when LoopOptions::resume is off).
  std::optional<CheckpointRef> findCheckpoint();
  void resume(const CheckpointRef& ref);
  // DDP over the current group with bucketOrder_.
  void wrapReplicated(bool synchronize);
  // ZeRO over DDP, then the factory's optimizer over its parts.
  void shardOptimizerState();
  void makeOptimizer();
  void requireParts() const;
  // The optimizer updates exactly the tensors parameters() returns.
  void checkOptimizer() const;
  bool zeroSharded() const { return options_.sharding == Sharding::Zero1 || options_.sharding == Sharding::Zero2; }
  // One iteration that plans DDP's buckets (not applied): ZeRO's parts are placed on the final
  // layout, so that a resumed run (which restores it) is bitwise the fresh one.
  void settleBuckets(const StepFunction& fn);
  void saveCheckpoint(const std::string& reason);
  void periodicCheckpoint();
  // One attempt at the step: false when the job stops after it.
  bool trainStep(const StepFunction& fn, Window& window);
  void recover(std::exception_ptr cause);
  void admitJoiners();
  void regroup();
  void transferState();
  void log(Window& window);
  // Rank 0: the metrics line and the progress line (or LoopHooks::onLog).
  void report(const Progress& progress);
  void checkSetUp() const;
  // Straggler detection: this rank's figures into the control vote's block on a gather step
  // (`ctl` points at the vote), and the analysis once the vote is reduced.
  bool gatherStep() const;
  void putStepFigures(double* ctl);
  void analyzeStepFigures(const double* ctl);
  void reportStraggler(const StragglerVerdict& verdict, int member);
  // Phase::Backward (LoopHooks::atBackward, a fail-at in backward): a hook on every gradient.
  void armBackwardHook();
  // LoopHooks::at and TestSwitches at `phase` of `step`.
  void reach(int64_t step, Phase phase);
  void recordSamples(int64_t step, const data::SamplerPosition& position) const;
  int memberId() const;
  // TestSwitches::slowRank: whether this member sleeps now (in the data wait, or in forward).
  bool slowsHere(bool inData) const {
    return options_.test.slowMs > 0 && options_.test.slowInData == inData && memberId() == options_.test.slowMember;
  }

  LoopOptions options_;
  std::unique_ptr<elastic::ElasticGroup> elastic_;
  std::shared_ptr<ProcessGroup> group_;
  StorePtr store_;  // the launcher's (not elastic: the membership's is elastic_->store())
  std::optional<DeviceMesh> mesh_;  // tensor or pipeline parallelism only
  std::optional<pipeline::Schedule> schedule_;
  std::optional<pipeline::GptStages> stages_;
  std::unique_ptr<pipeline::PipelineRunner> runner_;
  std::shared_ptr<ProcessGroup> dataGroup() const { return mesh_ ? (*mesh_)["dp"] : group_; }
  bool joining_ = false;
  std::string finished_;  // a replacement that found the job finished: why (run() does nothing)
  std::string left_;      // elastic TP: this rank left with its broken replica (why)
  int64_t restartCount_ = 0;

  std::shared_ptr<nn::Module> model_;
  optim::Optimizer* optimizer_ = nullptr;
  OptimizerFactory makeOptimizer_;
  std::unique_ptr<optim::Optimizer> ownedOptimizer_;
  std::function<double(int64_t)> learningRate_;
  std::shared_ptr<const data::Dataset> dataset_;
  EvalFunction evaluate_;
  std::vector<std::string> evaluationNames_;
  std::vector<std::pair<std::string, Tensor>> extraTensors_;
  std::vector<std::pair<std::string, Generator*>> extraStreams_;
  std::vector<std::pair<std::string, int64_t*>> extraValues_;

  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<ZeroRedundancy> zero_;
  std::unique_ptr<FullyShardedDataParallel> fsdp_;
  // Sharded stages: the stage parameters' shards by Tensor::id(), and the stages' parameters
  // gathered (Full: during a step; ZeRO: from an update to the next step's reduction).
  std::unordered_map<const void*, Tensor> shardOf_;
  // The other stages' parameters' storages, freed by setPipelineModel, and their sizes.
  std::vector<std::pair<Storage, size_t>> released_;
  std::optional<FullyShardedDataParallel::FullParametersGuard> stagesGathered_;
  // Sharding::Full under --elastic: after a loss, the newest checkpoint at the new world size.
  void reloadShards();
  // reloadShards went back: the next step starts the log window again, and the checkpoint just
  // read is not written again.
  bool reloaded_ = false;
  // Sharding::Full: a joiner gets the members' shards (redistributeState) and step.
  void redistributeShards(const std::vector<StateTensor>& held);
  // The parameters whole on every rank (gathered when sharded), for the final check.
  std::vector<Tensor> wholeParameters();
  std::vector<std::string> bucketOrder_;  // from a checkpoint or the state a joiner received
  std::optional<data::DistributedSampler> sampler_;
  std::unique_ptr<data::PrefetchLoader> loader_;
  double lossWeight_ = 1.0;  // this rank's share of the global batch x world / global batch
  std::optional<CheckpointDir> checkpoints_;
  std::unique_ptr<MetricsFile> metrics_;
  std::unique_ptr<Profiler> profiler_;
  void profile();  // starts or ends LoopOptions' profile window at a step boundary

  int64_t step_ = 0;
  int64_t startStep_ = 0;
  int64_t joinedAtStep_ = -1;  // a replacement: the step it joined at
  bool someoneJoined_ = false;  // a join happened in this process's view
  double priorSeconds_ = 0;  // training time of earlier runs (from the checkpoint)
  double runSeconds_ = 0;
  double recentLoss_ = 0;
  double lastLoss_ = 0;
  double committedLoss_ = 0;  // elastic: the step's loss this rank voted with
  double gradNorm_ = 0;
  Tensor control_;              // the per-step control allreduce (see trainStep)
  // A gather step's control vote: control_'s 3 values, then kFigureSlots per rank.
  Tensor controlWide_;
  StepFigures stepSums_;          // this rank's figures since the last gather, summed
  int64_t stepCount_ = 0;         // ... over this many steps
  std::optional<StragglerDetector> stragglers_;  // null: detection off
  uint64_t stragglerEpoch_ = 0;   // the membership epoch the detector's counts belong to
  bool lastMicroBatch_ = true;  // the backward now is the step's last
  bool backwardReturns_ = false;  // Sharding::Full: Phase::Backward once backward returned
  std::chrono::steady_clock::time_point loopStart_;
  std::vector<std::pair<std::string, double>> evaluation_;
};

}  // namespace dt::train
