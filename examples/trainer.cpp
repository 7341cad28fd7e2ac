// trainer: data-parallel training on Fashion-MNIST, the program README's main command runs
// under `dtrun --nproc 4 ./trainer`. It shows every part of dtrain working together:
//
//   launcher   dtrun starts the ranks, hosts the store, restarts them after a failure
//              (DT_RESTART_COUNT) and forwards SIGTERM/SIGUSR1
//   group      initProcessGroup() from the launcher's (or SLURM's) environment
//   data       Fashion-MNIST's gzip'd IDX files (Debian's dataset-fashion-mnist), a
//              DistributedSampler shard per rank, batches prepared by a background thread
//   DDP        DistributedDataParallel averages gradients while backward runs
//   tensor     an MLP (784-256-128-10, ReLU), cross-entropy, AdamW or SGD
//
// Checkpoints: every --checkpoint-every steps, at the end and when stopped, the ranks write the
// training state: model, optimizer state, sampler position and every rank's RNG state
// (safetensors + JSON manifest, written atomically, with CRC-32s; checkpoint/checkpoint_dir.h). On start the ranks resume from the
// newest checkpoint in --checkpoint-dir (always after a restart); resuming is exact: the
// parameters end bitwise equal to an uninterrupted run's with the same seed and world size.
//
// Pre-emption: on SIGTERM, SIGUSR1 or SIGINT (what SLURM sends before a time limit) the ranks
// agree at the next step boundary (the stop flag rides on a tiny allreduce every step), rank 0
// writes a checkpoint and every rank exits 0.
//
// Output: rank 0 prints a line every --log-every steps (epoch, step, loss, samples/s of the
// whole job, time left) and a final line ending in "test accuracy 0.8912". Every rank prints
// the fingerprint of its final parameters; the ranks check that they are identical.
// `trainer --help` lists the flags and their defaults.
#include <atomic>
#include <cerrno>
#include <chrono>
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <numbers>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "collectives/coalesce.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "data/sampler.h"
#include "ddp/ddp.h"
#include "checkpoint/transfer.h"
#include "elastic/elastic_group.h"
#include "examples/run_support.h"
#include "process_group/init.h"
#include "tensor/autograd/autograd.h"
#include "tensor/generator.h"
#include "tensor/nn/module.h"
#include "tensor/ops.h"
#include "tensor/optim/optim.h"

namespace {

using dt::InvalidArgument;
using dt::str;
using Clock = std::chrono::steady_clock;

// ---- configuration ------------------------------------------------------------------------------------------

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
  int64_t stepPauseMs = 0;  // --step-pause: sleep at the start of every step (tests)
  bool quiet = false;
  std::string checkpointDir = "trainer-checkpoints";
  int64_t checkpointEvery = 500;
  int keep = 3;
  std::string resume = "auto";
  std::string device = "cpu";
  bool eval = true;
  bool bench = false;
  int64_t benchWarmup = 20;
  // Elastic training (dtrun --elastic, docs/elastic.md): on by default under dtrun --elastic.
  bool elastic = false;
  std::vector<std::string> failAt;  // "MEMBER:STEP:WHERE" each: SIGKILL self there (to test recovery)
  std::string recordSamples;   // PREFIX: each rank appends each attempt at a step (its example ids) to PREFIX.<member>
  std::string stepLog;         // FILE: rank 0 appends a line per committed step (and --fail-at's member one before its kill)
  bool measureTransfer = false;  // --measure-transfer: time a plain broadcast of the state's bytes after each transfer
  std::vector<int64_t> dumpAt;  // steps after which rank 0 writes the parameters to dumpDir
  std::string dumpDir;

