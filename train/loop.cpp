#include "train/loop.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <thread>
#include <unordered_set>

#include "checkpoint/exchange.h"
#include "checkpoint/transfer.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "parallel/checkpoint.h"
#include "parallel/clip_grad.h"
#include "process_group/init.h"
#include "store/prefix_store.h"
#include "store/status_records.h"
#include "tensor/autograd/anomaly.h"
#include "tensor/autograd/autograd.h"
#include "tensor/nn/clip_grad.h"
#include "tensor/ops.h"
#include "train/pipeline_state.h"
#include "train/support.h"

namespace dt::train {

using Clock = std::chrono::steady_clock;
// Per rank in a gather step's control vote: steps counted, then the means of data wait,
// forward, backward, communication wait and the whole step (ms).
constexpr int kFigureSlots = 6;

// A record for dtrun's status page (store/status_records.h) is never worth a step: a store that
// does not take it is said once per process and training goes on.
template <typename Post>
void postStatus(const StorePtr& store, const std::string& program, Post&& post) {
  if (!store) return;
  try {
    post(*store);
  } catch (const std::exception& e) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) {
      std::fprintf(stderr, "%s: cannot post a status record to the job's store (dtrun's status page misses it): %s\n",
                   program.c_str(), e.what());
    }
  }
}

// A double that reads back bitwise (a loss carried in metadata or to a joiner).
static std::string exactDouble(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.17g", v);
  return text;
}

// v averaged over `group` (a collective; v itself on a group of one).
static double meanOver(ProcessGroup& group, double v, const Device& device) {
  if (group.size() == 1) return v;
  Tensor sum = full({1}, v, DType::Float64, device);
  group.allreduce(sum)->wait();
  return sum.to(Device::cpu()).item<double>() / static_cast<double>(group.size());
}

int64_t epochMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Rank 0's events (recoveries, admissions, checkpoints) for the page: the line it prints.
void statusEvent(const StorePtr& store, const ProcessGroup& group, const std::string& program, const char* kind,
                 const std::string& text) {
  if (group.rank() != 0) return;
  postStatus(store, program, [&](Store& s) { status::postEvent(s, {epochMs(), kind, text}); });
}

const char* phaseName(Phase phase) {
  switch (phase) {
    case Phase::Begin: return "begin";
    case Phase::Forward: return "forward";
    case Phase::Backward: return "backward";
    case Phase::Commit: return "commit";
    case Phase::Checkpoint: return "checkpoint";
  }
  return "?";
}

TestSwitches TestSwitches::fromEnvironment(TestSwitches given) {
  if (given.failAt.empty()) {
    for (const std::string& spec : split(env::getString("DT_TEST_FAIL_AT"), ',')) {
      if (!spec.empty()) given.failAt.push_back(spec);
    }
  }
  for (const std::string& spec : given.failAt) {
    const auto parts = split(spec, ':');
    const bool ok = parts.size() == 3 && !parts[0].empty() && !parts[1].empty() &&
                    parts[0].find_first_not_of("0123456789") == std::string::npos &&
                    parts[1].find_first_not_of("0123456789") == std::string::npos &&
                    (parts[2] == "forward" || parts[2] == "backward" || parts[2] == "commit" || parts[2] == "checkpoint");
    if (!ok) {
      throw InvalidArgument(str("fail-at \"", spec, "\" is not MEMBER:STEP:PHASE with PHASE one of forward, backward, "
                                "commit, checkpoint"));
    }
  }
  if (given.recordSamples.empty()) given.recordSamples = env::getString("DT_TEST_RECORD_SAMPLES");
  if (given.stepPauseMs == 0) given.stepPauseMs = env::getInt("DT_TEST_STEP_PAUSE_MS");
  if (given.stepPauseMs < 0) throw InvalidArgument(str("step pause ", given.stepPauseMs, " ms is negative"));
  if (given.slowRank.empty()) given.slowRank = env::getString("DT_TEST_SLOW_RANK");
  if (!given.slowRank.empty()) {
    const auto parts = split(given.slowRank, ':');
    const bool ok = (parts.size() == 2 || (parts.size() == 3 && (parts[2] == "forward" || parts[2] == "data"))) &&
                    !parts[0].empty() && !parts[1].empty() && parts[0].size() < 10 &&
                    parts[0].find_first_not_of("0123456789") == std::string::npos &&
                    parts[1].find_first_not_of("0123456789") == std::string::npos && parts[1].size() < 10;
    if (!ok) {
      throw InvalidArgument(str("slow rank \"", given.slowRank, "\" is not MEMBER:MS[:forward|data] (e.g. 2:200: member 2 "
                                "sleeps 200 ms in each forward; 2:200:data: while it waits for each batch)"));
    }
    given.slowMember = std::stoi(parts[0]);
    given.slowMs = std::stoll(parts[1]);
    given.slowInData = parts.size() == 3 && parts[2] == "data";
  }
  if (given.waitForJoinerAt < 0 && !env::getString("DT_TEST_WAIT_FOR_JOINER_AT").empty()) {
    given.waitForJoinerAt = env::getInt("DT_TEST_WAIT_FOR_JOINER_AT");
  }
  return given;
}

// The log window: what the progress line averages.
struct Loop::Window {
  double lossSum = 0;
  int64_t losses = 0;
  Clock::time_point start;
  int64_t startStep = 0;
  std::vector<std::pair<std::string, double>> metricSums;  // rank 0's, in first-seen order
  int64_t metricSteps = 0;

  void reset(int64_t step) {
    lossSum = 0;
    losses = 0;
    start = Clock::now();
    startStep = step;
    metricSums.clear();
    metricSteps = 0;
  }
  void addMetrics(const std::vector<std::pair<std::string, double>>& values) {
    for (const auto& [name, v] : values) {
      auto it = std::find_if(metricSums.begin(), metricSums.end(), [&](const auto& e) { return e.first == name; });
      if (it == metricSums.end()) metricSums.emplace_back(name, v);
      else it->second += v;
    }
    ++metricSteps;
  }
};

Loop::Loop(LoopOptions options) : options_(std::move(options)) {
  const std::string& p = options_.program;
  if (options_.steps <= 0) throw InvalidArgument(str(p, ": LoopOptions::steps is ", options_.steps, "; it must be positive"));
  if (options_.globalBatch <= 0) {
    throw InvalidArgument(str(p, ": LoopOptions::globalBatch is ", options_.globalBatch, "; it must be positive"));
  }
  if (options_.microBatches < 1) {
    throw InvalidArgument(str(p, ": LoopOptions::microBatches is ", options_.microBatches, "; it must be at least 1"));
  }
  if (options_.logEvery < 1) throw InvalidArgument(str(p, ": LoopOptions::logEvery is ", options_.logEvery, "; it must be at least 1"));
  if (options_.clipGradNorm < 0 || !std::isfinite(options_.clipGradNorm)) {
    throw InvalidArgument(str(p, ": LoopOptions::clipGradNorm is ", options_.clipGradNorm, "; use 0 (no clipping) or a positive norm"));
  }
  if (options_.checkpointEvery < 0 || options_.keep < 1) {
    throw InvalidArgument(str(p, ": LoopOptions::checkpointEvery ", options_.checkpointEvery, " and keep ", options_.keep,
                              ": every must be 0 or more, keep 1 or more"));
  }
  restartCount_ = env::getInt("DT_RESTART_COUNT");
  options_.test = TestSwitches::fromEnvironment(options_.test);
  try {
    options_.stragglers = StragglerOptions::fromEnvironment(options_.stragglers);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(str(p, ": ", e.what()));
  }
  if (options_.stragglers.every > 0) stragglers_.emplace(options_.stragglers.threshold, options_.stragglers.window);
  const bool elastic = options_.forceElastic || env::getBool("DT_ELASTIC");
  if (const int t = options_.tensorParallel; t != 1) {
    if (t < 1) throw InvalidArgument(str(p, ": LoopOptions::tensorParallel is ", t, "; it must be 1 (off) or more"));
    const char* sharding = options_.sharding == Sharding::Full    ? "Full"
                           : options_.sharding == Sharding::Zero1 ? "Zero1"
                                                                  : "Zero2";
    if (options_.sharding != Sharding::None && elastic && options_.pipeline.degree == 1 && options_.checkpointDir.empty()) {
      // A lost TP group's rows of the wrapper's shards have no other copy: the survivors reload
      // them from the newest checkpoint, so there must be one (said here rather than at the
      // first loss). A pipeline says the same in its own terms below.
      throw InvalidArgument(str(p, ": tensor parallelism (tensorParallel ", t, ") with Sharding::", sharding,
                                " under dtrun --elastic needs LoopOptions::checkpointDir: a lost rank's shards have no "
                                "other copy and come back from the newest checkpoint; set one, or use Sharding::None "
                                "(DDP over the replicas)"));
    }
    // A loss takes its whole TP group (one model replica) out; joiners come back t at a time.
    options_.elastic.replicaSize = t;
  }
  if (const int pp = options_.pipeline.degree; pp != 1) {
    const auto refuse = [&](const std::string& what) {
      return InvalidArgument(str(p, ": pipeline parallelism (pipeline.degree ", pp, ") ", what));
    };
    if (pp < 1) throw refuse("must be 1 (off) or more");
    if (options_.sharding != Sharding::None && elastic && options_.checkpointDir.empty()) {
      const char* sharding = options_.sharding == Sharding::Full ? "Full" : options_.sharding == Sharding::Zero1 ? "Zero1" : "Zero2";
      // A lost rank's rows of its stages have no other copy: the survivors reload them from the
      // newest checkpoint, so there must be one (said here rather than at the first loss).
      throw refuse(str("with Sharding::", sharding, " under dtrun --elastic needs LoopOptions::checkpointDir: a lost "
                       "rank's shards have no other copy and come back from the newest checkpoint; set one, or use "
                       "Sharding::None (DDP over the pipeline replicas)"));
    }
    if (options_.microBatches != 1) {
      throw refuse(str("with microBatches ", options_.microBatches,
                       ": the pipeline's micro-batches are pipeline.microBatches; leave microBatches at 1"));
    }
    // A replica is the whole pipeline with its TP groups: p t adjacent ranks, lost and joined together.
    options_.elastic.replicaSize = pp * std::max(options_.tensorParallel, 1);
  }
  if (options_.stopOnSignals) installStopHandlers(p);
  try {
    if (elastic) {
      elastic_ = elastic::ElasticGroup::fromEnvironment(options_.elastic);
      group_ = elastic_->group();
      joining_ = elastic_->joinedNow();
    } else {
      // initProcessGroup's two steps, keeping the job's store for the pipeline's failure causes.
      JobConnection job = connectJob();
      store_ = job.store;
      group_ = ProcessGroup::create(job.store, job.rank, job.worldSize, std::move(job.group));
    }
  } catch (const JobFinishedError& e) {
    finished_ = e.what();  // a replacement started after the job ended: nothing to do
    return;
  }
  if (options_.tensorParallel != 1 && !pipelined()) {
    const int world = group_->size(), t = options_.tensorParallel;
    if (world % t != 0) {
      throw InvalidArgument(str(p, ": tensorParallel ", t, " does not divide the world size ", world,
                                " (the mesh is {dp: world / tp, tp: tp})"));
    }
    makeMesh();
  }
  if (pipelined()) {
    const int world = group_->size(), pp = options_.pipeline.degree, t = options_.tensorParallel;
    const std::string tp = t > 1 ? str(" x tensorParallel ", t) : std::string();
    if (world % (pp * t) != 0) {
      throw InvalidArgument(str(p, ": pipeline degree ", pp, tp, " does not divide the world size ", world,
                                t > 1 ? " (the mesh is {dp: world / (pp tp), pp: pp, tp: tp})" : " (the mesh is {dp: world / pp, pp: pp})"));
    }
    makeSchedule();
    microBatchRows(world, "");
    makeMesh();
  }
  if (!options_.checkpointDir.empty()) checkpoints_.emplace(options_.checkpointDir, options_.keep);
}

