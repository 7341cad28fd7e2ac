// Benchmarks that start their own ranks: fork nproc children on this machine
// with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT on a free loopback port; rank 0 hosts the store), run
// runRank() in each, and return the worst exit status. Call before any
// thread exists. A child that throws prints the error and exits 1.
#pragma once

#include <functional>

namespace dt::bench {

int forkRanks(int nproc, const std::function<int()>& runRank);

}  // namespace dt::bench