  double learningRate() const { return lr.value_or(optimizer == "sgd" ? 0.05 : 1e-3); }
  double decay() const { return weightDecay.value_or(optimizer == "sgd" ? 0.0 : 1e-4); }
  bool checkpoints() const { return checkpointDir != "none"; }
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
  --fail-at M:STEP:WHERE[,...]  to test recovery: member M SIGKILLs itself during step STEP, WHERE =
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
  --dump-dir DIR          (default trainer-dumps)
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

std::string deviceName(const std::string& value, const std::string& flag) {
  try {
    dt::Device::parse(value);
  } catch (const InvalidArgument&) {
    throw InvalidArgument(str("trainer: ", flag, " \"", value, "\" is not one of cpu, cuda, cuda:N"));
  }
  return value;
}

Config parseArgs(int argc, char** argv, bool& help) {
  Config c;
  c.elastic = dt::env::getBool("DT_ELASTIC");
  c.dumpDir = "trainer-dumps";
  help = !examples::forEachFlag("trainer", argc, argv, {"--quiet", "--drop-last", "--no-eval", "--bench", "--elastic", "--measure-transfer"},
                                [&](const std::string& flag, const std::string& value) {
    if (flag == "--quiet") c.quiet = true;
    else if (flag == "--elastic") c.elastic = true;
    else if (flag == "--fail-at") {
      for (const auto& spec : dt::split(value, ',')) {
        const auto parts = dt::split(spec, ':');
        if (parts.size() != 3 || (parts[2] != "forward" && parts[2] != "backward" && parts[2] != "commit" && parts[2] != "checkpoint")) {
          throw InvalidArgument(str("trainer: --fail-at \"", spec, "\" is not MEMBER:STEP:WHERE with WHERE one of forward, backward, commit, checkpoint"));
        }
        parsePositive(parts[0], flag, 0);
        parsePositive(parts[1], flag, 0);
        c.failAt.push_back(spec);
      }
    }
    else if (flag == "--record-samples") c.recordSamples = value;
    else if (flag == "--step-log") c.stepLog = value;
    else if (flag == "--measure-transfer") c.measureTransfer = true;
    else if (flag == "--dump-at") {
      for (const auto& part : dt::split(value, ',')) c.dumpAt.push_back(parsePositive(std::string(part), flag, 0));
    }
    else if (flag == "--dump-dir") c.dumpDir = value;
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
    else if (flag == "--step-pause") c.stepPauseMs = parsePositive(value, flag, 0);
    else if (flag == "--checkpoint-dir") c.checkpointDir = value;
    else if (flag == "--checkpoint-every") c.checkpointEvery = parsePositive(value, flag, 0);
    else if (flag == "--keep") c.keep = static_cast<int>(parsePositive(value, flag));
    else if (flag == "--resume") c.resume = choice(value, flag, {"auto", "never"});
    else if (flag == "--device") c.device = deviceName(value, flag);
    else if (flag == "--bench-warmup") c.benchWarmup = parsePositive(value, flag, 0);
    else throw InvalidArgument(str("trainer: unknown flag ", flag, "; see --help"));
  });
  if (help) return c;
  if (c.checkpointDir.empty()) throw InvalidArgument("trainer: --checkpoint-dir is empty (use none to write no checkpoints)");
  return c;
}

// ---- helpers ----------------------------------------------------------------------------------------------------

using examples::fingerprint;
using examples::formatSeconds;
using examples::signalName;

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

struct EvalResult {
  double loss = 0;
  double accuracy = 0;
  int64_t examples = 0;
};

// Every rank evaluates its share of the test set (examples r, r + W, ...); sums are allreduced.
// --device cuda: the GPU of this rank's local rank, as torchrun users write
// cuda:LOCAL_RANK; cuda:N names one explicitly.
dt::Device deviceFor(const std::string& text) {
  dt::Device device = dt::Device::parse(text);
  if (device.isCpu()) return device;
  if (text == "cuda") {
    const int localRank = dt::resolveInit({}).localRank;  // from dtrun, torchrun's or SLURM's variables
    const int count = dt::deviceCount(dt::DeviceType::CUDA);
    if (count > 0) device = dt::Device::cuda(localRank % count);
  }
  if (!dt::deviceAvailable(device)) {
    throw dt::NotSupportedError(str("trainer: --device ", text, " (", device.str(), ") is not usable here: ",
                                    dt::deviceUnavailableReason(device), "; use --device cpu"));
  }
  return device;
}

EvalResult evaluate(dt::nn::Module& model, const dt::data::Dataset& test, dt::ProcessGroup& group, dt::Device device) {
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
  return {s[1] / s[2], s[0] / s[2], static_cast<int64_t>(s[2])};
}

// ---- the job ------------------------------------------------------------------------------------------------------

class Trainer {
 public:
  Trainer(Config config, dt::Device device) : c_(std::move(config)), device_(device) {}

  int run();

