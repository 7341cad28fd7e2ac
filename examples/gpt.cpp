// gpt: a GPT-style language model trained on real English text, data-parallel, under
// `dtrun --nproc 4 build/examples/gpt`. The second workload next to examples/trainer:
//
//   data       Debian's fortunes (15k quotations, jokes, definitions and poems, 2.5 MB of
//              English): byte tokens, a deterministic train/validation split by document,
//              random context windows, each rank its share of every step's windows
//   model      tensor/nn/gpt.h: token + position embeddings, pre-norm transformer blocks
//              (causal self-attention with a fused QKV projection, GELU MLP), final LayerNorm,
//              output layer tied to the token embedding; GPT-2's initialisation
//   training   AdamW without weight decay on biases, norms and embeddings, linear warm-up then
//              cosine learning rate, global gradient-norm clipping, gradient accumulation over
//              micro-batches (noSync on all but the last), the gradients averaged by DDP, or
//              by ZeRO-1/2 on DDP's buckets, or by the fully sharded wrapper (--sharding)
//
// Rank 0 prints a progress line every --log-every steps (loss, learning rate, gradient norm,
// tokens/s, elapsed, ETA) and the validation loss every --eval-every steps; --metrics FILE
// writes the same as one JSON object a line (scripts/plot_metrics.py draws it). At the end it
// prints a text sample generated from --prompt. Checkpoints and resume work as the trainer's
// (checkpoint/checkpoint_dir.h): the ranks write model, optimizer and every rank's RNG state
// every --checkpoint-every steps, at the end and on SIGTERM/SIGUSR1/SIGINT; a restart resumes
// from the newest one, bitwise exactly (the windows of step s depend on the seed and s alone).
// `gpt --help` lists the flags.
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives/coalesce.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "data/text.h"
#include "ddp/ddp.h"
#include "ddp/zero.h"
#include "fsdp/fully_shard.h"
#include "examples/run_support.h"
#include "process_group/init.h"
#include "tensor/nn/clip_grad.h"
#include "tensor/memory_stats.h"
#include "tensor/nn/gpt.h"
#include "tensor/optim/optim.h"
#include "tensor/optim/schedule.h"
#include "tensor/parallel.h"
#include "tensor/storage.h"

