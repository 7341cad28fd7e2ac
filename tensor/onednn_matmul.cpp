// The oneDNN side of the CPU matrix product (tensor/internal/gemm.h): one matmul primitive per
// problem shape, created once and kept, run on the calling thread's OpenMP team.
//
// Why a cache of our own: oneDNN keeps created primitives in its own cache, but building the
// primitive descriptor (its dispatcher trying implementations) runs on every lookup there,
// tens of microseconds per product. Here the key is everything the primitive bakes in (shape,
// transposes, leading dims and batch strides, dtype, alpha/beta, thread count), so a training
// step, which repeats its shapes, creates none after its first.
//
// Why scratchpad_mode::user: oneDNN's library-managed scratchpad is one global buffer unless
// it was built with DNNL_ENABLE_CONCURRENT_EXEC, and ranks that run as threads multiply at once.
// Each thread brings its own scratch memory instead.
#include <dlfcn.h>
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>
#include <utility>

#include "common/errors.h"
#include "common/sanitizers.h"
#include "common/strings.h"
#include "tensor/internal/gemm.h"
#include "tensor/parallel.h"

namespace dt::detail::onednn {

namespace {

// oneDNN's threads come from its threading runtime. Debian's 2.6 is built with OpenMP
// (DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP): its parallel regions use the calling
// thread's omp_get_max_threads(), an OpenMP per-thread setting that starts at the machine's
// cores (OMP_NUM_THREADS). Each product sets it from numThreads() on its own thread, so
// DT_NUM_THREADS / setNumThreads govern oneDNN as they govern OpenBLAS and dtrain's pool. The
// functions come from the libgomp that libdnnl loaded, looked up rather than linked, so the
// build needs no OpenMP flags of its own.
#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
using GetThreads = int (*)();
using SetThreads = void (*)(int);
const GetThreads ompGetMaxThreads = reinterpret_cast<GetThreads>(::dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
const SetThreads ompSetNumThreads = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
#endif

// GCC's OpenMP does not survive fork: a child whose parent ran a team of several threads
// waits forever for the parent's workers at its own first parallel region (measured: a
// two-thread region in a forked child hung). The process that last ran oneDNN with more than
// one thread is recorded; a forked child of it runs oneDNN on its calling thread only.
std::atomic<pid_t> gTeamOwner{0};

int useThreads() {
  // Inside a parallelFor chunk (the fused attention's heads) each chunk is already a thread.
  int n = insideParallelFor() ? 1 : numThreads();
#if defined(DT_THREAD_SANITIZER)
  n = 1;  // libgomp is not instrumented either: its team would read as races (see parallel.cpp)
#endif
#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
  const pid_t owner = gTeamOwner.load(std::memory_order_relaxed);
  const pid_t self = ::getpid();
  if (owner != 0 && owner != self) {
    n = 1;
  } else if (n > 1 && owner == 0) {
    gTeamOwner.store(self, std::memory_order_relaxed);
  }
  if (ompGetMaxThreads != nullptr && ompSetNumThreads != nullptr && ompGetMaxThreads() != n) ompSetNumThreads(n);
#endif
  return n;
}

const dnnl::engine& cpuEngine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

struct Key {
  DType inType;
  bool transA, transB;
  int64_t batch, m, n, k, lda, ldb, ldc, strideA, strideB, strideC;
  double alpha, beta;
  int threads;
  bool bias;
  bool operator==(const Key&) const = default;
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = std::hash<int>()(static_cast<int>(key.inType) * 4 + key.transA * 2 + key.transB);
    auto mix = [&h](auto v) { h ^= std::hash<decltype(v)>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    for (int64_t v : {key.batch, key.m, key.n, key.k, key.lda, key.ldb, key.ldc, key.strideA, key.strideB, key.strideC})
      mix(v);
    mix(key.alpha);
    mix(key.beta);
    mix(key.threads);
    mix(key.bias);
    return h;
  }
};

struct Entry {
  bool usable = false;  // false: only a reference implementation, or oneDNN refused the layout
  std::string impl;
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
  dnnl::memory::desc a, b, c, bias;
};

std::mutex gMu;
std::mutex gBuildMu;  // one primitive creation at a time (lookup)
std::unordered_map<Key, std::shared_ptr<const Entry>, KeyHash> gCache;
std::atomic<int64_t> gCreated{0};
std::atomic<int64_t> gRun{0};

dnnl::memory::data_type dnnlType(DType t) {
  switch (t) {
    case DType::Float32: return dnnl::memory::data_type::f32;
    case DType::BFloat16: return dnnl::memory::data_type::bf16;
    default: throw NotSupportedError(str("oneDNN matmul: dtype ", t, " is not supported (float32, bfloat16)"));
  }
}

// A [rows, cols] operand (or [batch, rows, cols]) stored row-major with leading dim ld, or as
// its transpose.
dnnl::memory::desc operandDesc(DType t, int64_t batch, int64_t rows, int64_t cols, bool trans, int64_t ld,
                               int64_t stride) {
  const dnnl::memory::dims strides2 = trans ? dnnl::memory::dims{1, ld} : dnnl::memory::dims{ld, 1};
  if (batch == 1) return dnnl::memory::desc({rows, cols}, dnnlType(t), strides2);
  return dnnl::memory::desc({batch, rows, cols}, dnnlType(t), {stride, strides2[0], strides2[1]});
}

std::shared_ptr<const Entry> build(const Key& key) {
  auto entry = std::make_shared<Entry>();
  try {
    entry->a = operandDesc(key.inType, key.batch, key.m, key.k, key.transA, key.lda, key.strideA);
    entry->b = operandDesc(key.inType, key.batch, key.k, key.n, key.transB, key.ldb, key.strideB);
    entry->c = operandDesc(DType::Float32, key.batch, key.m, key.n, false, key.ldc, key.strideC);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (key.alpha != 1.0) attr.set_output_scales(0, {static_cast<float>(key.alpha)});
    if (key.beta != 0.0) {
      dnnl::post_ops ops;
      ops.append_sum(static_cast<float>(key.beta));
      attr.set_post_ops(ops);
    }
    if (key.bias) {
      // One row broadcast over the rows (and the batch) of C.
      entry->bias = key.batch == 1 ? dnnl::memory::desc({1, key.n}, dnnl::memory::data_type::f32, {key.n, 1})
                                   : dnnl::memory::desc({1, 1, key.n}, dnnl::memory::data_type::f32, {key.n, key.n, 1});
      entry->pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(entry->a, entry->b, entry->bias, entry->c), attr,
                                               cpuEngine());
    } else {
      entry->pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(entry->a, entry->b, entry->c), attr, cpuEngine());
    }
    entry->impl = entry->pd.impl_info_str();
    // A reference kernel is a slow emulation: OpenBLAS does better.
    if (entry->impl.rfind("ref", 0) == 0) return entry;
    entry->primitive = dnnl::matmul(entry->pd);
    gCreated.fetch_add(1, std::memory_order_relaxed);
    entry->usable = true;
  } catch (const dnnl::error&) {
    // No implementation takes this layout (a zero batch stride, say): OpenBLAS runs it.
    entry->usable = false;
  }
  return entry;
}

std::shared_ptr<const Entry> lookup(const GemmProblem& p, int threads) {
  const Key key{p.inType, p.transA,  p.transB,  p.batch,   p.m,     p.n,    p.k,   p.lda,
                p.ldb,    p.ldc,     p.batch > 1 ? p.strideA : 0, p.batch > 1 ? p.strideB : 0,
                p.batch > 1 ? p.strideC : 0, p.alpha, p.beta, threads, p.bias != nullptr};
  {
    std::lock_guard lock(gMu);
    auto it = gCache.find(key);
    if (it != gCache.end()) return it->second;
  }
  // Built outside the cache's lock (milliseconds for a new brgemm kernel), so lookups of built
  // shapes never wait for a build; a second thread building the same key keeps whichever landed
  // first. Builds take turns: oneDNN initialises its own shared state (its primitive cache's
  // lock) lazily inside the first creations, and two ranks' threads creating their first
  // primitives at once read as a race to ThreadSanitizer, which cannot see oneDNN's own
  // synchronisation. A step creates none after its first, so the turns cost nothing later.
  std::shared_ptr<const Entry> entry;
  {
    std::lock_guard building(gBuildMu);
    entry = build(key);
  }
  std::lock_guard lock(gMu);
  // A workload whose shapes keep changing (generation, whose rows grow by one per token) would
  // grow the cache without end: past kMaxEntries it starts over. Entries in use stay alive
  // through their shared_ptr; oneDNN's own cache still holds recent kernels, so rebuilding is cheap.
  constexpr size_t kMaxEntries = 1024;
  if (gCache.size() >= kMaxEntries) gCache.clear();
  return gCache.emplace(key, std::move(entry)).first->second;
}

// Scratch memory for this thread's products, grown to the largest asked for.
void* threadScratch(size_t bytes) {
  struct Buffer {
    void* data = nullptr;
    size_t size = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buffer;
  if (bytes > buffer.size) {
    std::free(buffer.data);
    buffer.data = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (buffer.data == nullptr) {
      buffer.size = 0;
      throw std::bad_alloc();
    }
    buffer.size = bytes;
  }
  return buffer.data;
}

bool supported(const GemmProblem& p) {
  return (p.inType == DType::Float32 || p.inType == DType::BFloat16) && p.outType == DType::Float32 && p.m > 0 &&
         p.n > 0 && p.k > 0 && p.batch > 0;
}

}  // namespace

bool gemm(const GemmProblem& p) {
  if (!supported(p)) return false;
  const int threads = useThreads();
  const std::shared_ptr<const Entry> e = lookup(p, threads);
  if (!e->usable) return false;
  const dnnl::engine& engine = cpuEngine();
  thread_local dnnl::stream stream(engine);
  dnnl::memory a(e->a, engine, const_cast<void*>(p.a));
  dnnl::memory b(e->b, engine, const_cast<void*>(p.b));
  dnnl::memory c(e->c, engine, p.c);
  const dnnl::memory::desc scratchDesc = e->pd.scratchpad_desc();
  dnnl::memory scratch(scratchDesc, engine, threadScratch(std::max<size_t>(scratchDesc.get_size(), 1)));
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}, {DNNL_ARG_SCRATCHPAD, scratch}};
  if (p.bias != nullptr) args.emplace(DNNL_ARG_BIAS, dnnl::memory(e->bias, engine, const_cast<float*>(p.bias)));
  try {
    e->primitive.execute(stream, args);
    stream.wait();
    gRun.fetch_add(1, std::memory_order_relaxed);
  } catch (const dnnl::error& err) {
    throw BackendError(str("oneDNN matmul (", e->impl, ") failed on ", p.inType, " [", p.batch, " x ", p.m, " x ", p.k,
                           "] . [", p.k, " x ", p.n, "]: ", err.what()));
  }
  return true;
}