 private:
  void say(const std::string& line) const {
    if (rank_ == 0 && !c_.quiet) std::printf("%s\n", line.c_str());
  }
  // Joins the job: the process group, or under --elastic the job's membership (a
  // replacement blocks here until the members admit it).
  void connect();
  void resumeOrStart();
  // The whole training state, as checkpoints hold it (checkpoint/state.h).
  dt::TrainingState trainingState();
  // The DDP bucket layout a checkpoint recorded (DdpOptions::bucketOrder), so a resumed
  // run reduces with the layout the uninterrupted one had reached.
  std::vector<std::string> savedBucketOrder_;
  dt::DistributedDataParallel* ddp_ = nullptr;
  void saveCheckpoint(int64_t step, const std::string& reason);
  // The checkpoint due at `step` (--checkpoint-every), written again after a recovery.
  void periodicCheckpoint(int64_t& step, dt::DistributedDataParallel& ddp, std::unique_ptr<dt::data::PrefetchLoader>& loader);
  // --elastic: this rank's share of the global batch, and the loss weight that keeps the
  // gradient the mean over the global batch when the shares are uneven.
  void splitData();
  // --elastic: after a step failed with `cause`, goes on with the members left; applies the
  // step the others committed if this rank's commit missed it (++step).
  void recover(std::exception_ptr cause, int64_t& step, dt::DistributedDataParallel& ddp,
               std::unique_ptr<dt::data::PrefetchLoader>& loader);
  // --elastic: the members admit the joiners that wait (all at the same step boundary).
  void admitJoiners(int64_t step, dt::DistributedDataParallel& ddp, std::unique_ptr<dt::data::PrefetchLoader>& loader);
  // --elastic: after a new epoch, the members the last decision admitted receive the whole
  // training state from rank 0 (an old member); everyone else takes part. A joiner takes
  // the step and DDP's bucket layout from it.
  void transferState(int64_t& step);
  // After a membership change: the new group's rank and size, DDP on it, the data re-split
  // and the loader restarted at `step`.
  void regroup(int64_t step, dt::DistributedDataParallel& ddp, std::unique_ptr<dt::data::PrefetchLoader>& loader);
  void failHereIf(int64_t step, const char* where) const;
  // --fail-at M:S:backward: the kill happens inside backward, in the hook of the last
  // gradient to arrive, after DDP's own hook launched the last bucket (all on the wire).
  void armBackwardFailure();
  int64_t currentStep_ = 0;
  int64_t joinedAtStep_ = -1;  // --elastic: the step a replacement joined at
  // When this process started (CLOCK_REALTIME ns), for --step-log's join line.
  const int64_t startNs_ = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::system_clock::now().time_since_epoch()).count();
  void recordSamples(int64_t step, const dt::data::LoadedBatch& batch) const;
  // --step-log: appends `line` and the time (CLOCK_REALTIME ns), in one write (the file is
  // opened for appending, so lines from several processes do not interleave).
  void logStep(const std::string& line) const;
  std::unique_ptr<FILE, int (*)(FILE*)> stepLog_{nullptr, &std::fclose};
  void dumpParameters(int64_t step) const;
  double lrAt(int64_t step) const {
    if (c_.schedule == "constant") return c_.learningRate();
    return c_.learningRate() * 0.5 * (1.0 + std::cos(std::numbers::pi * static_cast<double>(step) / static_cast<double>(totalSteps_)));
  }

  Config c_;
  std::shared_ptr<dt::ProcessGroup> group_;
  int rank_ = 0;
  int world_ = 1;
  dt::Device device_;
  int64_t restartCount_ = 0;
  std::shared_ptr<dt::data::ImageClassificationDataset> train_, test_;
  std::optional<dt::data::DistributedSampler> sampler_;
  std::shared_ptr<dt::nn::Sequential> model_;
  std::string modelName_;
  dt::Generator initRng_;
  dt::Generator dropoutRng_;
  std::unique_ptr<dt::optim::Optimizer> optimizer_;
  std::optional<dt::CheckpointDir> checkpoints_;
  int64_t totalSteps_ = 0;
  int64_t startStep_ = 0;
  double priorSeconds_ = 0;  // training time of earlier attempts (from the checkpoint)
  double runSeconds_ = 0;
  double recentLoss_ = 0;  // mean training loss over the last log window
  Clock::time_point loopStart_;
  std::unique_ptr<dt::elastic::ElasticGroup> elastic_;
  double lossScale_ = 1.0;
};

void Trainer::splitData() {
  sampler_.emplace(train_->size(), world_, rank_,
                   dt::data::DistributedSamplerOptions{.batchSize = c_.globalBatch / std::max(world_, 1),
                                                       .globalBatchSize = elastic_ ? c_.globalBatch : 0,
                                                       .shuffle = true,
                                                       .seed = c_.seed,
                                                       .dropLast = c_.dropLast});
  // DDP averages over the ranks: a rank with n of the global batch's G examples weighs its
  // mean loss by n W / G, so the average is the mean over the global batch (1 when even).
  const int64_t share = sampler_->localBatchSize();
  lossScale_ = share * world_ == c_.globalBatch ? 1.0
                                                : static_cast<double>(share * world_) / static_cast<double>(c_.globalBatch);
}

void Trainer::connect() {
  if (c_.elastic) {
    elastic_ = dt::elastic::ElasticGroup::fromEnvironment();
    group_ = elastic_->group();
  } else {
    group_ = dt::initProcessGroup();
  }
  rank_ = group_->rank();
  world_ = group_->size();
}

void Trainer::recover(std::exception_ptr cause, int64_t& step, dt::DistributedDataParallel& ddp,
                      std::unique_ptr<dt::data::PrefetchLoader>& loader) {
  loader.reset();  // its thread prepares batches for the old split
  const dt::elastic::Membership& m = elastic_->recover(cause, step);
  if (m.resumeStep > step) {
    // The others committed this step: this rank holds its reduced gradients too (it voted
    // only after its backward), so it applies it as they did.
    optimizer_->step();
    ++step;
  }
  regroup(step, ddp, loader);
  if (!m.joined.empty()) transferState(step);  // an admission whose transfer failed: again
  say(str("trainer: epoch ", m.epoch, " of the job: ", world_, " rank(s) go on from step ", step, " without ", dt::join(m.lost, ", ")));
}

