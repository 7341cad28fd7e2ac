// OpenMPI peer for bench/run_collectives_bench.sh: MPI_Allreduce (float32, MPI_SUM, in place)
// and MPI_Bcast (root 0) of page-aligned float buffers. Start it under mpirun, e.g.
//
//   mpirun --oversubscribe --allow-run-as-root --bind-to none -np 2 --mca pml ob1
//          --mca btl vader,self build-peers/mpi_bench --op allreduce --label mpi-sm --sizes 4K,1M
//
// Per size, after a correctness check (rank r contributes r+1; allreduce must give
// n(n+1)/2 everywhere, broadcast 1):
//   pilot    barrier + one timed call (the slowest rank's time); when that is under 0.1 s,
//            the remaining warm-up calls (--warmup, 3 in all) and a second timed pilot;
//   batch    k = max(1, floor(--batch / pilot)) back-to-back calls per sample (<= 10000),
//            so that a sample of small messages lasts ~20 ms;
//   samples  ceil(--budget / (k * pilot)), clamped to [--min-samples, --max-samples];
//   sample   barrier, k calls, elapsed / k; its value is the slowest rank's;
//   reported median and minimum over the samples; algbw = bytes / median (GB = 1e9 B),
//            busbw = algbw * 2(n-1)/n for allreduce, = algbw for broadcast.
// Rank 0 prints one row per size, in columns:
//   RESULT <impl> <op> <ranks> <bytes> <k> <samples> <median_us> <min_us> <algbw_GBps> <busbw_GBps> <p99_us>
// (p99 over the samples, nearest rank).
// (run_collectives_bench.sh turns the row into key=value form). Exit status 1 when a
// check failed.
//
// usage: mpi_bench [--op allreduce|broadcast] [--sizes 4K,64K,...] [--label IMPL]
//                  [--budget S] [--batch S] [--min-samples N] [--max-samples N]
//                  [--warmup N] [--no-check]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

struct Config {
  std::string op = "allreduce";
  std::string label = "mpi";
  std::vector<size_t> sizes{4u << 10, 64u << 10, 1u << 20, 16u << 20, 64u << 20, 256u << 20};
  double budget = 1.0;
  double batch = 0.02;
  int minSamples = 5;
  int maxSamples = 50;
  int warmup = 3;
  bool check = true;
};

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "mpi_bench: %s\nusage: mpi_bench [--op allreduce|broadcast] [--sizes 4K,1M] [--label IMPL] "
               "[--budget S] [--batch S] [--min-samples N] [--max-samples N] [--warmup N] [--no-check]\n",
               why);
  std::exit(2);
}

size_t sizeArg(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str()) usage(("bad size " + text).c_str());
  double scale = 1;
  if (*end == 'k' || *end == 'K') scale = 1024.0;
  else if (*end == 'm' || *end == 'M') scale = 1024.0 * 1024;
  else if (*end == 'g' || *end == 'G') scale = 1024.0 * 1024 * 1024;
  else if (*end != '\0') usage(("bad size " + text).c_str());
  return static_cast<size_t>(v * scale);
}

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage((a + " needs a value").c_str());
      return argv[++i];
    };
    if (a == "--op") c.op = value();
    else if (a == "--label") c.label = value();
    else if (a == "--budget") c.budget = std::atof(value().c_str());
    else if (a == "--batch") c.batch = std::atof(value().c_str());
    else if (a == "--min-samples") c.minSamples = std::atoi(value().c_str());
    else if (a == "--max-samples") c.maxSamples = std::atoi(value().c_str());
    else if (a == "--warmup") c.warmup = std::atoi(value().c_str());
    else if (a == "--no-check") c.check = false;
    else if (a == "--sizes") {
      c.sizes.clear();
      const std::string list = value();
      size_t from = 0;
      while (from < list.size()) {
        size_t comma = list.find(',', from);
        if (comma == std::string::npos) comma = list.size();
        if (comma > from) c.sizes.push_back(sizeArg(list.substr(from, comma - from)));
        from = comma + 1;
      }
    } else usage(("unknown argument " + a).c_str());
  }
  if (c.op != "allreduce" && c.op != "broadcast") usage(("unknown op " + c.op).c_str());
  return c;
}