std::string implName(const GemmProblem& p) {
  if (!supported(p)) return "";
  const std::shared_ptr<const Entry> e = lookup(p, useThreads());
  return e->usable ? e->impl : "";
}

int64_t primitivesCreated() { return gCreated.load(std::memory_order_relaxed); }
int64_t productsRun() { return gRun.load(std::memory_order_relaxed); }

std::string version() {
  const dnnl_version_t* v = dnnl_version();
  return str(v->major, ".", v->minor, ".", v->patch);
}

namespace {

// Whether oneDNN's effective ISA (the CPU's, under any ONEDNN_MAX_CPU_ISA cap) includes `isa`:
// each ISA's value holds the bits of the ones it extends.
bool effectiveIsaHas(dnnl::cpu_isa isa) {
  const auto have = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto want = static_cast<unsigned>(isa);
  return (have & want) == want;
}

}  // namespace

// Without avx512_core_bf16 (AVX-512 with BF16; AMX's value includes it) oneDNN runs bf16 by
// emulation ("gemm:jit" converting), slower than float32.
bool bf16Instructions() { return effectiveIsaHas(dnnl::cpu_isa::avx512_core_bf16); }

bool hasAmx() { return effectiveIsaHas(dnnl::cpu_isa::avx512_core_amx); }