void Trainer::admitJoiners(int64_t step, dt::DistributedDataParallel& ddp, std::unique_ptr<dt::data::PrefetchLoader>& loader) {
  loader.reset();
  const dt::elastic::Membership& m = elastic_->admit(step);
  regroup(step, ddp, loader);
  if (!m.joined.empty()) transferState(step);
  std::vector<std::string> joined;
  for (int member : m.joined) joined.push_back(str("member ", member));
  say(str("trainer: epoch ", m.epoch, " of the job: ", world_, " rank(s) go on from step ", step,
          m.joined.empty() ? std::string(" (the joiners that waited died first)") : str(" with ", dt::join(joined, ", ")),
          m.lost.empty() ? std::string() : str(" without ", dt::join(m.lost, ", "))));
}

void Trainer::regroup(int64_t step, dt::DistributedDataParallel& ddp, std::unique_ptr<dt::data::PrefetchLoader>& loader) {
  group_ = elastic_->group();
  rank_ = elastic_->membership().rank;
  world_ = elastic_->membership().size();
  ddp.rebind(group_);
  splitData();
  loader = std::make_unique<dt::data::PrefetchLoader>(train_, *sampler_, dt::data::LoaderOptions{.prefetch = c_.prefetch});
  loader->start(sampler_->positionAfter(step));
}

void Trainer::transferState(int64_t& step) {
  dt::TrainingState state = trainingState();
  state.step = step;
  if (ddp_ != nullptr && ddp_->bucketsRebuilt()) state.metadata["ddp.bucket_order"] = dt::join(ddp_->bucketOrder(), ",");
  state.metadata["train_loss"] = std::to_string(recentLoss_);
  // --measure-transfer times the transfer alone: a joiner would otherwise count its wait for
  // the members to reach the step boundary.
  if (c_.measureTransfer) group_->barrier()->wait();
  const auto start = Clock::now();
  dt::broadcastState(state, *group_, 0, elastic_->joinedNow(), {.device = device_});
  const auto transferNs = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  // Counted once every rank holds the whole state (a joiner's optimizer had none before).
  int64_t bytes = 0;
  for (const auto& t : state.collect()) bytes += t.local.numel() * static_cast<int64_t>(dt::itemSize(t.local.dtype()));
  int64_t broadcastNs = 0;
  if (c_.measureTransfer) {  // the same bytes in one plain broadcast, on the same group
    dt::Tensor buffer = dt::zeros({std::max<int64_t>(bytes / 4, 1)}, dt::DType::Float32, device_);
    group_->barrier()->wait();
    const auto from = Clock::now();
    group_->broadcast(buffer, {.root = 0})->wait();
    broadcastNs = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - from).count();
  }
  if (!elastic_->joinedNow()) return;
  step = state.step;
  const auto& m = state.metadata;
  if (m.count("ddp.bucket_order")) savedBucketOrder_ = dt::split(m.at("ddp.bucket_order"), ',');
  recentLoss_ = std::strtod(m.at("train_loss").c_str(), nullptr);
  logStep(str("join ", elastic_->memberId(), " ", startNs_, " ", step, " ", bytes, " ", transferNs, " ", broadcastNs));
  if (!c_.quiet) {
    std::printf("trainer: member %d joined at step %lld as rank %d/%d; state received in %.1f ms (%.2f MB)\n",
                elastic_->memberId(), static_cast<long long>(step), rank_, world_, static_cast<double>(transferNs) / 1e6,
                static_cast<double>(bytes) / 1e6);
  }
}

void Trainer::failHereIf(int64_t step, const char* where) const {
  const int member = elastic_ ? elastic_->memberId() : rank_;
  for (const std::string& spec : c_.failAt) {
    const auto parts = dt::split(spec, ':');
    const int64_t at = std::stoll(parts[1]);
    // A member that joined after STEP cannot meet it: it fails in its first step instead.
    const bool now = step == at || (joinedAtStep_ > at && step == joinedAtStep_);
    if (std::stoi(parts[0]) == member && now && parts[2] == where) {
      logStep(str("kill ", step, " ", member));
      std::fflush(nullptr);
      ::kill(::getpid(), SIGKILL);
    }
  }
}

void Trainer::armBackwardFailure() {
  bool wanted = false;
  for (const std::string& spec : c_.failAt) wanted |= dt::split(spec, ':')[2] == "backward";
  if (!wanted) return;
  const std::vector<dt::Tensor> params = model_->parameters();
  auto fired = std::make_shared<size_t>(0);
  for (auto p : params) {
    p.registerPostAccumulateGradHook([this, fired, n = params.size()](dt::Tensor&) {
      if (++*fired % n == 0) failHereIf(currentStep_, "backward");
    });
  }
}