void Loop::makeSchedule() {
  namespace pl = dt::pipeline;
  const LoopOptions::Pipeline& o = options_.pipeline;
  const int p = o.degree, m = o.microBatches == 0 ? p : o.microBatches;
  if (!o.scheduleFile.empty()) {
    pl::Schedule mine = pl::parseFile(o.scheduleFile);
    const std::string where = str(options_.program, ": pipeline schedule file ", o.scheduleFile, " (", mine.name, ", p=",
                                  mine.p, " m=", mine.m, " v=", mine.v, ")");
    if (mine.p != p) throw InvalidArgument(str(where, ": it is for ", mine.p, " ranks but pipeline.degree is ", p));
    if (o.microBatches != 0 && mine.m != o.microBatches) {
      throw InvalidArgument(str(where, ": its m is ", mine.m, " but pipeline.microBatches is ", o.microBatches,
                                "; set it to 0 (the file's) or to ", mine.m));
    }
    try {
      pl::validate(mine);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(str(where, ": ", e.what()));
    }
    schedule_ = std::move(mine);
    return;
  }
  const std::string& name = o.schedule;
  const std::string where = str(options_.program, ": pipeline schedule \"", name, "\" over ", p, " ranks with ", m,
                                " micro-batch(es)");
  if (m < 1) throw InvalidArgument(str(where, ": pipeline.microBatches must be at least 1 (0: the degree)"));
  if (name == "interleaved" && o.virtualStages < 1) {
    throw InvalidArgument(str(where, ": pipeline.virtualStages is ", o.virtualStages, "; it must be at least 1"));
  }
  if (name != "zb1" && o.maxPendingWeightGrads != 0) {
    throw InvalidArgument(str(where, ": pipeline.maxPendingWeightGrads ", o.maxPendingWeightGrads,
                              " bounds ZB-H1's deferred weight gradients; use schedule zb1, or leave it at 0"));
  }
  try {
    if (name == "gpipe") schedule_ = pl::gpipe(p, m);
    else if (name == "1f1b") schedule_ = pl::oneFOneB(p, m);
    else if (name == "interleaved") schedule_ = pl::interleavedOneFOneB(p, m, o.virtualStages);
    else if (name == "zb1") schedule_ = pl::zeroBubbleH1(p, m, o.maxPendingWeightGrads);
    else if (name == "zbv") schedule_ = pl::zeroBubbleV(p, m);
    else throw InvalidArgument("unknown; use gpipe, 1f1b, interleaved, zb1 or zbv");
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(str(where, ": ", e.what()));
  }
}

int64_t Loop::microBatchRows(int world, const std::string& when) const {
  const int pp = options_.pipeline.degree, t = options_.tensorParallel;
  const std::string tp = t > 1 ? str(" x tensorParallel ", t) : std::string();
  const int dp = world / (pp * t), m = schedule_->m;
  if (options_.globalBatch % dp != 0 || options_.globalBatch / dp % m != 0) {
    // Elastic, the global batch stays and m stays; only the rows per micro-batch follow dp.
    throw InvalidArgument(str(options_.program, ": ", when, "the global batch ", options_.globalBatch, " does not split into ",
                              dp, " data-parallel replica(s) (world ", world, " / pipeline degree ", pp, tp, ") of ", m,
                              " micro-batches each; use a multiple of ", dp * m,
                              when.empty() ? std::string() : " (or of every data-parallel size the job may shrink to)"));
  }
  return options_.globalBatch / dp / m;
}

void Loop::makeRunner() {
  const nn::Gpt& model = dynamic_cast<const nn::Gpt&>(*model_);
  const std::vector<Tensor> params = model.parameters();
  const DType dtype = params.empty() ? DType::Float32 : params.front().dtype();
  const int64_t rows = microBatchRows(group_->size(), "");
  const int t = options_.tensorParallel;
  const int64_t T = model.config().contextLength;
  // The first rank to fail leaves its error here for the others, under a prefix of this group
  // instance: an elastic epoch's groups reuse the names (and the runner its step numbers) of
  // the epoch before.
  StorePtr store = elastic_ ? elastic_->store() : store_;
  if (store) {
    store = std::make_shared<PrefixStore>(
        elastic_ ? str("loop/pipeline/e", elastic_->membership().epoch) : std::string("loop/pipeline"), store);
  }
  runner_ = std::make_unique<pipeline::PipelineRunner>(
      *schedule_, stages_->runnerStages(), (*mesh_)["pp"],
      pipeline::PipelineOptions{.activationShape = {rows, options_.pipeline.sequenceParallel ? T / t : T, model.config().width},
                                .activationDType = dtype,
                                .store = std::move(store)});
}

void Loop::makeMesh() {
  // Row-major with tp innermost: a replica is t adjacent ranks, which the elastic membership
  // keeps together (ElasticOptions::replicaSize), so a rank's tp coordinate never changes.
  // A pipeline's ranks are adjacent too (torchtitan puts pp outermost, for hosts joined by a
  // slower network): its activations cross between stages every micro-batch, while dp's
  // reduction comes once a step, so the pipeline is the traffic to keep on one host.
  // With tensor parallelism too, tp stays innermost (one host, a collective per layer) and pp
  // next: {dp, pp, tp}.
  if (pipelined()) {
    const int pp = options_.pipeline.degree, t = options_.tensorParallel;
    std::vector<MeshDimension> dims{{"dp", group_->size() / (pp * t)}, {"pp", pp}};
    if (t > 1) dims.push_back({"tp", t});
    mesh_ = DeviceMesh::create(group_, dims);
    return;
  }
  const int t = options_.tensorParallel;
  mesh_ = DeviceMesh::create(group_, {{"dp", group_->size() / t}, {"tp", t}});
}

const DeviceMesh& Loop::mesh() const {
  if (!mesh_) {
    throw InvalidArgument(str(options_.program, ": mesh() without tensor or pipeline parallelism (LoopOptions::tensorParallel is ",
                              options_.tensorParallel, ", pipeline.degree ", options_.pipeline.degree, ")"));
  }
  return *mesh_;
}

ProcessGroup& Loop::dataParallelGroup() const { return mesh_ ? *(*mesh_)["dp"] : group(); }

Loop::~Loop() {
  loader_.reset();
  stagesGathered_.reset();  // before the wrapper it belongs to
  zero_.reset();  // it holds on to DDP
  fsdp_.reset();
  ddp_.reset();
  if (!elastic_ && group_) group_->destroy();
}

ProcessGroup& Loop::group() const {
  if (!group_) throw InvalidArgument(str(options_.program, ": no group: ", finished_));
  return *group_;
}

void Loop::say(const std::string& line) const {
  if (group_ && group_->rank() == 0 && !options_.quiet) std::printf("%s\n", line.c_str());
}

void Loop::setModel(std::shared_ptr<nn::Module> model) {
  if (!model) throw InvalidArgument(str(options_.program, ": setModel: the model is null"));
  if (dynamic_cast<DistributedDataParallel*>(model.get()) != nullptr) {
    throw InvalidArgument(str(options_.program, ": setModel: the model is already wrapped in DistributedDataParallel; "
                              "give the module itself: the loop wraps it for its group and rebinds it when the group "
                              "changes"));
  }
  if (pipelined()) {
    throw InvalidArgument(str(options_.program, ": setModel under pipeline parallelism (pipeline.degree ",
                              options_.pipeline.degree, "): hand the whole nn::Gpt to setPipelineModel, which splits it"));
  }
  model_ = std::move(model);
  if (!group_ || options_.sharding != Sharding::Full) return;  // DDP and ZeRO: made in run()
  FullyShardOptions sharded = options_.fullyShard;
  sharded.joining = joining_;
  fsdp_ = std::make_unique<FullyShardedDataParallel>(model_, dataGroup(), sharded);  // over dp under TP
}

void Loop::setModel(std::shared_ptr<nn::Module> model, FullyShardOptions sharded) {
  options_.fullyShard = std::move(sharded);
  setModel(std::move(model));
}

void Loop::setPipelineModel(std::shared_ptr<nn::Gpt> model) {
  const std::string& p = options_.program;
  if (!model) throw InvalidArgument(str(p, ": setPipelineModel: the model is null"));
  if (!pipelined()) {
    throw InvalidArgument(str(p, ": setPipelineModel without pipeline parallelism (pipeline.degree ",
                              options_.pipeline.degree, "); use setModel"));
  }
  if (stages_) throw InvalidArgument(str(p, ": setPipelineModel called twice"));
  if (!group_) {  // a replacement that found the job finished: run() says so
    model_ = std::move(model);
    return;
  }
  const ProcessGroupPtr& pp = (*mesh_)["pp"];
  try {
    stages_ = pipeline::splitGpt(*model, *schedule_, pp->rank(), {.rule = options_.pipeline.split});
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(str(p, ": setPipelineModel: schedule ", schedule_->name, " over ", schedule_->p, " rank(s) x ",
                              schedule_->v, " virtual stage(s): ", e.what()));
  }
  const int64_t rows = microBatchRows(group_->size(), "");
  // Sequence parallelism: a stage boundary carries this rank's block of the sequence.
  const int t = options_.tensorParallel;
  const int64_t T = model->config().contextLength;
  if (options_.pipeline.sequenceParallel && (t == 1 || !model->layout() || T % t != 0)) {
    throw InvalidArgument(str(p, ": pipeline.sequenceParallel with tensorParallel ", t, ", context ", T,
                              model->layout() ? "" : " and a model that is not tensor-parallel",
                              ": it needs a model parallelized with sequence parallelism over tp, and T a multiple of tp"));
  }
  if (t > 1 && !model->layout()) {
    throw InvalidArgument(str(p, ": setPipelineModel with tensorParallel ", t, ": parallelize the model over mesh() first "
                              "(dt::parallelize), then hand it over"));
  }
  model_ = std::move(model);
  releaseOtherStages();
  makeRunner();
  if (options_.sharding != Sharding::None) shardStages();
  if (mesh_->coordinate("dp") == 0 && !options_.quiet) {
    std::string lines;
    for (const std::string& line : split(stages_->summary(), '\n')) lines += str(p, ": ", line, "\n");
    if (pp->rank() == 0) {
      lines = str(p, ": pipeline ", schedule_->name, " over ", schedule_->p, " rank(s) x ", mesh_->size("dp"),
                  " data-parallel replica(s), ", schedule_->m, " micro-batches of ", rows, ", ", schedule_->numStages(),
                  " stage(s)\n") + lines;
    }
    std::fputs(lines.c_str(), stdout);
    std::fflush(stdout);
  }
}

namespace {

// This rank's stages as one module for the sharded wrapper: each distinct submodule of the chunks
// once (V's rank 0 holds the tied embedding in two chunks, and one tensor must be one shard).
class StageModules final : public nn::Module {
 public:
  explicit StageModules(const pipeline::GptStages& stages) {
    std::unordered_set<const nn::Module*> seen;
    for (size_t c = 0; c < stages.chunks.size(); ++c) {
      for (const auto& [name, child] : stages.chunks[c]->namedChildren()) {
        if (seen.insert(child.get()).second) registerModule(str("chunk", c, "_", name), child);
      }
    }
  }
  Tensor forward(const Tensor&) override {
    throw InvalidArgument("train: the pipeline's stage modules are run by the pipeline runner, chunk by chunk");
  }
  std::string typeName() const override { return "PipelineStages"; }
};

}  // namespace

