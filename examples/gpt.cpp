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
// The training loop is the library's (train/loop.h, docs/train.md): this file is the data, the
// model, the optimizer, the validation loss and the output. Rank 0 prints a progress line every
// --log-every steps (loss, learning rate, gradient norm, tokens/s, elapsed, ETA) and the
// validation loss every --eval-every steps; --metrics FILE writes the same as one JSON object a
// line (scripts/plot_metrics.py draws it). At the end it prints a text sample generated from
// --prompt. From the loop: checkpoints of the model, the optimizer and every rank's dropout
// stream every --checkpoint-every steps, at the end and on SIGTERM/SIGUSR1/SIGINT; a restart
// resumes from the newest one, bitwise exactly (the windows of step s depend on the seed and s
// alone); under `dtrun --elastic` a lost rank costs no restart and replacements join.
// `gpt --help` lists the flags.
#include <unistd.h>

#include <chrono>
#include <cinttypes>
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
#include "examples/run_support.h"
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
at the next step, exit 0), in-place recovery under dtrun --elastic, and a generated sample at
the end.

data and model
  --data DIR              folder of fortune files (default /usr/share/games/fortunes, Debian's fortunes)
  --layers N --heads N --width N --context N
                          transformer size (default 4 layers, 4 heads, width 256, context 128)
  --dropout P             on embeddings, attention and residual branches (default 0)
  --activation-checkpointing  recompute each block's activations in backward instead of keeping them
training
  --steps N               optimizer steps (default 250)
  --global-batch G        sequences per step over all ranks (default 16; a multiple of the ranks)
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
// same set for every world size), rank r taking windows r, r + W, ...; sums allreduced. Through
// the loop's wrapper, which gathers what a sharded model needs (a collective).
double validationLoss(dt::train::Loop& loop, const dt::data::TextWindows& val, int64_t count) {
  dt::NoGradGuard noGrad;
  dt::ProcessGroup& group = loop.group();
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
    const dt::Tensor logits = loop.forward(b.inputs);
    const int64_t rows = logits.sizes()[0] * logits.sizes()[1];
    lossSum += dt::crossEntropy(logits.reshape({rows, logits.sizes()[2]}), b.targets.reshape({rows}),
                                {.reduction = dt::Reduction::Sum})
                   .item<double>();
    tokens += static_cast<double>(rows);
  }
  loop.model().train();
  dt::Tensor sums = dt::fromVector<double>({lossSum, tokens});
  group.allreduce(sums)->wait();
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
  const int64_t T = c.model.contextLength;
  auto train = std::make_shared<dt::data::TextWindows>(corpus.train, T, "train");
  const dt::data::TextWindows val(corpus.validation, T, "validation");
  dt::train::LoopOptions options{
      .program = kProgram, .steps = c.steps, .globalBatch = c.globalBatch, .microBatches = static_cast<int>(c.microBatches),
      .clipGradNorm = c.gradClip, .seed = c.seed, .replacement = true, .unit = "tokens", .unitsPerExample = T,
      .checkpointDir = c.checkpoints() ? c.checkpointDir : "", .checkpointEvery = c.checkpointEvery, .keep = c.keep,
      .resume = c.resume == "auto", .logEvery = c.logEvery, .quiet = c.quiet, .metricsFile = c.metrics,
      .evalEvery = c.evalEvery, .evalAtStart = c.evalEvery > 0};
  options.config = {{"model", modelName(c.model)},
                    {"dropout", examples::exactText(c.model.dropout)},
                    {"lr", examples::exactText(c.lr)},
                    {"min_lr", examples::exactText(c.minLr)},
                    {"warmup", std::to_string(c.warmup)},
                    {"weight_decay", examples::exactText(c.weightDecay)},
                    {"grad_clip", examples::exactText(c.gradClip)},
                    {"seed", std::to_string(c.seed)},
                    {"global_batch", std::to_string(c.globalBatch)},
                    {"micro_batches", std::to_string(c.microBatches)},
                    {"train_bytes", std::to_string(corpus.train.size())}};
  options.sharding = c.sharding == "ddp"     ? dt::train::Sharding::None
                     : c.sharding == "zero1" ? dt::train::Sharding::Zero1
                     : c.sharding == "zero2" ? dt::train::Sharding::Zero2
                                             : dt::train::Sharding::Full;
  options.hooks.onLog = [&](const dt::train::Progress& p) {
    if (c.quiet) return;
    const double valLoss = valueOf(p.metrics, "val_loss");
    if (p.step == 0) {
      std::printf("gpt: step 0 validation loss %.4f\n", valLoss);
      return;
    }
    char v[40] = "";
    if (!std::isnan(valLoss)) std::snprintf(v, sizeof(v), "  val loss %.4f", valLoss);
    std::printf("step %lld/%lld  loss %.4f%s  lr %.2e  grad norm %.3f  %.0f tokens/s  elapsed %s  ETA %s\n",
                static_cast<long long>(p.step), static_cast<long long>(p.steps), p.loss, v, p.lr, p.gradNorm, p.rate,
                examples::formatSeconds(p.elapsed).c_str(), examples::formatSeconds(p.left).c_str());
    std::fflush(stdout);
  };
  // --bench: the steps after the warm-up, the peak memory of training (not of building the
  // whole model before it was sharded), and what one forward keeps for backward.
  int64_t benchFrom = -1;
  std::optional<Clock::time_point> benchStart, benchEnd;
  double activationMib = 0;
  options.hooks.at = [&](int64_t step, dt::train::Phase phase) {
    if (!c.bench || phase != dt::train::Phase::Begin) return;
    if (benchFrom < 0) {
      benchFrom = step + c.benchWarmup;
      dt::emptyCpuCache();
      resetPeakRss();
      dt::resetPeakMemoryStats();
    }
    if (step == benchFrom) benchStart = Clock::now();
  };
  options.hooks.afterStep = [&](const dt::train::StepDone& done) {
    if (done.steps == c.steps) benchEnd = Clock::now();
  };

  dt::train::Loop loop(options);
  if (loop.jobFinished()) {
    loop.run({});  // says why there is nothing to do
    return 0;
  }
  const int rank = loop.rank(), world = loop.worldSize();
  if (!c.quiet) std::printf("gpt: rank %d/%d pid %d attempt %lld\n", rank, world, static_cast<int>(getpid()), static_cast<long long>(loop.restartCount() + 1));
  dt::Generator initRng, dropoutRng;
  initRng.manualSeed(c.seed);
  dropoutRng.manualSeed(c.seed * 0x9e3779b97f4a7c15ull + 1000 + static_cast<uint64_t>(rank));
  const double fixedRss = rssMib("VmRSS:");  // libraries, the corpus, the process group: before the model exists
  auto model = std::make_shared<dt::nn::Gpt>(c.model, initRng, &dropoutRng);
  if (!c.initOut.empty() && rank == 0) dt::saveSafetensors(c.initOut, model->stateDict());
  dt::FullyShardOptions sharded;
  for (const auto& [name, block] : model->h->namedChildren()) sharded.units.push_back(block);
  sharded.reshardAfterForward = c.sharding == "fsdp";
  loop.setModel(model, sharded);
  const dt::optim::WarmupCosineSchedule schedule(c.lr, c.warmup, c.steps, c.minLr);
  loop.setOptimizer(
      [&](dt::train::Loop& l) {
        return std::make_unique<dt::optim::AdamW>(l.paramGroups(dt::optim::decayGroups(*model, c.weightDecay)),
                                                  dt::optim::AdamWOptions{.lr = c.lr, .beta2 = 0.95});
      },
      [&](int64_t step) { return schedule.at(step); });
  loop.setData(train);
  loop.addState("rng", dropoutRng);
  loop.setEvaluation([&] { return std::vector<std::pair<std::string, double>>{{"val_loss", validationLoss(loop, val, c.evalWindows)}}; },
                     {"val_loss"});
  if (rank == 0 && !c.quiet) {
    std::printf("gpt: %d rank(s); %s: train %zu bytes (%lld fortunes), validation %zu bytes (%lld); GPT %s (%lld parameters, "
                "vocabulary 256 bytes); AdamW lr %g warm-up %lld cosine to %g, weight decay %g, clip %g; global batch %lld x "
                "%lld tokens (%lld per rank%s); %lld steps; %s\n",
                world, corpus.source.c_str(), corpus.train.size(), static_cast<long long>(corpus.trainDocuments),
                corpus.validation.size(), static_cast<long long>(corpus.validationDocuments), modelName(c.model).c_str(),
                static_cast<long long>(c.model.parameterCount()), c.lr, static_cast<long long>(c.warmup), c.minLr,
                c.weightDecay, c.gradClip, static_cast<long long>(c.globalBatch), static_cast<long long>(T),
                static_cast<long long>(c.globalBatch / world),
                c.microBatches > 1 ? str(" in ", c.microBatches, " micro-batches").c_str() : "", static_cast<long long>(c.steps),
                c.sharding == "ddp" ? "DDP" : str("--sharding ", c.sharding).c_str());
  }
  const dt::train::LoopResult r = loop.run([&](const dt::data::Batch& b) {
    const bool measure = c.bench && loop.step() == benchFrom && activationMib == 0;
    const size_t before = measure ? dt::memoryStats().allocatedBytes : 0;
    dt::Tensor loss = dt::nn::Gpt::loss(loop.forward(b.inputs), b.targets);
    if (measure) activationMib = static_cast<double>(dt::memoryStats().allocatedBytes - before) / (1 << 20);
    return dt::train::StepOutput{loss};
  });
  if (r.stopped) return 0;  // the loop said so, and wrote the checkpoint
  // The peak of the training, each over the ranks.
  dt::Tensor memory = dt::fromVector<double>(
      {peakRssMib(), fixedRss, activationMib, static_cast<double>(dt::memoryStats().peakAllocatedBytes) / (1 << 20)});
  loop.group().allreduce(memory, {.reduceOp = dt::ReduceOp::Max})->wait();
  const auto mem = memory.toVector<double>();
  const double valLoss = valueOf(r.evaluation, "val_loss");
  const int64_t tokensPerStep = c.globalBatch * T;
  if (c.bench && rank == 0) {
    if (!benchStart || !benchEnd) {
      std::fprintf(stderr, "gpt: --bench measured nothing: it needs more than --bench-warmup %lld steps\n",
                   static_cast<long long>(c.benchWarmup));
    } else {
      const double seconds = std::chrono::duration<double>(*benchEnd - *benchStart).count();
      const int64_t measured = c.steps - benchFrom;
      std::printf("RESULT gpt impl=dtrain world=%d global_batch=%lld model=%s steps=%lld step_ms=%.3f tokens_per_s=%.1f "
                  "peak_rss_mb=%.1f val_loss_nats=%.5f sharding=%s parameters=%lld fixed_rss_mb=%.1f activation_mb=%.1f "
                  "peak_alloc_mb=%.1f blas=%s\n",
                  world, static_cast<long long>(c.globalBatch), modelName(c.model).c_str(), static_cast<long long>(c.steps),
                  1e3 * seconds / static_cast<double>(measured), static_cast<double>(measured * tokensPerStep) / seconds,
                  mem[0], valLoss, c.sharding.c_str(), static_cast<long long>(c.model.parameterCount()), mem[1], mem[2],
                  mem[3], dt::blasKernelName().c_str());
    }
  }
  if (!c.quiet) {
    std::printf("gpt: rank %d/%d final parameters fingerprint %016" PRIx64 " (spread across ranks %.3g)\n", rank, world,
                r.fingerprint, r.parameterSpread);
  }
  // fsdp: the whole model on every rank while rank 0 samples alone (no collective meanwhile).
  std::optional<dt::FullyShardedDataParallel::FullParametersGuard> whole;
  if (loop.fullySharded() != nullptr && c.sampleTokens > 0) whole.emplace(loop.fullySharded()->gatherFullParameters());
  if (rank == 0) {
    const double rate = static_cast<double>((r.steps - r.firstStep) * tokensPerStep) / std::max(r.seconds, 1e-9);
    std::printf("gpt: done: %lld steps in %s, %.0f tokens/s; train loss %.4f; validation loss %.4f; peak RSS %.0f MiB per rank\n",
                static_cast<long long>(r.steps), examples::formatSeconds(r.elapsed).c_str(), r.steps > r.firstStep ? rate : 0.0,
                r.loss, valLoss, mem[0]);
    if (c.sampleTokens > 0) {
      dt::Generator sampleRng(c.seed + 7);
      model->eval();
      std::vector<int64_t> prompt;
      for (unsigned char ch : c.prompt) prompt.push_back(ch);
      const auto text = model->generate(prompt, c.sampleTokens, {.temperature = c.temperature, .topK = c.topK}, sampleRng);
      std::printf("gpt: sample (temperature %g, top-k %lld):\n%s\n", c.temperature, static_cast<long long>(c.topK),
                  tokensToText(text).c_str());
    }
  }
  loop.group().barrier()->wait();
  whole.reset();
  if (r.parameterSpread != 0.0) {
    std::fprintf(stderr, "gpt: rank %d/%d: parameters differ across ranks (max difference %g)\n", rank, world, r.parameterSpread);
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
    return run(config);
  });
}
