// trainer: data-parallel training on Fashion-MNIST, the program README's main command runs
// under `dtrun --nproc 4 ./trainer`: an MLP (784-256-128-10, ReLU) with AdamW or SGD on the
// training loop library (train/loop.h, docs/train.md), which brings the rest: DDP, the data
// split per rank and prefetched, checkpoints every --checkpoint-every steps with an exact resume
// (bitwise, same seed and world size), pre-emption (SIGTERM, SIGUSR1 or SIGINT: checkpoint at the
// next step boundary, exit 0), progress lines, and under dtrun --elastic in-place recovery and
// replacements that join the running job. A final line ends in "test accuracy 0.8912"; every
// rank prints the fingerprint of its final parameters, which must be identical.
// `trainer --help` lists the flags and their defaults.
#include <cmath>
#include <cstdio>
#include <numbers>
#include <optional>
#include <string>
#include <unistd.h>
#include <vector>

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "data/dataset.h"
#include "data/sampler.h"
#include "examples/run_support.h"
#include "process_group/init.h"
#include "tensor/autocast.h"
#include "tensor/autograd/autograd.h"
#include "tensor/generator.h"
#include "tensor/nn/module.h"
#include "tensor/ops.h"
#include "tensor/optim/optim.h"
#include "train/loop.h"

namespace {

using dt::InvalidArgument;
using dt::str;

struct Config {
  std::string data = dt::data::kFashionMnistDir;
  int64_t epochs = 10, steps = 0, globalBatch = 128;  // steps 0: epochs x batches per epoch
  std::vector<int64_t> hidden = {256, 128};
  std::string optimizer = "adamw", schedule = "cosine";
  std::optional<double> lr, weightDecay;  // adamw 1e-3 and 1e-4, sgd 0.05 and 0
  double momentum = 0.9, dropout = 0.0;
  uint64_t seed = 0;
  bool dropLast = false, quiet = false, eval = true, bench = false;
  bool elastic = false;  // dtrun --elastic (DT_ELASTIC) or --elastic
  int prefetch = 8, keep = 3;
  int64_t logEvery = 100, checkpointEvery = 500, benchWarmup = 20;
  std::string checkpointDir = "trainer-checkpoints", resume = "auto", device = "cpu";
  std::string precision = "fp32";  // bf16: the forward's Linear layers under dt::autocast
  examples::TestFlags test;

