#include "tensor/parallel.h"

#include <cblas.h>
#include <dlfcn.h>
#include <strings.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <iterator>
#include <mutex>
#include <thread>
#include <vector>

#include "common/env.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/sanitizers.h"
#include "common/strings.h"
#include "common/thread_name.h"
#include "tensor/matmul_backend.h"

namespace dt {

namespace {

std::atomic<int> gThreads{0};
thread_local bool tInsideParallel = false;

// Before main: OpenBLAS's constructor has run (it is a library this one needs), no BLAS call has.
const bool gBlasWorkersStoppedAtStart = stopIdleBlasWorkers();

class Pool {
 public:
  const pid_t owner = getpid();  // a forked child has none of these threads
  explicit Pool(int workers) {
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] {
      setThreadName("dt-cpu-pool");
      loop();
    });
  }
  ~Pool() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void submit(std::function<void()> task) {
    {
      std::lock_guard lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }
  size_t size() const { return threads_.size(); }

 private:
  void loop() {
    tInsideParallel = true;
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (stop_ && tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};

Pool& pool(int wanted) {
  // Grows only; extra workers stay idle when fewer threads are asked for.
  static std::mutex mu;
  static std::unique_ptr<Pool> instance;
  std::lock_guard lock(mu);
  if (instance && instance->owner != getpid()) {
    // After fork the workers do not exist in this process: forget (leak) the old pool
    // rather than joining threads that are not there.
    (void)instance.release();
  }
  if (!instance || static_cast<int>(instance->size()) < wanted - 1) {
    // Another thread may still be submitting to the old pool: retire it without
    // destroying it (its idle workers just stay parked).
    (void)instance.release();
    instance = std::make_unique<Pool>(std::max(0, wanted - 1));
  }
  return *instance;
}

void warnOnceIfBlasKernelsDoNotFit() {
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string warning = blasKernelWarning(blasKernelName(), __builtin_cpu_supports("avx512f"), __builtin_cpu_supports("avx2"),
                                                  env::getString("OPENBLAS_CORETYPE"), onednnAvailable());
    if (warning.empty()) return;
    // AVX2 kernels on an AVX-512 CPU cost half the speed of the products left on OpenBLAS; with
    // oneDNN built in those are only the small ones, so every process of every job saying so
    // would be noise: an info line then. An SSE-era core is several times slower: always a warning.
    const bool onlyHalfSpeedOfSmallProducts = onednnAvailable() && warning.find("kernels (AVX2)") != std::string::npos;
    if (onlyHalfSpeedOfSmallProducts) {
      logger("tensor")->info("{}", warning);
    } else {
      logger("tensor")->warn("{}", warning);
    }
  });
}

}  // namespace

std::string blasKernelName() {
  const char* core = openblas_get_corename();
  return core != nullptr ? core : "";
}

std::string blasKernelWarning(const std::string& core, bool cpuHasAvx512, bool cpuHasAvx2, const std::string& coretypeVariable,
                              bool onednnBuiltIn) {
  // OpenBLAS's names for cores without AVX2: what it falls back to for a CPU it does not know.
  static const char* const kOldCores[] = {"Prescott", "Core2",  "Penryn",  "Dunnington", "Nehalem",
                                          "Atom",     "Katmai", "Coppermine", "Northwood", "Banias",
                                          "Sandybridge"};
  // Its cores with AVX-512 kernels; any other core on an AVX-512 CPU leaves half the vector unused.
  static const char* const kAvx512Cores[] = {"SkylakeX", "Cooperlake", "SapphireRapids"};
  const auto named = [&](const auto& names) {
    return std::any_of(std::begin(names), std::end(names), [&](const char* name) { return strcasecmp(core.c_str(), name) == 0; });
  };
  if (!cpuHasAvx2 || core.empty()) return "";
  const char* fit = cpuHasAvx512 ? "SkylakeX" : "Haswell";
  // oneDNN picks its kernels from the CPU's instruction bits, so a wrong OpenBLAS core slows
  // only the products the auto rule leaves on OpenBLAS (small and skinny ones, float64).
  const std::string onednn = onednnBuiltIn ? "; this build sends the larger float32 and all bf16 matrix products to oneDNN, which "
                                             "is not affected, the rest still run on OpenBLAS"
                                           : "";
  if (named(kOldCores)) {
    if (!coretypeVariable.empty()) return "";  // the user chose these kernels
    return str("OpenBLAS runs its \"", core, "\" kernels on a CPU with ", cpuHasAvx512 ? "AVX-512" : "AVX2",
               " (it does not know this CPU model), so matrix products run several times slower than they could; "
               "set OPENBLAS_CORETYPE=", fit, " in the environment before the program starts (dtrun passes it on to "
               "every rank)", onednn);
  }
  if (!cpuHasAvx512 || named(kAvx512Cores)) return "";
  return str("OpenBLAS runs its \"", core, "\" kernels (AVX2) on a CPU with AVX-512",
             coretypeVariable.empty() ? " (it does not know this CPU model)"
                                      : str(" because OPENBLAS_CORETYPE=", coretypeVariable, " is set"),
             ", so its matrix products run at about half the speed of its SkylakeX kernels; ",
             coretypeVariable.empty() ? "set OPENBLAS_CORETYPE=SkylakeX" : "unset OPENBLAS_CORETYPE (or set it to SkylakeX)",
             " before the program starts unless this OpenBLAS misbehaves with them", onednn);
}