void Loop::shardStages() {
  const std::string& p = options_.program;
  const DType dtype = stages_->parameters().front().dtype();
  if (options_.fullyShard.mixedPrecision.paramDtype != dtype) {
    throw InvalidArgument(str(p, ": pipeline parallelism with Sharding and mixed-precision parameters (",
                              toString(options_.fullyShard.mixedPrecision.paramDtype), " for ", toString(dtype),
                              " parameters) is not built yet: the stage boundaries carry the parameters' dtype"));
  }
  // Every block of the stages a unit; the embeddings, ln_f and the head the root. They are all
  // gathered together once a step (gatherFullParameters), so the units only decide how the
  // gathers and reduce-scatters are cut.
  auto stagesModule = std::make_shared<StageModules>(*stages_);
  FullyShardOptions sharded = options_.fullyShard;
  sharded.units.clear();
  // A joiner's stages start empty and receive their rows from the members (redistributeShards),
  // who rebind to the same dp group meanwhile; the members' first wrapping broadcasts dp rank 0's.
  sharded.joining = joining_;
  std::unordered_set<const nn::Module*> blocks;
  for (const auto& [name, block] : dynamic_cast<const nn::Gpt&>(*model_).h->namedChildren()) blocks.insert(block.get());
  for (const auto& [name, child] : stagesModule->namedChildren()) {
    for (const auto& [inner, block] : child->namedChildren()) {
      if (blocks.count(block.get())) sharded.units.push_back(block);
    }
  }
  fsdp_ = std::make_unique<FullyShardedDataParallel>(stagesModule, dataGroup(), sharded);  // collective over dp
  shardOf_.clear();
  const std::vector<Tensor> params = stages_->parameters();
  const std::vector<optim::ParamGroup> mapped = fsdp_->paramGroups({{params, 0.0}});
  for (size_t i = 0; i < params.size(); ++i) shardOf_.emplace(params[i].id(), mapped.front().params[i]);
}

StageShards Loop::stageShards() const {
  const ParameterMap map = fsdp_->parameterMap();
  StageShards out;
  size_t index = 0;
  for (const auto& [id, shard] : shardOf_) out.emplace(id, StageShard{shard, map.of(shard, index++)});
  return out;
}

Tensor Loop::stageShard(const Tensor& parameter) const {
  auto it = shardOf_.find(parameter.id());
  if (it == shardOf_.end()) {
    throw InvalidArgument(str(options_.program, ": ", parameter.describe(), " is no parameter of this rank's sharded stages"));
  }
  return it->second;
}

void Loop::releaseOtherStages() {
  // The other stages' parameters are nobody's to train here: their bytes go, while the tensors
  // stay for their names and shapes (checkpoints, paramGroups, decay groups read those), until
  // gatherPipelineModel gives them memory and values again. A storage a stage uses stays.
  std::vector<Storage> mine;
  for (const Tensor& t : stages_->parameters()) mine.push_back(t.storage());
  const auto used = [&mine](const Storage& s) {
    return std::any_of(mine.begin(), mine.end(), [&s](const Storage& m) { return m.isSameAs(s); });
  };
  for (const auto& [name, t] : model_->namedParameters()) {
    Storage storage = t.storage();
    if (storage.nbytes() == 0 || used(storage)) continue;
    released_.emplace_back(storage, storage.nbytes());
    storage.resizeBytes(0);
  }
}

void Loop::requireParts() const {
  if (!model_) throw InvalidArgument(str(options_.program, ": parameters() before setModel()"));
  if (zeroSharded() && !zero_ && !fsdp_) {
    throw InvalidArgument(str(options_.program, ": ZeRO's parts of the parameters exist once run() has wrapped the model: "
                              "make the optimizer in setOptimizer's factory, which run() calls then"));
  }
}

std::vector<Tensor> Loop::parameters() const {
  requireParts();
  if (stages_ && !fsdp_) return stages_->parameters();
  if (fsdp_) return fsdp_->parameters();
  if (zero_) return zero_->parameters();
  return model_->parameters();
}

std::vector<optim::ParamGroup> Loop::paramGroups(const std::vector<optim::ParamGroup>& groups) const {
  requireParts();
  if (stages_) {
    // The whole model's tensors by name, then the stage's under the same names: the last
    // stage's tied copy is "wte.weight" as the original is.
    std::unordered_map<const void*, std::string> names;  // by identity: the other stages' tensors hold no bytes
    for (const auto& [name, t] : model_->namedParameters()) names.emplace(t.id(), name);
    std::map<std::string, Tensor> mine;
    for (const auto& [name, t] : stages_->namedParameters()) mine.emplace(name, t);
    std::vector<optim::ParamGroup> out;
    std::unordered_set<const void*> taken;
    for (const optim::ParamGroup& g : groups) {
      optim::ParamGroup kept{{}, g.weightDecay};
      for (const Tensor& t : g.params) {
        auto name = names.find(t.id());
        if (name == names.end()) {
          throw InvalidArgument(str(options_.program, ": paramGroups: ", t.describe(), " is not a parameter of the model"));
        }
        auto it = mine.find(name->second);
        if (it != mine.end() && taken.insert(it->second.dataPtr()).second) kept.params.push_back(it->second);
      }
      if (!kept.params.empty()) out.push_back(std::move(kept));
    }
    return fsdp_ ? fsdp_->paramGroups(out) : out;
  }
  if (fsdp_) return fsdp_->paramGroups(groups);
  if (zero_) return zero_->paramGroups(groups);
  return groups;
}

void Loop::setOptimizer(optim::Optimizer& optimizer, std::function<double(int64_t)> learningRate) {
  if (zeroSharded() && !pipelined()) {
    throw InvalidArgument(str(options_.program, ": with ZeRO the optimizer is made over ZeRO's parts, which run() creates "
                              "once it knows DDP's bucket layout: use setOptimizer([](dt::train::Loop& l) { return "
                              "std::make_unique<...>(l.parameters(), ...); })"));
  }
  optimizer_ = &optimizer;
  makeOptimizer_ = nullptr;
  learningRate_ = std::move(learningRate);
}

void Loop::setOptimizer(OptimizerFactory make, std::function<double(int64_t)> learningRate) {
  if (!make) throw InvalidArgument(str(options_.program, ": setOptimizer: the optimizer factory is empty"));
  makeOptimizer_ = std::move(make);
  optimizer_ = nullptr;
  learningRate_ = std::move(learningRate);
}

optim::Optimizer& Loop::optimizer() {
  if (optimizer_ == nullptr) {
    throw InvalidArgument(str(options_.program, makeOptimizer_ ? ": the factory's optimizer exists only inside run()"
                                                               : ": no optimizer: call setOptimizer()"));
  }
  return *optimizer_;
}

void Loop::makeOptimizer() {
  ownedOptimizer_.reset();  // its state lives on the parts of the old group
  ownedOptimizer_ = makeOptimizer_(*this);
  if (!ownedOptimizer_) throw InvalidArgument(str(options_.program, ": setOptimizer's factory returned no optimizer"));
  optimizer_ = ownedOptimizer_.get();
  checkOptimizer();
}

void Loop::wrapReplicated(bool synchronize) {
  zero_.reset();  // it holds on to DDP
  DdpOptions ddpOptions = options_.ddp;
  ddpOptions.bucketOrder = bucketOrder_;
  ddpOptions.syncAtConstruction = synchronize;
  ddp_ = std::make_unique<DistributedDataParallel>(model_, dataGroup(), ddpOptions);
}

void Loop::shardOptimizerState() {
  zero_.reset();
  zero_ = std::make_unique<ZeroRedundancy>(*ddp_, ZeroOptions{.stage = options_.sharding == Sharding::Zero1 ? 1 : 2});
  makeOptimizer();
}

void Loop::settleBuckets(const StepFunction& fn) {
  const bool wasTraining = model_->isTraining();
  model_->eval();  // no dropout draws: the random streams stay where a resumed run finds them
  const data::SamplerPosition first = sampler_->positionAfter(0);
  const std::vector<int64_t> ids = sampler_->batchIndices(first.epoch, first.batch);
  const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(ids.size()) / options_.microBatches);
  const data::Batch batch = dataset_->get(std::span<const int64_t>(ids.data(), static_cast<size_t>(rows)));
  fn(batch).loss.backward();
  model_->zeroGrad();
  model_->train(wasTraining);
}

void Loop::setData(std::shared_ptr<const data::Dataset> dataset) {
  if (!dataset || dataset->size() <= 0) throw InvalidArgument(str(options_.program, ": setData: the dataset is empty"));
  dataset_ = std::move(dataset);
}

void Loop::setEvaluation(EvalFunction evaluate, std::vector<std::string> names) {
  evaluate_ = std::move(evaluate);
  evaluationNames_ = std::move(names);
}

void Loop::addState(const std::string& name, Tensor tensor) {
  if (!tensor.defined()) throw InvalidArgument(str(options_.program, ": addState(\"", name, "\"): the tensor is undefined"));
  extraTensors_.emplace_back(name, std::move(tensor));
}
void Loop::addState(const std::string& name, Generator& perRankStream) { extraStreams_.emplace_back(name, &perRankStream); }
void Loop::addState(const std::string& name, int64_t& value) { extraValues_.emplace_back(name, &value); }

DistributedDataParallel& Loop::ddp() {
  if (pipelined()) {
    throw InvalidArgument(str(options_.program, ": no DDP wrapper under pipeline parallelism (the stage's gradients are "
                              "averaged over the dp group after each step)"));
  }
  if (!ddp_) {
    throw InvalidArgument(str(options_.program, fsdp_ ? ": the model is fully sharded, not in DDP"
                                                      : ": the wrapped model exists only inside run()"));
  }
  return *ddp_;
}

Tensor Loop::forward(const Tensor& input) {
  if (pipelined()) {
    throw InvalidArgument(str(options_.program, ": forward() under pipeline parallelism: no rank holds the whole model; "
                              "the loop runs the pipeline itself (run() with an empty step function)"));
  }
  return fsdp_ ? (*fsdp_)(input) : ddp()(input);
}

void Loop::checkSetUp() const {
  const std::string& p = options_.program;
  if (!model_) throw InvalidArgument(str(p, pipelined() ? ": run() before setPipelineModel()" : ": run() before setModel()"));
  if (optimizer_ == nullptr && !makeOptimizer_) throw InvalidArgument(str(p, ": run() before setOptimizer()"));
  if (!dataset_) throw InvalidArgument(str(p, ": run() before setData()"));
  const int world = dataGroup()->size();
  if (!elastic_ && options_.globalBatch % world != 0) {
    throw InvalidArgument(str(p, ": the global batch ", options_.globalBatch, " is not divisible by the ",
                              mesh_ ? "data-parallel size (world / tensor or pipeline parallel) " : "world size ", world,
                              " (each rank takes global batch / world); use a multiple of ", world, ", e.g. ",
                              std::max<int64_t>(world, options_.globalBatch / world * world)));
  }
}

void Loop::checkOptimizer() const {
  const std::string& p = options_.program;
  // The optimizer must update exactly the model's parameters (a model rebuilt after the
  // optimizer was made, or another model's optimizer, trains nothing or the wrong thing).
  std::unordered_set<const void*> theirs;
  for (const Tensor& t : optimizer_->params()) theirs.insert(t.dataPtr());
  std::vector<std::pair<std::string, Tensor>> named;
  if (stages_) {
    std::unordered_set<const void*> seen;
    for (const auto& [name, t] : stages_->namedParameters()) {
      if (seen.insert(t.dataPtr()).second) named.emplace_back(name, fsdp_ ? stageShard(t) : t);
    }
  } else if (options_.sharding == Sharding::None) {
    named = model_->namedParameters();
  } else {
    for (const Tensor& t : parameters()) named.emplace_back(str("shard ", named.size()), t);
  }
  for (const auto& [name, t] : named) {
    if (!theirs.count(t.dataPtr())) {
      throw InvalidArgument(str(p, ": the optimizer does not update the model's parameter \"", name, "\" (",
                                t.describe(), "); it holds ", optimizer_->params().size(), " tensor(s), the model ",
                                named.size(), " parameter(s): make the optimizer over loop.parameters()"));
    }
  }
  if (optimizer_->params().size() != named.size()) {
    throw InvalidArgument(str(p, ": the optimizer updates ", optimizer_->params().size(), " tensor(s) but the model has ",
                              named.size(), " parameter(s): make the optimizer over loop.parameters() only"));
  }
}

