// pipeline_bench: pipeline parallelism's schedules on real ranks (issue 39), one configuration per
// launch (so that each one's peak memory is its own). Ranks are forked processes over the shm
// backend (or gloo), one thread each.
//
// Workloads:
//   fixed   stages of a fixed synthetic cost (pipeline::fixedCostStages: F, I and W sleep one
//           unit each, B two): the measured bubble is the schedule's and the transport's alone,
//           whatever the cores, and is compared with the simulator's formula.
//   gpt     nn::Gpt split by pipeline::splitGpt (AdamW, clipping at 1.0, random tokens), or with
//           --schedule ddp the whole model under DistributedDataParallel on every rank at the
//           same global batch (m micro-batches of --micro-batch rows; DDP's ranks each take
//           m / world of them in one batch), or with --schedule fsdp the same under the fully
//           sharded wrapper (a unit per block, its defaults).
// Each timed step starts after a barrier, so that a rank's wait for its first input is counted,
// and a rank's idle time runs to the end of the step's slowest rank (the simulator's makespan).
//
// Usage: pipeline_bench --nproc P --workload fixed|gpt --schedule gpipe|1f1b|interleaved|zb1|zbv|ddp|fsdp
//          [--m 8] [--v 2] [--zb-pending K] [--unit-ms 20] [--steps 5] [--warmup 1] [--backend shm|gloo]
//          [--layers 12 --width 512 --heads 8 --context 128 --vocab 256 --micro-batch 2]
// Rank 0 prints one line:
//   RESULT pipeline workload=fixed schedule=1f1b p=4 m=8 v=1 unit_ms=20 backend=shm step_ms=...
//     formula=0.375 bubble_max=... bubble_mean=... bubble_ranks=a,b,c,d idle_ms_max=...
//   RESULT pipeline workload=gpt schedule=zb1 p=4 m=8 ... step_ms=... tokens_per_s=...
//     peak_rss_mb_ranks=... peak_rss_mb_max=... bubble_ranks=... formula=...
//     state_mb_ranks=... peak_alloc_mb_ranks=... f_mb_ranks=... pending_w_mb_ranks=...
//     in_flight_ranks=... pending_w_ranks=...
// (bubble: idle / compute per rank, the median over the timed steps; formula: simulate() with
// F = I = W = 1, B = 2.) The gpt rows' memory from the allocator, which RSS's page reuse and
// fragmentation do not blur: state_mb is what a rank holds between steps (parameters, AdamW's
// moments), peak_alloc_mb the most it held during a timed step; f_mb what one micro-batch's
// forward through the rank's first chunk keeps until its B or I (measured once, outside the
// schedule), pending_w_mb what that micro-batch still keeps after its I until its W; in_flight
// and pending_w the simulator's peak counts of each on the rank (peakInFlight,
// peakPendingWeightGrads). Activations at the peak are then about
// in_flight x f_mb + pending_w x pending_w_mb (one chunk per rank; the counts' peaks need not
// coincide).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_common.h"
#include "common/strings.h"
#include "ddp/ddp.h"
#include "fsdp/fully_shard.h"
#include "parallel/pipeline.h"
#include "process_group/init.h"
#include "tensor/autograd/autograd.h"
#include "tensor/memory_stats.h"
#include "tensor/nn/clip_grad.h"
#include "tensor/nn/gpt.h"
#include "tensor/ops.h"
#include "tensor/optim/optim.h"
#include "tensor/parallel.h"