namespace {

using dt::InvalidArgument;
using dt::str;
using Clock = std::chrono::steady_clock;
constexpr const char* kProgram = "gpt";

struct Config {
  std::string data = dt::data::kFortunesDir;
  dt::nn::GptConfig model{.vocabSize = 256, .contextLength = 128, .layers = 4, .heads = 4, .width = 256};
  int64_t steps = 250;
  int64_t globalBatch = 16;  // sequences per optimizer step, over all ranks and micro-batches
  int64_t microBatches = 1;  // per rank and step
  double lr = 2e-3;
  double minLr = 2e-4;
  int64_t warmup = 25;
  double weightDecay = 0.1;
  double gradClip = 1.0;
  uint64_t seed = 0;
  int64_t evalEvery = 50;
  int64_t evalWindows = 64;
  int64_t logEvery = 10;
  std::string metrics;
  std::string initOut;
  std::string checkpointDir = "gpt-checkpoints";
  int64_t checkpointEvery = 100;
  int keep = 3;
  std::string resume = "auto";
  std::string prompt = "The ";
  int64_t sampleTokens = 300;
  double temperature = 0.8;
  int64_t topK = 40;
  bool quiet = false;
  bool bench = false;
  int64_t benchWarmup = 5;
  // ddp, zero1, zero2 (ddp/zero.h), fsdp, fsdp-keep (fsdp/fully_shard.h; keep: no reshard after forward).
  std::string sharding = "ddp";
  bool checkpoints() const { return checkpointDir != "none"; }
  bool fullySharded() const { return sharding.starts_with("fsdp"); }
};

constexpr const char* kUsage = R"(usage: gpt [flags]          (run it under dtrun: dtrun --nproc 4 build/examples/gpt)

Data-parallel training of a GPT-style byte-level language model on Debian's fortunes, with
validation loss, checkpoints and exact resume, pre-emption (SIGTERM/SIGUSR1/SIGINT: checkpoint
at the next step, exit 0) and a generated sample at the end.

data and model
  --data DIR              folder of fortune files (default /usr/share/games/fortunes, Debian's fortunes)
  --layers N --heads N --width N --context N
                          transformer size (default 4 layers, 4 heads, width 256, context 128)
  --dropout P             on embeddings, attention and residual branches (default 0)
  --activation-checkpointing  recompute each block's activations in backward instead of keeping them
training
  --steps N               optimizer steps (default 250)
  --global-batch G        sequences per step over all ranks (default 16; a multiple of ranks x micro-batches)
  --micro-batches K       gradient accumulation: each rank runs K micro-batches per step (default 1)
  --lr LR --min-lr LR     peak and final learning rate of the cosine schedule (default 0.002, 0.0002)
  --warmup N              linear warm-up steps (default 25)
  --weight-decay WD       AdamW decay of the Linear weights (default 0.1; none on biases, norms, embeddings)
  --grad-clip C           clip the global gradient norm to C (default 1; 0: no clipping)
  --seed S                initialisation, windows and dropout (default 0)
  --sharding MODE         ddp: every rank holds everything (default); zero1/zero2: the optimizer state
                          (zero2: and the gradients between steps) split over the ranks on DDP's buckets;
                          fsdp: parameters, gradients and optimizer state split, one block gathered at a
                          time; fsdp-keep: fsdp that keeps each block gathered from its forward to its
                          backward. Checkpoints of any mode resume in any other, at any world size
evaluation and output
  --eval-every N          validation loss every N steps and at the end (default 50; 0: only at the end)
  --eval-windows N        validation windows (of the context length) per evaluation (default 64)
  --log-every N           progress line every N steps on rank 0 (default 10)
  --metrics FILE          one JSON line per logged step (rank 0); plot with scripts/plot_metrics.py FILE
  --init-out FILE         rank 0 writes the initial weights there (safetensors; the PyTorch peer's --init)
  --prompt TEXT --sample-tokens N --temperature T --top-k K
                          the sample printed at the end (default "The ", 300 tokens, 0.8, 40; 0 tokens: none)
  --quiet                 only the final lines (and errors)
  --bench                 print a RESULT line (tokens/s after --bench-warmup steps, default 5; peak RSS,
                          the RSS before the model was built, the activations of one forward)
checkpoints
  --checkpoint-dir DIR    (default gpt-checkpoints; none: no checkpoints)
  --checkpoint-every N    steps between checkpoints; one is also written at the end (default 100)
  --keep K                checkpoints kept (default 3)
  --resume auto|never     auto: continue from the newest checkpoint in DIR; never: delete them first
)";

Config parseArgs(int argc, char** argv, bool& help) {
  Config c;
  auto positive = [](const std::string& v, const std::string& f, int64_t minimum = 1) {
    return examples::parsePositive(kProgram, v, f, minimum);
  };
  auto real = [](const std::string& v, const std::string& f, double lo, double hi) {
    return examples::parseDouble(kProgram, v, f, lo, hi);
  };
  help = !examples::forEachFlag(kProgram, argc, argv, {"--quiet", "--bench", "--activation-checkpointing"},
                                [&](const std::string& flag, const std::string& v) {
    if (flag == "--quiet") c.quiet = true;
    else if (flag == "--bench") c.bench = true;
    else if (flag == "--activation-checkpointing") c.model.activationCheckpointing = true;
    else if (flag == "--sharding") c.sharding = examples::choice(kProgram, v, flag, {"ddp", "zero1", "zero2", "fsdp", "fsdp-keep"});
    else if (flag == "--data") c.data = v;
    else if (flag == "--layers") c.model.layers = positive(v, flag);
    else if (flag == "--heads") c.model.heads = positive(v, flag);
    else if (flag == "--width") c.model.width = positive(v, flag);
    else if (flag == "--context") c.model.contextLength = positive(v, flag);
    else if (flag == "--dropout") c.model.dropout = real(v, flag, 0.0, 0.9);
    else if (flag == "--steps") c.steps = positive(v, flag);
    else if (flag == "--global-batch") c.globalBatch = positive(v, flag);
    else if (flag == "--micro-batches") c.microBatches = positive(v, flag);
    else if (flag == "--lr") c.lr = real(v, flag, 0.0, 1.0);
    else if (flag == "--min-lr") c.minLr = real(v, flag, 0.0, 1.0);
    else if (flag == "--warmup") c.warmup = positive(v, flag, 0);
    else if (flag == "--weight-decay") c.weightDecay = real(v, flag, 0.0, 1.0);
    else if (flag == "--grad-clip") c.gradClip = real(v, flag, 0.0, 1e6);
    else if (flag == "--seed") c.seed = static_cast<uint64_t>(positive(v, flag, 0));
    else if (flag == "--eval-every") c.evalEvery = positive(v, flag, 0);
    else if (flag == "--eval-windows") c.evalWindows = positive(v, flag);
    else if (flag == "--log-every") c.logEvery = positive(v, flag);
    else if (flag == "--metrics") c.metrics = v;
    else if (flag == "--init-out") c.initOut = v;
    else if (flag == "--checkpoint-dir") c.checkpointDir = v;
    else if (flag == "--checkpoint-every") c.checkpointEvery = positive(v, flag, 0);
    else if (flag == "--keep") c.keep = static_cast<int>(positive(v, flag));
    else if (flag == "--resume") c.resume = examples::choice(kProgram, v, flag, {"auto", "never"});
    else if (flag == "--prompt") c.prompt = v;
    else if (flag == "--sample-tokens") c.sampleTokens = positive(v, flag, 0);
    else if (flag == "--temperature") c.temperature = real(v, flag, 0.0, 10.0);
    else if (flag == "--top-k") c.topK = positive(v, flag, 0);
    else if (flag == "--bench-warmup") c.benchWarmup = positive(v, flag, 0);
    else throw InvalidArgument(str("gpt: unknown flag ", flag, "; see --help"));
  });
  if (help) return c;
  c.model.validate();
  if (c.minLr > c.lr) throw InvalidArgument(str("gpt: --min-lr ", c.minLr, " is above --lr ", c.lr));
  if (c.warmup > c.steps) throw InvalidArgument(str("gpt: --warmup ", c.warmup, " is more than --steps ", c.steps));
  if (c.prompt.empty()) throw InvalidArgument("gpt: --prompt is empty (the sample needs at least one byte)");
  if (c.checkpointDir.empty()) throw InvalidArgument("gpt: --checkpoint-dir is empty (use none to write no checkpoints)");
  return c;
}

std::string modelName(const dt::nn::GptConfig& m) {
  return str("L", m.layers, "-H", m.heads, "-C", m.width, "-T", m.contextLength);
}

// The process's resident set, its peak (VmHWM) or now (VmRSS), in MiB; 0 where /proc is missing.
double rssMib(const char* key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.starts_with(key)) return std::strtod(line.c_str() + std::strlen(key), nullptr) / 1024.0;
  }
  return 0.0;
}
double peakRssMib() { return rssMib("VmHWM:"); }