TrainingState Loop::trainingState(bool replicaLocal) {
  if (replicaLocal && stages_) {
    // A pipeline's dp group holds the same stages (its ranks share the pp and tp coordinates):
    // the stage's parameters as they are, by the unsplit names (the tied copy as wte.weight),
    // which a joiner at those coordinates holds the same shapes of. The rest of the model is
    // nobody's to train on this rank.
    ProcessGroup& dp = *dataGroup();
    TrainingState state(dp.rank(), dp.size());
    ParameterMap map;
    std::unordered_set<const void*> seen;
    for (const auto& [name, t] : stages_->namedParameters()) {
      if (!seen.insert(t.dataPtr()).second) continue;
      state.addTensor("model." + name, t);
      map.add(t, {name, Placement::Replicated, t.sizes(), 0, -1});
    }
    state.addOptimizer("optim", *optimizer_, std::move(map));
    addExtraState(state);
    return state;
  }
  if (replicaLocal && mesh_) {
    // What the ranks of one dp group hold alike: this rank's shards as local tensors under
    // the local names, which a joiner at the same tp coordinate holds the same shapes of.
    ProcessGroup& dp = *dataGroup();
    TrainingState state(dp.rank(), dp.size());
    state.addModule("model", *model_).addOptimizer("optim", *optimizer_, ParameterMap::replicated(*model_));
    addExtraState(state);
    return state;
  }
  TrainingState state(group_->rank(), group_->size());
  if (stages_) {
    // Each stage's tensors by the unsplit names, written by its dp replica 0: any pipeline
    // degree, or none, reads them back (train/pipeline_state.h).
    const int replica = mesh_->coordinate("dp");
    const int tpRank = options_.tensorParallel > 1 ? mesh_->coordinate("tp") : 0;
    const StageShards shards = fsdp_ ? stageShards() : StageShards{};
    std::shared_ptr<StateProvider> model = pipelineModelState(*stages_, *model_, replica, tpRank, shards);
    std::shared_ptr<StateProvider> optim =
        pipelineOptimizerState(*stages_, *optimizer_, *model_, replica, tpRank, group_->rank() == 0, shards);
    if (const int t = options_.tensorParallel; fsdp_ && t > 1) {
      // The wrapper's rows of each TP block, under the unsplit names, placed in the global
      // tensors as for TP inside a sharded wrapper without a pipeline.
      model = nestedState(model, tensorParallelPlacement(*model_, t, tpRank, replica, false));
      optim = nestedState(optim, tensorParallelPlacement(*model_, t, tpRank, replica, true));
    }
    state.add("model", model).add("optim", optim);
  } else if (fsdp_ || zero_) {
    std::shared_ptr<StateProvider> model = fsdp_ ? fsdp_->modelState() : zero_->modelState();
    std::shared_ptr<StateProvider> optim = optimizerState(*optimizer_, fsdp_ ? fsdp_->parameterMap() : zero_->parameterMap());
    if (const int t = options_.tensorParallel; t > 1) {
      // The wrapper holds each TP block as a whole tensor of its own: placed in the global
      // tensors, so that the checkpoint loads at any (TP, DP) shape and sharding.
      const int tpRank = mesh_->coordinate("tp"), replica = mesh_->coordinate("dp");
      model = nestedState(model, tensorParallelPlacement(*model_, t, tpRank, replica, false));
      optim = nestedState(optim, tensorParallelPlacement(*model_, t, tpRank, replica, true));
    }
    state.add("model", model).add("optim", optim);
  } else if (mesh_) {
    // The shards by global name and shape; replica 0 of each TP group writes them.
    const int replica = mesh_->coordinate("dp");
    state.add("model", tensorParallelModelState(*model_, replica))
        .addOptimizer("optim", *optimizer_, tensorParallelParameterMap(*model_, replica));
  } else {
    state.addModule("model", *model_).addOptimizer("optim", *optimizer_, ParameterMap::replicated(*model_));
  }
  addExtraState(state);
  return state;
}

void Loop::addExtraState(TrainingState& state) {
  for (auto& [name, t] : extraTensors_) state.addTensor(name, t);
  for (auto& [name, g] : extraStreams_) state.addGenerator(name, *g);
  state.step = step_;
  auto& m = state.metadata;
  for (const auto& [name, v] : extraValues_) m["value." + name] = std::to_string(*v);
  if (ddp_ && ddp_->bucketsRebuilt()) m["ddp.bucket_order"] = join(ddp_->bucketOrder(), ",");
  char loss[32];
  std::snprintf(loss, sizeof(loss), "%.6f", recentLoss_);
  m["train_loss"] = loss;
  // A joiner's first commit vote, and the first after a sharded model went back to a checkpoint,
  // carry the previous step's loss like everyone's (under a pipeline the global batch's, as every
  // rank's; else one replica's, near enough).
  m["last_loss"] = exactDouble(lastLoss_);
}

// The values addState(int64_t&) registered, from a state's metadata.
namespace {
void restoreValues(const std::map<std::string, std::string>& metadata,
                   const std::vector<std::pair<std::string, int64_t*>>& values, const std::string& from) {
  for (const auto& [name, v] : values) {
    auto it = metadata.find("value." + name);
    if (it == metadata.end()) throw InvalidArgument(str(from, " holds no value \"", name, "\" (addState)"));
    *v = std::stoll(it->second);
  }
}
}  // namespace

void Loop::splitData() {
  const int world = dataGroup()->size(), rank = dataGroup()->rank();
  sampler_.emplace(dataset_->size(), world, rank,
                   data::DistributedSamplerOptions{.batchSize = options_.globalBatch / std::max(world, 1),
                                                   // elastic: shares that may differ by one example
                                                   .globalBatchSize = elastic_ ? options_.globalBatch : 0,
                                                   .shuffle = options_.shuffle,
                                                   .seed = options_.seed,
                                                   .dropLast = options_.dropLast,
                                                   .replacement = options_.replacement});
  // DDP averages over the ranks: a rank with n of the global batch's G examples weighs its
  // mean loss by n W / G, so the average is the mean over the global batch (1 when even).
  const int64_t share = sampler_->localBatchSize();
  lossWeight_ = share * world == options_.globalBatch
                    ? 1.0
                    : static_cast<double>(share * world) / static_cast<double>(options_.globalBatch);
}

void Loop::startLoader() {
  loader_ = std::make_unique<data::PrefetchLoader>(dataset_, *sampler_, data::LoaderOptions{.prefetch = options_.prefetch});
  loader_->start(sampler_->positionAfter(std::min(step_, options_.steps)));
}

std::optional<CheckpointRef> Loop::findCheckpoint() {
  if (!checkpoints_) return std::nullopt;
  const std::string& p = options_.program;
  if (!options_.resume && restartCount_ == 0) {
    clearCheckpoints(*group_, *checkpoints_, p, options_.quiet);
    return std::nullopt;
  }
  const std::optional<CheckpointRef> ref = checkpoints_->latestAgreed(*group_);
  if (!ref) {
    if (restartCount_ > 0) say(str(p, ": restart ", restartCount_, " found no checkpoint in ", checkpoints_->path().string(), "; starting from step 0"));
    return std::nullopt;
  }
  const CheckpointManifest manifest = checkpoints_->readManifest(*ref);
  manifest.requireSame(options_.config, "config.", "Resume with the same settings, or start afresh in another checkpoint folder");
  if (manifest.has("ddp.bucket_order")) bucketOrder_ = split(manifest.text("ddp.bucket_order"), ',');
  return ref;
}

void Loop::resume(const CheckpointRef& ref) {
  const std::string& p = options_.program;
  TrainingState state = trainingState();
  const CheckpointManifest m = checkpoints_->load(ref, state, group_.get());
  for (const std::string& note : state.notes()) say(str(p, ": note: ", note));
  step_ = startStep_ = state.step;
  restoreValues(state.metadata, extraValues_, ref.manifest.string());
  priorSeconds_ = static_cast<double>(m.integer("train_ms")) / 1000.0;
  recentLoss_ = std::strtod(m.text("train_loss").c_str(), nullptr);
  if (m.integer("total_steps") != options_.steps) {
    say(str(p, ": note: the step budget changed from ", m.integer("total_steps"), " to ", options_.steps,
            learningRate_ ? "; the learning-rate schedule follows the new one" : ""));
  }
  const auto pos = sampler_->positionAfter(startStep_);
  say(str(p, ": resumed from ", ref.manifest.string(), " (step ", startStep_, ", epoch ", pos.epoch + 1, " batch ", pos.batch,
          ", written by ", m.worldSize, " rank(s), ", m.text("reason"), ")",
          restartCount_ > 0 ? str(" after restart ", restartCount_) : ""));
}

void Loop::saveCheckpoint(const std::string& reason) {
  TrainingState state = trainingState();
  const auto pos = sampler_->positionAfter(step_);
  auto& m = state.metadata;
  m["epoch"] = std::to_string(pos.epoch);
  m["batch_in_epoch"] = std::to_string(pos.batch);
  m["samples_seen"] = std::to_string(step_ * options_.globalBatch);
  m["total_steps"] = std::to_string(options_.steps);
  m["train_ms"] = std::to_string(static_cast<int64_t>((priorSeconds_ + runSeconds_) * 1000.0));
  m["reason"] = reason;
  for (const auto& [key, value] : options_.config) m["config." + key] = value;
  const CheckpointRef ref = checkpoints_->save(state, group_.get());
  const std::string line = str(options_.program, ": checkpoint at step ", step_, " (", reason, ") written to ", ref.tensors.string());
  say(line);
  statusEvent(elastic_ ? elastic_->store() : store_, *group_, options_.program, "checkpoint", line);
}

void Loop::periodicCheckpoint() {
  if (!checkpoints_ || options_.checkpointEvery <= 0 || step_ % options_.checkpointEvery != 0 || step_ >= options_.steps) return;
  // A sharded model that just went back to a checkpoint is at that checkpoint's step: it is on disk.
  if (reloaded_) return;
  while (true) {
    try {
      reach(step_, Phase::Checkpoint);
      saveCheckpoint("periodic");
      return;
    } catch (const Error&) {
      if (!elastic_) throw;
      recover(std::current_exception());  // every member is at this step: write it again
      if (!left_.empty() || reloaded_) return;
    }
  }
}

void Loop::regroup() {
  group_ = elastic_->group();
  if (mesh_) {
    // Whole replicas only, each rank at its old tp (and pp) coordinate: the shards and stages
    // stay valid, the layers move onto the new tp group and DDP onto the new dp group.
    makeMesh();
    if (options_.tensorParallel > 1) rebindTensorParallel(*model_, (*mesh_)["tp"]);
  }
  if (runner_) {
    // The same schedule over the same stages on the new pp group; the dp replica's share of the
    // global batch changed, so the micro-batches' rows (and the first step's shape check) do too.
    makeRunner();
    if (fsdp_) {
      // Sharded stages: cut again for the new dp group (a collective), zero until restored. A
      // step cut short may have left whole gradients that were never reduced: the redone step
      // must not add to them. ZeRO's stages, gathered between steps, are gathered again by the
      // next step.
      stagesGathered_.reset();
      for (Tensor p : stages_->parameters()) p.setGrad(Tensor());
      fsdp_->rebind(dataGroup());
    }
  } else {
    // A step cut short may have left the model's whole gradients unreduced or half reduced, and
    // the sharded wrappers' optimizer holds their parts only, so its zeroGrad would not clear
    // them: the redone step must not add to them (ZeRO-2's grad norm was 1.69 instead of 1.15).
    if (fsdp_ || zero_) {
      for (Tensor p : model_->parameters()) p.setGrad(Tensor());
    }
    if (fsdp_) {
      // A collective: the shards cut for the new dp group (under TP each rank's TP blocks, over
      // the ranks at its tp coordinate), zero until restored.
      fsdp_->rebind(dataGroup());
    } else {
      ddp_->rebind(dataGroup());
      if (zero_) shardOptimizerState();  // the parts cut for the new group, the state empty until restored
    }
  }
  splitData();
  startLoader();
}

