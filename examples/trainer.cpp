// trainer: data-parallel training on Fashion-MNIST, the program README's main command runs
// under `dtrun --nproc 4 ./trainer`: an MLP (784-256-128-10, ReLU) with AdamW or SGD on the
// training loop library (train/loop.h, docs/train.md), which brings the rest: DDP, the data
// split per rank and prefetched, checkpoints every --checkpoint-every steps with an exact resume
// (bitwise, same seed and world size), pre-emption (SIGTERM, SIGUSR1 or SIGINT: checkpoint at the
// next step boundary, exit 0), progress lines, and under dtrun --elastic in-place recovery and
// replacements that join the running job. A final line ends in "test accuracy 0.8912"; every
// rank prints the fingerprint of its final parameters, which must be identical.
// `trainer --help` lists the flags and their defaults.
#include <chrono>
#include <cinttypes>
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
  int64_t epochs = 10;
  int64_t steps = 0;  // 0: epochs x batches per epoch
  int64_t globalBatch = 128;
  std::vector<int64_t> hidden = {256, 128};
  std::string optimizer = "adamw";
  std::optional<double> lr;           // adamw 1e-3, sgd 0.05
  std::optional<double> weightDecay;  // adamw 1e-4, sgd 0
  double momentum = 0.9;
  std::string schedule = "cosine";
  double dropout = 0.0;
  uint64_t seed = 0;
  bool dropLast = false;
  int prefetch = 8;
  int64_t logEvery = 100;
  bool quiet = false;
  std::string checkpointDir = "trainer-checkpoints";
  int64_t checkpointEvery = 500;
  int keep = 3;
  std::string resume = "auto";
  std::string device = "cpu";
  bool eval = true;
  bool bench = false;
  int64_t benchWarmup = 20;
  bool elastic = false;  // dtrun --elastic (DT_ELASTIC) or --elastic
  examples::TestFlags test;

  double learningRate() const { return lr.value_or(optimizer == "sgd" ? 0.05 : 1e-3); }
  double decay() const { return weightDecay.value_or(optimizer == "sgd" ? 0.0 : 1e-4); }
};

constexpr const char* kUsage = R"(usage: trainer [flags]          (run it under dtrun: dtrun --nproc 4 ./trainer)

Data-parallel training of an MLP on Fashion-MNIST with checkpoints, exact resume and
pre-emption (SIGTERM/SIGUSR1/SIGINT: checkpoint at the next step, exit 0; a second such
signal ends the process at once).

data and model
  --data DIR              folder with the four gzip'd IDX files (default /usr/share/datasets/fashion-mnist,
                          where Debian's dataset-fashion-mnist package puts them)
  --hidden H1,H2,...      hidden layer sizes of the MLP 784-H1-...-10 (default 256,128)
  --dropout P             dropout after each hidden layer (default 0)
  --device cpu|cuda|cuda:N  (default cpu; cuda: each rank takes GPU LOCAL_RANK mod the GPU count)
training
  --epochs E              passes over the training set (default 10)
  --steps N               total steps instead of epochs (default 0: use --epochs)
  --global-batch G        examples per step over all ranks; each rank takes G / world (default 128)
  --optimizer adamw|sgd   (default adamw)
  --lr LR                 (default 0.001 for adamw, 0.05 for sgd)
  --weight-decay WD       (default 0.0001 for adamw, 0 for sgd)
  --momentum M            sgd momentum (default 0.9)
  --schedule cosine|constant  learning rate over the steps (default cosine)
  --seed S                model initialisation, shuffling and dropout (default 0)
  --drop-last             drop the short last batch of each epoch (default: pad it)
  --prefetch K            batches the loader thread prepares ahead (default 8)
checkpoints
  --checkpoint-dir DIR    (default trainer-checkpoints; none: no checkpoints)
  --checkpoint-every N    steps between checkpoints; one is also written at the end (default 500)
  --keep K                checkpoints kept (default 3)
  --resume auto|never     auto: continue from the newest checkpoint in DIR if there is one;
                          never: delete DIR's checkpoints and start afresh (after a restart by
                          dtrun, DT_RESTART_COUNT > 0, the newest checkpoint is always used)
output
  --log-every N           progress line every N steps on rank 0 (default 100)
  --quiet                 only the final line (and errors)
  --no-eval               skip the test-set evaluation at the end
  --bench                 print a RESULT line with samples/s (after --bench-warmup steps, default 20)
