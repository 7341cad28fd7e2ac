// gpt: a GPT-style language model trained on real English text, under `dtrun --nproc 4
// build/examples/gpt`, on the training loop library (train/loop.h, docs/train.md), which brings
// DDP / ZeRO / the fully sharded wrapper (--sharding), tensor parallelism (--tp, --sp; with DDP over
// the rest of the ranks), pipeline parallelism (--pp, --schedule; with --tp inside the stages and
// DDP over the rest of the ranks, or --sharding over them), gradient accumulation, clipping,
// checkpoints with a bitwise resume, pre-emption (SIGTERM/SIGUSR1/SIGINT), progress and metrics
// lines, and under `dtrun --elastic` in-place recovery and joiners. This file is the rest:
//   data       Debian's fortunes (2.5 MB of English), byte tokens, a train/validation split by
//              document, random context windows (drawn with replacement: the windows of step s
//              depend on the seed and s alone)
//   model      tensor/nn/gpt.h: pre-norm transformer blocks, the output layer tied to the token
//              embedding, GPT-2's initialisation; AdamW (no decay on biases, norms, embeddings),
//              linear warm-up then cosine learning rate
//   precision  --precision bf16: the forward (and so its backward) under dt::autocast, so the
//              matrix products run in bf16 while the weights, AdamW, LayerNorm and the loss stay
//              fp32 (tensor/autocast.h); the validation loss is measured in fp32
//   output     the validation loss (from step 0), a text sample from --prompt, --bench's RESULT
// `gpt --help` lists the flags.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/strings.h"
#include "data/text.h"
#include "ddp/comm_hooks.h"
#include "examples/run_support.h"
#include "parallel/parallelize.h"
#include "parallel/tensor_parallel.h"
#include "tensor/autocast.h"
#include "tensor/matmul_backend.h"
#include "tensor/memory_stats.h"
#include "tensor/nn/gpt.h"
#include "tensor/optim/optim.h"
#include "tensor/optim/schedule.h"
#include "tensor/parallel.h"
#include "tensor/storage.h"
#include "train/loop.h"