  double learningRate() const { return lr.value_or(optimizer == "sgd" ? 0.05 : 1e-3); }
  double decay() const { return weightDecay.value_or(optimizer == "sgd" ? 0.0 : 1e-4); }
};

// Every flag, bound to its place in `c`; false at --help (printed).
bool parseArgs(int argc, char** argv, Config& c) {
  c.elastic = dt::env::getBool("DT_ELASTIC");
  examples::Flags flags("trainer", R"(usage: trainer [flags]          (run it under dtrun: dtrun --nproc 4 ./trainer)

Data-parallel training of an MLP on Fashion-MNIST with checkpoints, exact resume and
pre-emption (SIGTERM/SIGUSR1/SIGINT: checkpoint at the next step, exit 0; a second such
signal ends the process at once).

)");
  flags.section("data and model")
      .add("--data", c.data, "DIR", "folder with the four gzip'd IDX files (where Debian's\ndataset-fashion-mnist package puts them)")
      .add("--hidden", "H1,H2,...", "hidden layer sizes of the MLP 784-H1-...-10 (default 256,128)",
           [&](const std::string& v) {
             c.hidden.clear();
             for (const auto& part : dt::split(v, ',')) c.hidden.push_back(examples::parsePositive("trainer", std::string(part), "--hidden"));
           })
      .add("--dropout", c.dropout, "P", "dropout after each hidden layer", 0.0, 0.95)
      .add("--device", "cpu|cuda|cuda:N", "(default cpu; cuda: each rank takes GPU LOCAL_RANK mod the GPU count)",
           [&](const std::string& v) { c.device = examples::deviceName("trainer", v, "--device"); });
  flags.section("training")
      .add("--epochs", c.epochs, "E", "passes over the training set")
      .add("--steps", c.steps, "N", "total steps instead of epochs (0: use --epochs)", 0)
      .add("--global-batch", c.globalBatch, "G", "examples per step over all ranks; each rank takes G / world")
      .add("--optimizer", c.optimizer, "", "", {"adamw", "sgd"})
      .add("--lr", c.lr, "LR", "(default 0.001 for adamw, 0.05 for sgd)", 0.0, 10.0)
      .add("--weight-decay", c.weightDecay, "WD", "(default 0.0001 for adamw, 0 for sgd)", 0.0, 1.0)
      .add("--momentum", c.momentum, "M", "sgd momentum", 0.0, 0.999)
      .add("--schedule", c.schedule, "", "learning rate over the steps", {"cosine", "constant"})
      .add("--seed", c.seed, "S", "model initialisation, shuffling and dropout")
      .add("--precision", c.precision, "P",
           "bf16: the Linear layers of each forward and its backward in bf16 (fp32\naccumulation, dt::autocast; "
           "--device cpu); weights, optimizer and loss stay fp32",
           {"fp32", "bf16"})
      .add("--drop-last", c.dropLast, "drop the short last batch of each epoch (default: pad it)")
      .add("--prefetch", c.prefetch, "K", "batches the loader thread prepares ahead");
  flags.section("checkpoints")
      .add("--checkpoint-dir", c.checkpointDir, "DIR", "none: no checkpoints")
      .add("--checkpoint-every", c.checkpointEvery, "N", "steps between checkpoints; one is also written at the end", 0)
      .add("--keep", c.keep, "K", "checkpoints kept")
      .add("--resume", c.resume, "auto|never",
           "auto: continue from the newest checkpoint in DIR if there is one;\nnever: delete DIR's checkpoints and start afresh (after a "
           "restart by\ndtrun, DT_RESTART_COUNT > 0, the newest checkpoint is always used)",
           {"auto", "never"});
  flags.section("output")
      .add("--log-every", c.logEvery, "N", "progress line every N steps on rank 0")
      .add("--quiet", c.quiet, "only the final line (and errors)")
      .add("--no-eval", c.eval, "skip the test-set evaluation at the end", false)
      .add("--bench", c.bench, "print a RESULT line with samples/s (after --bench-warmup steps)")
      .add("--bench-warmup", c.benchWarmup, "N", "steps --bench leaves out", 0);
  flags.section("elastic (docs/elastic.md)")
      .add("--elastic", c.elastic,
           "a rank that dies is left behind and the others go on in place from the same\nstep, with the same global batch (default: on "
           "when dtrun --elastic started it);\na replacement (dtrun --max-restarts) is admitted at the next step boundary and\nreceives "
           "the whole training state from the members, no checkpoint read")
      .alsoAccept([&](const std::string& flag, const std::string& v) { return c.test.parse("trainer", flag, v); }, {"--measure-transfer"},
                  examples::TestFlags::kUsage);
  if (!flags.parse(argc, argv)) return false;
  if (c.checkpointDir.empty()) throw InvalidArgument("trainer: --checkpoint-dir is empty (use none to write no checkpoints)");
  if (c.checkpointDir == "none") c.checkpointDir.clear();
  // autocast covers CPU products only: on CUDA the flag would silently change nothing.
  if (c.precision == "bf16" && c.device != "cpu") {
    throw InvalidArgument(str("trainer: --precision bf16 runs on --device cpu only (got --device ", c.device, ")"));
  }
  return true;
}

// ---- helpers ------------------------------------------------------------------------------------------------------

std::string modelName(int64_t inputs, const std::vector<int64_t>& hidden, int64_t classes) {
  std::vector<int64_t> sizes{inputs};
  sizes.insert(sizes.end(), hidden.begin(), hidden.end());
  sizes.push_back(classes);
  return dt::join(sizes, "-");
}

std::string exact(double v) { return examples::exactText(v); }

std::shared_ptr<dt::nn::Sequential> buildModel(const Config& c, int64_t inputs, int64_t classes, dt::Generator& init,
                                               dt::Generator& dropoutRng) {
  auto model = std::make_shared<dt::nn::Sequential>();
  int64_t width = inputs;
  for (int64_t h : c.hidden) {
    model->pushBack(std::make_shared<dt::nn::Linear>(width, h, true, init));
    model->pushBack(std::make_shared<dt::nn::ReLU>());
    if (c.dropout > 0) model->pushBack(std::make_shared<dt::nn::Dropout>(c.dropout, dropoutRng));
    width = h;
  }
  model->pushBack(std::make_shared<dt::nn::Linear>(width, classes, true, init));
  return model;
}

// The settings a checkpoint must share with the run that resumes it (config.* in the manifest).
std::vector<std::pair<std::string, std::string>> resumeKeys(const Config& c, const std::string& model, int64_t trainSize) {
  return {{"model", model}, {"dropout", exact(c.dropout)}, {"optimizer", c.optimizer}, {"lr", exact(c.learningRate())},
          {"weight_decay", exact(c.decay())}, {"momentum", c.optimizer == "sgd" ? exact(c.momentum) : "-"}, {"schedule", c.schedule},
          {"seed", std::to_string(c.seed)}, {"global_batch", std::to_string(c.globalBatch)}, {"drop_last", c.dropLast ? "yes" : "no"},
          {"train_examples", std::to_string(trainSize)}};
}

// Every rank evaluates its share of the test set (examples r, r + W, ...); sums are allreduced.
std::vector<std::pair<std::string, double>> evaluate(dt::nn::Module& model, const dt::data::Dataset& test, dt::ProcessGroup& group, dt::Device device) {
  dt::NoGradGuard noGrad;
  model.eval();
  double correct = 0, lossSum = 0, count = 0;
  std::vector<int64_t> indices;
  for (int64_t i = group.rank(); i < test.size(); i += group.size()) indices.push_back(i);
  constexpr size_t kBatch = 1000;
  for (size_t begin = 0; begin < indices.size(); begin += kBatch) {
    const size_t n = std::min(kBatch, indices.size() - begin);
    const dt::data::Batch b = test.get(std::span<const int64_t>(indices.data() + begin, n));
    const dt::Tensor targets = b.targets.to(device);
    const dt::Tensor logits = model(b.inputs.to(device));
    lossSum += dt::crossEntropy(logits, targets, {.reduction = dt::Reduction::Sum}).item<float>();
    correct += dt::sum(dt::eq(dt::argmax(logits, 1), targets)).item<int64_t>();
    count += static_cast<double>(n);
  }
  model.train();
  dt::Tensor sums = dt::fromVector<double>({correct, lossSum, count});
  group.allreduce(sums)->wait();
  const auto s = sums.toVector<double>();
  return {{"test loss", s[1] / s[2]}, {"test accuracy", s[0] / s[2]}};
}


// ---- the job ------------------------------------------------------------------------------------------------------

int run(const Config& c, dt::Device device) {
  // The data first: a replacement that joins a running job has it ready when it is admitted.
  const auto train = dt::data::loadFashionMnist(c.data, dt::data::Split::Train);
  const auto test = c.eval ? dt::data::loadFashionMnist(c.data, dt::data::Split::Test) : nullptr;
  const int64_t batchesPerEpoch = dt::data::DistributedSampler(train->size(), 1, 0, {.batchSize = c.globalBatch, .dropLast = c.dropLast}).batchesPerEpoch();
  const int64_t totalSteps = c.steps > 0 ? c.steps : c.epochs * batchesPerEpoch;
  const int64_t epochs = (totalSteps + batchesPerEpoch - 1) / batchesPerEpoch;
  constexpr int64_t kClasses = 10;
  const std::string name = modelName(train->features(), c.hidden, kClasses);
  std::shared_ptr<dt::nn::Sequential> model;  // made once the loop knows this rank
  dt::train::LoopOptions options{.program = "trainer", .steps = totalSteps, .globalBatch = c.globalBatch, .seed = c.seed,
                                 .dropLast = c.dropLast, .prefetch = c.prefetch, .checkpointDir = c.checkpointDir,
                                 .checkpointEvery = c.checkpointEvery, .keep = c.keep, .resume = c.resume == "auto",
                                 .config = resumeKeys(c, name, train->size()), .logEvery = c.logEvery, .quiet = c.quiet,
                                 .forceElastic = c.elastic};
  c.test.apply(options, [&] { return model; }, "trainer");
  examples::BenchWindow bench;
  if (c.bench) bench.attach(options, c.benchWarmup);
  options.hooks.onLog = [&](const dt::train::Progress& p) {
    if (c.quiet) return;
    std::printf("epoch %lld/%lld  step %lld/%lld  loss %.4f  %.0f samples/s  elapsed %s  left %s\n", static_cast<long long>(p.epoch),
                static_cast<long long>(p.epochs), static_cast<long long>(p.step), static_cast<long long>(p.steps), p.loss, p.rate,
                examples::formatSeconds(p.elapsed).c_str(), examples::formatSeconds(p.left).c_str());
  };
  dt::train::Loop loop(options);
  if (loop.jobFinished()) return loop.run({}), 0;  // a replacement that started after the job ended: nothing to do
  if (!c.elastic && !dt::env::getBool("DT_ELASTIC") && c.globalBatch % loop.worldSize() != 0) {
    throw InvalidArgument(str("trainer: --global-batch ", c.globalBatch, " is not divisible by the world size ", loop.worldSize(),
                              " (each rank takes global batch / world); use a multiple of ", loop.worldSize(), ", e.g. ",
                              std::max<int64_t>(loop.worldSize(), c.globalBatch / loop.worldSize() * loop.worldSize())));
  }
  if (!c.quiet) std::printf("trainer: rank %d/%d pid %d attempt %lld\n", loop.rank(), loop.worldSize(), static_cast<int>(getpid()), static_cast<long long>(loop.restartCount() + 1));

  // The same initial model on every rank (DDP also broadcasts rank 0's); dropout masks differ per rank.
  dt::Generator initRng, dropoutRng;
  initRng.manualSeed(c.seed);
  dropoutRng.manualSeed(c.seed * 0x9e3779b97f4a7c15ull + 1000 + static_cast<uint64_t>(loop.rank()));
  model = buildModel(c, train->features(), kClasses, initRng, dropoutRng);
  model->to(device);  // initialised on the CPU, so every device starts from the same values
  std::unique_ptr<dt::optim::Optimizer> optimizer;
  if (c.optimizer == "adamw") {
    optimizer = std::make_unique<dt::optim::AdamW>(model->parameters(), dt::optim::AdamWOptions{.lr = c.learningRate(), .weightDecay = c.decay()});
  } else {
    optimizer = std::make_unique<dt::optim::SGD>(model->parameters(), dt::optim::SGDOptions{.lr = c.learningRate(), .momentum = c.momentum, .weightDecay = c.decay()});
  }
  loop.setModel(model);
  loop.setOptimizer(*optimizer, [&](int64_t step) {
    if (c.schedule == "constant") return c.learningRate();
    return c.learningRate() * 0.5 * (1.0 + std::cos(std::numbers::pi * static_cast<double>(step) / static_cast<double>(totalSteps)));
  });
  loop.setData(train);
  loop.addState("rng", dropoutRng);
  if (test) loop.setEvaluation([&] { return evaluate(*model, *test, loop.group(), device); });
  int64_t paramCount = 0;
  for (const auto& p : model->parameters()) paramCount += p.numel();
  if (loop.rank() == 0 && !c.quiet) {
    std::printf("trainer: %d rank(s) on %s; %s; MLP %s (%lld parameters%s); %s lr %g %s; global batch %lld (%lld per rank); %lld epoch(s) = %lld steps; %s; precision %s\n",
                loop.worldSize(), device.isCpu() ? "cpu" : str("cuda (rank 0: ", device.str(), ")").c_str(), train->describe().c_str(), name.c_str(),
                static_cast<long long>(paramCount), c.dropout > 0 ? str(", dropout ", c.dropout).c_str() : "",
                c.optimizer == "adamw" ? "AdamW" : "SGD", c.learningRate(), c.schedule.c_str(), static_cast<long long>(c.globalBatch),
                static_cast<long long>(c.globalBatch / loop.worldSize()), static_cast<long long>(epochs), static_cast<long long>(totalSteps),
                c.checkpointDir.empty() ? "no checkpoints"
                                        : str("checkpoints every ", c.checkpointEvery, " steps in ", c.checkpointDir, " (keep ", c.keep, ")").c_str(),
                c.precision.c_str());
  }

  const dt::train::LoopResult r = loop.run([&](const dt::data::Batch& b) {
    // Backward keeps the dtype each product chose in forward, so the scope ends with the forward.
    const dt::autocast scope(dt::DType::BFloat16, c.precision == "bf16");
    return dt::train::StepOutput{dt::crossEntropy(loop.forward(b.inputs.to(device)), b.targets.to(device))};
  });
  if (r.stopped) {
    if (!c.quiet) std::printf("trainer: rank %d/%d stopped cleanly after step %lld\n", loop.rank(), loop.worldSize(), static_cast<long long>(r.steps));
    return 0;
  }
  if (c.bench && loop.rank() == 0 && !bench.measured()) {
    std::fprintf(stderr, "trainer: --bench measured nothing: it needs more than --bench-warmup %lld steps (ran %lld)\n",
                 static_cast<long long>(c.benchWarmup), static_cast<long long>(r.steps - r.firstStep));
  } else if (c.bench && loop.rank() == 0) {
    const double seconds = bench.seconds();
    const int64_t measured = bench.steps();
    std::printf("RESULT trainer impl=dtrain device=%s world=%d global_batch=%lld model=%s optimizer=%s steps=%lld step_ms=%.3f "
                "samples_per_s=%.1f data_wait_ms=%.3f%s\n",
                device.isCpu() ? "cpu" : "cuda", loop.worldSize(), static_cast<long long>(c.globalBatch), name.c_str(), c.optimizer.c_str(),
                static_cast<long long>(measured), 1e3 * seconds / static_cast<double>(measured),
                static_cast<double>(measured * c.globalBatch) / seconds, r.dataWaitMs,
                // Only bf16 says so: the fp32 line stays as bench/peers/torch_trainer.py's pairs with it.
                c.precision == "bf16" ? " precision=bf16" : "");
  }
  if (const int code = examples::reportParameters("trainer", loop, r, c.quiet)) return code;
  if (loop.rank() == 0) {
    std::string line = str("trainer: done: ", r.steps, " steps (", epochs, " epoch(s)) in ", examples::formatSeconds(r.elapsed));
    char buf[96];
    if (r.steps > r.firstStep) {
      std::snprintf(buf, sizeof(buf), ", %.0f samples/s", static_cast<double>((r.steps - r.firstStep) * c.globalBatch) / std::max(r.seconds, 1e-9));
      line += buf;
    } else {
      line += " (all in earlier runs: the checkpoint was already at the end)";
    }
    std::snprintf(buf, sizeof(buf), "; train loss %.4f", r.loss);
    line += buf;
    if (r.evaluation.size() == 2) {
      std::snprintf(buf, sizeof(buf), "; test loss %.4f, test accuracy %.4f", r.evaluation[0].second, r.evaluation[1].second);
      line += buf;
    }
    std::printf("%s\n", line.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::runMain("trainer", [&] {
    Config config;
    if (!parseArgs(argc, argv, config)) return 0;
    const dt::Device device = examples::deviceFor("trainer", config.device);
    dt::setCurrentDevice(device);  // before any CUDA call, so no rank opens a context on cuda:0 too
    return run(config, device);
  });
}