bool hasAvx512() { return effectiveIsaHas(dnnl::cpu_isa::avx512_core); }

namespace {

// Twelve independent accumulators hide each instruction's latency, so the loop runs at the
// instruction's throughput. They start apart: chains that started equal would be computed once
// (the compiler merged them, and a first version of this probe measured latency instead).
constexpr int kProbeIterations = 16384;
constexpr int kChains = 12;

// Seconds for kProbeIterations x kChains AVX512_BF16 dot products (kBf16) or float32 FMAs, all
// on 512-bit vectors. Runs only where bf16Instructions() holds.
template <bool kBf16>
__attribute__((target("avx512f,avx512bf16"))) double chainSeconds(float x) {
  const __m512 a = _mm512_set1_ps(x), b = _mm512_set1_ps(1.0f - x);
  const __m512bh pairsA = _mm512_cvtne2ps_pbh(a, a), pairsB = _mm512_cvtne2ps_pbh(b, b);
  __m512 c[kChains];
  for (int j = 0; j < kChains; ++j) c[j] = _mm512_set1_ps(x * static_cast<float>(j + 1));
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kProbeIterations; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < kChains; ++j) {
      if constexpr (kBf16) {
        c[j] = _mm512_dpbf16_ps(c[j], pairsA, pairsB);
      } else {
        c[j] = _mm512_fmadd_ps(a, b, c[j]);
      }
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  __m512 all = c[0];  // used, so that the loop stays
  for (int j = 1; j < kChains; ++j) all = _mm512_add_ps(all, c[j]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, all);
  volatile float sink = lanes[0];
  (void)sink;
  return seconds;
}

double measureBf16DotOverFloat32Fma() {
  // The best of several alternating trials: a trial another process preempted only gets slower.
  // The first rounds are not counted: a core that has not run 512-bit instructions for a while
  // may run them slower until its power state follows (tens to hundreds of microseconds).
  volatile float seed = 0.5f;
  double fma = 1e30, dot = 1e30;
  for (int trial = 0; trial < 10; ++trial) {
    const double f = chainSeconds<false>(seed), d = chainSeconds<true>(seed);
    if (trial < 2) continue;
    fma = std::min(fma, f);
    dot = std::min(dot, d);
  }
  // A dot product instruction does 32 multiply-adds (two bf16 pairs per float32 lane), an FMA 16.
  return (32.0 / dot) / (16.0 / fma);
}

}  // namespace