namespace {

using dt::InvalidArgument;
using dt::str;
constexpr const char* kProgram = "gpt";

struct Config {
  std::string data = dt::data::kFortunesDir;
  dt::nn::GptConfig model{.vocabSize = 256, .contextLength = 128, .layers = 4, .heads = 4, .width = 256};
  int64_t steps = 250, globalBatch = 16, microBatches = 1, warmup = 25;  // global batch: sequences per step, all ranks
  double lr = 2e-3, minLr = 2e-4, weightDecay = 0.1, gradClip = 1.0;
  uint64_t seed = 0;
  int64_t evalEvery = 50, evalWindows = 64, logEvery = 10, checkpointEvery = 100, sampleTokens = 300, topK = 40, benchWarmup = 5;
  std::string metrics, initOut, checkpointDir = "gpt-checkpoints", resume = "auto", prompt = "The ";
  int keep = 3;
  double temperature = 0.8;
  bool quiet = false, bench = false;
  std::string sharding = "ddp";  // ddp, zero1, zero2 (ddp/zero.h), fsdp, fsdp-keep (fsdp/fully_shard.h: no reshard after forward)
  int tp = 1;       // tensor parallelism's degree (parallel/parallelize.h); DDP over world / tp replicas
  bool sp = false;  // and sequence parallelism
  int pp = 1;       // pipeline parallelism's degree (train/loop.h); DDP (or --sharding) over world / pp replicas
  std::string schedule = "1f1b", split = "layers";
  std::string scheduleFile;  // a schedule of the user's own (parallel/pipeline_schedule.h's text format)
  int virtualStages = 2;
  int zbPending = 0;  // --schedule zb1: deferred weight gradients per rank at most (0: --pp)
  std::string precision = "fp32";  // bf16: the forward's matrix products under dt::autocast
  std::string gradReduce = "fp32";  // bf16: gradients on the wire in bf16 (DDP's bf16 hook, the sharded wrapper's reduceDtype)
  bool checkpoints() const { return checkpointDir != "none"; }
};

// Every flag, bound to its place in `c`; false at --help (printed).
bool parseArgs(int argc, char** argv, Config& c) {
  examples::Flags flags(kProgram, R"(usage: gpt [flags]          (run it under dtrun: dtrun --nproc 4 build/examples/gpt)

Data-parallel training of a GPT-style byte-level language model on Debian's fortunes, with
validation loss, checkpoints and exact resume, pre-emption (SIGTERM/SIGUSR1/SIGINT: checkpoint
at the next step, exit 0), in-place recovery under dtrun --elastic, and a generated sample at
the end.

)");
  flags.section("data and model")
      .add("--data", c.data, "DIR", "folder of fortune files (Debian's fortunes)")
      .add("--layers", c.model.layers, "N", "transformer blocks")
      .add("--heads", c.model.heads, "N", "attention heads")
      .add("--width", c.model.width, "N", "embedding width (a multiple of --heads)")
      .add("--context", c.model.contextLength, "N", "tokens per window")
      .add("--dropout", c.model.dropout, "P", "on embeddings, attention and residual branches", 0.0, 0.9)
      .add("--activation-checkpointing", c.model.activationCheckpointing, "recompute each block's activations in backward instead of keeping them");
  flags.section("training")
      .add("--steps", c.steps, "N", "optimizer steps")
      .add("--global-batch", c.globalBatch, "G", "sequences per step over all ranks (a multiple of the ranks)")
      .add("--micro-batches", c.microBatches, "K", "gradient accumulation: each rank runs K micro-batches per step; with\n--pp the "
                                                 "pipeline's micro-batches (each replica's share in K pieces)")
      .add("--lr", c.lr, "LR", "peak learning rate of the cosine schedule", 0.0, 1.0)
      .add("--min-lr", c.minLr, "LR", "final learning rate", 0.0, 1.0)
      .add("--warmup", c.warmup, "N", "linear warm-up steps", 0)
      .add("--weight-decay", c.weightDecay, "WD", "AdamW decay of the Linear weights (none on biases, norms, embeddings)", 0.0, 1.0)
      .add("--grad-clip", c.gradClip, "C", "clip the global gradient norm to C (0: no clipping)", 0.0, 1e6)
      .add("--seed", c.seed, "S", "initialisation, windows and dropout")
      .add("--precision", c.precision, "P",
           "bf16: the matrix products of each forward and its backward in bf16 (fp32\naccumulation, "
           "dt::autocast); weights, AdamW, LayerNorm and the loss stay fp32.\nOn a CPU without bf16 "
           "instructions they run in fp32 (one log line says why)",
           {"fp32", "bf16"})
      .add("--grad-reduce", c.gradReduce, "P",
           "bf16: gradients are cast to bf16, summed across the ranks in bf16 and cast\nback (half the bytes on the wire; "
           "DDP's bf16 hook, or the fsdp wrapper's\nreduce dtype). Not with --sharding zero1/zero2",
           {"fp32", "bf16"})
      .add("--sharding", c.sharding, "MODE",
           "ddp: every rank holds everything; zero1/zero2: the optimizer state\n(zero2: and the gradients between steps) split over "
           "the ranks on DDP's buckets;\nfsdp: parameters, gradients and optimizer state split, one block gathered at a\ntime; "
           "fsdp-keep: fsdp that keeps each block gathered from its forward to its\nbackward. Checkpoints of any mode resume in any "
           "other, at any world size",
           {"ddp", "zero1", "zero2", "fsdp", "fsdp-keep"})
      .add("--tp", c.tp, "N", "tensor parallelism: each model replica split over N adjacent ranks (heads,\nMLP, vocabulary; "
                               "the loss never gathers the logits), DDP over the replicas")
      .add("--sp", c.sp, "sequence parallelism with --tp: norms and residuals on a block of the sequence")
      .add("--pp", c.pp, "N", "pipeline parallelism: each model replica's blocks split into stages over N\nadjacent ranks "
                               "(embeddings on the first, the tied head on the last), DDP (or\n--sharding over the replicas, each "
                               "stage gathered once a step); its checkpoints\nresume at any --pp; the validation loss runs through "
                               "the stages (--eval-windows\nrounded down to a multiple of --global-batch); the sample from the "
                               "stages' parameters\ngathered to the first pipeline")
      .add("--schedule", c.schedule, "NAME", "the pipeline's schedule with --pp (docs/parallel.md): gpipe, 1f1b,\ninterleaved "
                                              "(--virtual-stages chunks per rank), zb1 (ZB-H1), zbv",
           {"gpipe", "1f1b", "interleaved", "zb1", "zbv"})
      .add("--schedule-file", c.scheduleFile, "PATH", "--pp: a schedule of your own instead (the text format of\ndocs/parallel.md), "
                                                       "validated before the first step; its m is\nthe micro-batches")
      .add("--virtual-stages", c.virtualStages, "V", "--schedule interleaved: stages per rank (p * V stages in all)")
      .add("--zb-pending", c.zbPending, "K", "--schedule zb1: at most K deferred weight gradients wait per rank, 1 to\n--pp "
                                              "(0: --pp); each keeps about a micro-batch's activations, and fewer\nleave more "
                                              "bubble: (2p-1-K)/(3m) instead of (p-1)/(3m)", 0)
      .add("--split", c.split, "RULE", "--pp: blocks per stage by count (layers) or balancing the parameters (params)",
           {"layers", "params"});
  flags.section("evaluation and output")
      .add("--eval-every", c.evalEvery, "N", "validation loss at step 0, every N steps and at the end (0: only at the end)", 0)
      .add("--eval-windows", c.evalWindows, "N", "validation windows (of the context length) per evaluation")
      .add("--log-every", c.logEvery, "N", "progress line every N steps on rank 0")
      .add("--metrics", c.metrics, "FILE", "one JSON line per logged step (rank 0); plot with scripts/plot_metrics.py FILE")
      .add("--init-out", c.initOut, "FILE", "rank 0 writes the initial weights there (safetensors; the PyTorch peer's --init)")
      .add("--prompt", c.prompt, "TEXT", "the start of the sample printed at the end")
      .add("--sample-tokens", c.sampleTokens, "N", "bytes generated (0: no sample)", 0)
      .add("--temperature", c.temperature, "T", "of the sample's draws", 0.0, 10.0)
      .add("--top-k", c.topK, "K", "draw among the K likeliest bytes (0: all)", 0)
      .add("--quiet", c.quiet, "only the final lines (and errors)")
      .add("--bench", c.bench, "print a RESULT line (tokens/s after --bench-warmup steps; peak RSS, the RSS\nbefore the model was built, "
                               "the activations of one forward)")
      .add("--bench-warmup", c.benchWarmup, "N", "steps --bench leaves out", 0);
  flags.section("checkpoints")
      .add("--checkpoint-dir", c.checkpointDir, "DIR", "none: no checkpoints")
      .add("--checkpoint-every", c.checkpointEvery, "N", "steps between checkpoints; one is also written at the end", 0)
      .add("--keep", c.keep, "K", "checkpoints kept")
      .add("--resume", c.resume, "auto|never", "auto: continue from the newest checkpoint in DIR; never: delete them first", {"auto", "never"});
  if (!flags.parse(argc, argv)) return false;
  c.model.validate();
  if (c.minLr > c.lr) throw InvalidArgument(str("gpt: --min-lr ", c.minLr, " is above --lr ", c.lr));
  if (c.warmup > c.steps) throw InvalidArgument(str("gpt: --warmup ", c.warmup, " is more than --steps ", c.steps));
  if (c.prompt.empty()) throw InvalidArgument("gpt: --prompt is empty (the sample needs at least one byte)");
  if (c.checkpointDir.empty()) throw InvalidArgument("gpt: --checkpoint-dir is empty (use none to write no checkpoints)");
  if (c.sp && c.tp == 1) throw InvalidArgument("gpt: --sp needs --tp 2 or more (it splits the sequence over the TP group)");
  if (!c.scheduleFile.empty() && c.pp == 1) {
    throw InvalidArgument(str("gpt: --schedule-file ", c.scheduleFile, " needs --pp 2 or more (the schedule's p)"));
  }
  // (A schedule file's stages are counted by the loop, which refuses too few blocks the same way.)
  if (const int64_t stages = c.pp * (c.schedule == "interleaved" ? c.virtualStages : c.schedule == "zbv" ? 2 : 1);
      c.pp > 1 && c.scheduleFile.empty() && c.model.layers < stages) {
    throw InvalidArgument(str("gpt: --pp ", c.pp, " --schedule ", c.schedule,
                              c.schedule == "interleaved" ? str(" --virtual-stages ", c.virtualStages) : std::string(),
                              " makes ", stages, " stages but --layers is ", c.model.layers,
                              " (every stage needs at least one block)"));
  }
  if (c.gradReduce == "bf16" && c.sharding.starts_with("zero")) {
    throw InvalidArgument(str("gpt: --grad-reduce bf16 with --sharding ", c.sharding, " is not supported: ZeRO reduce-scatters "
                              "DDP's buckets in fp32; use --sharding ddp or fsdp for bf16 gradients"));
  }

  return true;
}

std::string modelName(const dt::nn::GptConfig& m) {
  return str("L", m.layers, "-H", m.heads, "-C", m.width, "-T", m.contextLength);
}

// The process's resident set, its peak (VmHWM) or now (VmRSS), in MiB; 0 where /proc is missing.
double rssMib(const char* key) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with(key)) return std::strtod(line.c_str() + std::strlen(key), nullptr) / 1024.0;
  }
  return 0.0;
}
// VmHWM starts again from the current resident set (Linux's clear_refs "5").
void resetPeakRss() { std::ofstream("/proc/self/clear_refs") << "5"; }

