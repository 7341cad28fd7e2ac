// What a joiner's state transfer costs against a plain broadcast of the same bytes, on the
// same group in the same run (issue 36: a joiner received the state at 4 % of broadcast speed).
//
//   state_transfer_bench [--nproc W] [--backend shm|gloo] [--model gpt|mlp] [--reps R]
//
// Forks W ranks (default 4): ranks 0..W-2 are members holding a trained state (a GPT or the
// trainer's MLP, AdamW with its moments after one step), rank W-1 is a joiner that builds a
// fresh model and optimizer (no moments yet) for every repetition, as a replacement process
// does, so its destination memory is as fresh as a real joiner's. Each repetition, after a
// barrier:
//   transfer     broadcastState(state, group, 0, restoreHere = joiner): the whole state
//                (parameters + both moments + the step) restored on the joiner
//   bcast        one plain broadcast of as many bytes into a buffer every rank allocated and
//                touched before the barrier (what the recovery bench compares with)
//   bcast_fresh  the same into a buffer allocated just before it and not touched (what a
//                joiner's first write into new memory costs: page faults)
// Each time is the slowest rank's. Then, once, a joiner's time to its first step: it builds a
// fresh replica, receives the state and wraps the model in DDP (ready_ms, on its own clock
// from before the build), then takes one training step with the members (batch 4 x 128 tokens
// per rank for the GPT, 32 images for the MLP; first_step_ms). The process's start, rendezvous
// and connect are not in it (bench/run_recovery_bench.sh's join_ms has them for the MLP
// trainer). Prints a table, RESULT lines (medians) and the goals: transfer >= 0.5x bcast
// bandwidth, and a GPT joiner ready for its first step within 2 s.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_common.h"
#include "checkpoint/state.h"
#include "checkpoint/transfer.h"
#include "common/strings.h"
#include "ddp/ddp.h"
#include "process_group/init.h"
#include "tensor/nn/gpt.h"
#include "tensor/nn/module.h"
#include "tensor/ops.h"
#include "tensor/optim/optim.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  int nproc = 4;
  std::string backend = "shm";
  std::string model = "gpt";
  int reps = 5;
};

[[noreturn]] void usage(const std::string& problem) {
  std::fprintf(stderr, "state_transfer_bench: %s\nusage: state_transfer_bench [--nproc W>=2] [--backend shm|gloo] "
                       "[--model gpt|mlp] [--reps R]\n", problem.c_str());
  std::exit(2);
}

Args parseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) usage(dt::str("missing value after ", arg));
    const std::string value = argv[++i];
    if (arg == "--nproc") a.nproc = std::atoi(value.c_str());
    else if (arg == "--backend") a.backend = value;
    else if (arg == "--model") a.model = value;
    else if (arg == "--reps") a.reps = std::atoi(value.c_str());
    else usage(dt::str("unknown argument ", arg));
  }
  if (a.nproc < 2) usage(dt::str("--nproc must be at least 2 (members and a joiner), got ", a.nproc));
  if (a.backend != "shm" && a.backend != "gloo") usage(dt::str("--backend must be shm or gloo, got ", a.backend));
  if (a.model != "gpt" && a.model != "mlp") usage(dt::str("--model must be gpt or mlp, got ", a.model));
  if (a.reps < 1) usage(dt::str("--reps must be at least 1, got ", a.reps));
  return a;
}

// The trainer's MLP (784-256-128-10) or the sharded bench's 38M GPT (L12-H8-C512-T128).
std::shared_ptr<dt::nn::Module> makeModel(const std::string& kind) {
  dt::Generator init(1);
  if (kind == "gpt") {
    return std::make_shared<dt::nn::Gpt>(
        dt::nn::GptConfig{.vocabSize = 256, .contextLength = 128, .layers = 12, .heads = 8, .width = 512}, init);
  }
  auto mlp = std::make_shared<dt::nn::Sequential>();
  mlp->pushBack(std::make_shared<dt::nn::Linear>(784, 256, true, init));
  mlp->pushBack(std::make_shared<dt::nn::Linear>(256, 128, true, init));
  mlp->pushBack(std::make_shared<dt::nn::Linear>(128, 10, true, init));
  return mlp;
}