// Starts VmHWM again from the current resident set (Linux's clear_refs "5"): --bench measures
// the peak of training, not that of building the whole model before it was sharded.
void resetPeakRss() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
}

// Byte tokens back to text (the vocabulary is the 256 byte values).
std::string tokensToText(const std::vector<int64_t>& tokens) {
  std::string out;
  for (int64_t t : tokens) out += static_cast<char>(t);
  return out;
}

// One evaluation's loss: the first `count` windows at stride T of the validation text (the
// same set for every world size), rank r taking windows r, r + W, ...; sums allreduced.
double validationLoss(dt::nn::Gpt& model, const dt::data::TextWindows& val, int64_t count, dt::ProcessGroup& group) {
  dt::NoGradGuard noGrad;
  const bool wasTraining = model.isTraining();
  model.eval();
  const int64_t stride = val.contextLength();
  const int64_t available = std::min<int64_t>(count, (val.size() + stride - 1) / stride);
  std::vector<int64_t> mine;
  for (int64_t w = group.rank(); w < available; w += group.size()) mine.push_back(w * stride);
  double lossSum = 0, tokens = 0;
  constexpr size_t kBatch = 16;
  for (size_t begin = 0; begin < mine.size(); begin += kBatch) {
    const size_t n = std::min(kBatch, mine.size() - begin);
    const dt::data::Batch b = val.get(std::span<const int64_t>(mine.data() + begin, n));
    const dt::Tensor logits = model(b.inputs);
    const int64_t rows = logits.sizes()[0] * logits.sizes()[1];
    lossSum += dt::crossEntropy(logits.reshape({rows, logits.sizes()[2]}), b.targets.reshape({rows}),
                                {.reduction = dt::Reduction::Sum})
                   .item<double>();
    tokens += static_cast<double>(rows);
  }
  model.train(wasTraining);
  dt::Tensor sums = dt::fromVector<double>({lossSum, tokens});
  group.allreduce(sums)->wait();
  const auto s = sums.toVector<double>();
  return s[0] / s[1];
}

class GptJob {
 public:
  GptJob(Config config, std::shared_ptr<dt::ProcessGroup> group)
      : c_(std::move(config)), group_(std::move(group)), rank_(group_->rank()), world_(group_->size()) {}
  int run();