// One line per attempt at a step, written before the step's commit vote (a rank that dies
// after voting has still trained on its examples): "<membership epoch> <step> <data epoch> ids...".
// A step redone after a loss appears again with a later membership epoch; the last is the one
// that was committed.
void Trainer::recordSamples(int64_t step, const dt::data::LoadedBatch& batch) const {
  if (c_.recordSamples.empty()) return;
  const std::vector<int64_t> ids = sampler_->batchIndices(batch.position.epoch, batch.position.batch);
  const int member = elastic_ ? elastic_->memberId() : rank_;
  FILE* out = std::fopen(str(c_.recordSamples, ".", member).c_str(), "a");
  if (out == nullptr) throw dt::Error(str("trainer: cannot append to ", c_.recordSamples, ".", member, ": ", std::strerror(errno)));
  std::fprintf(out, "%llu %lld %lld", static_cast<unsigned long long>(elastic_ ? elastic_->membership().epoch : 0),
               static_cast<long long>(step), static_cast<long long>(batch.position.epoch));
  for (int64_t id : ids) std::fprintf(out, " %lld", static_cast<long long>(id));
  std::fprintf(out, "\n");
  std::fclose(out);
}

void Trainer::logStep(const std::string& line) const {
  if (!stepLog_) return;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::fprintf(stepLog_.get(), "%s %lld\n", line.c_str(), static_cast<long long>(ns));
  std::fflush(stepLog_.get());
}

void Trainer::dumpParameters(int64_t step) const {
  if (rank_ != 0 || std::find(c_.dumpAt.begin(), c_.dumpAt.end(), step) == c_.dumpAt.end()) return;
  std::filesystem::create_directories(c_.dumpDir);
  dt::NamedTensors tensors;
  for (const auto& [name, t] : model_->namedParameters()) tensors.emplace_back(name, t.to(dt::Device::cpu()));
  dt::saveSafetensors(std::filesystem::path(c_.dumpDir) / str("step-", step, ".safetensors"), tensors);
}

dt::TrainingState Trainer::trainingState() {
  dt::TrainingState state(rank_, world_);
  state.addModule("model", *model_);
  state.addOptimizer("optim", *optimizer_, dt::ParameterMap::replicated(*model_));
  state.addGenerator("rng", dropoutRng_);
  return state;
}

void Trainer::resumeOrStart() {
  if (!checkpoints_) return;
  if (c_.resume == "never" && restartCount_ == 0) {
    // A fresh start: the folder is cleared before anyone looks, so that a restart later
    // resumes from this run's checkpoints only.
    examples::clearCheckpoints(*group_, *checkpoints_, "trainer", c_.quiet);
    return;
  }
  // Rank 0 picks the checkpoint and tells the others, so every rank resumes from the same one.
  const std::optional<dt::CheckpointRef> ref = checkpoints_->latestAgreed(*group_);
  if (!ref) {
    if (restartCount_ > 0) say(str("trainer: restart ", restartCount_, " found no checkpoint in ", checkpoints_->path().string(), "; starting from step 0"));
    return;
  }
  const std::string file = ref->manifest.string();
  checkpoints_->readManifest(*ref).requireSame(
      resumeKeys(c_, modelName_, train_->size()), "config.",
      "Resume with the same settings, or start afresh with --resume never or another --checkpoint-dir");
  dt::TrainingState state = trainingState();
  const dt::CheckpointManifest m = checkpoints_->load(*ref, state, group_.get());
  if (m.worldSize != world_ && c_.dropout > 0) {
    say(str("trainer: note: checkpoint written by ", m.worldSize, " ranks, resumed by ", world_,
            ": the per-rank dropout streams restart from the seed, so this resume is not bitwise exact"));
  }
  startStep_ = state.step;
  if (m.has("ddp.bucket_order")) savedBucketOrder_ = dt::split(m.text("ddp.bucket_order"), ',');
  priorSeconds_ = static_cast<double>(m.integer("train_ms")) / 1000.0;
  recentLoss_ = std::strtod(m.text("train_loss").c_str(), nullptr);
  const int64_t savedTotal = m.integer("total_steps");
  if (savedTotal != totalSteps_) {
    say(str("trainer: note: the step budget changed from ", savedTotal, " to ", totalSteps_, "; the learning-rate schedule follows the new one"));
  }
  const auto pos = sampler_->positionAfter(startStep_);
  say(str("trainer: resumed from ", file, " (step ", startStep_, ", epoch ", pos.epoch + 1, " batch ", pos.batch, ", written by ",
          m.worldSize, " rank(s), ", m.text("reason"), ")", restartCount_ > 0 ? str(" after restart ", restartCount_) : ""));
}

void Trainer::periodicCheckpoint(int64_t& step, dt::DistributedDataParallel& ddp,
                                 std::unique_ptr<dt::data::PrefetchLoader>& loader) {
  if (!checkpoints_ || c_.checkpointEvery <= 0 || step % c_.checkpointEvery != 0 || step >= totalSteps_) return;
  while (true) {
    try {
      failHereIf(step, "checkpoint");
      saveCheckpoint(step, "periodic");
      return;
    } catch (const dt::Error&) {
      if (!elastic_) throw;
      recover(std::current_exception(), step, ddp, loader);  // every member is at this step: write it again
    }
  }
}