void Loop::leaveJob(const elastic::Membership& m) {
  loader_.reset();
  std::vector<std::string> replicas;
  for (const auto& replica : m.brokenReplicas) {
    std::vector<std::string> ids;
    for (int member : replica) ids.push_back(std::to_string(member));
    replicas.push_back(join(ids, ", "));
  }
  left_ = str(options_.program, ": member ", elastic_->memberId(), " leaves at step ", step_, ": its ", replicaName(),
              " (members ", join(replicas, "; "), ") lost ", join(m.lost, "; "), "; the other replicas go on (", m.size(),
              " rank(s), ", m.size() / std::max(options_.elastic.replicaSize, 1), " replica(s)) and this process ends");
  std::fprintf(stderr, "%s\n", left_.c_str());
  std::fflush(stderr);
}

void Loop::recover(std::exception_ptr cause) {
  loader_.reset();  // its thread prepares batches for the old split
  const elastic::Membership& m = elastic_->recover(cause, step_);
  if (elastic_->hasLeft()) return leaveJob(m);
  // Refused here, out of run() on every survivor alike, rather than as a failure of the new group.
  if (pipelined()) microBatchRows(m.size(), str("after the loss of ", join(m.lost, ", "), ": "));
  if (fsdp_ || zero_) {
    // The lost rank's shards exist nowhere else: every member goes back to the newest checkpoint.
    regroup();
    loader_.reset();
    reloadShards();
    startLoader();
    const std::string line = str(options_.program, ": epoch ", m.epoch, " of the job: ", m.size(), " rank(s) go on from step ",
                                 step_, " (the newest checkpoint: the lost shards have no other copy) without ", join(m.lost, ", "));
    say(line);
    statusEvent(elastic_->store(), *group_, options_.program, "recovery", line);
    return;
  }
  if (m.resumeStep > step_) {
    // The others committed this step: this rank holds its reduced gradients too (it voted
    // only after its backward), so it applies it as they did.
    optimizer_->step();
    lastLoss_ = committedLoss_;
    ++step_;
    if (options_.hooks.afterStep) options_.hooks.afterStep({step_, m.epoch, m.rank, m.size()});
  }
  try {
    regroup();  // under TP a collective: the new mesh's groups
    if (!m.joined.empty()) transferState();  // an admission whose transfer failed: again
  } catch (const Error&) {
    // A member of the new epoch died meanwhile: one more round (each drops at least one member).
    return recover(std::current_exception());
  }
  const std::string line = str(options_.program, ": epoch ", m.epoch, " of the job: ", m.size(), " rank(s) go on from step ",
                               step_, " without ", join(m.lost, ", "), leftNote(m));
  say(line);
  statusEvent(elastic_->store(), *group_, options_.program, "recovery", line);
}

std::string Loop::leftNote(const elastic::Membership& m) const {
  if (m.left.empty()) return "";
  std::vector<std::string> ids;
  for (int member : m.left) ids.push_back(std::to_string(member));
  const int size = std::max(options_.elastic.replicaSize, 1);
  return str("; member(s) ", join(ids, ", "), " left with their ", replicaName(), " (", m.size() / size, " replica(s) of ",
             size, " go on)");
}

std::string Loop::replicaName() const {
  return pipelined() ? "pipeline replica" : "tensor-parallel group";
}

void Loop::admitJoiners() {
  loader_.reset();
  std::vector<StateTensor> held;  // the shards in the old layout, which the rebind replaces
  if (fsdp_ || zero_) held = trainingState().collect();
  const elastic::Membership& m = elastic_->admit(step_);
  if (elastic_->hasLeft()) return leaveJob(m);  // a member of its replica died meanwhile
  if (pipelined()) microBatchRows(m.size(), "admitting joiners: ");
  someoneJoined_ = someoneJoined_ || !m.joined.empty();
  regroup();
  if (fsdp_ || zero_) {
    redistributeShards(held);
  } else if (!m.joined.empty()) {
    transferState();
  }
  std::vector<std::string> joined;
  for (int member : m.joined) joined.push_back(str("member ", member));
  const std::string line =
      str(options_.program, ": epoch ", m.epoch, " of the job: ", m.size(), " rank(s) go on from step ", step_,
          m.joined.empty() ? std::string(" (the joiners that waited died first)") : str(" with ", join(joined, ", ")),
          m.lost.empty() ? std::string() : str(" without ", join(m.lost, ", ")), leftNote(m));
  say(line);
  statusEvent(elastic_->store(), *group_, options_.program, "admission", line);
}

void Loop::transferState() {
  // Under TP along each dp group (its rank 0 an old member at the joiner's tp coordinate,
  // holding the same shards), else over the whole group.
  TrainingState state = trainingState(/*replicaLocal=*/true);  // the last step's loss included
  ProcessGroup& over = mesh_ ? *dataGroup() : *group_;
  const Device device = model_->parameters().empty() ? Device::cpu() : model_->parameters().front().device();
  // --measure-transfer times the transfer alone: a joiner would otherwise count its wait for
  // the members to reach the step boundary.
  if (options_.measureTransfer) group_->barrier()->wait();
  const auto start = Clock::now();
  broadcastState(state, over, 0, elastic_->joinedNow(), {.device = device});
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  int64_t bytes = 0;
  for (const auto& t : state.collect()) bytes += t.local.numel() * static_cast<int64_t>(itemSize(t.local.dtype()));
  double broadcastSeconds = 0;
  if (options_.measureTransfer) {  // the same bytes in one plain broadcast, on the same group
    Tensor buffer = zeros({std::max<int64_t>(bytes / 4, 1)}, DType::Float32, device);
    group_->barrier()->wait();
    const auto from = Clock::now();
    group_->broadcast(buffer, {.root = 0})->wait();
    broadcastSeconds = std::chrono::duration<double>(Clock::now() - from).count();
  }
  if (!elastic_->joinedNow()) return;
  step_ = startStep_ = joinedAtStep_ = state.step;
  someoneJoined_ = true;
  const auto& m = state.metadata;
  restoreValues(m, extraValues_, "the state received");
  if (m.count("ddp.bucket_order")) bucketOrder_ = split(m.at("ddp.bucket_order"), ',');
  recentLoss_ = std::strtod(m.at("train_loss").c_str(), nullptr);
  if (m.count("last_loss")) lastLoss_ = std::strtod(m.at("last_loss").c_str(), nullptr);
  if (options_.hooks.onJoined) options_.hooks.onJoined({elastic_->memberId(), step_, bytes, seconds, broadcastSeconds});
  if (!options_.quiet) {
    std::printf("%s: member %d joined at step %lld as rank %d/%d; state received in %.1f ms (%.2f MB)\n",
                options_.program.c_str(), elastic_->memberId(), static_cast<long long>(step_), group_->rank(),
                group_->size(), seconds * 1e3, static_cast<double>(bytes) / 1e6);
  }
}