namespace {

namespace pp = dt::pipeline;
using Clock = std::chrono::steady_clock;

struct Args {
  int nproc = 0;
  std::string workload = "fixed";
  std::string schedule = "1f1b";
  std::string backend = "shm";
  int m = 8;
  int v = 2;
  int zbPending = 0;  // zb1: deferred weight gradients per rank at most (0: p)
  double unitMs = 20;
  int steps = 5;
  int warmup = 1;
  dt::nn::GptConfig gpt{.vocabSize = 256, .contextLength = 128, .layers = 12, .heads = 8, .width = 512};
  int64_t microBatch = 2;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "pipeline_bench: %s\nusage: pipeline_bench --nproc P --workload fixed|gpt --schedule "
               "gpipe|1f1b|interleaved|zb1|zbv|ddp|fsdp [--m M] [--v V] [--zb-pending K] [--unit-ms U] [--steps S] [--warmup W] "
               "[--backend shm|gloo] [--layers L --width C --heads H --context T --vocab N --micro-batch B]\n",
               why.c_str());
  std::exit(2);
}

Args parseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) usage(arg + " needs a value");
    const std::string value = argv[++i];
    try {
      if (arg == "--nproc") a.nproc = std::stoi(value);
      else if (arg == "--workload") a.workload = value;
      else if (arg == "--schedule") a.schedule = value;
      else if (arg == "--backend") a.backend = value;
      else if (arg == "--m") a.m = std::stoi(value);
      else if (arg == "--v") a.v = std::stoi(value);
      else if (arg == "--zb-pending") a.zbPending = std::stoi(value);
      else if (arg == "--unit-ms") a.unitMs = std::stod(value);
      else if (arg == "--steps") a.steps = std::stoi(value);
      else if (arg == "--warmup") a.warmup = std::stoi(value);
      else if (arg == "--layers") a.gpt.layers = std::stoi(value);
      else if (arg == "--width") a.gpt.width = std::stoi(value);
      else if (arg == "--heads") a.gpt.heads = std::stoi(value);
      else if (arg == "--context") a.gpt.contextLength = std::stoi(value);
      else if (arg == "--vocab") a.gpt.vocabSize = std::stoi(value);
      else if (arg == "--micro-batch") a.microBatch = std::stoi(value);
      else usage("unknown argument " + arg);
    } catch (const std::logic_error&) {
      usage(arg + " " + value + " is not a number");
    }
  }
  if (a.workload != "fixed" && a.workload != "gpt") usage("--workload " + a.workload + " (fixed or gpt)");
  if ((a.schedule == "ddp" || a.schedule == "fsdp") && a.workload != "gpt")
    usage("--schedule " + a.schedule + " is a baseline of --workload gpt");
  if (a.steps < 1) usage("--steps must be at least 1");
  if (a.zbPending != 0 && a.schedule != "zb1") usage("--zb-pending bounds zb1's pending weight gradients");
  return a;
}

pp::Schedule scheduleOf(const Args& a, int p) {
  if (a.schedule == "gpipe") return pp::gpipe(p, a.m);
  if (a.schedule == "1f1b") return pp::oneFOneB(p, a.m);
  if (a.schedule == "interleaved") return pp::interleavedOneFOneB(p, a.m, a.v);
  if (a.schedule == "zb1") return pp::zeroBubbleH1(p, a.m, a.zbPending);
  if (a.schedule == "zbv") return pp::zeroBubbleV(p, a.m);
  usage("--schedule " + a.schedule + " (gpipe, 1f1b, interleaved, zb1, zbv, ddp, fsdp)");
}



// One value per rank, gathered on every rank (a sum of one-hot vectors).
std::vector<double> gatherPerRank(const dt::ProcessGroupPtr& group, double value) {
  dt::Tensor all = dt::zeros({group->size()}, dt::DType::Float64);
  all.data<double>()[group->rank()] = value;
  group->allreduce(all)->wait();
  return std::vector<double>(all.data<double>(), all.data<double>() + group->size());
}

std::string joined(const std::vector<double>& values, const char* format) {
  std::string out;
  for (double v : values) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, format, v);
    if (!out.empty()) out += ',';
    out += buffer;
  }
  return out;
}

