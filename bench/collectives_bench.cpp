// collectives_bench: allreduce (sum) and broadcast (root 0) of float32
// tensors through dtrain's ProcessGroup on the Gloo or shm backend (CPU
// tensors) or NCCL (tensors on cuda:<local rank mod GPUs>; a rep ends when the
// stream has finished it; with --nproc a child process, not this one, asks
// whether cuda:0 is usable, as the ranks forked after it could not use CUDA
// once this process had initialised it) (--backend, default gloo;
// impl=dtrain-<backend>),
// with the methodology
// of bench/peers/torch_allreduce.py so the numbers pair up:
//   * per size: warm-up max(2, reps/10) ops, then `reps` timed ops (200 up to
//     64 KiB, 50 at 1 MiB, 15 at 16 MiB, 7 at 64 MiB), each preceded by a
//     barrier; a rep's time is the slowest rank's (one allreduce(max) over the
//     per-rank duration vectors after the loop); time_us is the median;
//   * algbw = bytes/time, busbw = algbw*2(n-1)/n (allreduce) or algbw
//     (broadcast); GB = 1e9 bytes; the allreduce buffer is reset to ones every
//     8 reps outside the timed region; p99_us is the 99th percentile of the
//     reps (the slow tail a median hides).
//   * --batch-ms B: the timing of bench/peers/mpi_bench.cpp instead, for a
//     like-for-like comparison with it: a pilot (barrier, one op, the slowest
//     rank's time) sets k = clamp(floor(B / pilot), 1, 10000); each of `reps`
//     samples (default 50) is a barrier, then k ops back to back, timed as
//     elapsed / k (the slowest rank's). Ops between two barriers overlap as
//     they do in training: with one op per barrier, ranks stacked on one core
//     pay two hand-overs of the core per op (the barrier's and the op's);
//     back to back, about one.
//   * op "empty" (the cost of the API itself): allreduce of a zero-element
//     tensor, issued and waited through ProcessGroup and Work; best run with
//     --nproc 1, where no peer adds an exchange. Ops are timed in batches of
//     1000 back to back (one op is too short for the clock); time_us is the
//     median batch's time per op. --sizes does not apply. Before each batch
//     the same thread times a host reference: a fixed loop of what an op is
//     made of (mutex round trips, allocations, atomic updates) and nothing of
//     dtrain's. The host's speed moves in stretches of seconds on a shared
//     VM; host_ref_ns (its median) says how fast the host was, and
//     host_fast_time_us / host_slow_time_us split the batches by whether
//     their reference was within 5 % of its fastest or not (the count of
//     each follows).
//
// Usage:
//   collectives_bench --nproc 4 [--backend gloo|shm|nccl] [--sizes 4K,64K,1M,16M,64M] [--ops allreduce,broadcast] [--reps R] [--batch-ms B]
//     forks 4 ranks on this machine (rank 0 hosts the store on a free port);
//   collectives_bench (with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT or dtrun's
//     variables set) runs as one rank of an externally launched job.
// Rank 0 prints an nccl-tests style table on stderr and RESULT lines on stdout:
//   RESULT allreduce impl=dtrain-gloo world=4 bytes=1048576 reps=50 threads=1 time_us=... min_us=... p99_us=... algbw_GBps=... busbw_GBps=...
//   RESULT empty impl=dtrain-shm world=1 bytes=0 reps=200 threads=1 time_us=... min_us=... p99_us=...
//     host_ref_ns=... host_ref_min_ns=... host_fast_time_us=... fast_batches=... host_slow_time_us=... slow_batches=...

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bench/bench_common.h"
#include "common/errors.h"
#include "common/strings.h"
#include "process_group/init.h"
#include "tensor/tensor.h"

#if DT_HAVE_CUDA
#include "tensor/cuda/stream.h"
#endif