bool Loop::trainStep(const StepFunction& fn, Window& window) {
  const std::string& p = options_.program;
  const LoopHooks& hooks = options_.hooks;
  if (reloaded_) {
    // A recovery (in a step, its log or a checkpoint) went back to the newest checkpoint: the
    // window starts again there, or it would count the redone steps twice (and a negative rate).
    window.reset(step_);
    reloaded_ = false;
  }
  profile();
  reach(step_, Phase::Begin);
  std::optional<AnomalyMode> anomaly;
  if (options_.anomalyMode) anomaly.emplace();
  // Where this attempt's time goes (straggler detection): a few clock reads a step.
  const Clock::time_point stepStart = Clock::now();
  StepFigures figures;
  const auto msSince = [](Clock::time_point from) { return std::chrono::duration<double, std::milli>(Clock::now() - from).count(); };
  // {stop requested, previous step's loss, joiners waiting}, summed over the ranks; every
  // stragglers.every steps followed by a block of every rank's step figures (its own slot
  // filled, zeros elsewhere), so that the sum hands everyone everyone's: one slightly larger
  // all-reduce every K steps instead of a collective of its own.
  const bool gather = gatherStep();
  Tensor& vote = gather ? controlWide_ : control_;
  if (gather) controlWide_ = zeros({3 + kFigureSlots * group_->size()}, DType::Float64);
  double* ctl = vote.data<double>();
  const int voters = group_->size();  // who sums the control vote (an admission grows the group after it)
  ctl[0] = stopSignal().load() != 0 ? 1.0 : 0.0;
  ctl[1] = lastLoss_;
  ctl[2] = elastic_ && elastic_->joinersWaiting() ? 1.0 : 0.0;
  if (gather) putStepFigures(ctl);
  try {
    // Elastic: the control allreduce is the step's commit vote, after backward: a rank joins
    // it only with its gradients reduced, and no rank applies the step unless every rank of
    // the group voted. Otherwise it is in flight while the step computes.
    WorkPtr controlWork = elastic_ ? nullptr : group_->allreduce(vote);
    Clock::time_point phaseStart = Clock::now();
    const data::LoadedBatch batch = loader_->next();
    if (slowsHere(true)) std::this_thread::sleep_for(std::chrono::milliseconds(options_.test.slowMs));
    figures.dataMs = msSince(phaseStart);
    if (learningRate_) optimizer_->setLr(learningRate_(step_));
    optimizer_->zeroGrad();
    const int64_t rows = batch.batch.inputs.size(0);
    const int64_t pieces = pipelined() ? 0 : std::min<int64_t>(options_.microBatches, std::max<int64_t>(rows, 1));
    double stepLoss = 0.0;
    if (pipelined()) {
      phaseStart = Clock::now();
      if (slowsHere(false)) std::this_thread::sleep_for(std::chrono::milliseconds(options_.test.slowMs));
      const double slept = msSince(phaseStart);
      phaseStart = Clock::now();
      stepLoss = pipelineStep(batch.batch);
      // The runner's compute (F, B, I, W alike) is the forward figure; its waiting and the dp
      // average, communication.
      const double total = msSince(phaseStart), compute = runner_->lastStep().computeSeconds * 1e3;
      figures.forwardMs += slept + compute;
      figures.commMs += std::max(0.0, total - compute);
    }
    // DDP's end-of-backward wait for its buckets, when its reducer ran this step.
    const uint64_t ddpIterations = ddp_ ? ddp_->lastIteration().iteration : 0;
    std::vector<std::pair<std::string, double>> stepMetrics;
    std::vector<Tensor> microLosses;  // read once after the loop
    std::vector<double> fractions;
    for (int64_t k = 0, at = 0; k < pieces; ++k) {
      const int64_t n = rows / pieces + (k < rows % pieces ? 1 : 0);
      const data::Batch micro = pieces == 1 ? batch.batch
                                            : data::Batch{batch.batch.inputs.narrow(0, at, n), batch.batch.targets.narrow(0, at, n)};
      at += n;
      lastMicroBatch_ = k + 1 == pieces;
      std::optional<DistributedDataParallel::NoSyncGuard> noSync;
      std::optional<FullyShardedDataParallel::NoSyncGuard> shardedNoSync;
      if (!lastMicroBatch_ && fsdp_) shardedNoSync.emplace(fsdp_->noSync());
      if (!lastMicroBatch_ && !fsdp_) noSync.emplace(ddp_->noSync());
      StepOutput out;
      phaseStart = Clock::now();
      try {
        out = fn(micro);
        // The test switch's straggler: slow in its forward, once a step.
        if (k == 0 && slowsHere(false)) std::this_thread::sleep_for(std::chrono::milliseconds(options_.test.slowMs));
      } catch (const Error&) {
        throw;
      } catch (const std::exception& e) {
        // Not a failure of the group: reported with where it happened, never recovered from.
        throw std::runtime_error(str(p, " (rank ", group_->rank(), "/", group_->size(), "): the step function threw at step ",
                                     step_, ": ", e.what()));
      }
      if (!out.loss.defined() || out.loss.numel() != 1) {
        throw InvalidArgument(str(p, ": the step function returned ", out.loss.defined() ? out.loss.describe() : "no loss",
                                  " at step ", step_, "; it must return the loss as a tensor of one element"));
      }
      if (!out.loss.requiresGrad()) {
        throw InvalidArgument(str(p, ": the loss the step function returned at step ", step_,
                                  " does not require a gradient: no parameter reaches it, so there is no backward to run "
                                  "(was it computed under NoGradGuard, detached, or from another model?)"));
      }
      figures.forwardMs += msSince(phaseStart);
      reach(step_, Phase::Forward);
      const double fraction = static_cast<double>(n) / static_cast<double>(rows);
      microLosses.push_back(out.loss.detach().reshape({1}));
      fractions.push_back(fraction);
      for (const auto& [name, v] : out.metrics) {
        auto it = std::find_if(stepMetrics.begin(), stepMetrics.end(), [&](const auto& e) { return e.first == name; });
        if (it == stepMetrics.end()) stepMetrics.emplace_back(name, v * fraction);
        else it->second += v * fraction;
      }
      const double weight = lossWeight_ * fraction;
      phaseStart = Clock::now();
      (weight == 1.0 ? out.loss : mul(out.loss, weight)).backward();  // the last one returns with averaged gradients
      figures.backwardMs += msSince(phaseStart);
    }
    if (!microLosses.empty()) {
      // One read of the micro-batches' losses a step, not one per micro-batch: on a GPU each read
      // waits for the device. The same float values in the same order as reading them one by one.
      const Tensor losses = microLosses.size() == 1 ? microLosses[0] : cat(microLosses, 0);
      const std::vector<float> values = losses.to(DType::Float32).to(Device::cpu()).toVector<float>();
      for (size_t k = 0; k < values.size(); ++k) stepLoss += values[k] * fractions[k];
      // Sharded under --elastic, every rank's step loss is the global batch's, as a pipeline's
      // is (pipelineStep): a checkpoint's last loss, which the survivors' first commit vote after
      // going back to it reports, is then the undisturbed run's, not one replica's. Here, after
      // the backward, where every rank of the dp group issues the same collectives.
      if (elastic_ && (fsdp_ || zero_)) stepLoss = meanOver(*dataGroup(), stepLoss, losses.device());
    }
    if (ddp_ && ddp_->lastIteration().iteration != ddpIterations) {
      const double exposed = std::min(ddp_->lastIteration().exposedCommMs, figures.backwardMs);
      figures.backwardMs -= exposed;
      figures.commMs += exposed;
    }
    if (backwardReturns_) reach(step_, Phase::Backward);
    recordSamples(step_, batch.position);
    if (hooks.onBatch) {
      hooks.onBatch(step_, elastic_ ? elastic_->membership().epoch : 0, batch.position,
                    sampler_->batchIndices(batch.position.epoch, batch.position.batch));
    }
    if (options_.clipGradNorm > 0) {
      nn::ClipGradNormOptions clip;
      if (fsdp_) clip.reducePartial = fsdp_->gradNormReducer();
      if (zero_) clip.reducePartial = zero_->gradNormReducer();
      // Under TP the split parameters' sums go over tp, then (sharded) the wrapper's over dp.
      // A pipeline's over pp: its dp replicas hold the same averaged gradients by now.
      // Sharded stages: each rank's pieces summed over dp, then over pp.
      gradNorm_ = runner_ ? (fsdp_ ? pipeline::clipGradNorm(*runner_, options_.clipGradNorm,
                                                            [this](const Tensor& t) { return stageShard(t); }, clip,
                                                            options_.tensorParallel > 1 ? (*mesh_)["tp"] : nullptr)
                             : options_.tensorParallel > 1 ? pipeline::clipGradNorm(*runner_, options_.clipGradNorm, (*mesh_)["tp"])
                                                           : pipeline::clipGradNorm(*runner_, options_.clipGradNorm))
                  : mesh_ ? clipTensorParallelGradNorm(*model_, parameters(), options_.clipGradNorm, (*mesh_)["tp"], clip)
                        : nn::clipGradNorm(parameters(), options_.clipGradNorm, clip);
    }
    if (elastic_) {
      committedLoss_ = stepLoss;  // what recover() reports if the others commit the step without this rank
      phaseStart = Clock::now();
      group_->allreduce(vote)->wait();
      figures.commMs += msSince(phaseStart);
      reach(step_, Phase::Commit);
    }
    optimizer_->step();
    if (zero_) zero_->gatherParameters();  // on the wire while the next step begins
    if (stages_ && zeroSharded()) {
      // ZeRO keeps the parameters whole between steps: the stages gathered right after the update.
      stagesGathered_.reset();
      stagesGathered_.emplace(fsdp_->gatherFullParameters());
    }
    lastLoss_ = stepLoss;
    if (controlWork) {
      phaseStart = Clock::now();
      controlWork->wait();
      figures.commMs += msSince(phaseStart);
    }
    ++step_;
    figures.wallMs = msSince(stepStart);
    if (gather) analyzeStepFigures(ctl);
    if (stragglers_) {
      stepSums_.dataMs += figures.dataMs;
      stepSums_.forwardMs += figures.forwardMs;
      stepSums_.backwardMs += figures.backwardMs;
      stepSums_.commMs += figures.commMs;
      stepSums_.wallMs += figures.wallMs;
      ++stepCount_;
    }
    if (hooks.afterStep) {
      hooks.afterStep({step_, elastic_ ? elastic_->membership().epoch : 0, group_->rank(), group_->size()});
    }
    if (group_->rank() == 0) window.addMetrics(stepMetrics);
    // Every member voted the same sum: they all admit at this boundary.
    if (elastic_ && ctl[2] > 0 && ctl[0] == 0 && step_ < options_.steps) admitJoiners();
  } catch (const Error&) {
    if (!elastic_) throw;
    recover(std::current_exception());
    return left_.empty();
  }
  if (!left_.empty()) return false;  // an admission dropped this rank's replica
  runSeconds_ = std::chrono::duration<double>(Clock::now() - loopStart_).count();
  if (step_ > startStep_ + 1) {  // the reduced loss is the previous step's
    window.lossSum += ctl[1] / voters;
    ++window.losses;
  }
  if (ctl[0] > 0) return false;
  // An evaluation's collectives come after the step was applied everywhere: a loss there is
  // recovered from like one in the step, and the evaluation done again on the new group.
  for (const int64_t at = step_;;) {
    try {
      log(window);
      break;
    } catch (const Error&) {
      if (!elastic_) throw;
      recover(std::current_exception());
      if (!left_.empty()) return false;
      if (step_ != at) break;  // sharded: back at the newest checkpoint's step
    }
  }
  return true;
}

std::pair<std::vector<Tensor>, std::vector<Tensor>> Loop::pipelineMicroBatches(const data::Batch& batch) const {
  const pipeline::Schedule& s = runner_->schedule();
  const int me = mesh_->coordinate("pp"), m = s.m;
  const int64_t rows = batch.inputs.size(0);
  if (rows % m != 0) {  // the constructor checked the even split; a short last batch (dropLast off) is not
    throw InvalidArgument(str(options_.program, ": step ", step_, " has ", rows, " example(s) on this rank, which ", m,
                              " pipeline micro-batches do not split evenly; set LoopOptions::dropLast"));
  }
  const int64_t n = rows / m;
  const bool first = s.rankOfStage(0) == me, last = s.rankOfStage(s.numStages() - 1) == me;
  std::vector<Tensor> inputs, targets;
  for (int k = 0; k < m; ++k) {
    if (first) inputs.push_back(batch.inputs.narrow(0, k * n, n).contiguous());
    if (last) targets.push_back(batch.targets.narrow(0, k * n, n).contiguous());
  }
  return {std::move(inputs), std::move(targets)};
}

double Loop::pipelineLoss(const data::Batch& batch) {
  if (!runner_) throw InvalidArgument(str(options_.program, ": pipelineLoss needs pipeline parallelism and run()"));
  const auto [inputs, targets] = pipelineMicroBatches(batch);
  struct EvalMode {  // back to training even when the evaluation throws
    const std::vector<std::shared_ptr<nn::Module>>& chunks;
    explicit EvalMode(const std::vector<std::shared_ptr<nn::Module>>& c) : chunks(c) {
      for (const auto& chunk : chunks) chunk->eval();
    }
    ~EvalMode() {
      for (const auto& chunk : chunks) chunk->train();
    }
  } evalMode(stages_->chunks);
  std::optional<FullyShardedDataParallel::FullParametersGuard> whole;
  if (fsdp_ && !stagesGathered_) whole.emplace(fsdp_->gatherFullParameters());  // a collective over dp
  return runner_->evaluate(inputs, targets);
}

void Loop::gatherPipelineModel() {
  const std::string& p = options_.program;
  if (!runner_) throw InvalidArgument(str(p, ": gatherPipelineModel needs pipeline parallelism and setPipelineModel"));
  // Sharded stages stay gathered from here on (a later step would find them so, and reduce as usual).
  if (fsdp_ && !stagesGathered_) stagesGathered_.emplace(fsdp_->gatherFullParameters());
  const ProcessGroupPtr& pp = (*mesh_)["pp"];
  // Each parameter from the rank whose stage trains it: the tied weight from the first stage's (the
  // last stage's copy is equal, see pipeline.h).
  std::map<std::string, Tensor> mine;
  for (const auto& [name, t] : stages_->namedParameters()) {
    if (!(stages_->tiedIsLast && t.dataPtr() == stages_->tiedCopy.dataPtr())) mine.emplace(name, t);
  }
  for (auto& [storage, bytes] : released_) storage.resizeBytes(bytes);  // filled below
  released_.clear();
  const NamedTensors all = model_->namedParameters();
  Tensor owners = zeros({static_cast<int64_t>(all.size())}, DType::Int64);
  for (size_t i = 0; i < all.size(); ++i) {
    if (mine.count(all[i].first)) owners.data<int64_t>()[i] = pp->rank() + 1;
  }
  pp->allreduce(owners, {.reduceOp = ReduceOp::Max})->wait();
  NoGradGuard noGrad;
  for (size_t i = 0; i < all.size(); ++i) {
    const auto& [name, target] = all[i];
    const int root = static_cast<int>(owners.data<int64_t>()[i]) - 1;
    if (root < 0) throw InvalidArgument(str(p, ": gatherPipelineModel: no stage of pp group ", pp->name(), " holds ", name));
    const auto held = mine.find(name);
    Tensor buffer = root == pp->rank() ? held->second.detach().contiguous().clone() : empty(target.sizes(), target.dtype(), target.device());
    pp->broadcast(buffer, {.root = root})->wait();
    Tensor whole = target;
    if (held == mine.end() || held->second.dataPtr() != target.dataPtr()) whole.copy_(buffer);
  }
}

double Loop::pipelineStep(const data::Batch& batch) {
  const auto [inputs, targets] = pipelineMicroBatches(batch);
  // Sharded stages: gathered once for the step's m micro-batches (not once per micro-batch, as
  // the wrapper's own forward would), their gradients accumulated whole and reduce-scattered
  // over dp once, averaged there; Full frees the whole parameters right after.
  if (fsdp_ && !stagesGathered_) stagesGathered_.emplace(fsdp_->gatherFullParameters());
  double loss = runner_->step(inputs, targets);
  reach(step_, Phase::Forward);
  if (fsdp_) {
    fsdp_->reduceGradients();
    if (!zeroSharded()) stagesGathered_.reset();
    // Elastic, every rank's step loss is the global batch's, as averageStageGradients makes it
    // with DDP: a checkpoint's last loss, which the survivors' first vote after a reload reports,
    // and a joiner's are then right at any dp.
    if (elastic_) loss = meanOver(*dataGroup(), loss, stages_->parameters().front().device());
  } else {
    averageStageGradients(loss);
  }
  return loss;
}

