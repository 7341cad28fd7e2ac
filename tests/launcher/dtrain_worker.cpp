// A real dtrain worker for dtrun's end-to-end tests: initProcessGroup from
// the launcher's environment (DT_STORE_ADDR, the launcher's store), Gloo
// allreduces, and the failure modes the launcher must handle.
//   dtrain_worker allreduce STEPS     every rank checks STEPS allreduces, prints "ok"
//   dtrain_worker restart             rank 1 fails after one allreduce in attempt 0
//   dtrain_worker hang                3 allreduces, then rank 1 stops calling them
//   dtrain_worker steps STEPS MS      STEPS allreduces MS ms apart, each announced
//                                     ("rank r step i"), then "ok" as for allreduce
//   dtrain_worker backend             prints the CPU backend the group chose, checks
//                                     sum/avg allreduces of several sizes and that
//                                     every rank holds the same bits, prints "ok"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "process_group/init.h"
#include "tensor/tensor.h"

namespace {

int envInt(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::atoi(value) : 0;
}

void allreduceOnce(dt::ProcessGroup& pg, int rank, int world) {
  dt::Tensor t = dt::full({4}, static_cast<double>(rank + 1));
  pg.allreduce(t)->wait(std::chrono::minutes(5));
  const float expected = static_cast<float>(world * (world + 1) / 2);
  if (t.data<float>()[0] != expected) {
    std::fprintf(stderr, "rank %d: allreduce gave %f, expected %f\n", rank, t.data<float>()[0], expected);
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 64;
  const std::string mode = argv[1];
  auto pg = dt::initProcessGroup({});
  const int rank = pg->rank(), world = pg->size();
  const int restart = envInt("DT_RESTART_COUNT");
  if (mode == "allreduce") {
    const int steps = argc > 2 ? std::atoi(argv[2]) : 3;
    for (int i = 0; i < steps; ++i) allreduceOnce(*pg, rank, world);
    std::printf("rank %d allreduce ok world %d restart %d\n", rank, world, restart);
    return 0;
  }
  if (mode == "steps") {
    const int steps = argc > 2 ? std::atoi(argv[2]) : 10;
    const int pause = argc > 3 ? std::atoi(argv[3]) : 100;
    for (int i = 0; i < steps; ++i) {
      allreduceOnce(*pg, rank, world);
      std::printf("rank %d step %d\n", rank, i);
      std::fflush(stdout);
      std::this_thread::sleep_for(std::chrono::milliseconds(pause));
    }
    std::printf("rank %d allreduce ok world %d restart %d\n", rank, world, restart);
    return 0;
  }
  if (mode == "restart") {
    allreduceOnce(*pg, rank, world);
    if (restart == 0 && rank == 1) {
      std::fprintf(stderr, "rank 1 failing after one allreduce in attempt 0\n");
      return 3;
    }
    for (int i = 0; i < 3; ++i) allreduceOnce(*pg, rank, world);
    std::printf("rank %d allreduce ok world %d restart %d\n", rank, world, restart);
    return 0;
  }
  if (mode == "backend") {
    const std::string backend = pg->backendFor(dt::Device::cpu()).name();
    for (int64_t n : {7, 5000, 300000}) {
      for (dt::ReduceOp op : {dt::ReduceOp::Sum, dt::ReduceOp::Avg}) {
        dt::Tensor t = dt::full({n}, static_cast<double>(rank + 1));
        pg->allreduce(t, {.reduceOp = op})->wait(std::chrono::minutes(5));
        const float sum = static_cast<float>(world * (world + 1) / 2);
        const float expected = op == dt::ReduceOp::Sum ? sum : sum / static_cast<float>(world);
        dt::Tensor low = t.clone(), high = t.clone();
        pg->allreduce(low, {.reduceOp = dt::ReduceOp::Min})->wait(std::chrono::minutes(5));
        pg->allreduce(high, {.reduceOp = dt::ReduceOp::Max})->wait(std::chrono::minutes(5));
        for (int64_t i = 0; i < n; ++i) {
          if (t.data<float>()[i] != expected || low.data<float>()[i] != high.data<float>()[i]) {
            std::fprintf(stderr, "rank %d: %s allreduce of %lld elements gave %f at %lld, expected %f on every rank\n",
                         rank, std::string(dt::toString(op)).c_str(), static_cast<long long>(n), t.data<float>()[i],
                         static_cast<long long>(i), expected);
            return 1;
          }
        }
      }
    }
    std::printf("rank %d backend %s ok\n", rank, backend.c_str());
    return 0;
  }
  if (mode == "hang") {
    for (int i = 0; i < 3; ++i) allreduceOnce(*pg, rank, world);
    std::printf("rank %d finished 3 allreduces\n", rank);
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::minutes(5));
      return 0;
    }
    allreduceOnce(*pg, rank, world);
    return 0;
  }
  return 64;
}