 private:
  void say(const std::string& line) const {
    if (rank_ == 0 && !c_.quiet) std::printf("%s\n", line.c_str());
  }
  std::vector<std::pair<std::string, std::string>> resumeKeys() const;
  void resumeOrStart();
  dt::TrainingState trainingState();
  void saveCheckpoint(int64_t step, const std::string& reason);
  void settleBuckets(int64_t microBatch);
  // The model wrapped as --sharding says, and its optimizer on what this rank updates.
  void wrapModel();
  dt::Tensor forward(const dt::Tensor& tokens);
  double clipGradients();
  // The whole parameters on every rank (a collective for fsdp; zero: gathered first).
  std::vector<dt::Tensor> wholeParameters();

  Config c_;
  std::shared_ptr<dt::ProcessGroup> group_;
  int rank_;
  int world_;
  int64_t restartCount_ = 0;
  std::shared_ptr<dt::data::TextWindows> train_, val_;
  dt::Generator initRng_, dropoutRng_;
  std::shared_ptr<dt::nn::Gpt> model_;
  std::shared_ptr<dt::DistributedDataParallel> ddp_;
  std::unique_ptr<dt::ZeroRedundancy> zero_;
  std::unique_ptr<dt::FullyShardedDataParallel> fsdp_;
  std::unique_ptr<dt::optim::AdamW> optimizer_;
  std::optional<dt::CheckpointDir> checkpoints_;
  int64_t startStep_ = 0;
  double priorSeconds_ = 0;
  double recentLoss_ = 0;
  double runSeconds_ = 0;
  std::optional<double> lastValLoss_;
};

std::vector<std::pair<std::string, std::string>> GptJob::resumeKeys() const {
  return {{"model", modelName(c_.model)},
          {"dropout", examples::exactText(c_.model.dropout)},
          {"lr", examples::exactText(c_.lr)},
          {"min_lr", examples::exactText(c_.minLr)},
          {"warmup", std::to_string(c_.warmup)},
          {"weight_decay", examples::exactText(c_.weightDecay)},
          {"grad_clip", examples::exactText(c_.gradClip)},
          {"seed", std::to_string(c_.seed)},
          {"global_batch", std::to_string(c_.globalBatch)},
          {"micro_batches", std::to_string(c_.microBatches)},
          {"train_bytes", std::to_string(train_->text().size())}};
}

dt::TrainingState GptJob::trainingState() {
  dt::TrainingState state(rank_, world_);
  if (fsdp_) {
    state.add("model", fsdp_->modelState()).addOptimizer("optim", *optimizer_, fsdp_->parameterMap());
  } else if (zero_) {
    state.add("model", zero_->modelState()).addOptimizer("optim", *optimizer_, zero_->parameterMap());
  } else {
    state.addModule("model", *model_).addOptimizer("optim", *optimizer_, dt::ParameterMap::replicated(*model_));
  }
  state.addGenerator("rng", dropoutRng_);
  return state;
}

void GptJob::wrapModel() {
  const auto groups = dt::optim::decayGroups(*model_, c_.weightDecay);
  const dt::optim::AdamWOptions adamw{.lr = c_.lr, .beta2 = 0.95};
  if (c_.fullySharded()) {
    dt::FullyShardOptions options;
    for (const auto& [name, block] : model_->h->namedChildren()) options.units.push_back(block);
    options.reshardAfterForward = c_.sharding == "fsdp";
    fsdp_ = std::make_unique<dt::FullyShardedDataParallel>(model_, group_, options);
    optimizer_ = std::make_unique<dt::optim::AdamW>(fsdp_->paramGroups(groups), adamw);
    return;
  }
  ddp_ = std::make_shared<dt::DistributedDataParallel>(model_, group_);
  if (c_.sharding == "ddp") {
    optimizer_ = std::make_unique<dt::optim::AdamW>(groups, adamw);
  } else {
    zero_ = std::make_unique<dt::ZeroRedundancy>(*ddp_, dt::ZeroOptions{.stage = c_.sharding == "zero1" ? 1 : 2});
    optimizer_ = std::make_unique<dt::optim::AdamW>(zero_->paramGroups(groups), adamw);
  }
}

dt::Tensor GptJob::forward(const dt::Tensor& tokens) { return fsdp_ ? (*fsdp_)(tokens) : (*ddp_)(tokens); }

