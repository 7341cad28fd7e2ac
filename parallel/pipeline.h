// Pipeline parallelism's runtime (issue 39, second phase): a model cut into stages along the
// mesh's "pp" dimension, and the runner that executes a pipeline_schedule.h schedule on them.
//
//   auto model = std::make_shared<dt::nn::Gpt>(config, init);        // the same seed on every rank
//   dt::pipeline::Schedule s = dt::pipeline::oneFOneB(pp->size(), /*m=*/8);
//   dt::pipeline::GptStages stages = dt::pipeline::splitGpt(*model, s, pp->rank());
//   dt::pipeline::PipelineRunner runner(s, stages.runnerStages(), pp,
//                                       {.activationShape = {microBatch, T, C}, .activationDType = dtype});
//   optimizer over stages.parameters();
//   double loss = runner.step(inputs, targets);    // m micro-batches: inputs on stage 0, targets on the last
//   dt::pipeline::clipGradNorm(runner, 1.0);       // global norm over every stage, the tied weight once
//   optimizer.step();
//
// Stages (splitGpt): the model's p*v stages (Schedule::numStages) each take a contiguous range of
// blocks; stage 0 also holds wte, wpe and the embedding dropout, the last stage ln_f and the
// output layer. Which rank holds which stage is the schedule's placement (Schedule::stageOf:
// interleaved, chunk c of rank r is stage c*p + r; V, rank r holds r and 2p-1-r). The split is
// by block count (the first layers % stages stages get one more) or, with SplitRule::Parameters,
// the contiguous cut that minimises the largest stage's parameter count (the embeddings counted
// on stage 0, ln_f and the tied head's weight on the last). Every stage needs at least one block.
// Each chunk names its parameters as the unsplit model does ("h.5.attn.c_attn.weight"), so a
// checkpoint or a test can match them by name. splitGpt logs one line per local stage (info).
//
// Tied embeddings: the output layer is wte's weight. When the first and the last stage sit on
// one rank (the V placement, or p = 1) their chunks share the tensor and autograd sums its two
// gradients as in the unsplit model. Otherwise the last stage holds a copy (equal at split time);
// after each step's backward the runner exchanges the two gradients between those two ranks and
// both add them (first + last, in that order on both), so both copies get the unsplit model's
// gradient and, stepped by the same optimizer, stay equal.
//
// The runner (PipelineRunner::step) runs this rank's action list in order:
//  * F runs the chunk on its input (tokens on stage 0; else the received or, between two stages
//    on this rank, the handed-over activation, a fresh leaf that requires grad) and keeps the
//    autograd graph until the B; on the last stage it also takes the loss against the target.
//  * SEND_F / SEND_B post a send and move on (as the simulator's isend); the step waits for them
//    before it returns. RECV_F / RECV_B post a recv and wait for it (with options.timeout).
//  * B (and I) runs backward: on the last stage from loss / m, so the gradients are the mean over
//    the m micro-batches as the unsplit model's over the global batch; elsewhere from the
//    received gradient of the stage's output. Parameter gradients accumulate in .grad over the
//    micro-batches (zero them before a step, as before backward).
//  * I is the first half of a split backward (autograd's backwardDeferringWeights): the input
//    gradient, which the previous stage waits for, without the weight-gradient products; the
//    slot keeps what those need until its W computes them and accumulates each parameter's
//    .grad (the parameter's hooks fire then).
//  * step returns the mean loss over the m micro-batches, broadcast from the last stage's rank
//    over the pp group, so every rank returns the same value.
//
// The shape check: on the first step (and after setActivation) every SEND is preceded by its
// tensor's dtype and shape and answered by the receiver's verdict against options' activation
// (the same spec for every boundary and for the gradients coming back). A mismatch throws
// InvalidArgument on both ends naming the receiving stage, the micro-batch, the direction, the
// expected and the received shape. This makes the first step's sends wait for their receiver
// (strict rendezvous, which validate() proves deadlock-free); later steps send without it.
//
// Errors: anything that throws inside step (a chunk's forward, the shape check, a transfer that
// failed or timed out, bad arguments) aborts the pp group with the error (ProcessGroup::abort):
// every other rank's transfer in flight fails at once instead of at its timeout. The error
// rethrown keeps its type and reads "pipeline rank r/p (pg=...) stage s step k, action #i F3
// failed: <cause>", followed by the schedule's action grid with that action marked. The others'
// cause is the transport's "rank r aborted the group's transfers"; with options.store the first
// rank to fail on its own (its stage threw, its check failed, or its transfer timed out) leaves
// its error there and the others add "; the failure that started it: rank r stage s action #i
// F3: <its error>". A rank whose peer never comes fails at its transfer's timeout; so does a
// rank that waits on a rank that waits on it, unless an abort reaches it first. The group is
// broken afterwards (its brokenCause()); rebuild it to go on.
//
// Contract: not thread-safe; one runner per rank per pp group, step called on every rank of the
// group, the same number of times. Every step blocks until this rank's list is done (at most
// about one options.timeout per transfer). The runner holds the chunks (shared) and the group.
// Sends and receives use tags from options.tagBase up; nothing else should use those tags on
// the group while a step runs. Tensor parallelism composes inside the stages (splitGpt);
// data parallelism over replicas is the caller's: average the stages' gradients over the dp
// group after step (train::Loop does, with checkpoints across PP degrees), or shard them with
// the fully sharded wrapper over dp (train::Loop's ZeRO and Full under a pipeline: the stage's
// parameters gathered once per step, FullyShardedDataParallel::reduceGradients after it).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "parallel/pipeline_schedule.h"
#include "process_group/process_group.h"
#include "store/store.h"
#include "tensor/nn/clip_grad.h"
#include "tensor/nn/gpt.h"
#include "tensor/nn/module.h"