bool stopIdleBlasWorkers() {
  // OpenBLAS's own entry point for this (its fork handler calls it); absent from builds without
  // a thread pool of their own, where there is nothing to stop.
  using Shutdown = int (*)();
  const auto shutdown = reinterpret_cast<Shutdown>(::dlsym(RTLD_DEFAULT, "blas_thread_shutdown_"));
  if (shutdown == nullptr) return false;
  shutdown();
  return true;
}

int defaultNumThreads() {
  const std::string v = env::getString("DT_NUM_THREADS");
  if (!v.empty()) {
    const int64_t n = env::parseInt(v, "DT_NUM_THREADS");
    if (n < 1 || n > 4096) {
      throw InvalidArgument("DT_NUM_THREADS=" + v + " is out of range: expected a thread count between 1 and 4096");
    }
    return static_cast<int>(n);
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// ThreadSanitizer cannot see OpenBLAS's own synchronisation (the library is not instrumented):
// its worker threads, and several ranks' threads entering its pool at once, read as data races.
// Under TSan BLAS runs on the calling thread; dtrain's own parallelFor keeps its threads.
namespace {
void setBlasThreads(int n) {
#if defined(DT_THREAD_SANITIZER)
  n = 1;
#endif
  openblas_set_num_threads(n);
}
}  // namespace

int numThreads() {
  const int n = gThreads.load(std::memory_order_acquire);
  if (n != 0) return n;
  // The first call sets OpenBLAS up, which starts its thread server; two ranks' threads that
  // both found 0 would otherwise both do it, one multiplying while the other still initialises
  // the server's locks (ThreadSanitizer caught it). The others wait here, and the count is
  // published after OpenBLAS is set.
  static std::once_flag once;
  std::call_once(once, [] {
    if (gThreads.load(std::memory_order_acquire) != 0) return;  // setNumThreads came first
    const int first = defaultNumThreads();
    setBlasThreads(first);
    gThreads.store(first, std::memory_order_release);
    warnOnceIfBlasKernelsDoNotFit();
  });
  return gThreads.load(std::memory_order_acquire);
}

void setNumThreads(int n) {
  warnOnceIfBlasKernelsDoNotFit();
  n = std::max(1, n);
  setBlasThreads(n);
  gThreads.store(n, std::memory_order_release);
}

bool insideParallelFor() { return tInsideParallel; }

void parallelForImpl(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  const int threads = numThreads();
  const int64_t total = end - begin;
  const int64_t chunks = std::min<int64_t>(threads, (total + grain - 1) / std::max<int64_t>(grain, 1));
  if (chunks <= 1 || tInsideParallel) {
    fn(begin, end);
    return;
  }
  Pool& p = pool(threads);
  const int64_t per = (total + chunks - 1) / chunks;
  std::mutex mu;
  std::condition_variable cv;
  int64_t remaining = chunks - 1;
  std::exception_ptr error;
  for (int64_t c = 1; c < chunks; ++c) {
    const int64_t b = begin + c * per, e = std::min(end, b + per);
    p.submit([&, b, e] {
      try {
        if (b < e) fn(b, e);
      } catch (...) {
        std::lock_guard lock(mu);
        if (!error) error = std::current_exception();
      }
      std::lock_guard lock(mu);
      if (--remaining == 0) cv.notify_all();
    });
  }
  tInsideParallel = true;
  try {
    fn(begin, std::min(end, begin + per));
  } catch (...) {
    std::lock_guard lock(mu);
    if (!error) error = std::current_exception();
  }
  tInsideParallel = false;
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return remaining == 0; });
  if (error) std::rethrow_exception(error);
}

}  // namespace dt