double GptJob::clipGradients() {
  const double maxNorm = c_.gradClip > 0 ? c_.gradClip : std::numeric_limits<double>::max();
  if (fsdp_) return dt::nn::clipGradNorm(fsdp_->parameters(), maxNorm, {.reducePartial = fsdp_->gradNormReducer()});
  if (zero_) return dt::nn::clipGradNorm(zero_->parameters(), maxNorm, {.reducePartial = zero_->gradNormReducer()});
  return dt::nn::clipGradNorm(model_->parameters(), maxNorm);
}

std::vector<dt::Tensor> GptJob::wholeParameters() {
  std::vector<dt::Tensor> out;
  if (fsdp_) {
    const auto full = fsdp_->gatherFullParameters();
    for (const dt::Tensor& p : model_->parameters()) out.push_back(p.detach().clone());
    return out;
  }
  if (zero_) zero_->synchronize();
  return model_->parameters();
}

void GptJob::resumeOrStart() {
  if (!checkpoints_) return;
  if (c_.resume == "never" && restartCount_ == 0) {
    examples::clearCheckpoints(*group_, *checkpoints_, kProgram, c_.quiet);
    return;
  }
  const std::optional<dt::CheckpointRef> ref = checkpoints_->latestAgreed(*group_);
  if (!ref) return;
  checkpoints_->readManifest(*ref).requireSame(
      resumeKeys(), "config.", "Resume with the same settings, or start afresh with --resume never or another --checkpoint-dir");
  dt::TrainingState state = trainingState();
  const dt::CheckpointManifest m = checkpoints_->load(*ref, state, group_.get());
  if (m.worldSize != world_ && c_.model.dropout > 0) {
    say(str("gpt: note: checkpoint written by ", m.worldSize, " ranks, resumed by ", world_,
            ": the per-rank dropout streams restart from the seed, so this resume is not bitwise exact"));
  }
  startStep_ = state.step;
  priorSeconds_ = static_cast<double>(m.integer("train_ms")) / 1000.0;
  recentLoss_ = std::strtod(m.text("train_loss").c_str(), nullptr);
  say(str("gpt: resumed from ", ref->manifest.string(), " (step ", startStep_, ", written by ", m.worldSize, " rank(s), ",
          m.text("reason"), ")", restartCount_ > 0 ? str(" after restart ", restartCount_) : ""));
}

void GptJob::saveCheckpoint(int64_t step, const std::string& reason) {
  dt::TrainingState state = trainingState();
  state.step = step;
  auto& m = state.metadata;
  m["total_steps"] = std::to_string(c_.steps);
  m["tokens_seen"] = std::to_string(step * c_.globalBatch * c_.model.contextLength);
  m["train_ms"] = std::to_string(static_cast<int64_t>((priorSeconds_ + runSeconds_) * 1000.0));
  m["reason"] = reason;
  m["train_loss"] = str(recentLoss_);
  for (const auto& [key, value] : resumeKeys()) m["config." + key] = value;
  const dt::CheckpointRef ref = checkpoints_->save(state, group_.get());
  say(str("gpt: checkpoint at step ", step, " (", reason, ") written to ", ref.tensors.string()));
}

// DDP rebuilds its buckets after the first iteration (docs/ddp.md); one throwaway iteration,
// in eval mode (no dropout draws) and with no optimizer step, makes every real step of a
// fresh and of a resumed run use the same bucket layout, so resume stays bitwise exact (and
// ZeRO's parts are placed on the final layout before the first step).
void GptJob::settleBuckets(int64_t microBatch) {
  if (!ddp_) return;  // the sharded wrapper has no buckets to settle
  model_->eval();
  const dt::Tensor tokens = dt::zeros({microBatch, c_.model.contextLength}, dt::DType::Int64);
  dt::nn::Gpt::loss((*ddp_)(tokens), tokens).backward();
  optimizer_->zeroGrad();
  model_->train();
}