namespace dt::pipeline {

enum class SplitRule : std::uint8_t { Layers, Parameters };

// stageBegin[s] .. stageBegin[s+1] are stage s's blocks (numStages + 1 entries, 0 .. layers).
// InvalidArgument when layers < numStages.
std::vector<int> splitLayers(const nn::GptConfig& config, int numStages, SplitRule rule);

// What the runner needs of this rank's part of the model.
struct RunnerStages {
  std::vector<std::shared_ptr<nn::Module>> chunks;  // by local chunk index, v of them
  // The last stage's loss of its output against a micro-batch's target (a 0-dim tensor).
  std::function<Tensor(const Tensor& output, const Tensor& target)> loss;
  // The tied parameter's tensor on this rank when it is a copy kept in step with another rank's
  // (first and last stage on different ranks, this rank one of them); undefined otherwise.
  Tensor tiedCopy;
  int tiedPeer = -1;         // the other holder's rank in the pp group
  bool tiedIsLast = false;   // this rank holds the last stage's copy (counted once by clipping)
};

// This rank's chunks of a GPT.
struct GptStages {
  std::vector<std::shared_ptr<nn::Module>> chunks;  // by local chunk index
  std::vector<int> stages;                          // the global stage of each chunk
  std::vector<int> stageBegin;                      // the split (splitLayers)
  std::shared_ptr<nn::GptLayout> layout;            // the model's (tensor parallelism), or null
  RunnerStages runnerStages() const;
  Tensor tiedCopy;
  int tiedPeer = -1;
  bool tiedIsLast = false;
  // This rank's parameters, each tensor once (a shared tied weight once), in chunk order.
  std::vector<Tensor> parameters() const;
  // Each chunk's parameters by the unsplit model's names (the tied weight as "wte.weight" in
  // both the first and the last stage's chunk).
  NamedTensors namedParameters() const;
  // One line per local stage: "stage 1 (rank 1 chunk 0): blocks 2-3, 25,152 parameters".
  std::string summary() const;
};

struct SplitOptions {
  SplitRule rule = SplitRule::Layers;
  // The pp group's rank of the caller is `rank`; only its chunks are built.
};

// This rank's chunks of `model` under `schedule`'s placement. The chunks share `model`'s modules
// (no copies, except the last stage's tied weight when the first stage is elsewhere), so
// `model` is the reference for names and initial values; build it from the same seed on every
// rank. InvalidArgument when the layers do not cover the stages.
//
// A tensor-parallel model (parallelize() before splitGpt: a GptLayout) splits the same way; its
// chunks run the layout where Gpt::forward does (enterBlocks after the embeddings, enterHead
// before the head), the loss is the layout's (a block of the vocabulary), and the last stage's
// tied copy is this rank's vocabulary block. The runner's group is then the mesh's "pp" (the
// ranks of one tp coordinate), every boundary carries this rank's activation (with sequence
// parallelism [micro-batch, T / tp, width]), and each action's TP collectives run on "tp" in the
// same order on every rank of a tp group (they run the same list).
GptStages splitGpt(nn::Gpt& model, const Schedule& schedule, int rank, const SplitOptions& options = {});

struct PipelineOptions {
  // The dtype and shape of every activation crossing a stage boundary, and of the gradients
  // coming back ([micro-batch, T, width] for a GPT). Required.
  Shape activationShape;
  DType activationDType = DType::Float32;
  // Each transfer's timeout; nullopt: the group's.
  std::optional<std::chrono::milliseconds> timeout;
  // The first tag the runner uses; it uses tags below tagBase + 7 * stages * m + 1.
  std::uint32_t tagBase = 1u << 20;
  // Optional: where the rank that fails first leaves its error (one key per step under
  // "pipeline/<pg>/<tagBase>/"), so that the others' errors, which only learn from the abort that
  // a peer failed, carry the cause too (they wait up to causeWait for it).
  StorePtr store;
  std::chrono::milliseconds causeWait{1000};
};

// Where one step's time went on one rank. wall runs from step's entry to its return; compute is
// the rank's F, B, I and W actions; the rest (idle) is waiting: for a RECV's data, for the first
// step's shape checks, for the sends at the end, the tied-gradient exchange and the loss's
// broadcast. bubble() is idle over compute, simulate()'s bubble measured on this rank (start
// the ranks' steps together, e.g. after a barrier, or a late rank's wait is not counted).
struct StepTiming {
  double wallSeconds = 0;
  double computeSeconds = 0;
  double idleSeconds() const { return wallSeconds - computeSeconds; }
  double bubble() const { return computeSeconds > 0 ? idleSeconds() / computeSeconds : 0.0; }
};

class PipelineRunner {
 public:
  // Validates the schedule (InvalidArgument with the grid), and that it fits the group (p ranks)
  // and the stages (v chunks). Not collective.
  PipelineRunner(Schedule schedule, RunnerStages stages, ProcessGroupPtr pp, PipelineOptions options);