void Loop::averageStageGradients(double& loss) {
  ProcessGroup& dp = *dataGroup();
  if (dp.size() == 1) return;
  // One all-reduce for the stage, and one for the tied weight alone: its two copies (first and
  // last stage) sit in different buffers on different dp groups, and only the same reduction
  // of the same values keeps them bitwise equal.
  const Tensor& tied = stages_->tiedCopy;
  std::vector<Tensor> grads, tiedGrads;
  for (const Tensor& p : stages_->parameters()) {
    Tensor g = p.grad();
    if (!g.defined()) {
      throw InvalidArgument(str(options_.program, ": a stage parameter (", p.describe(), ") has no gradient after step ",
                                step_, "'s pipeline backward"));
    }
    (tied.defined() && p.dataPtr() == tied.dataPtr() ? tiedGrads : grads).push_back(g);
  }
  NoGradGuard noGrad;
  const double scale = 1.0 / static_cast<double>(dp.size());
  bool lossCarried = false;
  for (std::vector<Tensor>* list : {&grads, &tiedGrads}) {
    if (list->empty()) continue;
    std::vector<Tensor> flat;
    for (const Tensor& g : *list) flat.push_back(g.contiguous().reshape({-1}));
    // Elastic, the replica's loss rides along, so that every rank's step loss is the global
    // batch's: the commit vote's mean of it then stays right when a loss or an admission changes
    // the replicas between a step and the vote that reports it. (Not elastic, the vote's mean
    // over every rank is that already, and the first progress line stays rank 0's own loss, as
    // with DDP.)
    const bool carry = elastic_ && !lossCarried;
    if (carry) flat.push_back(full({1}, loss, flat.front().dtype(), flat.front().device()));
    lossCarried = true;
    Tensor buffer = flat.size() == 1 ? flat.front().clone() : cat(flat);
    dp.allreduce(buffer)->wait();
    mul_(buffer, scale);
    int64_t at = 0;
    for (Tensor& g : *list) {
      g.copy_(buffer.narrow(0, at, g.numel()).view(g.sizes()));
      at += g.numel();
    }
    if (carry) loss = buffer.narrow(0, at, 1).to(DType::Float64).item<double>();
  }
}

void Loop::reloadShards() {
  const std::string& p = options_.program;
  if (!checkpoints_) {
    throw Error(str(p, ": a lost rank's shards have no other copy and there is no checkpoint to reload them from "
                       "(a sharded model under --elastic needs LoopOptions::checkpointDir)"));
  }
  const std::optional<CheckpointRef> ref = checkpoints_->latestAgreed(*group_);
  if (!ref) throw Error(str(p, ": a lost rank's shards have no other copy and ", checkpoints_->path().string(), " holds no checkpoint"));
  TrainingState state = trainingState();
  const CheckpointManifest m = checkpoints_->load(*ref, state, group_.get());
  step_ = state.step;
  restoreValues(state.metadata, extraValues_, ref->manifest.string());
  recentLoss_ = std::strtod(m.text("train_loss").c_str(), nullptr);
  // The next commit vote reports the loss of the step before it: the checkpoint's last one, not
  // the last one this rank trained before the loss (an older checkpoint has none).
  if (m.has("last_loss")) lastLoss_ = std::strtod(m.text("last_loss").c_str(), nullptr);
  reloaded_ = true;
}

void Loop::redistributeShards(const std::vector<StateTensor>& held) {
  // The step and the values from rank 0 (an old member), then every rank's new rows from the
  // ranks that hold them.
  // ZeRO: DDP's bucket layout first, so that a joiner cuts the same parts.
  std::string text;
  if (group_->rank() == 0) {
    text = str(step_, "\n", recentLoss_, "\n", zero_ ? join(ddp_->bucketOrder(), ",") : std::string(), "\n",
               exactDouble(lastLoss_));
    for (const auto& [name, v] : extraValues_) text += str("\n", *v);
  }
  const auto start = Clock::now();
  broadcastString(*group_, text, 0);
  const auto lines = split(text, '\n');
  if (zeroSharded() && !zero_ && !pipelined()) {  // a pipeline's ZeRO is its stages' wrapper, made by now
    bucketOrder_ = lines.at(2).empty() ? std::vector<std::string>{} : split(lines.at(2), ',');
    wrapReplicated(false);
    shardOptimizerState();
  }
  TrainingState state = trainingState();
  redistributeState(held, state, *group_);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  step_ = std::stoll(lines.at(0));
  recentLoss_ = std::strtod(lines.at(1).c_str(), nullptr);
  for (size_t i = 0; i < extraValues_.size(); ++i) *extraValues_[i].second = std::stoll(lines.at(4 + i));
  if (!elastic_->joinedNow()) return;
  lastLoss_ = std::strtod(lines.at(3).c_str(), nullptr);  // the members keep their own
  startStep_ = joinedAtStep_ = step_;
  someoneJoined_ = true;
  int64_t bytes = 0;
  for (const auto& t : state.collect()) bytes += t.local.numel() * static_cast<int64_t>(itemSize(t.local.dtype()));
  if (options_.hooks.onJoined) options_.hooks.onJoined({elastic_->memberId(), step_, bytes, seconds, 0.0});
  if (!options_.quiet) {
    std::printf("%s: member %d joined at step %lld as rank %d/%d; its shards received in %.1f ms (%.2f MB)\n",
                options_.program.c_str(), elastic_->memberId(), static_cast<long long>(step_), group_->rank(),
                group_->size(), seconds * 1e3, static_cast<double>(bytes) / 1e6);
  }
}

std::vector<Tensor> Loop::wholeParameters() {
  if (stages_ && fsdp_) {
    std::optional<FullyShardedDataParallel::FullParametersGuard> whole;
    if (!stagesGathered_) whole.emplace(fsdp_->gatherFullParameters());
    std::vector<Tensor> out;
    for (const Tensor& p : stages_->parameters()) out.push_back(p.detach().clone());
    return out;
  }
  if (stages_) return stages_->parameters();  // the stage's: equal over its dp group
  if (fsdp_) {
    const auto full = fsdp_->gatherFullParameters();
    std::vector<Tensor> out;
    for (const Tensor& p : model_->parameters()) out.push_back(p.detach().clone());
    return out;
  }
  if (zero_) zero_->synchronize();
  return model_->parameters();
}

void Loop::profile() {
  const int64_t from = options_.profileFrom, to = from + options_.profileSteps;
  if (!profiler_ && from >= 0 && step_ >= from && step_ < to) {
    Profiler::setRank(group_->rank());
    profiler_ = std::make_unique<Profiler>();
    return;
  }
  if (!profiler_ || (step_ < to && step_ < options_.steps)) return;
  profiler_->stop();
  std::string path = options_.profileTrace;
  if (const auto at = path.find("{rank}"); at != std::string::npos) path.replace(at, 6, std::to_string(group_->rank()));
  profiler_->writeChromeTrace(path);
  if (group_->rank() == 0 && !options_.quiet) {
    std::printf("%s: profile of steps %lld-%lld written to %s (one file per rank); rank 0's busiest:\n%s",
                options_.program.c_str(), static_cast<long long>(from), static_cast<long long>(step_ - 1), path.c_str(),
                profiler_->table({.rowLimit = 15}).c_str());
  }
  profiler_.reset();
}

void Loop::log(Window& window) {
  const bool evalNow = evaluate_ && (step_ == options_.steps || (options_.evalEvery > 0 && step_ % options_.evalEvery == 0));
  if (evalNow) evaluation_ = evaluate_();
  if (step_ % options_.logEvery != 0 && step_ != options_.steps && !evalNow) return;
  recentLoss_ = window.losses > 0 ? window.lossSum / static_cast<double>(window.losses) : lastLoss_;
  const double seconds = std::chrono::duration<double>(Clock::now() - window.start).count();
  const double rate = static_cast<double>((step_ - window.startStep) * options_.globalBatch * options_.unitsPerExample) /
                      std::max(seconds, 1e-9);
  postStatus(elastic_ ? elastic_->store() : store_, options_.program, [&](Store& s) {
    static const std::string host = [] {
      char name[256] = {};
      return ::gethostname(name, sizeof(name) - 1) == 0 ? std::string(name) : std::string();
    }();
    status::postRank(s, memberId(),
                     {epochMs(), step_, options_.steps, recentLoss_, rate, options_.unit, status::residentBytes(),
                      group_->rank(), group_->size(), host});
  });
  if (group_->rank() == 0) {
    Progress progress;
    progress.step = step_;
    progress.steps = options_.steps;
    progress.epoch = sampler_->positionAfter(step_ - 1).epoch + 1;
    progress.epochs = (options_.steps + sampler_->batchesPerEpoch() - 1) / sampler_->batchesPerEpoch();
    progress.loss = recentLoss_;
    progress.rate = rate;
    progress.lr = optimizer_->lr();
    progress.gradNorm = gradNorm_;
    progress.elapsed = priorSeconds_ + runSeconds_;
    progress.left = runSeconds_ / static_cast<double>(step_ - startStep_) * static_cast<double>(options_.steps - step_);
    for (const auto& [name, sum] : window.metricSums) {
      progress.metrics.emplace_back(name, sum / static_cast<double>(std::max<int64_t>(window.metricSteps, 1)));
    }
    if (evalNow) {
      progress.metrics.insert(progress.metrics.end(), evaluation_.begin(), evaluation_.end());
    } else {
      for (const std::string& name : evaluationNames_) progress.metrics.emplace_back(name, std::nan(""));
    }
    report(progress);
  }
  window.reset(step_);
}