// One evaluation's loss: the first `count` windows at stride T of the validation text (the
// same set for every world size), data-parallel rank r taking windows r, r + W, ... (the ranks
// of a TP group take the same ones); sums allreduced over every rank, which counts each window
// tp times in both sums. Through the loop's wrapper, which gathers what a sharded model needs
// (a collective), and the model's own loss (vocab-parallel under --tp).
double validationLoss(dt::train::Loop& loop, const dt::nn::Gpt& model, const dt::data::TextWindows& val, int64_t count) {
  dt::NoGradGuard noGrad;
  dt::ProcessGroup& group = loop.dataParallelGroup();
  loop.model().eval();
  const int64_t stride = val.contextLength();
  const int64_t available = std::min<int64_t>(count, (val.size() + stride - 1) / stride);
  std::vector<int64_t> mine;
  for (int64_t w = group.rank(); w < available; w += group.size()) mine.push_back(w * stride);
  double lossSum = 0, tokens = 0;
  constexpr size_t kBatch = 16;
  for (size_t begin = 0; begin < mine.size(); begin += kBatch) {
    const size_t n = std::min(kBatch, mine.size() - begin);
    const dt::data::Batch b = val.get(std::span<const int64_t>(mine.data() + begin, n));
    const int64_t rows = b.targets.numel();
    lossSum += model.nextTokenLoss(loop.forward(b.inputs), b.targets).item<double>() * static_cast<double>(rows);
    tokens += static_cast<double>(rows);
  }
  loop.model().train();
  dt::Tensor sums = dt::fromVector<double>({lossSum, tokens});
  loop.group().allreduce(sums)->wait();
  const auto s = sums.toVector<double>();
  return s[0] / s[1];
}