int runRank(const Args& args) {
  dt::setNumThreads(1);
  auto group = dt::initProcessGroup();
  const int rank = group->rank(), world = group->size();
  // The data-parallel baselines: the whole model on every rank, DDP or fully sharded.
  const bool fsdpBaseline = args.schedule == "fsdp";
  const bool wholeModelBaseline = args.schedule == "ddp" || fsdpBaseline;
  const int64_t T = args.gpt.contextLength;

  std::unique_ptr<pp::PipelineRunner> runner;
  std::shared_ptr<dt::nn::Gpt> whole;
  std::shared_ptr<dt::DistributedDataParallel> ddp;
  std::unique_ptr<dt::FullyShardedDataParallel> fsdp;
  std::unique_ptr<dt::optim::AdamW> adamw;
  std::vector<dt::Tensor> inputs, targets;
  dt::Tensor wholeInputs, wholeTargets;
  double formula = 0;
  double forwardMb = 0, pendingWMb = 0, inFlight = 0, pendingW = 0;
  dt::Generator data(1000);  // the same tokens on every rank: each takes its part

  if (wholeModelBaseline) {
    if (args.m % world != 0) usage(dt::str("--m ", args.m, " is not a multiple of the world ", world));
    dt::Generator init(1234);
    whole = std::make_shared<dt::nn::Gpt>(args.gpt, init);
    if (fsdpBaseline) {
      dt::FullyShardOptions sharded;
      for (const auto& [name, block] : whole->h->namedChildren()) sharded.units.push_back(block);
      fsdp = std::make_unique<dt::FullyShardedDataParallel>(whole, group, sharded);
      adamw = std::make_unique<dt::optim::AdamW>(fsdp->parameters(), dt::optim::AdamWOptions{.lr = 1e-4});
    } else {
      ddp = std::make_shared<dt::DistributedDataParallel>(whole, group, dt::DdpOptions{});
      adamw = std::make_unique<dt::optim::AdamW>(whole->parameters(), dt::optim::AdamWOptions{.lr = 1e-4});
    }
    const int64_t rows = args.m * args.microBatch / world;
    const dt::Tensor tokens = dt::randint(0, args.gpt.vocabSize, {args.m * args.microBatch, T + 1}, data);
    const dt::Tensor mine = tokens.narrow(0, rank * rows, rows);
    wholeInputs = mine.narrow(1, 0, T).contiguous();
    wholeTargets = mine.narrow(1, 1, T).contiguous();
  } else {
    const pp::Schedule schedule = scheduleOf(args, world);
    const pp::SimulationResult simulated = pp::simulate(schedule);
    formula = simulated.bubble;
    inFlight = simulated.peakInFlight.at(static_cast<size_t>(rank));
    pendingW = simulated.peakPendingWeightGrads.at(static_cast<size_t>(rank));
    const bool first = schedule.rankOfStage(0) == rank, last = schedule.rankOfStage(schedule.numStages() - 1) == rank;
    dt::Shape activation;
    if (args.workload == "fixed") {
      const auto unit = std::chrono::microseconds(static_cast<int64_t>(args.unitMs * 1000));
      activation = {args.microBatch, 4};
      runner = std::make_unique<pp::PipelineRunner>(schedule, pp::fixedCostStages(schedule, rank, {}, unit), group,
                                                    pp::PipelineOptions{.activationShape = activation});
      for (int i = 0; i < args.m; ++i) {
        if (first) inputs.push_back(dt::ones(activation).setRequiresGrad(true));
        if (last) targets.push_back(dt::ones(activation));
      }
    } else {
      dt::Generator init(1234);
      auto model = std::make_shared<dt::nn::Gpt>(args.gpt, init);
      const pp::GptStages stages = pp::splitGpt(*model, schedule, rank);
      if (rank == 0) std::fprintf(stderr, "# %s\n", stages.summary().c_str());
      model.reset();  // the chunks keep their blocks; the others go
      activation = {args.microBatch, T, args.gpt.width};
      runner = std::make_unique<pp::PipelineRunner>(schedule, stages.runnerStages(), group,
                                                    pp::PipelineOptions{.activationShape = activation});
      adamw = std::make_unique<dt::optim::AdamW>(stages.parameters(), dt::optim::AdamWOptions{.lr = 1e-4});
      for (int i = 0; i < args.m; ++i) {
        const dt::Tensor tokens = dt::randint(0, args.gpt.vocabSize, {args.microBatch, T + 1}, data);
        if (first) inputs.push_back(tokens.narrow(1, 0, T).contiguous());
        if (last) targets.push_back(tokens.narrow(1, 1, T).contiguous());
      }
      // What one micro-batch costs the rank's first chunk: the forward's graph until its I, and
      // what its deferred weight gradients keep from the I to the W.
      const auto& chunk = stages.chunks.front();
      dt::Generator probe(7);
      dt::Tensor x = stages.stages.front() == 0 ? dt::randint(0, args.gpt.vocabSize, {args.microBatch, T}, probe)
                                                : dt::randn(activation, probe).setRequiresGrad(true);
      const auto live = [] { return static_cast<double>(dt::memoryStats().allocatedBytes) / (1 << 20); };
      const double before = live();
      dt::Tensor y = (*chunk)(x);
      forwardMb = live() - before;
      dt::Tensor g = dt::randn(y.sizes(), probe);
      dt::WeightGradients w = dt::backwardDeferringWeights({y}, {g}, chunk->parameters());
      y = g = x = dt::Tensor();  // the output, its gradient and the input's gradient, as the runner drops them
      pendingWMb = live() - before;
      w.run();
      chunk->zeroGrad();
    }
  }

  auto step = [&] {
    if (wholeModelBaseline) {
      adamw->zeroGrad();
      if (fsdp) {
        dt::nn::Gpt::loss((*fsdp)(wholeInputs), wholeTargets).backward();
        dt::nn::clipGradNorm(fsdp->parameters(), 1.0, {.reducePartial = fsdp->gradNormReducer()});
      } else {
        dt::nn::Gpt::loss((*ddp)(wholeInputs), wholeTargets).backward();
        dt::nn::clipGradNorm(whole->parameters(), 1.0);
      }
      adamw->step();
      return;
    }
    for (const auto& chunk : runner->stages().chunks) chunk->zeroGrad();
    runner->step(inputs, targets);
    if (adamw) {
      pp::clipGradNorm(*runner, 1.0);
      adamw->step();
    }
  };
  for (int i = 0; i < args.warmup; ++i) step();
  if (!wholeModelBaseline) {
    for (const auto& chunk : runner->stages().chunks) chunk->zeroGrad();
  }
  const double stateMb = static_cast<double>(dt::memoryStats().allocatedBytes) / (1 << 20);
  dt::resetPeakMemoryStats();
  dt::bench::resetPeakRss();
  std::vector<double> stepMs, bubbles, idleMs;
  for (int i = 0; i < args.steps; ++i) {
    group->barrier()->wait();
    const auto start = Clock::now();
    step();
    stepMs.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    if (runner) {
      // As the simulator counts it: every rank's idle time runs to the end of the step's last
      // rank (the makespan), not to its own (the last stage's rank returns early).
      const std::vector<double> walls = gatherPerRank(group, runner->lastStep().wallSeconds);
      const double makespan = *std::max_element(walls.begin(), walls.end());
      const double compute = runner->lastStep().computeSeconds;
      bubbles.push_back(compute > 0 ? (makespan - compute) / compute : 0.0);
      idleMs.push_back((makespan - compute) * 1000);
    }
  }
  // A step's time is its slowest rank's.
  const std::vector<double> stepByRank = gatherPerRank(group, dt::bench::median(stepMs));
  const std::vector<double> bubbleByRank = gatherPerRank(group, bubbles.empty() ? 0.0 : dt::bench::median(bubbles));
  const std::vector<double> idleByRank = gatherPerRank(group, idleMs.empty() ? 0.0 : dt::bench::median(idleMs));
  const std::vector<double> rssByRank = gatherPerRank(group, dt::bench::peakRssMb());
  const std::vector<double> stateByRank = gatherPerRank(group, stateMb);
  const std::vector<double> peakByRank =
      gatherPerRank(group, static_cast<double>(dt::memoryStats().peakAllocatedBytes) / (1 << 20));
  const std::vector<double> forwardByRank = gatherPerRank(group, forwardMb);
  const std::vector<double> pendingByRank = gatherPerRank(group, pendingWMb);
  const std::vector<double> inFlightByRank = gatherPerRank(group, inFlight);
  const std::vector<double> pendingCountByRank = gatherPerRank(group, pendingW);
  if (rank == 0) {
    const double ms = *std::max_element(stepByRank.begin(), stepByRank.end());
    const double tokens = static_cast<double>(args.m * args.microBatch * (args.workload == "gpt" ? T : 1));
    double bubbleSum = 0;
    for (double b : bubbleByRank) bubbleSum += b;
    // zb1 with fewer pending W than p is its own row: zb1k1, zb1k2, ...
    const std::string label = args.zbPending > 0 && args.zbPending < world ? dt::str("zb1k", args.zbPending) : args.schedule;
    std::printf("RESULT pipeline workload=%s schedule=%s p=%d m=%d v=%d backend=%s", args.workload.c_str(),
                label.c_str(), world, args.m, runner ? runner->schedule().v : 1, args.backend.c_str());
    if (args.workload == "fixed") {
      std::printf(" unit_ms=%g", args.unitMs);
    } else {
      std::printf(" model=L%lld-H%lld-C%lld-T%lld micro_batch=%lld params=%lld threads=1",
                  static_cast<long long>(args.gpt.layers), static_cast<long long>(args.gpt.heads),
                  static_cast<long long>(args.gpt.width), static_cast<long long>(T),
                  static_cast<long long>(args.microBatch), static_cast<long long>(args.gpt.parameterCount()));
    }
    std::printf(" steps=%d step_ms=%.1f tokens_per_s=%.1f", args.steps, ms, tokens / (ms / 1000));
    if (runner) {
      std::printf(" formula=%.4f bubble_max=%.4f bubble_mean=%.4f bubble_ranks=%s idle_ms_max=%.1f", formula,
                  *std::max_element(bubbleByRank.begin(), bubbleByRank.end()), bubbleSum / world,
                  joined(bubbleByRank, "%.4f").c_str(), *std::max_element(idleByRank.begin(), idleByRank.end()));
    }
    std::printf(" peak_rss_mb_max=%.1f peak_rss_mb_ranks=%s", *std::max_element(rssByRank.begin(), rssByRank.end()),
                joined(rssByRank, "%.0f").c_str());
    if (args.workload == "gpt") {
      std::printf(" state_mb_ranks=%s peak_alloc_mb_max=%.1f peak_alloc_mb_ranks=%s", joined(stateByRank, "%.1f").c_str(),
                  *std::max_element(peakByRank.begin(), peakByRank.end()), joined(peakByRank, "%.1f").c_str());
      if (runner) {
        std::printf(" f_mb_ranks=%s pending_w_mb_ranks=%s in_flight_ranks=%s pending_w_ranks=%s",
                    joined(forwardByRank, "%.2f").c_str(), joined(pendingByRank, "%.2f").c_str(),
                    joined(inFlightByRank, "%.0f").c_str(), joined(pendingCountByRank, "%.0f").c_str());
      }
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  group->barrier()->wait();
  runner.reset();
  ddp.reset();
  fsdp.reset();
  group->destroy();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parseArgs(argc, argv);
  if (args.backend != "shm" && args.backend != "gloo") usage("--backend " + args.backend + " (shm or gloo)");
  ::setenv("DT_BACKEND", args.backend.c_str(), 1);
  return dt::bench::rankMain(args.nproc, [&] { return runRank(args); }, "pipeline_bench");
}