namespace {

struct Args {
  int nproc = 0;
  std::vector<size_t> sizes = {4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20};
  std::vector<std::string> ops = {"allreduce", "broadcast"};
  int reps = 0;
  int warmup = 0;
  double batchMs = 0;  // 0: one op per barrier
  std::string backend = "gloo";
  std::string impl;  // default: dtrain-<backend>
};

size_t parseSize(const std::string& s) {
  const char last = s.empty() ? '0' : static_cast<char>(std::toupper(static_cast<unsigned char>(s.back())));
  const double mult = last == 'K' ? 1024.0 : last == 'M' ? 1048576.0 : last == 'G' ? 1073741824.0 : 1.0;
  const std::string number = mult == 1.0 ? s : s.substr(0, s.size() - 1);
  return static_cast<size_t>(std::stod(number) * mult);
}

Args parseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--nproc") a.nproc = std::stoi(next());
    else if (arg == "--sizes") {
      a.sizes.clear();
      for (const auto& s : dt::split(next(), ',')) a.sizes.push_back(parseSize(s));
    } else if (arg == "--ops") a.ops = dt::split(next(), ',');
    else if (arg == "--reps") a.reps = std::stoi(next());
    else if (arg == "--warmup") a.warmup = std::stoi(next());
    else if (arg == "--batch-ms") a.batchMs = std::stod(next());
    else if (arg == "--impl") a.impl = next();
    else if (arg == "--backend") a.backend = next();
    else {
      std::fprintf(stderr, "unknown argument %s\nusage: collectives_bench [--nproc N] [--sizes 4K,1M] "
                           "[--ops allreduce,broadcast] [--reps R] [--warmup W] [--batch-ms B] [--backend gloo|shm|nccl] [--impl NAME]\n", arg.c_str());
      std::exit(2);
    }
  }
  if (a.backend != "gloo" && a.backend != "shm" && a.backend != "nccl") {
    std::fprintf(stderr, "--backend must be gloo, shm or nccl, got %s\n", a.backend.c_str());
    std::exit(2);
  }
  if (a.impl.empty()) a.impl = "dtrain-" + a.backend;
  // The ranks' initProcessGroup reads it (it is inherited through fork);
  // NCCL is chosen by the tensors' device, the group's CPU side stays default.
  if (a.backend != "nccl") ::setenv("DT_BACKEND", a.backend.c_str(), 1);
  return a;
}

int defaultReps(size_t bytes) {
  if (bytes <= (64u << 10)) return 200;
  if (bytes <= (1u << 20)) return 50;
  if (bytes <= (16u << 20)) return 15;
  return 7;
}

std::string human(size_t bytes) {
  if (bytes >= (1u << 20)) return dt::str(bytes >> 20, " MiB");
  if (bytes >= (1u << 10)) return dt::str(bytes >> 10, " KiB");
  return dt::str(bytes, " B");
}

int localRank() {
  const char* value = std::getenv("LOCAL_RANK");  // set by dtrun and by rankMain's fork
  return value != nullptr ? std::atoi(value) : 0;
}

// The host reference (see the header): per iteration, what one small op does
// besides moving bytes (four mutex round trips, one shared allocation and one
// plain one, eight atomic updates), in nanoseconds per iteration. It moves
// with the host, not with dtrain's code.
double hostReferenceNs(int iterations) {
  static std::mutex mutex;
  static std::atomic<uint64_t> counter{0};
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) {
    for (int j = 0; j < 4; ++j) {
      std::lock_guard<std::mutex> lock(mutex);
      counter.fetch_add(1, std::memory_order_relaxed);
    }
    auto shared = std::make_shared<std::array<char, 160>>();
    void* plain = std::malloc(48);
    counter.fetch_add(reinterpret_cast<uintptr_t>(plain) & 1, std::memory_order_relaxed);
    std::free(plain);
    auto copy = shared;
    (*copy)[0] = static_cast<char>(i);
  }
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / iterations;
}

