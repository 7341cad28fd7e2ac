// Gloo-only behaviour beyond the conformance suite:
//  * the allreduce algorithms, each forced in turn: results match sums
//    computed here and are bitwise identical on every rank (also for values
//    whose float sum depends on the order), at every world size 1-8 and at
//    sizes that do not split evenly; the per-size choice and its knob;
//  * Gloo's event-loop thread runs under SCHED_BATCH, the caller's policy is kept;
//  * a rank may close the group right after building it without failing a
//    peer's connect.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>

#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <fstream>

#include "common/errors.h"
#include "common/strings.h"
#include "process_group/gloo/gloo_backend.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"
#include "tensor/generator.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"
#include "tests/testing/testing.h"

namespace dt {
// So parameterised test names read "GetParam() = ring", not a byte dump.
void PrintTo(GlooAllreduceAlgorithm algorithm, std::ostream* out) { *out << algorithmName(algorithm); }
}  // namespace dt

namespace dt::testing {
namespace {

using namespace std::chrono_literals;
using Algorithm = GlooAllreduceAlgorithm;

TEST(GlooAllreduceChoice, AutoPicksBySizeAndAForcedAlgorithmStays) {
  EXPECT_EQ(chooseAllreduceAlgorithm(Algorithm::Auto, 4 << 10, 4), Algorithm::RecursiveDoubling);
  EXPECT_EQ(chooseAllreduceAlgorithm(Algorithm::Auto, kRecursiveDoublingMaxBytes - 1, 3), Algorithm::RecursiveDoubling);
  EXPECT_EQ(chooseAllreduceAlgorithm(Algorithm::Auto, kRecursiveDoublingMaxBytes, 3), Algorithm::Ring);
  EXPECT_EQ(chooseAllreduceAlgorithm(Algorithm::Auto, 1 << 20, 2), Algorithm::RecursiveDoubling);
  EXPECT_EQ(chooseAllreduceAlgorithm(Algorithm::Auto, kRecursiveDoublingMaxBytesTwoRanks, 2), Algorithm::Ring);
  EXPECT_EQ(chooseAllreduceAlgorithm(Algorithm::Auto, 64 << 20, 8), Algorithm::Ring);
  EXPECT_EQ(chooseAllreduceAlgorithm(Algorithm::Ring, 4, 8), Algorithm::Ring);
  EXPECT_EQ(chooseAllreduceAlgorithm(Algorithm::HalvingDoubling, 4, 2), Algorithm::HalvingDoubling);
  EXPECT_EQ(chooseAllreduceAlgorithm(Algorithm::RecursiveDoubling, 64 << 20, 3), Algorithm::RecursiveDoubling);
}

TEST(GlooAllreduceChoice, NamesRoundTripAndABadValueIsNamed) {
  for (auto a : {Algorithm::Auto, Algorithm::Ring, Algorithm::HalvingDoubling, Algorithm::RecursiveDoubling}) {
    EXPECT_EQ(parseGlooAllreduceAlgorithm(algorithmName(a), "test"), a);
  }
  expectThrowsWith<InvalidArgument>([] { parseGlooAllreduceAlgorithm("bcube", "DT_GLOO_ALLREDUCE"); },
                                    {"DT_GLOO_ALLREDUCE", "bcube", "halving_doubling"});
  // The backend reads the knob when it is built, so a typo fails at start-up.
  ScopedEnv env("DT_GLOO_ALLREDUCE", "halving-doubling");
  expectThrowsWith<InvalidArgument>(
      [] { GlooBackend(std::make_shared<HashStore>(), 0, 1); }, {"DT_GLOO_ALLREDUCE", "halving-doubling"});
}

class GlooAllreduceAlgorithmTest : public ::testing::TestWithParam<Algorithm> {};

std::atomic<int> gGroup{0};

// Each rank's input: seeded by rank, so the test can recompute every sum.
std::vector<double> inputsOf(int rank, int64_t n) {
  Generator g(1000 + static_cast<uint64_t>(rank));
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = g.nextDouble() * 2.0 - 1.0;  // order-dependent float32 sums
  return v;
}

TEST_P(GlooAllreduceAlgorithmTest, ExactAndIdenticalOnEveryRankAtEveryWorldAndSize) {
  const std::vector<int64_t> sizes = {1, 2, 3, 7, 8, 9, 1023, 4099, 262147};
  for (int world = 1; world <= 8; ++world) {
    auto root = std::make_shared<HashStore>();
    const std::string scope = str("algorithms/", gGroup.fetch_add(1));
    std::mutex mutex;
    std::vector<std::vector<std::vector<uint8_t>>> bytes(sizes.size(), std::vector<std::vector<uint8_t>>(world));
    runRanks(world, [&](int rank) {
      GlooBackendOptions options;
      options.allreduceAlgorithm = GetParam();
      options.timeout = 60s;
      GlooBackend backend(std::make_shared<PrefixStore>(scope, root), rank, world, options);
      std::vector<Tensor> sums, maxima, halves;
      std::vector<WorkPtr> works;
      for (int64_t n : sizes) {
        sums.push_back(fromVector<double>(inputsOf(rank, n), {n}).to(DType::Float32));
        works.push_back(backend.allreduce({sums.back()}));
        Tensor m = mul(arange(n, DType::Int64), rank + 1);
        AllreduceOptions maxOptions;
        maxOptions.reduceOp = ReduceOp::Max;
        works.push_back(backend.allreduce({m}, maxOptions));
        maxima.push_back(m);
        halves.push_back(full({n}, 0.5 * (rank + 1), DType::Float16));
        works.push_back(backend.allreduce({halves.back()}));
      }
      for (auto& w : works) w->wait();
      for (size_t s = 0; s < sizes.size(); ++s) {
        const int64_t n = sizes[s];
        const std::string what = str(algorithmName(GetParam()), " world ", world, " rank ", rank, " n ", n);
        const auto got = sums[s].toVector<float>();
        std::vector<double> want(static_cast<size_t>(n), 0.0);
        for (int r = 0; r < world; ++r) {
          const auto in = inputsOf(r, n);
          for (int64_t i = 0; i < n; ++i) want[i] += static_cast<float>(in[i]);
        }
        for (int64_t i = 0; i < n; ++i) {
          if (std::abs(got[i] - want[i]) > 1e-5 * world) {
            ADD_FAILURE() << what << ": sum element " << i << " is " << got[i] << ", expected " << want[i];
            break;
          }
        }
        const auto mx = maxima[s].toVector<int64_t>();
        for (int64_t i = 0; i < n; ++i) {
          if (mx[i] != i * world) {
            ADD_FAILURE() << what << ": max element " << i << " is " << mx[i] << ", expected " << i * world;
            break;
          }
        }
        const double halfSum = 0.5 * world * (world + 1) / 2;
        const auto hv = halves[s].toVector<double>();
        for (int64_t i = 0; i < n; ++i) {
          if (hv[i] != halfSum) {
            ADD_FAILURE() << what << ": float16 element " << i << " is " << hv[i] << ", expected " << halfSum;
            break;
          }
        }
        std::lock_guard<std::mutex> lock(mutex);
        const auto* p = static_cast<const uint8_t*>(sums[s].dataPtr());
        bytes[s][rank].assign(p, p + sums[s].nbytes());
      }
      backend.shutdown();
    }, 180s);
    for (size_t s = 0; s < sizes.size(); ++s) {
      for (int r = 1; r < world; ++r) {
        EXPECT_TRUE(bytes[s][r] == bytes[s][0])
            << algorithmName(GetParam()) << " world " << world << " n " << sizes[s] << ": rank " << r
            << "'s float32 sum differs bitwise from rank 0's";
      }
    }
  }
}

// Threads of this process whose scheduling policy (field 41 of /proc/<pid>/task/<tid>/stat) is SCHED_BATCH.
int batchThreads() {
  int count = 0;
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  while (dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    std::ifstream in(str("/proc/self/task/", entry->d_name, "/stat"));
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto close = stat.rfind(')');  // the name may hold spaces; fields follow it
    if (close == std::string::npos) continue;
    const auto fields = split(stat.substr(close + 2), ' ');
    if (fields.size() > 38 && fields[38] == std::to_string(SCHED_BATCH)) ++count;  // field 41 = index 38 after ")"
  }
  ::closedir(dir);
  return count;
}

TEST(GlooBackendScheduling, EventLoopRunsUnderBatchPolicyAndTheCallerKeepsItsOwn) {
  ASSERT_EQ(batchThreads(), 0);
  {
    GlooBackendOptions options;
    options.batchEventLoop = false;
    GlooBackend backend(std::make_shared<HashStore>(), 0, 1, options);
    EXPECT_EQ(batchThreads(), 0) << "batchEventLoop = false must leave every thread's policy alone";
  }
  {
    ScopedEnv env("DT_GLOO_BATCH_LOOP", "sometimes");
    expectThrowsWith<InvalidArgument>([] { GlooBackend(std::make_shared<HashStore>(), 0, 1); },
                                      {"DT_GLOO_BATCH_LOOP", "sometimes"});
  }
  GlooBackend backend(std::make_shared<HashStore>(), 0, 1);
  EXPECT_GE(batchThreads(), 1) << "Gloo's event-loop thread should run under SCHED_BATCH";
  int policy = -1;
  sched_param param{};
  ASSERT_EQ(pthread_getschedparam(pthread_self(), &policy, &param), 0);
  EXPECT_EQ(policy, SCHED_OTHER) << "the constructing thread must get its own policy back";
  Tensor t = ones({3});
  backend.allreduce({t})->wait();  // and the backend works as usual
  EXPECT_EQ(t.toVector<float>(), (std::vector<float>{1, 1, 1}));
}

// A group that one rank closes the moment it is built (create, then destroy)
// must not fail a peer that is still finishing its side of the same pair: CI
// once saw "Connection closed by peer" from exactly this.
TEST(GlooBackendConnect, ARankThatClosesTheGroupAtOnceDoesNotFailItsPeersConnect) {
  constexpr int kWorld = 4;
  constexpr int kRounds = 25;
  auto root = std::make_shared<HashStore>();
  std::atomic<int> connected{0};
  runRanks(kWorld, [&](int rank) {
    for (int round = 0; round < kRounds; ++round) {
      GlooBackendOptions options;
      options.timeout = 30s;
      GlooBackend backend(std::make_shared<PrefixStore>(str("close-at-once/", round), root), rank, kWorld, options);
      connected.fetch_add(1);
      backend.shutdown();  // and the destructor closes every pair
    }
  }, 120s);
  EXPECT_EQ(connected.load(), kWorld * kRounds);
}

INSTANTIATE_TEST_SUITE_P(Forced, GlooAllreduceAlgorithmTest,
                         ::testing::Values(Algorithm::Ring, Algorithm::HalvingDoubling, Algorithm::RecursiveDoubling),
                         [](const auto& info) { return std::string(algorithmName(info.param)); });

}  // namespace
}  // namespace dt::testing
