// dt::testing::spawn: run a function as N forked ranks and get back how each
// one ended, for tests of distributed code (torch.multiprocessing.spawn for
// dtrain). docs/testing.md shows a whole gtest.
//
//   auto result = dt::testing::spawn(4, [](dt::testing::RankContext& ctx) {
//     auto group = dt::initProcessGroup();   // the environment is dtrun's
//     ...
//     return std::string("ok");
//   });
//   EXPECT_TRUE(result.ok()) << result.summary();
//
// Contract:
//  * spawn(n, fn, options) forks n children from the calling thread, then
//    hosts a TcpStore on 127.0.0.1, port 0, with a fresh token, in this
//    process, and blocks until every rank has ended. SpawnedRanks is the same
//    run as an object, for tests that act while the ranks run (kill, freeze,
//    read the store); its wait() blocks until every rank has ended.
//  * Fork safety (the caller's duty, checked): fork() copies only the calling
//    thread, so a child of a process with other threads can block forever
//    on a lock one of them held. Spawn therefore refuses (InvalidArgument
//    naming the threads) when this process has started any other thread
//    since it began, unless options.allowThreads says the caller knows those
//    threads hold nothing the ranks need. Threads that ran before main()
//    (shared libraries' pools, such as pthread OpenBLAS's, which guard
//    themselves with pthread_atfork) do not count, nor do dtrain's pools
//    that a child rebuilds for itself (tensor ops' dt-cpu-pool, Work's
//    dt-pg-callback), which earlier work may have left idle. Spawn forks
//    before it starts its own threads (the store's event loop, the
//    monitor), and they are gone with the SpawnedRanks object. So: spawn
//    from a test body before starting threads (compute references inside a
//    rank, not in the test process; destroy a process group made in the test
//    process first), one run at a time. Never touch CUDA before spawning.
//  * Each rank's environment is what dtrun gives a worker on one node:
//    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (0),
//    GROUP_WORLD_SIZE (1), MASTER_ADDR (127.0.0.1), MASTER_PORT (a free port
//    kept for the ranks), DT_STORE_ADDR and DT_STORE_TOKEN (the parent's
//    store), DT_RUN_ID (unique per run), DT_RESTART_COUNT (0), and with
//    several ranks OMP_NUM_THREADS / DT_NUM_THREADS = 1 unless already set.
//    So initProcessGroup() works in fn unchanged. options.env adds or
//    overrides variables; fn may setenv before it initialises anything.
//  * A rank's stdout and stderr (file descriptors 1 and 2, so loggers too)
//    go to one pipe; the parent keeps the last options.logBytes bytes and,
//    with options.echo, copies each line to its own stderr as "[rank r] ...".
//    stdout is line-buffered in the child, and a planned kill flushes stdio
//    first, so the log ends with the last line the rank printed.
//  * A rank ends in one of the ways of Ending. When fn returns, its value
//    goes back to the parent and the child ends with _exit(0); when fn
//    throws, describe(e) goes back and it ends with _exit(1). Neither runs
//    static destructors or atexit handlers of the test process. A rank also
//    dies with the thread that spawned it (PR_SET_PDEATHSIG), so a crashed
//    test leaves no ranks behind.
//  * A failure is a rank that threw, exited with a non-zero code or died of
//    a signal nobody planned. With options.killAllOnFailure (default) the
//    first failure SIGKILLs every rank still running. At options.deadline
//    (from the start) every rank still running, frozen ones included, is
//    SIGKILLed. Kills and freezes that the plan or the test asked for are
//    not failures.
//  * Plans: options.plan lists steps such as killAt(2, "in-backward", 3)
//    ("kill rank 2 the 3rd time it reaches point("in-backward")") or
//    freezeAt(1, "commit", 2s). See testing/point.h for what a point costs
//    and does. A freeze with no duration lasts until resume(rank) or the end
//    of the run: once wait() has been called and only such frozen ranks are
//    left, they are killed (ending Killed), since nobody can resume them.
//  * Errors: bad input throws InvalidArgument (one line naming the rank,
//    point and value) before anything is forked, as does a process that
//    ignores SIGCHLD (the kernel would reap the ranks); a failing fork(),
//    pipe() or store start throws dt::Error after killing the ranks already
//    forked.
//    Nothing in this library calls exit() or abort(); children end with
//    _exit once fn has returned.
//  * The harness sees stops and continues it did not cause (a rank's code
//    SIGSTOPs another): state() reads Frozen meanwhile.
//  * Thread safety: SpawnedRanks' methods may be called from any thread.
//    freeze() and resume() block until the stop is seen (milliseconds; at
//    worst until the deadline). The destructor kills whatever still runs and
//    reaps it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "store/tcp_store.h"
#include "testing/point.h"

namespace dt::testing {

// What a rank sees. store() connects a TcpStore client (with this rank set)
// to the parent's store at the first call and returns the same one after.
struct RankContext {
  int rank = 0;
  int worldSize = 0;
  std::string storeHost;  // "127.0.0.1"
  uint16_t storePort = 0;
  std::string storeToken;
  std::shared_ptr<TcpStore> store();