double bf16DotOverFloat32FmaRate() {
  if (!bf16Instructions()) return 0.0;
  static const double rate = measureBf16DotOverFloat32Fma();
  return rate;
}

std::string bf16MissingReason() {
  if (bf16Instructions()) return "";
  // Both cases end with the same words, so a log search or a test finds them on any CPU.
  static constexpr const char* kNeeds =
      "oneDNN's bf16 kernels need AVX512_BF16 (its ISA avx512_core_bf16) or AMX-BF16 (avx512_core_amx)";
  const bool cpuHas = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (cap == nullptr) cap = std::getenv("DNNL_MAX_CPU_ISA");
  if (cpuHas) {
    return str("the CPU has AVX512_BF16 but oneDNN's ISA is capped below it",
               cap != nullptr ? str(" (ONEDNN_MAX_CPU_ISA=", cap, ")") : std::string(),
               "; ", kNeeds);
  }
  // __builtin_cpu_supports takes only string literals.
  const std::pair<const char*, bool> features[] = {{"avx512f", __builtin_cpu_supports("avx512f")},
                                                   {"avx512bw", __builtin_cpu_supports("avx512bw")},
                                                   {"avx512vl", __builtin_cpu_supports("avx512vl")},
                                                   {"avx512bf16", __builtin_cpu_supports("avx512bf16")}};
  std::string missing;
  for (const auto& [feature, has] : features) {
    if (!has) missing += missing.empty() ? std::string(feature) : str(", ", feature);
  }
  return str("this CPU lacks ", missing, "; ", kNeeds);
}

}  // namespace dt::detail::onednn