struct Replica {
  std::shared_ptr<dt::nn::Module> model;
  std::unique_ptr<dt::optim::AdamW> optimizer;
};

// A member's replica has taken one step (its moments exist); a joiner's has not.
Replica makeReplica(const std::string& kind, bool stepped) {
  Replica r{makeModel(kind), nullptr};
  r.optimizer = std::make_unique<dt::optim::AdamW>(r.model->parameters());
  if (stepped) {
    for (dt::Tensor& p : r.model->parameters()) p.setGrad(dt::full(p.sizes(), 1e-3, p.dtype()));
    r.optimizer->step();
  }
  return r;
}

dt::TrainingState stateOf(Replica& r, const dt::ProcessGroup& group) {
  dt::TrainingState state(group.rank(), group.size());
  state.addModule("model", *r.model);
  state.addOptimizer("optim", *r.optimizer, dt::ParameterMap::replicated(*r.model));
  return state;
}

double slowest(dt::ProcessGroup& group, double seconds) {
  dt::Tensor t = dt::fromVector<double>({seconds});
  dt::AllreduceOptions max;
  max.reduceOp = dt::ReduceOp::Max;
  group.allreduce(t, max)->wait();
  return t.data<double>()[0];
}

int runRank(const Args& args) {
  auto group = dt::initProcessGroup();
  const int rank = group->rank(), world = group->size();
  const bool joiner = rank == world - 1;
  Replica member;
  if (!joiner) member = makeReplica(args.model, true);
  int64_t bytes = 0;
  std::vector<double> transfer, bcast, fresh;
  for (int rep = 0; rep < args.reps; ++rep) {
    Replica fresher;
    Replica& mine = joiner ? (fresher = makeReplica(args.model, false)) : member;
    dt::TrainingState state = stateOf(mine, *group);
    group->barrier()->wait();
    auto t0 = Clock::now();
    dt::broadcastState(state, *group, 0, joiner);
    transfer.push_back(slowest(*group, std::chrono::duration<double>(Clock::now() - t0).count()));

    bytes = 0;
    for (const auto& t : state.collect()) bytes += t.local.numel() * static_cast<int64_t>(dt::itemSize(t.local.dtype()));
    dt::Tensor touched = dt::zeros({std::max<int64_t>(bytes / 4, 1)}, dt::DType::Float32);
    group->barrier()->wait();
    t0 = Clock::now();
    group->broadcast(touched, {.root = 0})->wait();
    bcast.push_back(slowest(*group, std::chrono::duration<double>(Clock::now() - t0).count()));

    group->barrier()->wait();
    t0 = Clock::now();
    dt::Tensor untouched = dt::empty({std::max<int64_t>(bytes / 4, 1)}, dt::DType::Float32);
    group->broadcast(untouched, {.root = 0})->wait();
    fresh.push_back(slowest(*group, std::chrono::duration<double>(Clock::now() - t0).count()));
  }
  // A joiner's first step.
  group->barrier()->wait();
  auto t0 = Clock::now();
  Replica fresher;
  Replica& mine = joiner ? (fresher = makeReplica(args.model, false)) : member;
  const double buildS = std::chrono::duration<double>(Clock::now() - t0).count();
  auto t1 = Clock::now();
  dt::TrainingState state = stateOf(mine, *group);
  dt::broadcastState(state, *group, 0, joiner);
  const double transferS = std::chrono::duration<double>(Clock::now() - t1).count();
  t1 = Clock::now();
  dt::DistributedDataParallel ddp(mine.model, group);
  const double readyS = std::chrono::duration<double>(Clock::now() - t0).count();
  dt::Generator data(7 + static_cast<uint64_t>(rank));
  mine.optimizer->zeroGrad();
  if (args.model == "gpt") {
    const dt::Tensor tokens = dt::randint(0, 256, {4, 129}, data);
    const dt::Tensor logits = ddp(tokens.narrow(1, 0, 128).contiguous());
    dt::nn::Gpt::loss(logits, tokens.narrow(1, 1, 128).contiguous()).backward();
  } else {
    dt::sum(ddp(dt::randn({32, 784}, data))).backward();
  }
  mine.optimizer->step();
  const double stepS = std::chrono::duration<double>(Clock::now() - t1).count();
  // The joiner's numbers, at rank 0.
  dt::Tensor joinerTimes = dt::fromVector<double>({joiner ? buildS : 0, joiner ? transferS : 0, joiner ? readyS : 0,
                                                   joiner ? stepS : 0});
  group->allreduce(joinerTimes)->wait();
  const double* jt = joinerTimes.data<double>();

  if (rank != 0) return 0;
  const double mb = static_cast<double>(bytes) / 1e6;
  const double tMs = dt::bench::median(transfer) * 1e3, bMs = dt::bench::median(bcast) * 1e3,
               fMs = dt::bench::median(fresh) * 1e3;
  const std::string impl = dt::str("dtrain-", args.backend);
  std::printf("# state_transfer_bench: %s, world %d (%d members, 1 joiner), model %s, %.2f MB of state, %d reps\n",
              impl.c_str(), world, world - 1, args.model.c_str(), mb, args.reps);
  std::printf("| %-12s | %10s | %10s | %10s |\n", "what", "ms", "MB/s", "x bcast");
  std::printf("|--------------|------------|------------|------------|\n");
  const auto row = [&](const char* what, double ms) {
    std::printf("| %-12s | %10.1f | %10.0f | %10.2f |\n", what, ms, mb / (ms / 1e3), bMs / ms);
  };
  row("transfer", tMs);
  row("bcast", bMs);
  row("bcast_fresh", fMs);
  std::printf("RESULT state_transfer impl=%s world=%d model=%s bytes=%lld reps=%d transfer_ms=%.3f bcast_ms=%.3f "
              "bcast_fresh_ms=%.3f transfer_mb_s=%.1f bcast_mb_s=%.1f transfer_vs_bcast=%.3f\n",
              impl.c_str(), world, args.model.c_str(), static_cast<long long>(bytes), args.reps, tMs, bMs, fMs,
              mb / (tMs / 1e3), mb / (bMs / 1e3), bMs / tMs);
  std::printf("# a joiner: build %.0f ms + transfer %.0f ms + DDP = ready for its first step at %.0f ms; "
              "that step (DDP's first, with the members) %.0f ms\n", jt[0] * 1e3, jt[1] * 1e3, jt[2] * 1e3, jt[3] * 1e3);
  std::printf("RESULT joiner_first_step impl=%s world=%d model=%s build_ms=%.1f transfer_ms=%.1f ready_ms=%.1f "
              "first_step_ms=%.1f\n", impl.c_str(), world, args.model.c_str(), jt[0] * 1e3, jt[1] * 1e3, jt[2] * 1e3,
              jt[3] * 1e3);
  if (args.model == "gpt") {
    std::printf("GOAL joiner_ready impl=%s model=gpt ready_ms=%.0f (< 2000) %s\n", impl.c_str(), jt[2] * 1e3,
                jt[2] < 2.0 ? "MET" : "MISSED");
  }
  std::printf("GOAL state_transfer impl=%s model=%s transfer_vs_bcast=%.3f (>= 0.5) %s\n", impl.c_str(),
              args.model.c_str(), bMs / tMs, bMs / tMs >= 0.5 ? "MET" : "MISSED");
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parseArgs(argc, argv);
  ::setenv("DT_BACKEND", args.backend.c_str(), 1);  // the ranks' initProcessGroup reads it
  return dt::bench::rankMain(args.nproc, [&] { return runRank(args); }, "state_transfer_bench");
}