 private:
  std::shared_ptr<TcpStore> store_;
};

using RankFunction = std::function<std::string(RankContext&)>;

enum class Ending {
  Returned,            // fn returned; RankOutcome::value holds what
  Threw,               // fn threw; RankOutcome::error holds describe(e)
  Exited,              // the process called exit()/_exit() before fn returned
  Signaled,            // a signal nobody planned ended it (SIGSEGV, abort, its own kill)
  Killed,              // killed as the plan or the test asked (see RankOutcome::note)
  KilledAfterFailure,  // killed because another rank failed (killAllOnFailure)
  KilledAtDeadline,    // still running or frozen at the deadline
};
std::string_view toString(Ending ending);

// "SIGKILL", "SIGSEGV", ... ("signal 70" for one without a name).
std::string signalName(int signal);

struct RankOutcome {
  int rank = -1;
  int worldSize = 0;
  Ending ending = Ending::KilledAtDeadline;
  int exitCode = -1;  // the exit status when the process exited, else -1
  int signal = 0;     // the signal that ended the process, else 0
  std::string value;  // Returned: what fn returned
  std::string error;  // Threw: describe(e) ("dt::TimeoutError: ...")
  std::string note;   // Killed*: who killed it and why
  std::vector<std::string> events;  // what the plan or the test did to it, in order
  std::string log;                  // the last logBytes bytes of its stdout and stderr
  size_t logBytesDropped = 0;       // output older than that tail

  bool returned() const { return ending == Ending::Returned; }
  bool failed() const;  // Threw, Exited with a code other than 0, Signaled
  // The last `count` lines of the log (fewer if it has fewer).
  std::vector<std::string> lastLines(size_t count) const;
  // One line: 'rank 2/4 was killed (SIGKILL) at point "in-backward" (hit 3), as planned'.
  std::string describe() const;
};

struct SpawnResult {
  std::vector<RankOutcome> ranks;
  int firstFailure = -1;                  // the first rank that failed, or -1
  std::vector<std::string> planNotFired;  // plan steps whose point was never reached that often
  std::chrono::milliseconds elapsed{0};

  // Every rank returned.
  bool ok() const;
  const RankOutcome& operator[](int rank) const { return ranks.at(static_cast<size_t>(rank)); }
  // One line per rank (describe()), then the last `logLines` lines of each
  // rank that did not return, for a failure message.
  std::string summary(size_t logLines = 10) const;
};

struct PlanStep {
  enum class Action { Kill, Freeze };
  Action action = Action::Kill;
  int rank = 0;
  std::string point;
  int hit = 1;  // the hit-th time the rank reaches the point (1 = the first)
  // Freeze: how long; nullopt: until resume(rank) or the end of the run.
  std::optional<std::chrono::milliseconds> freezeFor;
  // 'kill rank 2 the 3rd time it reaches "in-backward"'.
  std::string describe() const;
};
PlanStep killAt(int rank, std::string point, int hit = 1);
PlanStep freezeAt(int rank, std::string point, std::optional<std::chrono::milliseconds> duration = std::nullopt,
                  int hit = 1);

struct SpawnOptions {
  std::chrono::milliseconds deadline = std::chrono::seconds(60);
  bool killAllOnFailure = true;
  std::vector<PlanStep> plan;
  size_t logBytes = 64 * 1024;  // per rank
  bool echo = true;             // copy rank output to this process's stderr as "[rank r] ..."
  bool allowThreads = false;    // see "Fork safety" above
  std::vector<std::pair<std::string, std::string>> env;  // extra variables for every rank
};

enum class RankState { Running, Frozen, Ended };

namespace detail {
// fn as a RankFunction; a fn that returns nothing returns "".
template <typename F>
RankFunction asRankFunction(F&& fn) {
  if constexpr (std::is_void_v<std::invoke_result_t<F&, RankContext&>>) {
    return [fn = std::forward<F>(fn)](RankContext& ctx) mutable {
      fn(ctx);
      return std::string();
    };
  } else {
    return RankFunction(std::forward<F>(fn));
  }
}
template <typename F>
concept OtherRankCallable = !std::is_same_v<std::decay_t<F>, RankFunction> && std::is_invocable_v<F&, RankContext&>;
}  // namespace detail

class SpawnedRanks {
 public:
  // Forks the ranks, hosts the store and returns at once.
  SpawnedRanks(int worldSize, RankFunction fn, SpawnOptions options = {});
  template <detail::OtherRankCallable F>
  SpawnedRanks(int worldSize, F&& fn, SpawnOptions options = {})
      : SpawnedRanks(worldSize, detail::asRankFunction(std::forward<F>(fn)), std::move(options)) {}
  ~SpawnedRanks();
  SpawnedRanks(const SpawnedRanks&) = delete;
  SpawnedRanks& operator=(const SpawnedRanks&) = delete;

  int worldSize() const;
  // This process's client of the ranks' store; it stays usable after wait().
  TcpStore& store();
  pid_t pid(int rank) const;
  RankState state(int rank) const;

  // SIGKILL now (ending Killed, "by the test"); false if it had already ended.
  bool kill(int rank);
  // SIGSTOP; returns once the rank is stopped (true) or has ended (false).
  bool freeze(int rank);
  // SIGCONT for a rank the test or the plan froze; false if it was not frozen.
  bool resume(int rank);

  // Blocks until every rank has ended; later calls return the same result.
  SpawnResult wait();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Runs fn on worldSize forked ranks and returns once every one has ended.
// fn takes a RankContext& and returns a std::string (or nothing).
SpawnResult spawn(int worldSize, RankFunction fn, SpawnOptions options = {});

template <detail::OtherRankCallable F>
SpawnResult spawn(int worldSize, F&& fn, SpawnOptions options = {}) {
  return spawn(worldSize, detail::asRankFunction(std::forward<F>(fn)), std::move(options));
}

}  // namespace dt::testing
