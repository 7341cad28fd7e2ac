// Helpers shared by dtrain's benchmarks.
//
//  * forkRanks(nproc, runRank): forks nproc children on this machine with
//    torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
//    MASTER_PORT on a free loopback port; rank 0 hosts the store), runs
//    runRank() in each, and returns the worst exit status. Call before any
//    thread exists, and before any CUDA call: CUDA does not work in a child
//    forked after the parent initialised it (any CUDA runtime call does), so
//    every rank would fail. A child that throws prints the error and exits 1.
//  * inChild(query): query() in a forked child, its string returned; for
//    what must not run in a process that forks ranks later, such as asking
//    CUDA for its devices (std::runtime_error naming the child's exit status
//    and output when it fails). Call before any thread exists, like forkRanks.
//  * rankMain(nproc, runRank, name): a benchmark's main: forkRanks when nproc
//    > 0, else runRank() as one rank of an externally launched job (its error
//    printed as "<name>: <what>", exit 1).
//  * peakRssMb(): this process's peak resident set (VmHWM) in MiB, as the torch peers read it;
//    resetPeakRss() starts the peak over from the current resident set (so a benchmark can leave
//    its set-up out).
//  * median(values); percentile(values, q) (nearest rank, q in [0, 1]); blasName(): the BLAS library mapped into this process
//    (openblas, blis, mkl, reference, libblas, unknown), as the peers print it.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace dt::bench {

int forkRanks(int nproc, const std::function<int()>& runRank);
std::string inChild(const std::function<std::string()>& query);
int rankMain(int nproc, const std::function<int()>& runRank, const char* name);
double peakRssMb();
void resetPeakRss();
double median(std::vector<double> values);
double percentile(std::vector<double> values, double q);
std::string blasName();

}  // namespace dt::bench