// The same under --pp, where no rank holds the whole model: the windows go through the pipeline
// forward only (Loop::pipelineLoss), `batch` at a time over the dp replicas as a step's batch
// (each replica a multiple of the schedule's m), so the count is rounded down to a multiple of
// it (at least one; windows past the text's end start over). Every rank of a replica gets its
// mean loss, so the sums over every rank count each window p * t times in both.
double pipelineValidationLoss(dt::train::Loop& loop, const dt::data::TextWindows& val, int64_t count, int64_t batch) {
  const dt::autocast fp32(dt::DType::BFloat16, false);  // measured in fp32, as without --pp
  const dt::ProcessGroup& dp = loop.dataParallelGroup();
  const int64_t stride = val.contextLength();
  const int64_t available = (val.size() + stride - 1) / stride;
  const int64_t perReplica = batch / dp.size();
  const int64_t calls = std::max<int64_t>(1, std::min(count, available) / batch);
  double lossSum = 0, rows = 0;
  for (int64_t k = 0; k < calls; ++k) {
    std::vector<int64_t> offsets;
    for (int64_t i = 0; i < perReplica; ++i) offsets.push_back((k * batch + dp.rank() * perReplica + i) % available * stride);
    lossSum += loop.pipelineLoss(val.get(offsets)) * static_cast<double>(perReplica);
    rows += static_cast<double>(perReplica);
  }
  dt::Tensor sums = dt::fromVector<double>({lossSum, rows});
  loop.group().allreduce(sums)->wait();
  const auto s = sums.toVector<double>();
  return s[0] / s[1];
}

