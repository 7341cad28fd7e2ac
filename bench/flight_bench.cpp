// flight_bench: what the flight recorder's failure path costs at N ranks, step by step as dtrun
// runs it after a failure (docs/debugging.md, "Under dtrun"): every rank fills its ring with
// --ops real allreduces of one float on the world group (shared memory), then
//   dump     each rank writes its dump (dumpFlightRecorder, timed on each rank: the ring
//            serialized as JSON, written under a temporary name and renamed);
//   gather   rank 0 packs every dump as a node's dtrun posts them (launcher/flight_gather.h),
//            sets the pack in the job's TcpStore, gets it back and unpacks it into a second
//            folder: one node's post plus another node's fetch, through the same store;
//   analyze  rank 0 reads the gathered dumps and tells the story (readFlightDumps +
//            analyzeFlightDumps: what dtrun prints after its summary).
// Usage: flight_bench --nproc N [--ops 5000] [--reps 5]
// Rank 0 prints, per repetition, and the medians:
//   RESULT flight_path world=N ops=K dump_ms_median=... dump_ms_max=... dump_kib=... gather_ms=...
//   analyze_ms=... total_ms=...
// (total: the slowest rank's dump + gather + analyze).
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/bench_common.h"
#include "common/strings.h"
#include "debug/flight_analysis.h"
#include "launcher/flight_gather.h"
#include "process_group/flight_recorder.h"
#include "process_group/init.h"
#include "process_group/process_group.h"
#include "tensor/ops.h"

namespace {

using Clock = std::chrono::steady_clock;
double msSince(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

struct Args {
  int nproc = 4;
  int ops = 5000;
  int reps = 5;
};

int runRank(const Args& a, const std::string& root) {
  dt::JobConnection job = dt::connectJob();
  auto pg = dt::ProcessGroup::create(job.store, job.rank, job.worldSize, job.group);
  const int rank = pg->rank(), world = pg->size();
  dt::Tensor one = dt::ones({1});
  std::vector<double> dumpMedians, dumpMaxes, gathers, analyses, totals, sizes;
  for (int rep = 0; rep < a.reps; ++rep) {
    const std::string dir = dt::str(root, "/rep", rep);
    ::setenv("DT_FLIGHT_RECORDER_DIR", dir.c_str(), 1);
    for (int i = 0; i < a.ops; ++i) pg->allreduce(one)->wait();
    pg->barrier()->wait();
    const auto start = Clock::now();
    const std::string path = dt::dumpFlightRecorder("request");
    dt::Tensor mine = dt::fromVector<double>({msSince(start), path.empty() ? 0.0 : static_cast<double>(std::filesystem::file_size(path))});
    std::vector<dt::Tensor> all;
    for (int r = 0; r < world; ++r) all.push_back(dt::zeros({2}, dt::DType::Float64));
    pg->allgather(all, mine)->wait();
    if (rank == 0) {
      std::vector<double> dumps;
      double bytes = 0;
      for (const auto& t : all) {
        dumps.push_back(t.toVector<double>()[0]);
        bytes += t.toVector<double>()[1];
      }
      auto t = Clock::now();
      const auto packed = dt::launcher::packFlightFiles(dir, size_t{64} << 20);
      job.store->set(dt::str("bench/flight/", rep), packed.bytes);
      const std::string back = job.store->get(dt::str("bench/flight/", rep));
      const std::string gathered = dir + "-gathered";
      dt::launcher::unpackFlightFiles(back, gathered, "the store");
      const double gatherMs = msSince(t);
      t = Clock::now();
      std::vector<std::string> problems;
      const auto read = dt::debug::readFlightDumps(gathered, "", &problems);
      const std::string story = dt::debug::analyzeFlightDumps(read);
      const double analyzeMs = msSince(t);
      if (static_cast<int>(read.size()) != world || packed.files != world) {
        std::fprintf(stderr, "flight_bench: %zu dumps read back of %d (%d packed, %zu problems)\n", read.size(), world,
                     packed.files, problems.size());
        return 1;
      }
      const double dumpMax = *std::max_element(dumps.begin(), dumps.end());
      dumpMedians.push_back(dt::bench::median(dumps));
      dumpMaxes.push_back(dumpMax);
      gathers.push_back(gatherMs);
      analyses.push_back(analyzeMs);
      totals.push_back(dumpMax + gatherMs + analyzeMs);
      sizes.push_back(bytes / world / 1024.0);
      std::printf("rep %d: dumps %.2f ms median, %.2f max (%.0f KiB each), gather %.2f ms, analyze %.2f ms (%zu story lines)\n",
                  rep, dumpMedians.back(), dumpMax, sizes.back(), gatherMs, analyzeMs,
                  static_cast<size_t>(std::count(story.begin(), story.end(), '\n')));
    }
    pg->barrier()->wait();
  }
  if (rank == 0) {
    std::printf("RESULT flight_path world=%d ops=%d reps=%d dump_ms_median=%.2f dump_ms_max=%.2f dump_kib=%.0f gather_ms=%.2f "
                "analyze_ms=%.2f total_ms=%.2f\n",
                world, a.ops, a.reps, dt::bench::median(dumpMedians), dt::bench::median(dumpMaxes), dt::bench::median(sizes),
                dt::bench::median(gathers), dt::bench::median(analyses), dt::bench::median(totals));
  }
  pg->destroy();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int value = std::atoi(argv[i + 1]);
    if (flag == "--nproc") a.nproc = value;
    else if (flag == "--ops") a.ops = value;
    else if (flag == "--reps") a.reps = value;
    else {
      std::fprintf(stderr, "flight_bench: unknown flag %s (usage: flight_bench --nproc N [--ops 5000] [--reps 5])\n", flag.c_str());
      return 2;
    }
  }
  if (a.nproc < 1 || a.ops < 1 || a.reps < 1) {
    std::fprintf(stderr, "flight_bench: --nproc %d --ops %d --reps %d: each must be 1 or more\n", a.nproc, a.ops, a.reps);
    return 2;
  }
  char tmpl[] = "/tmp/flight-bench-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) {
    std::perror("flight_bench: mkdtemp");
    return 1;
  }
  const std::string root = tmpl;
  const int rc = dt::bench::rankMain(a.nproc, [&] { return runRank(a, root); }, "flight_bench");
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  return rc;
}
