// An elastic dtrain worker for dtrun --elastic's tests (one node, network
// namespaces, SLURM): the training-like loop of tests/elastic, whose final
// state shows a lost or repeated step.
//
//   elastic_worker STEPS [MS] [DIE_RANK DIE_STEP kill|stop|exit|node|nodestop]
//
// Every step each rank sums its share of a global batch of 12 examples
// (positions r, r+W, ...), allreduces it ("the gradient"), allreduces a
// commit, then applies the sum, MS ms apart. Member DIE_RANK, on reaching step
// DIE_STEP (or its first step, when it joined later) before its commit,
// SIGKILLs itself (kill), SIGSTOPs itself (stop: the launcher's liveness check
// must find it), exits with code 3 (exit), SIGSTOPs its parent dtrun, the other workers
// and itself (nodestop: a node silent but not dead), or SIGKILLs its parent dtrun and
// itself (node: a node's loss; "kills its node at <ms>" first, also into the
// file $DT_TEST_KILL_STAMP when set, and each
// survivor prints "first commit after recovery at <ms>": wall-clock times).
// At the end each survivor prints
//   "member M rank R/N epoch E state S expected S' lost <who>"
// and exits 0 when S == S'; the job's exit code tells the rest. A replacement
// (dtrun --max-restarts) joins: the members admit it when their commit vote
// says it waits, and rank 0 sends it {state, steps applied}.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "common/errors.h"
#include "common/strings.h"
#include "elastic/elastic_group.h"
#include "tensor/tensor.h"
#include "tests/elastic/toy_step.h"

namespace {
int64_t wallMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The line on stdout and, when DT_TEST_KILL_STAMP names a file, in it too: a node's dtrun that is
// killed or stopped next often forwards nothing more, so a bench or test reads the file.
void announce(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  if (const char* stamp = std::getenv("DT_TEST_KILL_STAMP")) {
    if (FILE* f = std::fopen(stamp, "w")) {
      std::fprintf(f, "%s\n", line.c_str());
      std::fclose(f);
    }
  }
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 64;
  const int64_t steps = std::atoll(argv[1]);
  const int pauseMs = argc > 2 ? std::atoi(argv[2]) : 0;
  const int dieRank = argc > 5 ? std::atoi(argv[3]) : -1;
  const int64_t dieStep = argc > 5 ? std::atoll(argv[4]) : -1;
  const std::string how = argc > 5 ? argv[5] : "";
  try {
    auto elastic = dt::elastic::ElasticGroup::fromEnvironment();
    const int member = elastic->memberId();
    double state = 0;
    const double expected = dt::testing::toyState(steps);
    dt::Tensor grad = dt::zeros({1}, dt::DType::Float64);
    int64_t applied = 0;
    bool recovered = false;  // a new epoch began: its first commit is reported
    std::string lost;
    auto transfer = [&] {  // after a new epoch: rank 0 to the members just admitted
      if (elastic->membership().joined.empty()) return;
      dt::Tensor t = dt::fromVector<double>({state, static_cast<double>(applied)});
      elastic->group()->broadcast(t, {.root = 0})->wait();
      state = t.data<double>()[0];
      applied = static_cast<int64_t>(t.data<double>()[1]);
      if (elastic->joinedNow()) {
        std::printf("member %d: joined at step %lld as rank %d/%d\n", member, static_cast<long long>(applied),
                    elastic->membership().rank, elastic->membership().size());
        std::fflush(stdout);
      }
    };
    transfer();
    while (applied < steps) {
      const auto& m = elastic->membership();
      try {
        grad.data<double>()[0] = dt::testing::toyShare(applied, m.rank, m.size());
        elastic->group()->allreduce(grad)->wait();
        if (member == dieRank && applied >= dieStep) {  // >=: a member that joined later dies at its first step
          std::fflush(nullptr);
          if (how == "kill") ::kill(::getpid(), SIGKILL);
          if (how == "stop") ::kill(::getpid(), SIGSTOP);
          if (how == "exit") std::_Exit(3);
          if (how == "node") {
            announce(dt::str("member ", member, ": kills its node at ", wallMs(), " ms"));
            ::kill(::getppid(), SIGKILL);  // this node's dtrun: its other workers die with it
            ::kill(::getpid(), SIGKILL);
          }
          if (how == "nodestop") {  // the whole node silent, not dead: dtrun and every worker stopped
            announce(dt::str("member ", member, ": silences its node at ", wallMs(), " ms"));
            const pid_t dtrun = ::getppid();
            std::ifstream children(dt::str("/proc/", dtrun, "/task/", dtrun, "/children"));
            for (pid_t pid = 0; children >> pid;) {
              if (pid != ::getpid()) ::kill(pid, SIGSTOP);
            }
            ::kill(dtrun, SIGSTOP);
            ::kill(::getpid(), SIGSTOP);
          }
        }
        dt::Tensor commit = dt::fromVector<double>({1.0, elastic->joinersWaiting() ? 1.0 : 0.0});
        elastic->group()->allreduce(commit)->wait();
        state += grad.data<double>()[0];
        ++applied;
        if (recovered) {  // bench/run_node_loss_bench.sh: the loss's cost ends here
          std::printf("member %d: first commit after recovery at %lld ms\n", member, static_cast<long long>(wallMs()));
          std::fflush(stdout);
          recovered = false;
        }
        if (commit.data<double>()[1] > 0 && applied < steps) {
          elastic->admit(applied);
          transfer();
        }
      } catch (const dt::MembershipError&) {
        throw;
      } catch (const dt::Error&) {
        const auto& next = elastic->recover(std::current_exception(), applied);
        recovered = true;
        if (next.resumeStep > applied) {
          state += grad.data<double>()[0];
          ++applied;
        }
        transfer();
        for (const auto& l : next.lost) lost += l + "; ";
        std::printf("member %d: epoch %llu: %d member(s) go on from step %lld without: %s\n", member,
                    static_cast<unsigned long long>(next.epoch), next.size(), static_cast<long long>(next.resumeStep),
                    lost.c_str());
        std::fflush(stdout);
      }
      if (pauseMs > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pauseMs));
    }
    const auto& m = elastic->membership();
    std::printf("member %d rank %d/%d epoch %llu state %.0f expected %.0f lost %s\n", member, m.rank, m.size(),
                static_cast<unsigned long long>(m.epoch), state, expected, lost.empty() ? "none" : lost.c_str());
    return state == expected ? 0 : 1;
  } catch (const dt::JobFinishedError& e) {
    std::printf("%s\n", e.what());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "elastic_worker: %s\n", dt::describe(e).c_str());
    return 1;
  }
}