  // One step over the schedule's m micro-batches: inputs[i] on the rank of stage 0, targets[i]
  // on the rank of the last stage (empty vectors elsewhere). Returns the mean loss (every rank).
  double step(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets);

  // The same mean loss without backward: this rank's F, SEND_F and RECV_F in the schedule's order
  // (no gradients, no graph kept, no tied-gradient exchange), e.g. a validation loss. Set the
  // chunks' eval() first for a loss without dropout. Collective over the group as step is, with
  // the same arguments and errors (the failing action is marked in the grid the same way); it
  // does not count as a step (steps() and lastStep() are step's).
  double evaluate(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets);

  // A new activation spec: the next step checks shapes again.
  void setActivation(Shape shape, DType dtype);

  const Schedule& schedule() const { return schedule_; }
  const RunnerStages& stages() const { return stages_; }
  const ProcessGroupPtr& group() const { return pp_; }
  int64_t steps() const { return steps_; }
  // The last step's timing on this rank (zeros before the first; a failed step's partial).
  const StepTiming& lastStep() const { return lastStep_; }

 private:
  struct Slot;
  double execute(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets, bool forwardOnly);
  void run(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets, std::vector<double>& losses,
           int& current, bool forwardOnly, StepTiming& timing);
  void syncTied();
  std::string where(int stage) const;

  Schedule schedule_;
  RunnerStages stages_;
  ProcessGroupPtr pp_;
  PipelineOptions options_;
  int rank_;
  bool checkShapes_ = true;
  int64_t steps_ = 0;
  int64_t evaluations_ = 0;
  StepTiming lastStep_;
};

// Stages of a fixed synthetic cost, to measure what a schedule's bubble is on a real transport
// (the tests and bench/pipeline_bench.cpp): each of this rank's chunks multiplies its input by a
// one-element weight and sleeps `unit` x costs.f in forward; backward sleeps unit x costs.i for
// the input's gradient and unit x costs.w for the weight's (a B, both halves at once, sleeps
// their sum; set costs.b = costs.i + costs.w when simulating). Sleeping, not computing, keeps
// the ranks from competing for cores, so the measured idle time is the schedule's and the
// transport's. Inputs on stage 0 must require grad (so that its I has an input gradient to
// compute, as a real stage's blocks do) and have activationShape; the loss is the mean of
// output x target.
RunnerStages fixedCostStages(const Schedule& schedule, int rank, const Costs& costs, std::chrono::microseconds unit);

// Gradient clipping by the global norm over every stage (2-norm or infinity, as nn::clipGradNorm):
// each rank's partial statistic over its own parameters, the tied weight's last-stage copy left
// out, one all-reduce over the pp group; every gradient (the copy too) scaled by the same factor.
// Collective over the runner's group; call after step, before the optimizer. Returns the norm.
double clipGradNorm(const PipelineRunner& runner, double maxNorm, nn::ClipGradNormOptions options = {});
// The same for tensor-parallel stages: a TP block's squares are summed over `tensorParallel`
// first (parameterShardsOf), a replicated parameter counts once; collective over pp and tp.
double clipGradNorm(const PipelineRunner& runner, double maxNorm, const ProcessGroupPtr& tensorParallel,
                    nn::ClipGradNormOptions options = {});
// The same when a data-parallel wrapper holds the stages' gradients in pieces (the fully sharded
// wrapper over dp, which train::Loop uses for ZeRO and Full under a pipeline): holderOf(parameter)
// is the tensor whose .grad holds this rank's piece of the parameter's gradient (the wrapper's
// shard), and options.reducePartial sums a partial statistic over the holders' group (the
// wrapper's gradNormReducer()); that total then goes over pp. Every holder's gradient is scaled,
// the last stage's tied copy's too, which the norm leaves out as above. With `tensorParallel` the
// split parameters' partial goes over tp first (a replicated one's pieces are equal across tp and
// count once), then the whole sum over the holders' group and pp. Collective over all of them.
double clipGradNorm(const PipelineRunner& runner, double maxNorm, const std::function<Tensor(const Tensor&)>& holderOf,
                    nn::ClipGradNormOptions options, const ProcessGroupPtr& tensorParallel = nullptr);

}  // namespace dt::pipeline