// The API's own cost: a zero-element allreduce issued and waited, timed in
// batches (see the header).
void measureEmptyOp(dt::ProcessGroup& pg, const Args& args) {
  using Clock = std::chrono::steady_clock;
  constexpr int kBatch = 1000;
  const int reps = args.reps > 0 ? args.reps : 200;
  const int warmup = args.warmup > 0 ? args.warmup : 10;
  dt::Tensor empty = dt::zeros({0}, dt::DType::Float32);
  auto batch = [&] {
    for (int i = 0; i < kBatch; ++i) pg.allreduce(empty)->wait();
  };
  for (int i = 0; i < warmup; ++i) batch();
  dt::Tensor durations = dt::zeros({reps}, dt::DType::Float64);
  double* d = durations.data<double>();
  std::vector<double> reference(reps);
  for (int i = 0; i < reps; ++i) {
    pg.barrier()->wait();
    reference[i] = hostReferenceNs(kBatch);
    const auto t0 = Clock::now();
    batch();
    d[i] = std::chrono::duration<double>(Clock::now() - t0).count() / kBatch;
  }
  dt::AllreduceOptions maxOpts;
  maxOpts.reduceOp = dt::ReduceOp::Max;
  pg.allreduce(durations, maxOpts)->wait();
  if (pg.rank() != 0) return;
  std::vector<double> v(d, d + reps);
  const double med = dt::bench::median(v), mn = *std::min_element(v.begin(), v.end());
  const double p99 = dt::bench::percentile(v, 0.99);
  const double fastestReference = *std::min_element(reference.begin(), reference.end());
  std::vector<double> onFastHost, onSlowHost;
  for (int i = 0; i < reps; ++i) (reference[i] <= 1.05 * fastestReference ? onFastHost : onSlowHost).push_back(v[i]);
  auto medianUs = [](const std::vector<double>& batches) { return batches.empty() ? 0.0 : dt::bench::median(batches) * 1e6; };
  std::fprintf(stderr, "  %-10s %12s %10d %12.3f %12.3f %10.3f %10s %10s %6d\n", "empty", "0 B", 0, med * 1e6,
               mn * 1e6, p99 * 1e6, "-", "-", reps);
  std::fprintf(stderr, "  host reference %.0f ns (fastest %.0f): empty op %.3f us in %zu batches on the fast host, %.3f us in %zu on the slow\n",
               dt::bench::median(reference), fastestReference, medianUs(onFastHost), onFastHost.size(),
               medianUs(onSlowHost), onSlowHost.size());
  std::printf("RESULT empty impl=%s world=%d bytes=0 reps=%d threads=1 time_us=%.3f min_us=%.3f p99_us=%.3f "
              "host_ref_ns=%.0f host_ref_min_ns=%.0f host_fast_time_us=%.3f fast_batches=%zu host_slow_time_us=%.3f "
              "slow_batches=%zu\n",
              args.impl.c_str(), pg.size(), reps, med * 1e6, mn * 1e6, p99 * 1e6, dt::bench::median(reference),
              fastestReference, medianUs(onFastHost), onFastHost.size(), medianUs(onSlowHost), onSlowHost.size());
  std::fflush(stdout);
}