void Trainer::saveCheckpoint(int64_t step, const std::string& reason) {
  // A collective: every rank writes its part (here rank 0 holds everything but the other
  // ranks' RNG states, which travel to it).
  dt::TrainingState state = trainingState();
  state.step = step;
  const auto pos = sampler_->positionAfter(step);
  auto& m = state.metadata;
  m["epoch"] = std::to_string(pos.epoch);
  m["batch_in_epoch"] = std::to_string(pos.batch);
  m["samples_seen"] = std::to_string(step * c_.globalBatch);
  m["total_steps"] = std::to_string(totalSteps_);
  m["train_ms"] = std::to_string(static_cast<int64_t>((priorSeconds_ + runSeconds_) * 1000.0));
  m["reason"] = reason;
  // DDP settled its layout after the first step (docs/ddp.md, Rebuild); the layout decides the
  // order of every reduction, so a resume must reduce with it to stay bitwise exact.
  if (ddp_ != nullptr && ddp_->bucketsRebuilt()) m["ddp.bucket_order"] = dt::join(ddp_->bucketOrder(), ",");
  char loss[32];
  std::snprintf(loss, sizeof(loss), "%.6f", recentLoss_);
  m["train_loss"] = loss;
  for (const auto& [key, value] : resumeKeys(c_, modelName_, train_->size())) m["config." + key] = value;
  const dt::CheckpointRef ref = checkpoints_->save(state, group_.get());
  say(str("trainer: checkpoint at step ", step, " (", reason, ") written to ", ref.tensors.string()));
}