int GptJob::run() {
  restartCount_ = dt::env::getInt("DT_RESTART_COUNT");
  if (c_.globalBatch % (world_ * c_.microBatches) != 0) {
    throw InvalidArgument(str("gpt: --global-batch ", c_.globalBatch, " is not divisible by ", world_, " rank(s) x ",
                              c_.microBatches, " micro-batch(es); use a multiple of ", world_ * c_.microBatches));
  }
  const int64_t perRank = c_.globalBatch / world_;
  const int64_t microBatch = perRank / c_.microBatches;
  const int64_t T = c_.model.contextLength;
  if (!c_.quiet) std::printf("gpt: rank %d/%d pid %d attempt %lld\n", rank_, world_, static_cast<int>(getpid()), static_cast<long long>(restartCount_ + 1));

  const dt::data::TextSplit corpus = dt::data::loadFortunes(c_.data);
  train_ = std::make_shared<dt::data::TextWindows>(corpus.train, T, "train");
  val_ = std::make_shared<dt::data::TextWindows>(corpus.validation, T, "validation");
  const dt::data::RandomWindowSampler sampler(train_->size(), world_, rank_, {.batchSize = perRank, .seed = c_.seed});

  initRng_.manualSeed(c_.seed);
  dropoutRng_.manualSeed(c_.seed * 0x9e3779b97f4a7c15ull + 1000 + static_cast<uint64_t>(rank_));
  // The runtime's own memory (libraries, the corpus, the process group) before the model exists.
  const double fixedRss = rssMib("VmRSS:");
  model_ = std::make_shared<dt::nn::Gpt>(c_.model, initRng_, &dropoutRng_);
  if (!c_.initOut.empty() && rank_ == 0) dt::saveSafetensors(c_.initOut, model_->stateDict());
  wrapModel();
  settleBuckets(microBatch);
  if (c_.bench) {
    // The whole model each rank built before sharding it: freed, and left out of the peak.
    dt::emptyCpuCache();
    resetPeakRss();
    dt::resetPeakMemoryStats();
  }
  const dt::optim::WarmupCosineSchedule schedule(c_.lr, c_.warmup, c_.steps, c_.minLr);
  if (c_.checkpoints()) checkpoints_.emplace(c_.checkpointDir, c_.keep);
  resumeOrStart();
  if (checkpoints_ && rank_ == 0) checkpoints_->removeTemporaries();
  say(str("gpt: ", world_, " rank(s); ", corpus.source, ": train ", corpus.train.size(), " bytes (", corpus.trainDocuments,
          " fortunes), validation ", corpus.validation.size(), " bytes (", corpus.validationDocuments, "); GPT ",
          modelName(c_.model), " (", c_.model.parameterCount(), " parameters, vocabulary 256 bytes); AdamW lr ", c_.lr,
          " warm-up ", c_.warmup, " cosine to ", c_.minLr, ", weight decay ", c_.weightDecay, ", clip ", c_.gradClip,
          "; global batch ", c_.globalBatch, " x ", T, " tokens (", perRank, " per rank", c_.microBatches > 1 ? str(" in ", c_.microBatches, " micro-batches") : "",
          "); ", c_.steps, " steps; ", c_.sharding == "ddp" ? std::string("DDP") : str("--sharding ", c_.sharding)));
  std::optional<dt::train::MetricsFile> metrics;
  if (rank_ == 0 && !c_.metrics.empty()) metrics.emplace(c_.metrics, startStep_, kProgram);
  // A value that is not known (the loss before any step, a step without evaluation) is null.
  auto writeMetrics = [&](int64_t at, double loss, std::optional<double> val, double lr, double norm, double rate, double elapsed) {
    if (metrics) {
      metrics->write(at, {{"loss", loss}, {"val_loss", val.value_or(std::nan(""))}, {"lr", lr}, {"grad_norm", norm},
                          {"tokens_per_s", rate}, {"elapsed_s", elapsed}});
    }
  };

  dt::Tensor control = dt::zeros({2}, dt::DType::Float64);  // {stop requested, previous step's loss}, summed
  const int64_t tokensPerStep = c_.globalBatch * T;
  double lastLoss = 0, windowLoss = 0;
  int64_t windowLosses = 0, step = startStep_;
  int stopSignal = 0;
  const Clock::time_point loopStart = Clock::now();
  Clock::time_point windowStart = loopStart;
  int64_t windowStartStep = step;
  std::optional<Clock::time_point> benchStart;
  const int64_t benchFrom = startStep_ + c_.benchWarmup;
  double gradNorm = 0;
  double activationMib = 0;  // --bench: what one forward keeps for backward (allocator bytes)

  if (step == 0 && c_.evalEvery > 0) {
    // Where the curve starts: the untrained model's validation loss (about ln 256 = 5.55).
    lastValLoss_ = validationLoss(*model_, *val_, c_.evalWindows, *group_);
    writeMetrics(0, std::nan(""), lastValLoss_, schedule.at(0), 0.0, 0.0, 0.0);
    say(str("gpt: step 0 validation loss ", *lastValLoss_));
  }
  while (step < c_.steps) {
    if (c_.bench && step == benchFrom) benchStart = Clock::now();
    double* ctl = control.data<double>();
    ctl[0] = examples::stopSignal().load() != 0 ? 1.0 : 0.0;
    ctl[1] = lastLoss;
    dt::WorkPtr controlWork = group_->allreduce(control);

    optimizer_->setLr(schedule.at(step));
    optimizer_->zeroGrad();
    const std::vector<int64_t> windows = sampler.batchIndices(step);
    double stepLoss = 0;
    for (int64_t micro = 0; micro < c_.microBatches; ++micro) {
      const dt::data::Batch b = train_->get(std::span<const int64_t>(windows.data() + micro * microBatch, static_cast<size_t>(microBatch)));
      // All but the last micro-batch accumulate locally; the last one's backward reduces the sum.
      std::optional<dt::DistributedDataParallel::NoSyncGuard> noSync;
      std::optional<dt::FullyShardedDataParallel::NoSyncGuard> shardedNoSync;
      if (micro + 1 < c_.microBatches) {
        if (fsdp_) shardedNoSync.emplace(fsdp_->noSync());
        else noSync.emplace(ddp_->noSync());
      }
      const size_t before = c_.bench ? dt::memoryStats().allocatedBytes : 0;
      dt::Tensor loss = dt::nn::Gpt::loss(forward(b.inputs), b.targets);
      if (c_.bench && step == benchFrom && micro == 0) {
        activationMib = static_cast<double>(dt::memoryStats().allocatedBytes - before) / (1 << 20);
      }
      stepLoss += loss.item<float>() / static_cast<double>(c_.microBatches);
      dt::mul(loss, 1.0 / static_cast<double>(c_.microBatches)).backward();
    }
    gradNorm = clipGradients();
    optimizer_->step();
    if (zero_) zero_->gatherParameters();  // on the wire while the next step begins
    lastLoss = stepLoss;
    controlWork->wait();
    ++step;
    runSeconds_ = std::chrono::duration<double>(Clock::now() - loopStart).count();
    if (step > startStep_ + 1) {  // the reduced loss is the previous step's
      windowLoss += control.data<double>()[1] / world_;
      ++windowLosses;
    }
    const bool stop = control.data<double>()[0] > 0;
    if (stop) {
      stopSignal = examples::stopSignal().load();
      break;
    }
    const bool evalNow = step == c_.steps || (c_.evalEvery > 0 && step % c_.evalEvery == 0);
    std::optional<double> valLoss;
    if (evalNow) {
      valLoss = validationLoss(*model_, *val_, c_.evalWindows, *group_);
      lastValLoss_ = valLoss;
    }
    if (step % c_.logEvery == 0 || step == c_.steps || evalNow) {
      recentLoss_ = windowLosses > 0 ? windowLoss / static_cast<double>(windowLosses) : lastLoss;
      const double now = std::chrono::duration<double>(Clock::now() - windowStart).count();
      const double rate = static_cast<double>((step - windowStartStep) * tokensPerStep) / std::max(now, 1e-9);
      const double perStep = runSeconds_ / static_cast<double>(step - startStep_);
      const double lr = schedule.at(step - 1);
      if (rank_ == 0) {
        writeMetrics(step, recentLoss_, valLoss, lr, gradNorm, rate, priorSeconds_ + runSeconds_);
        if (!c_.quiet) {
          char val[40] = "";
          if (valLoss) std::snprintf(val, sizeof(val), "  val loss %.4f", *valLoss);
          std::printf("step %lld/%lld  loss %.4f%s  lr %.2e  grad norm %.3f  %.0f tokens/s  elapsed %s  ETA %s\n",
                      static_cast<long long>(step), static_cast<long long>(c_.steps), recentLoss_, val, lr, gradNorm,
                      rate, examples::formatSeconds(priorSeconds_ + runSeconds_).c_str(),
                      examples::formatSeconds(perStep * static_cast<double>(c_.steps - step)).c_str());
        }
      }
      windowLoss = 0;
      windowLosses = 0;
      windowStart = Clock::now();
      windowStartStep = step;
    }
    if (checkpoints_ && c_.checkpointEvery > 0 && step % c_.checkpointEvery == 0 && step < c_.steps) {
      saveCheckpoint(step, "periodic");
    }
  }
  const double trainSeconds = runSeconds_;
  const Clock::time_point loopEnd = Clock::now();
  if (step < c_.steps) {
    const std::string why = stopSignal != 0 ? examples::signalName(stopSignal) : "a stop request on another rank";
    if (checkpoints_) saveCheckpoint(step, str("stopped by ", why));
    group_->barrier()->wait();
    say(str("gpt: stopped by ", why, " after step ", step, " of ", c_.steps,
            checkpoints_ ? str("; checkpoint written, run again to resume from step ", step) : std::string("; no checkpoint")));
    group_->destroy();
    return 0;
  }
  // The peak of the training (before fsdp gathers the whole model below); each over the ranks.
  dt::Tensor memory = dt::fromVector<double>(
      {peakRssMib(), fixedRss, activationMib, static_cast<double>(dt::memoryStats().peakAllocatedBytes) / (1 << 20)});
  group_->allreduce(memory, {.reduceOp = dt::ReduceOp::Max})->wait();
  const auto mem = memory.toVector<double>();
  dt::Tensor rss = dt::fromVector<double>({mem[0]});
  if (checkpoints_ && step > startStep_) saveCheckpoint(step, "final");
  if (!lastValLoss_) lastValLoss_ = validationLoss(*model_, *val_, c_.evalWindows, *group_);

  // Identical parameters everywhere: max and min over ranks must agree.
  const std::vector<dt::Tensor> params = wholeParameters();
  const double spread = examples::parameterSpread(*group_, params);

  if (c_.bench && rank_ == 0) {
    if (!benchStart) {
      std::fprintf(stderr, "gpt: --bench measured nothing: it needs more than --bench-warmup %lld steps\n",
                   static_cast<long long>(c_.benchWarmup));
    } else {
      const double seconds = std::chrono::duration<double>(loopEnd - *benchStart).count();
      const int64_t measured = step - benchFrom;
      std::printf("RESULT gpt impl=dtrain world=%d global_batch=%lld model=%s steps=%lld step_ms=%.3f tokens_per_s=%.1f "
                  "peak_rss_mb=%.1f val_loss_nats=%.5f sharding=%s parameters=%lld fixed_rss_mb=%.1f activation_mb=%.1f "
                  "peak_alloc_mb=%.1f blas=%s\n",
                  world_, static_cast<long long>(c_.globalBatch), modelName(c_.model).c_str(), static_cast<long long>(c_.steps),
                  1e3 * seconds / static_cast<double>(measured), static_cast<double>(measured * tokensPerStep) / seconds,
                  mem[0], *lastValLoss_, c_.sharding.c_str(), static_cast<long long>(c_.model.parameterCount()), mem[1],
                  mem[2], mem[3], dt::blasKernelName().c_str());
    }
  }
  if (!c_.quiet) {
    std::printf("gpt: rank %d/%d final parameters fingerprint %016" PRIx64 " (spread across ranks %.3g)\n", rank_, world_,
                examples::fingerprint(params), spread);
  }
  // fsdp: the whole model on every rank while rank 0 samples alone (no collective meanwhile).
  std::optional<dt::FullyShardedDataParallel::FullParametersGuard> whole;
  if (fsdp_ && c_.sampleTokens > 0) whole.emplace(fsdp_->gatherFullParameters());
  if (rank_ == 0) {
    const double rate = static_cast<double>((step - startStep_) * tokensPerStep) / std::max(trainSeconds, 1e-9);
    std::printf("gpt: done: %lld steps in %s, %.0f tokens/s; train loss %.4f; validation loss %.4f; peak RSS %.0f MiB per rank\n",
                static_cast<long long>(step), examples::formatSeconds(priorSeconds_ + trainSeconds).c_str(),
                step > startStep_ ? rate : 0.0, recentLoss_, *lastValLoss_, rss.item<double>());
    if (c_.sampleTokens > 0) {
      dt::Generator sampleRng(c_.seed + 7);
      model_->eval();
      std::vector<int64_t> prompt;
      for (unsigned char ch : c_.prompt) prompt.push_back(ch);
      const auto text = model_->generate(prompt, c_.sampleTokens, {.temperature = c_.temperature, .topK = c_.topK}, sampleRng);
      std::printf("gpt: sample (temperature %g, top-k %lld):\n%s\n", c_.temperature, static_cast<long long>(c_.topK),
                  tokensToText(text).c_str());
    }
  }
  group_->barrier()->wait();
  whole.reset();
  group_->destroy();
  if (spread != 0.0) {
    std::fprintf(stderr, "gpt: rank %d/%d: parameters differ across ranks (max difference %g)\n", rank_, world_, spread);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::runMain(kProgram, [&] {
    bool help = false;
    const Config config = parseArgs(argc, argv, help);
    if (help) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    examples::installStopHandlers(kProgram);
    auto group = dt::initProcessGroup();
    GptJob job(config, group);
    return job.run();
  });
}