int runRank(const Args& args) {
  using Clock = std::chrono::steady_clock;
  auto pg = dt::initProcessGroup();
  const int rank = pg->rank(), world = pg->size();
  const bool onGpu = args.backend == "nccl";
  const dt::Device device = onGpu ? dt::Device::cuda(localRank() % dt::deviceCount(dt::DeviceType::CUDA))
                                  : dt::Device::cpu();
  dt::setCurrentDevice(device);
  // The host waits for the device: a rep is over when its result is in memory.
  auto finish = [&] {
#if DT_HAVE_CUDA
    if (onGpu) dt::cuda::currentStream(device).synchronize();
#endif
  };
  if (rank == 0) {
    std::fprintf(stderr, "# collectives_bench: %s, world %d, float32, threads=1\n", args.impl.c_str(), world);
    std::fprintf(stderr, "# %-10s %12s %10s %12s %12s %10s %10s %10s %6s\n", "op", "size", "count", "time(us)",
                 "min(us)", "p99(us)", "algbw", "busbw", "reps");
  }
  for (const auto& op : args.ops) {
    if (op == "empty") {
      measureEmptyOp(*pg, args);
      continue;
    }
    for (size_t bytes : args.sizes) {
      const int64_t count = static_cast<int64_t>(bytes / 4);
      dt::Tensor buf = dt::ones({count}, dt::DType::Float32, device);
      const int reps = args.reps > 0 ? args.reps : args.batchMs > 0 ? 50 : defaultReps(bytes);
      const int warmup = args.warmup > 0 ? args.warmup : std::max(2, reps / 10);
      const bool isAllreduce = op == "allreduce";
      if (!isAllreduce && op != "broadcast") {  // "empty" was handled above
        std::fprintf(stderr, "unknown op %s\n", op.c_str());
        return 2;
      }
      auto run = [&] {
        if (isAllreduce) {
          pg->allreduce(buf)->wait();
        } else {
          pg->broadcast(buf)->wait();
        }
        finish();
      };
      for (int i = 0; i < warmup; ++i) run();
      buf.fill_(1.0);
      finish();
      // k ops per timed sample: 1, or (--batch-ms) as many as fill the batch, agreed by all ranks.
      int k = 1;
      if (args.batchMs > 0) {
        dt::Tensor pilot = dt::zeros({1}, dt::DType::Float64);
        pg->barrier()->wait();
        const auto t0 = Clock::now();
        run();
        pilot.data<double>()[0] = std::max(std::chrono::duration<double>(Clock::now() - t0).count(), 1e-7);
        dt::AllreduceOptions slowest;
        slowest.reduceOp = dt::ReduceOp::Max;
        pg->allreduce(pilot, slowest)->wait();
        k = static_cast<int>(std::clamp(std::floor(args.batchMs / 1e3 / pilot.data<double>()[0]), 1.0, 10000.0));
        buf.fill_(1.0);
      }
      dt::Tensor durations = dt::zeros({reps}, dt::DType::Float64);
      double* d = durations.data<double>();
      for (int i = 0; i < reps; ++i) {
        pg->barrier()->wait();
        const auto t0 = Clock::now();
        for (int j = 0; j < k; ++j) run();
        d[i] = std::chrono::duration<double>(Clock::now() - t0).count() / k;
        if (isAllreduce && (k > 1 || (i & 7) == 7)) {  // outside the timed region
          buf.fill_(1.0);
          finish();
        }
      }
      dt::AllreduceOptions maxOpts;
      maxOpts.reduceOp = dt::ReduceOp::Max;
      pg->allreduce(durations, maxOpts)->wait();  // per-rep slowest rank
      if (rank == 0) {
        std::vector<double> v(d, d + reps);
        const double med = dt::bench::median(v);
        const double mn = *std::min_element(v.begin(), v.end());
        const double p99 = dt::bench::percentile(v, 0.99);
        const double algbw = static_cast<double>(bytes) / med / 1e9;
        const double busbw = isAllreduce ? algbw * 2.0 * (world - 1) / world : algbw;
        std::fprintf(stderr, "  %-10s %12s %10lld %12.1f %12.1f %10.1f %10.3f %10.3f %6d\n", op.c_str(),
                     human(bytes).c_str(), static_cast<long long>(count), med * 1e6, mn * 1e6, p99 * 1e6, algbw,
                     busbw, reps);
        std::printf("RESULT %s impl=%s world=%d bytes=%zu reps=%d threads=1 time_us=%.1f min_us=%.1f p99_us=%.1f "
                    "algbw_GBps=%.3f busbw_GBps=%.3f\n",
                    op.c_str(), args.impl.c_str(), world, bytes, reps, med * 1e6, mn * 1e6, p99 * 1e6, algbw, busbw);
        std::fflush(stdout);
      }
    }
  }
  pg->barrier()->wait();
  pg->destroy();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parseArgs(argc, argv);
  if (args.backend == "nccl") {
    // Asking for a device initialises CUDA's driver, and CUDA does not work in a child forked
    // after that: with --nproc the question goes to a child of its own, so that the ranks are
    // forked from a process that never touched CUDA (forkRanks refuses otherwise).
    std::string why;
    try {
      const auto reason = [] { return dt::deviceUnavailableReason(dt::Device::cuda(0)); };
      why = args.nproc > 0 ? dt::bench::inChild(reason) : reason();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "collectives_bench: cannot tell whether cuda:0 is usable: %s\n", e.what());
      return 1;
    }
    if (!why.empty()) {
      std::fprintf(stderr, "collectives_bench: --backend nccl needs a CUDA device: %s\n", why.c_str());
      return 2;
    }
  }
  return dt::bench::rankMain(args.nproc, [&] { return runRank(args); }, "collectives_bench");
}