elastic (docs/elastic.md)
  --elastic               a rank that dies is left behind and the others go on in place from the same
                          step, with the same global batch (default: on when dtrun --elastic started it);
                          a replacement (dtrun --max-restarts) is admitted at the next step boundary and
                          receives the whole training state from the members, no checkpoint read
)";

int64_t parsePositive(const std::string& value, const std::string& flag, int64_t minimum = 1) {
  return examples::parsePositive("trainer", value, flag, minimum);
}

double parseDouble(const std::string& value, const std::string& flag, double minimum, double maximum) {
  return examples::parseDouble("trainer", value, flag, minimum, maximum);
}

std::string choice(const std::string& value, const std::string& flag, const std::vector<std::string>& allowed) {
  return examples::choice("trainer", value, flag, allowed);
}

Config parseArgs(int argc, char** argv, bool& help) {
  Config c;
  c.elastic = dt::env::getBool("DT_ELASTIC");
  help = !examples::forEachFlag("trainer", argc, argv, {"--quiet", "--drop-last", "--no-eval", "--bench", "--elastic", "--measure-transfer"},
                                [&](const std::string& flag, const std::string& value) {
    if (flag == "--quiet") c.quiet = true;
    else if (flag == "--elastic") c.elastic = true;
    else if (c.test.parse("trainer", flag, value)) {}
    else if (flag == "--drop-last") c.dropLast = true;
    else if (flag == "--no-eval") c.eval = false;
    else if (flag == "--bench") c.bench = true;
    else if (flag == "--data") c.data = value;
    else if (flag == "--epochs") c.epochs = parsePositive(value, flag);
    else if (flag == "--steps") c.steps = parsePositive(value, flag, 0);
    else if (flag == "--global-batch") c.globalBatch = parsePositive(value, flag);
    else if (flag == "--hidden") {
      c.hidden.clear();
      for (const auto& part : dt::split(value, ',')) c.hidden.push_back(parsePositive(std::string(part), "--hidden"));
    }
    else if (flag == "--optimizer") c.optimizer = choice(value, flag, {"adamw", "sgd"});
    else if (flag == "--lr") c.lr = parseDouble(value, flag, 0.0, 10.0);
    else if (flag == "--weight-decay") c.weightDecay = parseDouble(value, flag, 0.0, 1.0);
    else if (flag == "--momentum") c.momentum = parseDouble(value, flag, 0.0, 0.999);
    else if (flag == "--schedule") c.schedule = choice(value, flag, {"cosine", "constant"});
    else if (flag == "--dropout") c.dropout = parseDouble(value, flag, 0.0, 0.95);
    else if (flag == "--seed") c.seed = static_cast<uint64_t>(parsePositive(value, flag, 0));
    else if (flag == "--prefetch") c.prefetch = static_cast<int>(parsePositive(value, flag));
    else if (flag == "--log-every") c.logEvery = parsePositive(value, flag);
    else if (flag == "--checkpoint-dir") c.checkpointDir = value;
    else if (flag == "--checkpoint-every") c.checkpointEvery = parsePositive(value, flag, 0);
    else if (flag == "--keep") c.keep = static_cast<int>(parsePositive(value, flag));
    else if (flag == "--resume") c.resume = choice(value, flag, {"auto", "never"});
    else if (flag == "--device") c.device = examples::deviceName("trainer", value, flag);
    else if (flag == "--bench-warmup") c.benchWarmup = parsePositive(value, flag, 0);
    else throw InvalidArgument(str("trainer: unknown flag ", flag, "; see --help"));
  });
  if (help) return c;
  if (c.checkpointDir.empty()) throw InvalidArgument("trainer: --checkpoint-dir is empty (use none to write no checkpoints)");
  if (c.checkpointDir == "none") c.checkpointDir.clear();
  return c;
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
  return {{"model", model},
          {"dropout", exact(c.dropout)},
          {"optimizer", c.optimizer},
          {"lr", exact(c.learningRate())},
          {"weight_decay", exact(c.decay())},
          {"momentum", c.optimizer == "sgd" ? exact(c.momentum) : "-"},
          {"schedule", c.schedule},
          {"seed", std::to_string(c.seed)},
          {"global_batch", std::to_string(c.globalBatch)},
          {"drop_last", c.dropLast ? "yes" : "no"},
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
  std::optional<std::chrono::steady_clock::time_point> benchStart, benchEnd;
  int64_t benchFrom = -1;
  options.hooks.at = [&](int64_t step, dt::train::Phase phase) {
    if (phase != dt::train::Phase::Begin) return;
    if (benchFrom < 0) benchFrom = step + c.benchWarmup;
    if (step == benchFrom) benchStart = std::chrono::steady_clock::now();
  };
  auto stepLog = options.hooks.afterStep;
  options.hooks.afterStep = [&, stepLog](const dt::train::StepDone& done) {
    if (stepLog) stepLog(done);
    if (done.steps == totalSteps) benchEnd = std::chrono::steady_clock::now();
  };
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
    std::printf("trainer: %d rank(s) on %s; %s; MLP %s (%lld parameters%s); %s lr %g %s; global batch %lld (%lld per rank); %lld epoch(s) = %lld steps; %s\n",
                loop.worldSize(), device.isCpu() ? "cpu" : str("cuda (rank 0: ", device.str(), ")").c_str(), train->describe().c_str(), name.c_str(),
                static_cast<long long>(paramCount), c.dropout > 0 ? str(", dropout ", c.dropout).c_str() : "",
                c.optimizer == "adamw" ? "AdamW" : "SGD", c.learningRate(), c.schedule.c_str(), static_cast<long long>(c.globalBatch),
                static_cast<long long>(c.globalBatch / loop.worldSize()), static_cast<long long>(epochs), static_cast<long long>(totalSteps),
                c.checkpointDir.empty() ? "no checkpoints"
                                        : str("checkpoints every ", c.checkpointEvery, " steps in ", c.checkpointDir, " (keep ", c.keep, ")").c_str());
  }

  const dt::train::LoopResult r = loop.run([&](const dt::data::Batch& b) {
    return dt::train::StepOutput{dt::crossEntropy(loop.forward(b.inputs.to(device)), b.targets.to(device))};
  });
  if (r.stopped) {
    if (!c.quiet) std::printf("trainer: rank %d/%d stopped cleanly after step %lld\n", loop.rank(), loop.worldSize(), static_cast<long long>(r.steps));
    return 0;
  }
  if (c.bench && loop.rank() == 0) {
    if (!benchStart || !benchEnd) {
      std::fprintf(stderr, "trainer: --bench measured nothing: it needs more than --bench-warmup %lld steps (ran %lld)\n",
                   static_cast<long long>(c.benchWarmup), static_cast<long long>(r.steps - r.firstStep));
    } else {
      const double seconds = std::chrono::duration<double>(*benchEnd - *benchStart).count();
      const int64_t measured = r.steps - benchFrom;
      std::printf("RESULT trainer impl=dtrain device=%s world=%d global_batch=%lld model=%s optimizer=%s steps=%lld step_ms=%.3f "
                  "samples_per_s=%.1f data_wait_ms=%.3f\n",
                  device.isCpu() ? "cpu" : "cuda", loop.worldSize(), static_cast<long long>(c.globalBatch), name.c_str(), c.optimizer.c_str(),
                  static_cast<long long>(measured), 1e3 * seconds / static_cast<double>(measured),
                  static_cast<double>(measured * c.globalBatch) / seconds, r.dataWaitMs);
    }
  }
  if (!c.quiet) {
    std::printf("trainer: rank %d/%d final parameters fingerprint %016" PRIx64 " (spread across ranks %.3g)\n", loop.rank(), loop.worldSize(),
                r.fingerprint, r.parameterSpread);
  }
  if (r.parameterSpread != 0.0) {
    std::fprintf(stderr, "trainer: rank %d/%d: parameters differ across ranks (max difference %g)\n", loop.rank(), loop.worldSize(), r.parameterSpread);
    return 1;
  }
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
    bool help = false;
    const Config config = parseArgs(argc, argv, help);
    if (help) {
      std::fputs(kUsage, stdout);
      std::fputs(examples::TestFlags::kUsage, stdout);
      return 0;
    }
    const dt::Device device = examples::deviceFor("trainer", config.device);
    dt::setCurrentDevice(device);  // before any CUDA call, so no rank opens a context on cuda:0 too
    return run(config, device);
  });
}