int Trainer::run() {
  restartCount_ = dt::env::getInt("DT_RESTART_COUNT");
  // The data first: a replacement that joins a running job has it ready when it is admitted.
  train_ = dt::data::loadFashionMnist(c_.data, dt::data::Split::Train);
  if (c_.eval) test_ = dt::data::loadFashionMnist(c_.data, dt::data::Split::Test);
  try {
    connect();
  } catch (const dt::JobFinishedError& e) {
    if (!c_.quiet) std::printf("trainer: %s; nothing to do\n", e.what());
    return 0;
  }
  const bool joining = elastic_ && elastic_->joinedNow();
  if (c_.globalBatch % world_ != 0 && !elastic_) {
    throw InvalidArgument(str("trainer: --global-batch ", c_.globalBatch, " is not divisible by the world size ", world_,
                              " (each rank takes global batch / world); use a multiple of ", world_, ", e.g. ",
                              std::max<int64_t>(world_, c_.globalBatch / world_ * world_)));
  }
  const int64_t perRank = c_.globalBatch / world_;
  if (!c_.stepLog.empty()) {
    stepLog_.reset(std::fopen(c_.stepLog.c_str(), "a"));
    if (!stepLog_) throw dt::Error(str("trainer: cannot append to ", c_.stepLog, ": ", std::strerror(errno)));
  }
  if (!c_.quiet) std::printf("trainer: rank %d/%d pid %d attempt %lld\n", rank_, world_, static_cast<int>(getpid()), static_cast<long long>(restartCount_ + 1));

  splitData();
  totalSteps_ = c_.steps > 0 ? c_.steps : c_.epochs * sampler_->batchesPerEpoch();
  const int64_t epochs = (totalSteps_ + sampler_->batchesPerEpoch() - 1) / sampler_->batchesPerEpoch();

  // The same initial model on every rank (DDP also broadcasts rank 0's); dropout masks differ per rank.
  initRng_.manualSeed(c_.seed);
  dropoutRng_.manualSeed(c_.seed * 0x9e3779b97f4a7c15ull + 1000 + static_cast<uint64_t>(rank_));
  constexpr int64_t kClasses = 10;
  model_ = buildModel(c_, train_->features(), kClasses, initRng_, dropoutRng_);
  model_->to(device_);  // initialised on the CPU, so every device starts from the same values
  modelName_ = modelName(train_->features(), c_.hidden, kClasses);
  if (c_.optimizer == "adamw") {
    optimizer_ = std::make_unique<dt::optim::AdamW>(model_->parameters(), dt::optim::AdamWOptions{.lr = c_.learningRate(), .weightDecay = c_.decay()});
  } else {
    optimizer_ = std::make_unique<dt::optim::SGD>(
        model_->parameters(), dt::optim::SGDOptions{.lr = c_.learningRate(), .momentum = c_.momentum, .weightDecay = c_.decay()});
  }
  if (c_.checkpoints()) checkpoints_.emplace(c_.checkpointDir, c_.keep);
  if (joining) {
    transferState(startStep_);  // the members send it right after admitting this process
    joinedAtStep_ = startStep_;
  } else {
    resumeOrStart();
    if (checkpoints_ && rank_ == 0) checkpoints_->removeTemporaries();  // only once the checkpoint read is good
  }

  dt::DistributedDataParallel ddp(model_, group_, {.bucketOrder = savedBucketOrder_, .syncAtConstruction = !joining});
  ddp_ = &ddp;
  const std::vector<dt::Tensor> params = model_->parameters();
  armBackwardFailure();
  int64_t paramCount = 0;
  for (const auto& p : params) paramCount += p.numel();

  say(str("trainer: ", world_, " rank(s) on ", device_.isCpu() ? std::string("cpu") : str("cuda (rank 0: ", device_.str(), ")"), "; ", train_->describe(), "; MLP ", modelName_, " (", paramCount, " parameters",
          c_.dropout > 0 ? str(", dropout ", c_.dropout) : "", "); ", c_.optimizer == "adamw" ? "AdamW" : "SGD", " lr ",
          c_.learningRate(), " ", c_.schedule, "; global batch ", c_.globalBatch, " (", perRank, " per rank); ", epochs,
          " epoch(s) = ", totalSteps_, " steps; ",
          checkpoints_ ? str("checkpoints every ", c_.checkpointEvery, " steps in ", checkpoints_->path().string(), " (keep ", c_.keep, ")")
                       : std::string("no checkpoints")));

  auto loader = std::make_unique<dt::data::PrefetchLoader>(train_, *sampler_, dt::data::LoaderOptions{.prefetch = c_.prefetch});
  loader->start(sampler_->positionAfter(std::min(startStep_, totalSteps_)));

  // The per-step control allreduce: {stop requested, previous step's loss, joiners waiting
  // (--elastic)}, summed over ranks.
  dt::Tensor control = dt::zeros({3}, dt::DType::Float64);
  double lastLoss = 0;
  double windowLoss = 0;  // mean over ranks of each step's loss since the last log line
  int64_t windowLosses = 0;
  int64_t step = startStep_;
  int stopSignal = 0;
  loopStart_ = Clock::now();
  Clock::time_point windowStart = loopStart_;
  int64_t windowStartStep = step;
  std::optional<Clock::time_point> benchStart;
  int64_t benchFromStep = startStep_ + c_.benchWarmup;

  // Admitted at a checkpoint's step, a joiner writes that checkpoint with the members: they write
  // it at the end of the step whose boundary admitted it, after the admission.
  if (joining) periodicCheckpoint(step, ddp, loader);
  while (step < totalSteps_) {
    if (c_.bench && step == benchFromStep) benchStart = Clock::now();
    if (c_.stepPauseMs > 0) std::this_thread::sleep_for(std::chrono::milliseconds(c_.stepPauseMs));
    double* ctl = control.data<double>();
    ctl[0] = examples::stopSignal().load() != 0 ? 1.0 : 0.0;
    ctl[1] = lastLoss;
    ctl[2] = elastic_ && elastic_->joinersWaiting() ? 1.0 : 0.0;
    try {
      // Elastic: the control allreduce is the step's commit vote, after backward: a rank joins
      // it only with its gradients reduced, and no rank applies the step unless every rank of
      // the group voted. Otherwise it is in flight while the step computes.
      dt::WorkPtr controlWork = elastic_ ? nullptr : group_->allreduce(control);
      dt::data::LoadedBatch batch = loader->next();
      currentStep_ = step;
      optimizer_->setLr(lrAt(step));
      optimizer_->zeroGrad();
      dt::Tensor loss = dt::crossEntropy(ddp(batch.batch.inputs.to(device_)), batch.batch.targets.to(device_));
      failHereIf(step, "forward");
      if (lossScale_ != 1.0) loss = dt::mul(loss, lossScale_);
      loss.backward();  // returns with gradients averaged over the ranks
      recordSamples(step, batch);
      if (elastic_) {
        group_->allreduce(control)->wait();
        failHereIf(step, "commit");
      }
      optimizer_->step();
      lastLoss = loss.item<float>() / lossScale_;
      if (controlWork) controlWork->wait();
      ++step;
      dumpParameters(step);
      // Every member voted the same sum: they all admit at this boundary.
      if (elastic_ && control.data<double>()[2] > 0 && control.data<double>()[0] == 0 && step < totalSteps_) {
        admitJoiners(step, ddp, loader);
      }
    } catch (const dt::Error&) {
      if (!elastic_) throw;
      recover(std::current_exception(), step, ddp, loader);
      continue;
    }
    runSeconds_ = std::chrono::duration<double>(Clock::now() - loopStart_).count();
    if (stepLog_ && rank_ == 0) logStep(str(step - 1, " ", elastic_ ? elastic_->membership().epoch : static_cast<uint64_t>(restartCount_), " ", world_));

    if (step > startStep_ + 1) {  // the reduced loss is the previous step's
      windowLoss += control.data<double>()[1] / world_;
      ++windowLosses;
    }
    const bool stop = control.data<double>()[0] > 0;
    if ((step % c_.logEvery == 0 || step == totalSteps_) && !stop) {
      recentLoss_ = windowLosses > 0 ? windowLoss / static_cast<double>(windowLosses) : lastLoss;
      if (!c_.quiet && rank_ == 0) {
        const double now = std::chrono::duration<double>(Clock::now() - windowStart).count();
        const double rate = static_cast<double>((step - windowStartStep) * c_.globalBatch) / std::max(now, 1e-9);
        const double perStep = runSeconds_ / static_cast<double>(step - startStep_);
        const auto pos = sampler_->positionAfter(step - 1);
        std::printf("epoch %lld/%lld  step %lld/%lld  loss %.4f  %.0f samples/s  elapsed %s  left %s\n",
                    static_cast<long long>(pos.epoch + 1), static_cast<long long>(epochs), static_cast<long long>(step),
                    static_cast<long long>(totalSteps_), recentLoss_, rate, formatSeconds(priorSeconds_ + runSeconds_).c_str(),
                    formatSeconds(perStep * static_cast<double>(totalSteps_ - step)).c_str());
        std::fflush(stdout);
      }
      windowLoss = 0;
      windowLosses = 0;
      windowStart = Clock::now();
      windowStartStep = step;
    }
    if (stop) {
      // Any rank's signal stops every rank here, after the same step.
      stopSignal = examples::stopSignal().load();
      break;
    }
    periodicCheckpoint(step, ddp, loader);
  }
  const double trainSeconds = runSeconds_;
  const Clock::time_point loopEnd = Clock::now();
  if (stopSignal != 0 || (step < totalSteps_)) {
    const std::string why = stopSignal != 0 ? signalName(stopSignal) : "a stop request on another rank";
    if (checkpoints_) saveCheckpoint(step, str("stopped by ", why));
    group_->barrier()->wait();
    say(str("trainer: stopped by ", why, " after step ", step, " of ", totalSteps_,
            checkpoints_ ? str("; checkpoint written, run again to resume from step ", step) : std::string("; no checkpoint (--checkpoint-dir none)")));
    if (!c_.quiet) std::printf("trainer: rank %d/%d stopped cleanly after step %lld\n", rank_, world_, static_cast<long long>(step));
    group_->destroy();
    return 0;
  }
  if (checkpoints_ && step > startStep_) saveCheckpoint(step, "final");

  // Identical parameters everywhere: max and min over ranks must agree.
  const double spread = examples::parameterSpread(*group_, params);

  std::optional<EvalResult> eval;
  if (c_.eval) eval = evaluate(*model_, *test_, *group_, device_);
  if (c_.bench && rank_ == 0) {
    if (!benchStart) {
      std::fprintf(stderr, "trainer: --bench measured nothing: it needs more than --bench-warmup %lld steps (ran %lld)\n",
                   static_cast<long long>(c_.benchWarmup), static_cast<long long>(step - startStep_));
    } else {
      const double seconds = std::chrono::duration<double>(loopEnd - *benchStart).count();
      const int64_t measured = step - benchFromStep;
      const auto stats = loader->stats();
      std::printf("RESULT trainer impl=dtrain device=%s world=%d global_batch=%lld model=%s optimizer=%s steps=%lld step_ms=%.3f "
                  "samples_per_s=%.1f data_wait_ms=%.3f\n",
                  device_.isCpu() ? "cpu" : "cuda", world_, static_cast<long long>(c_.globalBatch), modelName_.c_str(), c_.optimizer.c_str(),
                  static_cast<long long>(measured), 1e3 * seconds / static_cast<double>(measured),
                  static_cast<double>(measured * c_.globalBatch) / seconds, stats.waitMs);
    }
  }
  group_->barrier()->wait();
  group_->destroy();

  if (!c_.quiet) {
    std::printf("trainer: rank %d/%d final parameters fingerprint %016" PRIx64 " (spread across ranks %.3g)\n", rank_, world_,
                fingerprint(params), spread);
  }
  if (spread != 0.0) {
    std::fprintf(stderr, "trainer: rank %d/%d: parameters differ across ranks (max difference %g)\n", rank_, world_, spread);
    return 1;
  }
  if (rank_ == 0) {
    const double total = priorSeconds_ + trainSeconds;
    const double rate = static_cast<double>((step - startStep_) * c_.globalBatch) / std::max(trainSeconds, 1e-9);
    std::string line = str("trainer: done: ", step, " steps (", epochs, " epoch(s)) in ", formatSeconds(total));
    char buf[96];
    if (step > startStep_) {
      std::snprintf(buf, sizeof(buf), ", %.0f samples/s", rate);
      line += buf;
    } else {
      line += " (all in earlier runs: the checkpoint was already at the end)";
    }
    std::snprintf(buf, sizeof(buf), "; train loss %.4f", recentLoss_);
    line += buf;
    if (eval) {
      std::snprintf(buf, sizeof(buf), "; test loss %.4f, test accuracy %.4f", eval->loss, eval->accuracy);
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
      return 0;
    }
    const dt::Device device = deviceFor(config.device);
    dt::setCurrentDevice(device);  // before any CUDA call, so no rank opens a context on cuda:0 too
    examples::installStopHandlers("trainer");
    Trainer trainer(config, device);
    return trainer.run();
  });
}