double valueOf(const std::vector<std::pair<std::string, double>>& values, const std::string& name) {
  for (const auto& [key, v] : values) {
    if (key == name) return v;
  }
  return std::nan("");
}

int run(const Config& c) {
  const dt::data::TextSplit corpus = dt::data::loadFortunes(c.data);
  const int64_t T = c.model.contextLength, tokensPerStep = c.globalBatch * T;
  auto train = std::make_shared<dt::data::TextWindows>(corpus.train, T, "train");
  const dt::data::TextWindows val(corpus.validation, T, "validation");
  dt::train::LoopOptions options{
      .program = kProgram, .steps = c.steps, .globalBatch = c.globalBatch, .microBatches = static_cast<int>(c.microBatches),
      .clipGradNorm = c.gradClip, .seed = c.seed, .replacement = true, .unit = "tokens", .unitsPerExample = T,
      .checkpointDir = c.checkpoints() ? c.checkpointDir : "", .checkpointEvery = c.checkpointEvery, .keep = c.keep,
      .resume = c.resume == "auto", .logEvery = c.logEvery, .quiet = c.quiet, .metricsFile = c.metrics,
      .evalEvery = c.evalEvery, .evalAtStart = c.evalEvery > 0};
  options.config = {{"model", modelName(c.model)}, {"dropout", examples::exactText(c.model.dropout)},
                    {"lr", examples::exactText(c.lr)}, {"min_lr", examples::exactText(c.minLr)},
                    {"warmup", std::to_string(c.warmup)}, {"weight_decay", examples::exactText(c.weightDecay)},
                    {"grad_clip", examples::exactText(c.gradClip)}, {"seed", std::to_string(c.seed)},
                    {"global_batch", std::to_string(c.globalBatch)}, {"micro_batches", std::to_string(c.microBatches)},
                    {"train_bytes", std::to_string(corpus.train.size())}};
  options.tensorParallel = c.tp;
  if (c.pp > 1) {
    // The pipeline's micro-batches take --micro-batches' place.
    options.microBatches = 1;
    // A schedule file brings its own m: --micro-batches left at 1 takes it, any other must agree.
    options.pipeline = {.degree = c.pp, .schedule = c.schedule, .scheduleFile = c.scheduleFile,
                        .microBatches = static_cast<int>(!c.scheduleFile.empty() && c.microBatches == 1 ? 0 : c.microBatches),
                        .virtualStages = c.virtualStages,
                        .maxPendingWeightGrads = c.zbPending,
                        .split = c.split == "params" ? dt::pipeline::SplitRule::Parameters : dt::pipeline::SplitRule::Layers,
                        .sequenceParallel = c.sp};
  }
  if (c.gradReduce == "bf16") options.ddp.commHook = dt::bf16CompressHook();
  // --pp with --sharding: the loop shards the stages itself (these options, its own units).
  if (c.gradReduce == "bf16") options.fullyShard.mixedPrecision.reduceDtype = dt::DType::BFloat16;
  options.sharding = c.sharding == "ddp"     ? dt::train::Sharding::None
                     : c.sharding == "zero1" ? dt::train::Sharding::Zero1
                     : c.sharding == "zero2" ? dt::train::Sharding::Zero2
                                             : dt::train::Sharding::Full;
  options.hooks.onLog = [&](const dt::train::Progress& p) {
    const double valLoss = valueOf(p.metrics, "val_loss");
    if (c.quiet) return;
    if (p.step == 0) {
      std::printf("gpt: step 0 validation loss %.4f\n", valLoss);
      return;
    }
    char v[40] = "";
    if (!std::isnan(valLoss)) std::snprintf(v, sizeof(v), "  val loss %.4f", valLoss);
    std::printf("step %lld/%lld  loss %.4f%s  lr %.2e  grad norm %.3f  %.0f tokens/s  elapsed %s  ETA %s\n",
                static_cast<long long>(p.step), static_cast<long long>(p.steps), p.loss, v, p.lr, p.gradNorm, p.rate,
                examples::formatSeconds(p.elapsed).c_str(), examples::formatSeconds(p.left).c_str());
  };
  // --bench: the peak memory of training (not of building the whole model before it was
  // sharded), and what one forward keeps for backward.
  examples::BenchWindow bench;
  if (c.bench) bench.attach(options, c.benchWarmup, [] { dt::emptyCpuCache(), resetPeakRss(), dt::resetPeakMemoryStats(); });
  double activationMib = 0;

  dt::train::Loop loop(options);
  if (loop.jobFinished()) return loop.run({}), 0;  // a replacement that started after the job ended: nothing to do
  const int rank = loop.rank(), world = loop.worldSize();
  if (!c.quiet) std::printf("gpt: rank %d/%d pid %d attempt %lld\n", rank, world, static_cast<int>(getpid()), static_cast<long long>(loop.restartCount() + 1));
  dt::Generator initRng, dropoutRng;
  initRng.manualSeed(c.seed);
  // Each data-parallel replica its own masks; the ranks of one TP group share a stream, since its
  // replicated regions must drop the same elements (parallelize refuses streams that differ).
  const int dropoutReplica = c.tp > 1 ? loop.mesh().coordinate("dp") : rank;
  dropoutRng.manualSeed(c.seed * 0x9e3779b97f4a7c15ull + 1000 + static_cast<uint64_t>(dropoutReplica));
  const double fixedRss = rssMib("VmRSS:");  // libraries, the corpus, the process group: before the model exists
  auto model = std::make_shared<dt::nn::Gpt>(c.model, initRng, &dropoutRng);
  if (!c.initOut.empty() && rank == 0) dt::saveSafetensors(c.initOut, model->stateDict());
  if (c.tp > 1) dt::parallelize(*model, loop.mesh(), dt::gptParallelPlan({.sequenceParallel = c.sp}));
  int64_t localParameters = 0;  // --bench under --tp: this rank's shards (before any data-parallel sharding)
  for (const dt::Tensor& p : model->parameters()) localParameters += p.numel();
  // --bench under --tp: the TP collectives of the measured steps (forward + backward), counted
  // from the first measured step's start to the last one's (parallel/tensor_parallel.h).
  const dt::ProcessGroup* tpGroup = c.bench && c.tp > 1 ? loop.mesh()["tp"].get() : nullptr;
  std::optional<dt::TpCollectiveCounts> tpFirst;
  dt::TpCollectiveCounts tpLast;
  int64_t tpFrom = 0, tpTo = 0;
  dt::FullyShardOptions sharded{.reshardAfterForward = c.sharding == "fsdp"};
  if (c.gradReduce == "bf16") sharded.mixedPrecision.reduceDtype = dt::DType::BFloat16;
  for (const auto& [name, block] : model->h->namedChildren()) sharded.units.push_back(block);
  if (c.pp > 1) {
    loop.setPipelineModel(model);
  } else {
    loop.setModel(model, sharded);
  }
  const dt::optim::WarmupCosineSchedule schedule(c.lr, c.warmup, c.steps, c.minLr);
  loop.setOptimizer(
      [&](dt::train::Loop& l) {
        return std::make_unique<dt::optim::AdamW>(l.paramGroups(dt::optim::decayGroups(*model, c.weightDecay)),
                                                  dt::optim::AdamWOptions{.lr = c.lr, .beta2 = 0.95});
      },
      [&](int64_t step) { return schedule.at(step); });
  loop.setData(train);
  loop.addState("rng", dropoutRng);
  loop.setEvaluation(
      [&] {
        const double loss = c.pp > 1 ? pipelineValidationLoss(loop, val, c.evalWindows, c.globalBatch)
                                     : validationLoss(loop, *model, val, c.evalWindows);
        return std::vector<std::pair<std::string, double>>{{"val_loss", loss}};
      },
      {"val_loss"});
  const bool bf16 = c.precision == "bf16";
  // What the products really ran in: bf16 falls back to fp32 where the CPU lacks the instructions.
  const std::string precision = !bf16 ? "fp32" : dt::bf16MatmulNative() ? "bf16" : "bf16-as-fp32";
  if (rank == 0 && !c.quiet) {
    std::printf("gpt: %d rank(s); %s: train %zu bytes (%lld fortunes), validation %zu bytes (%lld); GPT %s (%lld parameters, vocabulary "
                "256 bytes); AdamW lr %g warm-up %lld cosine to %g, weight decay %g, clip %g; global batch %lld x %lld tokens (%lld per "
                "rank%s); %lld steps; %s; precision %s\n",
                world, corpus.source.c_str(), corpus.train.size(), static_cast<long long>(corpus.trainDocuments), corpus.validation.size(),
                static_cast<long long>(corpus.validationDocuments), modelName(c.model).c_str(), static_cast<long long>(c.model.parameterCount()),
                c.lr, static_cast<long long>(c.warmup), c.minLr, c.weightDecay, c.gradClip, static_cast<long long>(c.globalBatch),
                static_cast<long long>(T), static_cast<long long>(c.globalBatch * c.tp * c.pp / world), c.microBatches > 1 ? str(" in ", c.microBatches, " micro-batches").c_str() : "",
                static_cast<long long>(c.steps),
                c.pp > 1 ? str("PP=", c.pp, " (", c.scheduleFile.empty() ? c.schedule : c.scheduleFile, ")", c.tp > 1 ? str(" x TP=", c.tp, c.sp ? " with SP" : "") : std::string(),
                               c.sharding == "ddp" ? " x DDP over " : str(" x --sharding ", c.sharding, " over ").c_str(),
                               world / (c.pp * c.tp)).c_str()
                : c.tp > 1 ? str("TP=", c.tp, c.sp ? " with SP" : "",
                                 c.sharding == "ddp" ? " x DDP over " : str(" x --sharding ", c.sharding, " over ").c_str(),
                                 world / c.tp).c_str()
                : c.sharding == "ddp" ? "DDP" : str("--sharding ", c.sharding).c_str(),
                precision.c_str());
  }
  const dt::train::StepFunction step = [&](const dt::data::Batch& b) {
    const bool measure = c.bench && loop.step() == bench.firstMeasuredStep() && activationMib == 0;
    if (tpGroup != nullptr && loop.step() >= bench.firstMeasuredStep()) {
      tpLast = dt::tpCollectiveCounts(*tpGroup), tpTo = loop.step();
      if (!tpFirst) tpFirst = tpLast, tpFrom = tpTo;
    }
    const size_t before = measure ? dt::memoryStats().allocatedBytes : 0;
    // The loss's backward runs after this returns: each product's backward keeps the dtype its
    // forward chose, so the scope need not outlive the forward.
    const dt::autocast scope(dt::DType::BFloat16, bf16);
    dt::Tensor loss = model->nextTokenLoss(loop.forward(b.inputs), b.targets);
    if (measure) activationMib = static_cast<double>(dt::memoryStats().allocatedBytes - before) / (1 << 20);
    return dt::train::StepOutput{loss};
  };
  // --pp: the loop runs the pipeline itself (the last stage takes nn::Gpt's loss), on this
  // thread, so the scope covers its stages' forwards (the evaluation opts out of it).
  const dt::train::LoopResult r = [&] {
    const dt::autocast scope(dt::DType::BFloat16, bf16 && c.pp > 1);
    return loop.run(c.pp > 1 ? dt::train::StepFunction{} : step);
  }();
  // Its replica broke under --elastic: the loop said why; the other replicas finish the job.
  if (r.left) return 0;
  if (r.stopped) return 0;  // the loop said so, and wrote the checkpoint
  const int finalRank = loop.rank();  // under --elastic not the starting rank after a loss
  // The peak of the training, each the maximum over the ranks.
  dt::Tensor memory = dt::fromVector<double>({rssMib("VmHWM:"), fixedRss, activationMib, dt::memoryStats().peakAllocatedBytes / 1048576.0});
  loop.group().allreduce(memory, {.reduceOp = dt::ReduceOp::Max})->wait();
  const auto mem = memory.toVector<double>();
  const double valLoss = valueOf(r.evaluation, "val_loss");
  if (c.bench && finalRank == 0 && !bench.measured()) {
    std::fprintf(stderr, "gpt: --bench measured nothing: it needs more than --bench-warmup %lld steps\n", static_cast<long long>(c.benchWarmup));
  } else if (c.bench && finalRank == 0) {
    std::printf("RESULT gpt impl=dtrain world=%d global_batch=%lld model=%s steps=%lld step_ms=%.3f tokens_per_s=%.1f peak_rss_mb=%.1f "
                "val_loss_nats=%.5f precision=%s sharding=%s parameters=%lld fixed_rss_mb=%.1f activation_mb=%.1f peak_alloc_mb=%.1f blas=%s kernels=%s\n",
                world, static_cast<long long>(c.globalBatch), modelName(c.model).c_str(), static_cast<long long>(c.steps),
                1e3 * bench.seconds() / static_cast<double>(bench.steps()), static_cast<double>(bench.steps() * tokensPerStep) / bench.seconds(),
                mem[0], valLoss, precision.c_str(), c.sharding.c_str(), static_cast<long long>(c.model.parameterCount()), mem[1], mem[2], mem[3],
                dt::blasKernelName().c_str(), dt::matmulKernelName().c_str());
    if (tpGroup != nullptr && tpTo > tpFrom) {  // per step: counts, elements of the whole tensors, a ring's elements per rank
      const dt::TpCollectiveCounts d = tpLast - *tpFirst;
      const double n = static_cast<double>(tpTo - tpFrom);
      std::printf("RESULT gpt_tp impl=dtrain world=%d tp=%d sp=%d local_parameters=%lld steps_counted=%lld allreduces=%.1f "
                  "allgathers=%.1f reduce_scatters=%.1f elements=%.0f ring_elements_per_rank=%.0f\n",
                  world, c.tp, c.sp ? 1 : 0, static_cast<long long>(localParameters), static_cast<long long>(tpTo - tpFrom),
                  static_cast<double>(d.allReduces) / n, static_cast<double>(d.allGathers) / n,
                  static_cast<double>(d.reduceScatters) / n, static_cast<double>(d.elements) / n, d.ringElementsPerRank(c.tp) / n);
    }
  }
  const int code = examples::reportParameters(kProgram, loop, r, c.quiet);
  if (c.pp > 1 && loop.fullySharded() != nullptr && !c.quiet) {
    // The stages' wrapper gathers once a step for all the micro-batches (docs/parallel.md).
    const dt::FullyShardedDataParallel& w = *loop.fullySharded();
    std::printf("gpt: rank %d/%d sharded stages: %zu unit(s); last step %zu gather(s), %zu reduce-scatter(s) for %d micro-batches\n",
                finalRank, loop.worldSize(), w.unitNames().size(), w.lastIteration().gathers, w.lastIteration().reduceScatters,
                static_cast<int>(c.microBatches));
  }
  // fsdp: the whole model on every rank while rank 0 (its tp group under --tp) samples: no dp collective meanwhile.
  std::optional<dt::FullyShardedDataParallel::FullParametersGuard> whole;
  if (loop.fullySharded() != nullptr && c.sampleTokens > 0 && c.pp == 1) whole.emplace(loop.fullySharded()->gatherFullParameters());
  // --pp: every stage's parameters into each rank's whole model (a collective); the first pipeline
  // (its tp group under --tp) then samples as an unsplit model does.
  if (c.pp > 1 && c.sampleTokens > 0) loop.gatherPipelineModel();
  if (finalRank == 0) {
    const double rate = static_cast<double>((r.steps - r.firstStep) * tokensPerStep) / std::max(r.seconds, 1e-9);
    std::printf("gpt: done: %lld steps in %s, %.0f tokens/s; train loss %.4f; validation loss %.4f; precision=%s; peak RSS %.0f MiB per rank\n",
                static_cast<long long>(r.steps), examples::formatSeconds(r.elapsed).c_str(), r.steps > r.firstStep ? rate : 0.0, r.loss,
                valLoss, precision.c_str(), mem[0]);
  }
  // --tp: the ranks of rank 0's tensor-parallel group generate together (the layout gathers each
  // token's logits over tp), with the same draws; rank 0 prints.
  const bool samples = c.sampleTokens > 0 && (c.pp > 1   ? loop.mesh().coordinate("dp") == 0 && loop.mesh().coordinate("pp") == 0
                                              : c.tp == 1 ? finalRank == 0
                                                          : loop.mesh().coordinate("dp") == 0);
  if (samples) {
    dt::Generator sampleRng(c.seed + 7);
    model->eval();
    std::vector<int64_t> prompt;
    for (unsigned char ch : c.prompt) prompt.push_back(ch);  // byte tokens
    const auto text = model->generate(prompt, c.sampleTokens, {.temperature = c.temperature, .topK = c.topK}, sampleRng);
    if (finalRank == 0) {
      std::printf("gpt: sample (temperature %g, top-k %lld):\n%s\n", c.temperature, static_cast<long long>(c.topK),
                  std::string(text.begin(), text.end()).c_str());
    }
  }
  loop.group().barrier()->wait();
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::runMain(kProgram, [&] {
    Config config;
    return parseArgs(argc, argv, config) ? run(config) : 0;
  });
}