// Page-aligned, zeroed, already faulted in.
class Floats {
 public:
  explicit Floats(size_t count) : count_(count) {
    const size_t bytes = std::max<size_t>((count * sizeof(float) + 4095) / 4096 * 4096, 4096);
    data_ = static_cast<float*>(std::aligned_alloc(4096, bytes));
    if (data_ == nullptr) {
      std::fprintf(stderr, "mpi_bench: out of memory\n");
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    std::memset(data_, 0, bytes);
  }
  ~Floats() { std::free(data_); }
  Floats(const Floats&) = delete;
  Floats& operator=(const Floats&) = delete;
  float* data() { return data_; }
  size_t size() const { return count_; }
  void fill(float v) { std::fill(data_, data_ + count_, v); }

 private:
  float* data_ = nullptr;
  size_t count_;
};

void slowest(double* values, int count) {
  MPI_Allreduce(MPI_IN_PLACE, values, count, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
}

double timedOnce(const std::function<void()>& call) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double start = now();
  call();
  double t = now() - start;
  slowest(&t, 1);
  return t;
}

void timeOneSize(const Config& cfg, int rank, int ranks, size_t bytes, const std::function<void()>& call) {
  double pilot = timedOnce(call);
  if (pilot < 0.1) {
    for (int i = 1; i < cfg.warmup; ++i) call();
    pilot = timedOnce(call);
  }
  pilot = std::max(pilot, 1e-7);
  const int k = std::min(10000, static_cast<int>(std::max(1.0, std::floor(cfg.batch / pilot))));
  const int samples =
      std::clamp(static_cast<int>(std::ceil(cfg.budget / (pilot * k))), cfg.minSamples, std::max(cfg.minSamples, cfg.maxSamples));

  std::vector<double> perCall(samples);
  for (double& t : perCall) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = now();
    for (int j = 0; j < k; ++j) call();
    t = (now() - start) / k;
  }
  slowest(perCall.data(), samples);
  if (rank != 0) return;
  std::sort(perCall.begin(), perCall.end());
  const double median = samples % 2 == 1 ? perCall[samples / 2] : (perCall[samples / 2 - 1] + perCall[samples / 2]) / 2;
  // Nearest rank, as collectives_bench reports it.
  const double p99 = perCall[static_cast<size_t>(std::max(1.0, std::ceil(0.99 * samples))) - 1];
  const double algbw = static_cast<double>(bytes) / median / 1e9;
  const double bus = cfg.op == "allreduce" ? (ranks > 1 ? 2.0 * (ranks - 1) / ranks : 0.0) : 1.0;
  std::printf("RESULT   %-20s %-9s %3d %11zu %5d %4d %12.1f %12.1f %9.3f %9.3f %12.1f\n", cfg.label.c_str(), cfg.op.c_str(),
              ranks, bytes, k, samples, median * 1e6, perCall.front() * 1e6, algbw, algbw * bus, p99 * 1e6);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const Config cfg = parse(argc, argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  if (rank == 0) {
    std::printf("# mpi_bench impl=%s op=%s ranks=%d budget=%.2fs batch=%.3fs\n", cfg.label.c_str(), cfg.op.c_str(),
                ranks, cfg.budget, cfg.batch);
    std::printf("#        %-20s %-9s %3s %11s %5s %4s %12s %12s %9s %9s %12s\n", "impl", "op", "n", "bytes", "k", "smp",
                "median_us", "min_us", "algbw", "busbw", "p99_us");
    std::fflush(stdout);
  }

  int badSizes = 0;
  for (size_t bytes : cfg.sizes) {
    Floats buf(bytes / sizeof(float));
    const int count = static_cast<int>(buf.size());
    std::function<void()> call;
    if (cfg.op == "allreduce")
      call = [&] { MPI_Allreduce(MPI_IN_PLACE, buf.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); };
    else
      call = [&] { MPI_Bcast(buf.data(), count, MPI_FLOAT, 0, MPI_COMM_WORLD); };

    if (cfg.check) {
      buf.fill(static_cast<float>(rank + 1));
      call();
      const float want = cfg.op == "allreduce" ? ranks * (ranks + 1) / 2.0f : 1.0f;
      const size_t wrong = static_cast<size_t>(std::count_if(buf.data(), buf.data() + buf.size(), [&](float v) { return v != want; }));
      if (wrong > 0) {
        std::fprintf(stderr, "mpi_bench: rank %d: %zu wrong values at %zu bytes\n", rank, wrong, bytes);
        ++badSizes;
      }
      buf.fill(0.0f);  // zeros stay zeros: the timed calls never overflow
    }
    timeOneSize(cfg, rank, ranks, bytes, call);
  }
  int allBad = 0;
  MPI_Allreduce(&badSizes, &allBad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Finalize();
  return allBad > 0 ? 1 : 0;
}