void Loop::report(const Progress& progress) {
  postStatus(elastic_ ? elastic_->store() : store_, options_.program, [&](Store& s) {
    status::CurvePoint point{progress.step, progress.loss, progress.rate, {}};
    for (const auto& [name, v] : progress.metrics) {
      if (!std::isnan(v)) point.metrics.emplace_back(name, v);
    }
    status::postCurvePoint(s, point);
  });
  if (metrics_) {
    std::vector<std::pair<std::string, double>> values = {{"loss", progress.loss},
                                                          {"lr", progress.lr},
                                                          {"grad_norm", progress.gradNorm},
                                                          {options_.unit + "_per_s", progress.rate},
                                                          {"elapsed_s", progress.elapsed}};
    values.insert(values.end(), progress.metrics.begin(), progress.metrics.end());
    metrics_->write(progress.step, values);
  }
  if (options_.hooks.onLog) {
    options_.hooks.onLog(progress);
    return;
  }
  if (options_.quiet) return;
  std::string line = str(options_.program, ": epoch ", progress.epoch, "/", progress.epochs, "  step ", progress.step, "/",
                         options_.steps);
  char buf[160];
  if (!std::isnan(progress.loss)) {
    std::snprintf(buf, sizeof(buf), "  loss %.4f", progress.loss);
    line += buf;
  }
  for (const auto& [name, v] : progress.metrics) {
    if (std::isnan(v)) continue;
    std::snprintf(buf, sizeof(buf), "  %s %.4g", name.c_str(), v);
    line += buf;
  }
  if (progress.step > 0) {
    std::snprintf(buf, sizeof(buf), "  %.0f %s/s  elapsed %s  left %s", progress.rate, options_.unit.c_str(),
                  formatSeconds(progress.elapsed).c_str(), formatSeconds(progress.left).c_str());
    line += buf;
  }
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

int Loop::memberId() const { return elastic_ ? elastic_->memberId() : group_->rank(); }

bool Loop::gatherStep() const {
  return stragglers_ && group_->size() > 1 && step_ > 0 && step_ % options_.stragglers.every == 0;
}

void Loop::putStepFigures(double* ctl) {
  // Window means since the last gather; a rank with none yet (a joiner's first) sends a count of 0.
  double* slot = ctl + 3 + kFigureSlots * group_->rank();
  const double n = static_cast<double>(stepCount_);
  slot[0] = n;
  if (stepCount_ > 0) {
    slot[1] = stepSums_.dataMs / n;
    slot[2] = stepSums_.forwardMs / n;
    slot[3] = stepSums_.backwardMs / n;
    slot[4] = stepSums_.commMs / n;
    slot[5] = stepSums_.wallMs / n;
  }
  stepSums_ = {};
  stepCount_ = 0;
}

void Loop::analyzeStepFigures(const double* ctl) {
  // Every rank decides the same from the same sums; rank 0 speaks. New ranks (an elastic loss
  // or admission) start every count again.
  if (elastic_ && elastic_->membership().epoch != stragglerEpoch_) {
    stragglerEpoch_ = elastic_->membership().epoch;
    stragglers_->reset();
  }
  const int world = group_->size();
  std::vector<StepFigures> all(static_cast<size_t>(world));
  int64_t steps = std::numeric_limits<int64_t>::max();
  for (int r = 0; r < world; ++r) {
    const double* slot = ctl + 3 + kFigureSlots * r;
    if (slot[0] < 1) return;  // a rank without figures yet: this gather is not judged
    steps = std::min(steps, static_cast<int64_t>(slot[0]));
    all[static_cast<size_t>(r)] = StepFigures{slot[1], slot[2], slot[3], slot[4], slot[5]};
  }
  std::vector<int> roles;  // a pipeline's stages do different work: each is compared with its own
  if (pipelined()) {
    const int t = std::max(options_.tensorParallel, 1), pp = options_.pipeline.degree;
    for (int r = 0; r < world; ++r) roles.push_back((r / t) % pp);
  }
  for (const StragglerVerdict& v : stragglers_->add(all, roles, steps)) {
    if (group_->rank() != 0) continue;
    const int member = elastic_ ? elastic_->membership().members.at(static_cast<size_t>(v.rank)) : v.rank;
    reportStraggler(v, member);
  }
}

void Loop::reportStraggler(const StragglerVerdict& v, int member) {
  StorePtr store = elastic_ ? elastic_->store() : store_;
  std::string host;
  if (store) {
    try {
      const std::string key = str("dt/straggler/host/", member);
      if (store->check({key})) host = store->get(key);
    } catch (const std::exception&) {
      // The host is a courtesy; the report goes on without it.
    }
  }
  const std::string line = describeStraggler(options_.program, v, host, step_ - 1);  // the gather's figures end there
  if (!options_.quiet) {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }
  if (metrics_) {
    metrics_->write(step_ - 1, {{"straggler_rank", v.rank}, {"straggler_member", member}, {"straggler_ratio", v.ratio}},
                    {{"straggler_section", v.section}, {"straggler", line}});
  }
  if (!store) return;
  try {  // for dtrun (launcher/agent.cpp reads dt/straggler/1, 2, ...)
    const int64_t n = store->add("dt/straggler/count", 1);
    store->set(str("dt/straggler/", n), str(member, "\t", v.rank, "\t", line));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: cannot post the straggler report to the job's store: %s\n", options_.program.c_str(), e.what());
  }
}

void Loop::reach(int64_t step, Phase phase) {
  if (phase == Phase::Begin && options_.test.stepPauseMs > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(options_.test.stepPauseMs));
  }
  if (phase == Phase::Begin && elastic_ && step == options_.test.waitForJoinerAt && !someoneJoined_) {
    const auto deadline = Clock::now() + std::chrono::minutes(2);
    while (!elastic_->joinersWaiting() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (const std::string& spec : options_.test.failAt) {
    const auto parts = split(spec, ':');
    const int64_t at = std::stoll(parts[1]);
    // A member that joined after STEP cannot meet it: it fails in its first step instead.
    const bool now = step == at || (joinedAtStep_ > at && step == joinedAtStep_);
    if (std::stoi(parts[0]) == memberId() && now && parts[2] == phaseName(phase)) {
      if (options_.test.beforeKill) options_.test.beforeKill(step, memberId());
      std::fflush(nullptr);
      ::kill(::getpid(), SIGKILL);
    }
  }
  if (options_.hooks.at) options_.hooks.at(step, phase);
}

void Loop::recordSamples(int64_t step, const data::SamplerPosition& position) const {
  if (options_.test.recordSamples.empty()) return;
  const std::vector<int64_t> ids = sampler_->batchIndices(position.epoch, position.batch);
  const std::string path = str(options_.test.recordSamples, ".", memberId());
  std::string line = str(elastic_ ? elastic_->membership().epoch : 0, " ", step, " ", position.epoch);
  for (int64_t id : ids) line += str(" ", id);
  line += "\n";
  FILE* out = std::fopen(path.c_str(), "a");
  if (out == nullptr) throw Error(str(options_.program, ": cannot append to ", path, ": ", std::strerror(errno)));
  std::fputs(line.c_str(), out);
  std::fclose(out);
}

void Loop::armBackwardHook() {
  bool wanted = options_.hooks.at && options_.hooks.atBackward;
  for (const std::string& spec : options_.test.failAt) wanted |= split(spec, ':')[2] == "backward";
  if (!wanted) return;
  if (fsdp_ || pipelined()) {  // the sharded wrapper sets its shards' gradients itself; the pipeline's are done when its step returns
    backwardReturns_ = true;
    return;
  }
  const std::vector<Tensor> params = model_->parameters();  // what autograd accumulates into (not ZeRO's parts)
  auto fired = std::make_shared<size_t>(0);
  for (Tensor p : params) {
    // The last gradient of the last micro-batch's backward: DDP's own hook, registered first,
    // has launched the last bucket.
    p.registerPostAccumulateGradHook([this, fired, n = params.size()](Tensor&) {
      if (++*fired % n == 0 && lastMicroBatch_) reach(step_, Phase::Backward);
    });
  }
}

LoopResult Loop::run(StepFunction fn) {
  LoopResult result;
  if (!group_) {
    if (!options_.quiet) std::printf("%s: %s; nothing to do\n", options_.program.c_str(), finished_.c_str());
    result.stopReason = finished_;
    return result;
  }
  if (pipelined() && fn) {
    throw InvalidArgument(str(options_.program, ": run() under pipeline parallelism takes an empty step function: "
                              "the loop runs the pipeline, whose last stage takes nn::Gpt::loss"));
  }
  if (!pipelined() && !fn) throw InvalidArgument(str(options_.program, ": run() needs a step function"));
  checkSetUp();
  control_ = zeros({3}, DType::Float64);
  if (stragglers_) {
    // Where this member runs, for rank 0's straggler report.
    StorePtr store = elastic_ ? elastic_->store() : store_;
    char host[256] = {};
    if (store && ::gethostname(host, sizeof(host) - 1) == 0) {
      try {
        store->set(str("dt/straggler/host/", memberId()), host);
      } catch (const std::exception&) {
        // The report names the rank without its host then.
      }
    }
  }
  splitData();
  // ZeRO's optimizer comes once ZeRO is made (below); the others' update tensors that exist now.
  if (!makeOptimizer_) {
    checkOptimizer();
  } else if (!zeroSharded() || pipelined()) {  // a pipeline's ZeRO is its sharded wrapper, made by now
    makeOptimizer();
  }
  if (joining_) {
    // The members send it right after admitting this process.
    if (fsdp_ || zeroSharded()) {
      redistributeShards({});
    } else {
      transferState();
    }
  } else {
    const std::optional<CheckpointRef> ref = findCheckpoint();
    if (zeroSharded() && !pipelined()) {
      wrapReplicated(true);
      // A checkpoint without DDP's bucket order (written by another mode, or before DDP had
      // settled) settles here too: ZeRO's parts must not be cut again once its state is loaded.
      if (!ref || bucketOrder_.empty()) settleBuckets(fn);
      shardOptimizerState();
    }
    if (ref) resume(*ref);
    if (checkpoints_ && group_->rank() == 0) checkpoints_->removeTemporaries();  // only once the checkpoint read is good
    // Sharded and elastic: a loss goes back to the newest checkpoint, so there is always one.
    // The barrier: rank 0 may still be removing temporaries, which the others' first writes
    // would be (later checkpoints follow a step's collectives).
    if ((fsdp_ || zero_) && elastic_ && checkpoints_ && step_ == 0) {
      group_->barrier()->wait();
      saveCheckpoint("start");
    }
  }
  if (!ddp_ && !fsdp_ && !pipelined()) wrapReplicated(!joining_);
  armBackwardHook();
  if (group_->rank() == 0 && !options_.metricsFile.empty()) {
    metrics_ = std::make_unique<MetricsFile>(options_.metricsFile, startStep_, options_.program);
  }
  startLoader();
  if (options_.evalAtStart && evaluate_ && step_ == 0 && !joining_) {
    // Where the curve starts: the untrained model.
    evaluation_ = evaluate_();
    if (group_->rank() == 0) {
      Progress start;
      start.steps = options_.steps;
      start.epochs = (options_.steps + sampler_->batchesPerEpoch() - 1) / sampler_->batchesPerEpoch();
      start.loss = std::nan("");
      start.lr = learningRate_ ? learningRate_(0) : optimizer_->lr();
      start.metrics = evaluation_;
      report(start);
    }
  }
  loopStart_ = Clock::now();
  Window window;
  window.reset(step_);
  // Admitted at a checkpoint's step, a joiner writes that checkpoint with the members: they
  // write it at the end of the step whose boundary admitted it, after the admission.
  if (joining_) periodicCheckpoint();
  bool goOn = true;
  while (step_ < options_.steps && goOn && left_.empty()) {
    goOn = trainStep(fn, window);
    if (goOn) periodicCheckpoint();
  }
  // Its replica is gone and so is its group: nothing collective is left to do here.
  if (!left_.empty()) return leftResult();
  profile();  // a window that reached the end
  result.seconds = runSeconds_;
  result.elapsed = priorSeconds_ + runSeconds_;
  result.firstStep = startStep_;
  result.dataWaitMs = loader_ ? loader_->stats().waitMs : 0;
  result.steps = step_;
  result.loss = recentLoss_;
  if (step_ < options_.steps) {
    const int sig = stopSignal().load();
    result.stopped = true;
    result.stopReason = sig != 0 ? signalName(sig) : "a stop request on another rank";
    if (checkpoints_) saveCheckpoint(str("stopped by ", result.stopReason));
    group_->barrier()->wait();
    say(str(options_.program, ": stopped by ", result.stopReason, " after step ", step_, " of ", options_.steps,
            checkpoints_ ? str("; checkpoint written, run again to resume from step ", step_) : std::string("; no checkpoint")));
  }
  while (true) {
    try {
      if (!result.stopped && checkpoints_ && step_ > startStep_) saveCheckpoint("final");
      const std::vector<Tensor> params = wholeParameters();
      result.parameterSpread = parameterSpread(*dataGroup(), params);
      result.fingerprint = fingerprint(params);
      if (!result.stopped && evaluate_ && evaluation_.empty()) evaluation_ = evaluate_();
      result.evaluation = evaluation_;
      group_->barrier()->wait();
      return result;
    } catch (const Error&) {
      // A member lost after the last step (its commit vote passed everywhere): the others
      // recover as in a step and do the end again on the new group. A sharded model would go
      // back to its newest checkpoint, before the end: not here.
      if (!elastic_ || fsdp_ || zero_ || result.stopped) throw;
      recover(std::current_exception());
      if (!left_.empty()) return leftResult();
    }
  }
}

LoopResult Loop::leftResult() const {
  LoopResult result;
  result.left = true;
  result.stopReason = left_;
  result.steps = step_;
  result.firstStep = startStep_;
  result.seconds = runSeconds_;
  result.elapsed = priorSeconds_ + runSeconds_;
  result.loss = recentLoss_;
  return result;
}

}  // namespace dt::train
