// The Backend conformance suite (see backend_conformance.h). Threads as
// ranks over one HashStore; every expected value is computed here from the
// inputs, never taken from the backend.
#include "tests/process_group/backend_conformance.h"

#include <atomic>
#include <cmath>
#include <mutex>
#include <thread>

#include "collectives/fingerprint.h"
#include "common/config.h"
#include "common/errors.h"
#include "common/strings.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"
#include "tests/testing/testing.h"
#if DT_HAVE_CUDA
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/stream.h"
#endif

namespace dt::testing {

GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(BackendConformance);

namespace {

using namespace std::chrono_literals;

const std::vector<DType> kDTypes = {DType::Float32, DType::Float64, DType::Float16,
                                    DType::BFloat16, DType::Int32, DType::Int64};
const std::vector<ReduceOp> kOps = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max, ReduceOp::Product};

bool isFloat(DType d) { return d == DType::Float32 || d == DType::Float64 || d == DType::Float16 || d == DType::BFloat16; }

// Rounds an exactly computed value to what `dtype` stores.
double roundTo(DType dtype, double v) {
  switch (dtype) {
    case DType::Float32: return static_cast<float>(v);
    case DType::Float16: return toFloat(toHalf(static_cast<float>(v)));
    case DType::BFloat16: return toFloat(toBFloat16(static_cast<float>(v)));
    default: return v;
  }
}

// Small integers, so every dtype holds sums/products of up to 8 ranks exactly.
double inputValue(ReduceOp op, int rank, int64_t i) {
  if (op == ReduceOp::Product) {
    static const double kVals[] = {-1, 1, 2};
    return kVals[(rank + i) % 3];
  }
  return static_cast<double>((rank * 3 + i * 7) % 11 - 3);
}

double expectedValue(DType dtype, ReduceOp op, int world, int64_t i) {
  double acc = inputValue(op, 0, i);
  for (int r = 1; r < world; ++r) {
    const double v = inputValue(op, r, i);
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg: acc += v; break;
      case ReduceOp::Min: acc = std::min(acc, v); break;
      case ReduceOp::Max: acc = std::max(acc, v); break;
      case ReduceOp::Product: acc *= v; break;
    }
  }
  if (op == ReduceOp::Avg) {
    if (dtype == DType::Float64) return acc / world;
    if (isFloat(dtype)) return roundTo(dtype, static_cast<float>(acc) / static_cast<float>(world));
    return static_cast<double>(static_cast<int64_t>(acc) / world);  // truncates toward zero
  }
  return roundTo(dtype, acc);
}

// The device of the rank running on this thread (cuda:<rank> for a CUDA
// factory): every tensor a test makes goes there.
thread_local Device tRankDevice = Device::cpu();

Tensor placed(Tensor t) { return tRankDevice.isCpu() ? t : t.to(tRankDevice); }
Tensor dzeros(Shape sizes, DType dtype = DType::Float32) { return placed(zeros(std::move(sizes), dtype)); }
Tensor dones(Shape sizes, DType dtype = DType::Float32) { return placed(ones(std::move(sizes), dtype)); }
Tensor dfull(Shape sizes, double value, DType dtype = DType::Float32) {
  return placed(full(std::move(sizes), value, dtype));
}
template <typename T>
Tensor dfromVector(const std::vector<T>& values, Shape sizes) {
  return placed(fromVector<T>(values, std::move(sizes)));
}

Tensor makeInput(DType dtype, ReduceOp op, int rank, int64_t n) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = inputValue(op, rank, i);
  return placed(fromVector<double>(v, {n}).to(dtype));
}

// Waits until the op completed, for every backend: a device backend's
// wait() only makes the caller's stream wait (work.h), and the tests read
// results and errors on the host.
void finish(const WorkPtr& work) {
  if (work->hasDeviceWait()) {
    work->wait(std::chrono::minutes(5));
  } else {
    work->wait();
  }
}

// Why `factory` cannot run a group of `world` ranks here, or "" when it can.
std::string skipReason(const BackendFactory& factory, int world) {
  if (!factory.device.isCuda()) return "";
#if DT_HAVE_CUDA
  const int devices = cuda::deviceCount();
  if (devices == 0) return str("needs a CUDA device: ", cuda::unavailableReason());
  if (world > devices) {
    return str("world size ", world, " needs ", world, " GPUs: NCCL 2.28 rejects two ranks on one GPU; this machine has ",
               devices);
  }
  return "";
#else
  return "needs a CUDA device: this build has no CUDA (DT_HAVE_CUDA=0)";
#endif
}

// Skips the test when the backend lacks a feature it needs (the reason is the factory's).
#define DT_SKIP_UNLESS(feature)                                                           \
  do {                                                                                    \
    if (!GetParam().unsupported.feature.empty()) GTEST_SKIP() << GetParam().unsupported.feature; \
  } while (0)

// Checks every element (a few hundred mismatches would drown the log, so stop at the first).
void expectReduced(const Tensor& t, DType dtype, ReduceOp op, int world, const std::string& what) {
  const auto got = t.toVector<double>();
  for (int64_t i = 0; i < static_cast<int64_t>(got.size()); ++i) {
    const double want = expectedValue(dtype, op, world, i);
    if (got[i] != want) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", expected " << want;
      return;
    }
  }
}

int64_t elementsFor(DType dtype, int64_t sizeSpec) {
  // Negative spec: bytes (-1048576 -> 1 MiB of this dtype).
  return sizeSpec >= 0 ? sizeSpec : -sizeSpec / static_cast<int64_t>(itemSize(dtype));
}

std::atomic<int> gGroupCounter{0};

// Runs fn(rank, backend) on `world` threads, each with its own backend over
// one shared in-process store.
// A world size this machine cannot run is skipped with the reason: the test
// reads as skipped (unless something failed), and its other world sizes
// still run.
void withBackends(const BackendFactory& factory, int world, const std::function<void(int, Backend&)>& fn,
                  BackendTestOptions options = {}, std::chrono::milliseconds deadline = 120s) {
  if (const std::string reason = skipReason(factory, world); !reason.empty()) {
    GTEST_SKIP() << factory.name << ", world size " << world << ": " << reason;
  }
  auto root = std::make_shared<HashStore>();
  const std::string scope = str("conformance/", gGroupCounter.fetch_add(1));
  runRanks(world, [&](int rank) {
#if DT_HAVE_CUDA
    if (factory.device.isCuda()) {
      tRankDevice = Device::cuda(rank);
      cuda::setCurrentDevice(rank);
    }
#endif
    auto backend = factory.make(std::make_shared<PrefixStore>(scope, root), rank, world, options);
    fn(rank, *backend);
    backend->shutdown();
  }, deadline);
}

void waitAll(const std::vector<WorkPtr>& works) {
  for (const auto& w : works) finish(w);
}

TEST_P(BackendConformance, AllreduceEveryDTypeOpAndSize) {
  for (int world : {1, 2, 3, 4, 8}) {
    withBackends(GetParam(), world, [&](int rank, Backend& backend) {
      for (DType dtype : kDTypes) {
        for (ReduceOp op : kOps) {
          // 1 MiB only for sum and max, to keep the suite fast on two cores.
          std::vector<int64_t> sizes = {0, 1, 1023};
          if (op == ReduceOp::Sum || op == ReduceOp::Max) sizes.push_back(-(1 << 20));
          std::vector<Tensor> tensors;
          std::vector<WorkPtr> works;
          for (int64_t spec : sizes) {
            Tensor t = makeInput(dtype, op, rank, elementsFor(dtype, spec));
            AllreduceOptions o;
            o.reduceOp = op;
            works.push_back(backend.allreduce({t}, o));
            tensors.push_back(t);
          }
          waitAll(works);
          for (const auto& t : tensors) {
            expectReduced(t, dtype, op, world,
                          str("world ", world, " rank ", rank, " allreduce ", toString(dtype), "[", t.numel(), "] ",
                              toString(op)));
          }
        }
      }
    });
  }
}

TEST_P(BackendConformance, Allreduce64MiB) {
  withBackends(GetParam(), 2, [&](int rank, Backend& backend) {
    const int64_t n = (64 << 20) / 4;
    Tensor t = makeInput(DType::Float32, ReduceOp::Sum, rank, n);
    finish(backend.allreduce({t}));
    expectReduced(t, DType::Float32, ReduceOp::Sum, 2, "64 MiB float32 sum");
  });
  withBackends(GetParam(), 3, [&](int rank, Backend& backend) {
    const int64_t n = (64 << 20) / 2;
    Tensor t = makeInput(DType::BFloat16, ReduceOp::Max, rank, n);
    AllreduceOptions o;
    o.reduceOp = ReduceOp::Max;
    finish(backend.allreduce({t}, o));
    expectReduced(t, DType::BFloat16, ReduceOp::Max, 3, "64 MiB bfloat16 max");
  });
}

TEST_P(BackendConformance, BroadcastEveryDTypeSizeAndRoot) {
  for (int world : {1, 2, 3, 5}) {
    withBackends(GetParam(), world, [&](int rank, Backend& backend) {
      for (int root : {0, world - 1}) {
        for (DType dtype : kDTypes) {
          for (int64_t spec : {int64_t(0), int64_t(1), int64_t(1023), int64_t(-(1 << 20))}) {
            const int64_t n = elementsFor(dtype, spec);
            // Root holds the values of "rank 100"; the others hold their own.
            Tensor t = makeInput(dtype, ReduceOp::Sum, rank == root ? 100 : rank, n);
            BroadcastOptions o;
            o.root = root;
            finish(backend.broadcast({t}, o));
            const auto got = t.toVector<double>();
            for (int64_t i = 0; i < n; ++i) {
              if (got[i] != inputValue(ReduceOp::Sum, 100, i)) {
                ADD_FAILURE() << "broadcast world " << world << " root " << root << " " << toString(dtype) << "["
                              << n << "] element " << i << " is " << got[i];
                break;
              }
            }
          }
        }
      }
    });
  }
}

TEST_P(BackendConformance, ReduceToRootLeavesOthersUnchanged) {
  for (int world : {1, 2, 4}) {
    withBackends(GetParam(), world, [&](int rank, Backend& backend) {
      for (int root : {0, world - 1}) {
        for (DType dtype : kDTypes) {
          for (ReduceOp op : kOps) {
            Tensor t = makeInput(dtype, op, rank, 1023);
            const auto before = t.toVector<double>();
            ReduceOptions o;
            o.reduceOp = op;
            o.root = root;
            finish(backend.reduce({t}, o));
            if (rank == root) {
              expectReduced(t, dtype, op, world, str("reduce root ", root, " ", toString(dtype), " ", toString(op)));
            } else {
              EXPECT_EQ(t.toVector<double>(), before) << "reduce changed a non-root tensor";
            }
          }
        }
      }
    });
  }
}

TEST_P(BackendConformance, AllgatherEveryDTypeAndSize) {
  for (int world : {1, 2, 3, 4}) {
    withBackends(GetParam(), world, [&](int rank, Backend& backend) {
      for (DType dtype : kDTypes) {
        for (int64_t n : {0, 1, 1023}) {
          Tensor in = makeInput(dtype, ReduceOp::Sum, rank, n);
          std::vector<Tensor> outs;
          for (int r = 0; r < world; ++r) outs.push_back(dfull({n}, -99, dtype));
          finish(backend.allgather(outs, in));
          for (int r = 0; r < world; ++r) {
            EXPECT_EQ(outs[r].toVector<double>(), makeInput(dtype, ReduceOp::Sum, r, n).toVector<double>())
                << "allgather " << toString(dtype) << "[" << n << "] slot " << r;
          }
        }
      }
    });
  }
}

TEST_P(BackendConformance, ReduceScatterEveryDTypeAndOp) {
  for (int world : {1, 2, 3, 4}) {
    withBackends(GetParam(), world, [&](int rank, Backend& backend) {
      for (DType dtype : kDTypes) {
        for (ReduceOp op : kOps) {
          for (int64_t n : {0, 1, 1023}) {
            // Input j of every rank goes to rank j; offsetting the element
            // index by j*n makes each destination's chunk distinct.
            std::vector<Tensor> inputs;
            for (int j = 0; j < world; ++j) {
              std::vector<double> v(n);
              for (int64_t i = 0; i < n; ++i) v[i] = inputValue(op, rank, i + j * n);
              inputs.push_back(dfromVector<double>(v, {n}).to(dtype));
            }
            Tensor out = dfull({n}, -99, dtype);
            ReduceScatterOptions o;
            o.reduceOp = op;
            finish(backend.reduceScatter(out, inputs, o));
            const auto got = out.toVector<double>();
            for (int64_t i = 0; i < n; ++i) {
              const double want = expectedValue(dtype, op, world, i + rank * n);
              if (got[i] != want) {
                ADD_FAILURE() << "reduceScatter " << toString(dtype) << " " << toString(op) << " world " << world
                              << " element " << i << ": " << got[i] << " vs " << want;
                break;
              }
            }
          }
        }
      }
    });
  }
}

TEST_P(BackendConformance, AllToAllWithUnevenSizes) {
  for (int world : {1, 2, 3, 4}) {
    withBackends(GetParam(), world, [&](int rank, Backend& backend) {
      // Rank r sends (r + j) % 3 elements, valued 1000*r + j, to rank j.
      auto count = [](int from, int to) { return int64_t((from + to) % 3); };
      std::vector<Tensor> inputs, outputs;
      for (int j = 0; j < world; ++j) {
        inputs.push_back(dfull({count(rank, j)}, 1000.0 * rank + j, DType::Int64));
        outputs.push_back(dfull({count(j, rank)}, -1, DType::Int64));
      }
      finish(backend.allToAll(outputs, inputs));
      for (int i = 0; i < world; ++i) {
        EXPECT_EQ(outputs[i].toVector<int64_t>(), std::vector<int64_t>(count(i, rank), 1000 * i + rank))
            << "allToAll slot " << i;
      }
    });
  }
}

TEST_P(BackendConformance, AllToAllWithUnevenSizesPassesFingerprintChecks) {
  // Ranks legitimately pass different sizes; only dtypes must agree.
  BackendTestOptions o;
  o.checkFingerprints = true;
  withBackends(GetParam(), 3, [&](int rank, Backend& backend) {
    std::vector<Tensor> inputs, outputs;
    for (int j = 0; j < 3; ++j) {
      inputs.push_back(dfull({rank + j + 1}, rank, DType::Int32));
      outputs.push_back(dfull({j + rank + 1}, -1, DType::Int32));
    }
    finish(backend.allToAll(outputs, inputs));
    for (int j = 0; j < 3; ++j) EXPECT_EQ(outputs[j].toVector<int32_t>(), std::vector<int32_t>(j + rank + 1, j));
    Tensor in = dfull({rank + 3, 2}, rank, DType::Int64);  // rank r sends 1 row to 0, 1 to 1, r+1 to 2
    Tensor out = dfull({rank == 2 ? 6 : 3, 2}, -1, DType::Int64);
    const std::vector<int64_t> sendRows = {1, 1, rank + 1};
    const std::vector<int64_t> recvRows = rank == 2 ? std::vector<int64_t>{1, 2, 3} : std::vector<int64_t>{1, 1, 1};
    finish(backend.allToAllSingle(out, in, recvRows, sendRows));
    std::vector<int64_t> want;
    for (int j = 0; j < 3; ++j) want.insert(want.end(), 2 * recvRows[j], j);
    EXPECT_EQ(out.toVector<int64_t>(), want);
  }, o);
}

TEST_P(BackendConformance, GatherAndScatterEveryDTypeSizeAndRoot) {
  for (int world : {1, 2, 3, 4}) {
    withBackends(GetParam(), world, [&](int rank, Backend& backend) {
      for (DType dtype : kDTypes) {
        for (int64_t n : {0, 1, 1023}) {
          for (int root = 0; root < world; ++root) {
            const std::string what = str(toString(dtype), "[", n, "] world ", world, " root ", root);
            Tensor in = makeInput(dtype, ReduceOp::Sum, rank, n);
            std::vector<Tensor> outs;
            if (rank == root) {
              for (int r = 0; r < world; ++r) outs.push_back(dfull({n}, -99, dtype));
            }
            finish(backend.gather(outs, in, {.root = root}));
            for (int r = 0; r < static_cast<int>(outs.size()); ++r) {
              EXPECT_EQ(outs[r].toVector<double>(), makeInput(dtype, ReduceOp::Sum, r, n).toVector<double>())
                  << "gather " << what << " slot " << r;
            }
            // Scatter sends rank r the root's block r; blocks differ per destination.
            std::vector<Tensor> blocks;
            if (rank == root) {
              for (int r = 0; r < world; ++r) blocks.push_back(makeInput(dtype, ReduceOp::Sum, r + 7 * root, n));
            }
            Tensor got = dfull({n}, -99, dtype);
            finish(backend.scatter(got, blocks, {.root = root}));
            EXPECT_EQ(got.toVector<double>(), makeInput(dtype, ReduceOp::Sum, rank + 7 * root, n).toVector<double>())
                << "scatter " << what;
          }
        }
      }
    });
  }
}

TEST_P(BackendConformance, FlatAllgatherAndReduceScatterEveryDTypeAndOp) {
  for (int world : {1, 2, 3, 4}) {
    withBackends(GetParam(), world, [&](int rank, Backend& backend) {
      for (DType dtype : kDTypes) {
        for (int64_t n : {0, 1, 1023}) {
          // Gathered into a [world * n] buffer and into a strided [n, world] transpose.
          Tensor in = makeInput(dtype, ReduceOp::Sum, rank, n);
          Tensor flat = dfull({world * n}, -99, dtype);
          finish(backend.allgatherIntoTensor(flat, in));
          const bool strides = GetParam().unsupported.strided.empty();
          Tensor strided = dfull({n, world}, -99, dtype).transpose(0, 1);
          if (strides) finish(backend.allgatherIntoTensor(strided, in));
          for (int r = 0; r < world; ++r) {
            const auto want = makeInput(dtype, ReduceOp::Sum, r, n).toVector<double>();
            EXPECT_EQ(flat.narrow(0, r * n, n).toVector<double>(), want) << "allgatherIntoTensor " << toString(dtype);
            if (strides) {
              EXPECT_EQ(strided.select(0, r).toVector<double>(), want) << "allgatherIntoTensor strided " << toString(dtype);
            }
          }
          for (ReduceOp op : kOps) {
            // Block j of every rank's input goes to rank j (element index offset by j*n).
            std::vector<double> v(static_cast<size_t>(world * n));
            for (int64_t i = 0; i < world * n; ++i) v[i] = inputValue(op, rank, i);
            Tensor input = dfromVector<double>(v, {world, n}).to(dtype);
            Tensor out = dfull({n}, -99, dtype);
            finish(backend.reduceScatterTensor(out, input, {.reduceOp = op}));
            const auto got = out.toVector<double>();
            for (int64_t i = 0; i < n; ++i) {
              const double want = expectedValue(dtype, op, world, i + rank * n);
              if (got[i] != want) {
                ADD_FAILURE() << "reduceScatterTensor " << toString(dtype) << " " << toString(op) << " world " << world
                              << " element " << i << ": " << got[i] << " vs " << want;
                break;
              }
            }
          }
        }
      }
    });
  }
}

TEST_P(BackendConformance, AllToAllSingleEqualAndUnevenSplits) {
  for (int world : {1, 2, 3, 4}) {
    withBackends(GetParam(), world, [&](int rank, Backend& backend) {
      // Equal splits of 2 rows of 3: row values 100*from + 10*to + column.
      std::vector<double> v;
      for (int to = 0; to < world; ++to) {
        for (int row = 0; row < 2; ++row) {
          for (int c = 0; c < 3; ++c) v.push_back(100 * rank + 10 * to + c);
        }
      }
      Tensor in = dfromVector<double>(v, {2 * world, 3}).to(DType::Float32);
      Tensor out = dfull({2 * world, 3}, -1);
      finish(backend.allToAllSingle(out, in, {}, {}));
      std::vector<float> want;
      for (int from = 0; from < world; ++from) {
        for (int row = 0; row < 2; ++row) {
          for (int c = 0; c < 3; ++c) want.push_back(static_cast<float>(100 * from + 10 * rank + c));
        }
      }
      EXPECT_EQ(out.toVector<float>(), want) << "equal splits, world " << world;
      // Uneven: rank r sends (r + j) % 3 rows to rank j, a large one included.
      auto rows = [](int from, int to) { return int64_t((from + to) % 3) * (to == 0 ? 4096 : 1); };
      std::vector<int64_t> sendRows, recvRows;
      std::vector<Tensor> sendParts;
      int64_t recvTotal = 0;
      for (int j = 0; j < world; ++j) {
        sendRows.push_back(rows(rank, j));
        recvRows.push_back(rows(j, rank));
        recvTotal += recvRows.back();
        sendParts.push_back(dfull({rows(rank, j), 2}, 1000.0 * rank + j, DType::Int64));
      }
      Tensor unevenIn = cat(sendParts, 0);
      Tensor unevenOut = dfull({recvTotal, 2}, -1, DType::Int64);
      finish(backend.allToAllSingle(unevenOut, unevenIn, recvRows, sendRows));
      std::vector<int64_t> wantUneven;
      for (int i = 0; i < world; ++i) wantUneven.insert(wantUneven.end(), 2 * recvRows[i], 1000 * i + rank);
      EXPECT_EQ(unevenOut.toVector<int64_t>(), wantUneven) << "uneven splits, world " << world;
    });
  }
}

TEST_P(BackendConformance, BatchIsendIrecvPostsEverythingFirstAndRejectsBadBatchesWhole) {
  DT_SKIP_UNLESS(tags);
  withBackends(GetParam(), 3, [&](int rank, Backend& backend) {
    const int next = (rank + 1) % 3, prev = (rank + 2) % 3;
    // Every rank receives before it sends in its batch: one at a time this
    // would deadlock; posted together it cannot.
    Tensor fromPrev = dfull({5}, -1), fromNext = dfull({70000}, -1, DType::Float64);
    WorkPtr batch = backend.batchIsendIrecv({P2POp::recv({fromPrev}, prev, 1), P2POp::recv({fromNext}, next, 2),
                                             P2POp::send({dfull({5}, rank)}, next, 1),
                                             P2POp::send({dfull({70000}, 10.0 * rank, DType::Float64)}, prev, 2)});
    finish(batch);
    EXPECT_EQ(fromPrev.toVector<float>(), std::vector<float>(5, prev));
    EXPECT_EQ(fromNext.toVector<double>(), std::vector<double>(70000, 10.0 * next));
    // A bad op anywhere rejects the batch before anything is posted: the
    // next exchange on the same tag sees only the new values.
    expectThrowsWith<InvalidArgument>(
        [&] { backend.batchIsendIrecv({P2POp::send({dfull({5}, 99)}, next, 1), P2POp::recv({fromPrev}, rank, 1)}); },
        {"batchIsendIrecv", "op 1", "peer rank " + std::to_string(rank)});
    expectThrowsWith<InvalidArgument>([&] { backend.batchIsendIrecv({}); }, {"empty batch"});
    finish(backend.batchIsendIrecv({P2POp::send({dfull({5}, rank + 50)}, next, 1), P2POp::recv({fromPrev}, prev, 1)}));
    EXPECT_EQ(fromPrev.toVector<float>(), std::vector<float>(5, prev + 50));
  });
}

TEST_P(BackendConformance, MonitoredBarrierPassesAndNamesTheRanksThatDidNotArrive) {
  BackendTestOptions o;
  o.timeout = 20s;
  withBackends(GetParam(), 4, [&](int rank, Backend& backend) {
    for (int round = 0; round < 2; ++round) {
      if (rank == round + 1) std::this_thread::sleep_for(200ms);  // late, but within the timeout
      finish(backend.monitoredBarrier());
    }
    if (rank >= 2) {
      // Ranks 2 and 3 never come; stay alive until the others have given up.
      std::this_thread::sleep_for(3s);
      return;
    }
    auto work = backend.monitoredBarrier({.timeout = 1s});
    const std::string message = expectThrowsWith<TimeoutError>(
        [&] { finish(work); }, {"monitoredBarrier #3", "ranks 2 and 3 did not arrive within 1000 ms", "broken"});
    if (rank == 1) {
      EXPECT_NE(message.find("rank 0 reports"), std::string::npos) << message;
    }
    EXPECT_NE(backend.brokenCause(), nullptr);
    std::printf("rank %d: %s\n", rank, message.c_str());
  }, o);
}

TEST_P(BackendConformance, BadInputReadsAsTheCallersProblem) {
  withBackends(GetParam(), 2, [&](int rank, Backend& backend) {
    Tensor t = dzeros({3});
    auto expectUserError = [](const std::function<void()>& call, const std::vector<std::string>& parts) {
      const std::string message = expectThrowsWith<InvalidArgument>(call, parts);
      EXPECT_EQ(message.find("check failed"), std::string::npos) << message;
      EXPECT_EQ(message.find(".cpp:"), std::string::npos) << message;
    };
    expectUserError([&] { backend.reduce({t}, {.root = 2, .seq = 1}); },
                    {"reduce #1 (not issued): root 2 is not a rank of the group (size 2)"});
    expectUserError([&] { backend.gather({t, t}, t, {.root = 1 - rank}); }, {"gather", "only the root (rank"});
    expectUserError([&] { backend.scatter(t, {}, {.root = rank}); }, {"scatter", "one input tensor per rank"});
    expectUserError([&] { backend.allgatherIntoTensor(dzeros({5}), t); }, {"allgatherIntoTensor", "must hold 2 x 3"});
    expectUserError([&] { backend.reduceScatterTensor(t, dzeros({7})); }, {"reduceScatterTensor", "must hold 2 x 3"});
    expectUserError([&] { backend.allToAllSingle(dzeros({4, 2}), dzeros({4, 2}), {}, {1, 2}); },
                    {"allToAllSingle", "add up to 3 rows", "has 4"});
    expectUserError([&] { backend.allToAllSingle(dzeros({3}), dzeros({3}), {}, {}); }, {"cannot share equally"});
    finish(backend.allreduce({t}));  // still healthy
  });
}

TEST_P(BackendConformance, BarrierHoldsEveryRankUntilAllArrive) {
  std::atomic<int> arrived{0};
  withBackends(GetParam(), 4, [&](int rank, Backend& backend) {
    for (int round = 1; round <= 3; ++round) {
      if (rank == round) std::this_thread::sleep_for(100ms);  // a late rank each round
      arrived.fetch_add(1);
      finish(backend.barrier());
      EXPECT_GE(arrived.load(), 4 * round) << "rank " << rank << " left barrier " << round << " early";
      finish(backend.barrier());  // nobody starts the next round before all checked
    }
  });
}

TEST_P(BackendConformance, SendRecvWithTagsStridedAndLists) {
  DT_SKIP_UNLESS(tags);
  DT_SKIP_UNLESS(strided);
  withBackends(GetParam(), 3, [&](int rank, Backend& backend) {
    const int next = (rank + 1) % 3, prev = (rank + 2) % 3;
    // Two messages to the next rank with different tags, received in the
    // opposite order; plus a strided tensor and a list of two tensors.
    Tensor a = dfull({5}, 10.0 * rank + 1, DType::Float32);
    Tensor b = dfull({7}, 10.0 * rank + 2, DType::Int32);
    Tensor strided = dfromVector<double>({1, 2, 3, 4, 5, 6}, {2, 3}).to(DType::Float64).t();  // [3,2] view
    std::vector<Tensor> list = {dfull({2}, rank, DType::Int64), dfull({3}, rank + 100, DType::Int64)};
    SendOptions s1, s2, s3, s4;
    s1.tag = 1;
    s2.tag = 2;
    s3.tag = 3;
    s4.tag = 4;
    std::vector<WorkPtr> works = {backend.send({a}, next, s1), backend.send({b}, next, s2),
                                  backend.send({strided}, next, s3), backend.send(list, next, s4)};
    Tensor ra = dzeros({5}, DType::Float32), rb = dzeros({7}, DType::Int32);
    Tensor rs = dzeros({2, 3}, DType::Float64).t();
    std::vector<Tensor> rl = {dzeros({2}, DType::Int64), dzeros({3}, DType::Int64)};
    RecvOptions r1, r2, r3, r4;
    r1.tag = 1;
    r2.tag = 2;
    r3.tag = 3;
    r4.tag = 4;
    works.push_back(backend.recv({rb}, prev, r2));
    works.push_back(backend.recv({ra}, prev, r1));
    works.push_back(backend.recv(rl, prev, r4));
    works.push_back(backend.recv({rs}, prev, r3));
    waitAll(works);
    EXPECT_EQ(ra.toVector<float>(), std::vector<float>(5, 10.0f * prev + 1));
    EXPECT_EQ(rb.toVector<int32_t>(), std::vector<int32_t>(7, 10 * prev + 2));
    EXPECT_EQ(rs.toVector<double>(), strided.toVector<double>());
    EXPECT_EQ(rl[0].toVector<int64_t>(), std::vector<int64_t>(2, prev));
    EXPECT_EQ(rl[1].toVector<int64_t>(), std::vector<int64_t>(3, prev + 100));
  });
}

TEST_P(BackendConformance, NonContiguousMixedListsAndEmptyTensors) {
  DT_SKIP_UNLESS(strided);
  withBackends(GetParam(), 3, [&](int rank, Backend& backend) {
    Tensor base = dfromVector<double>({1, 2, 3, 4, 5, 6}, {2, 3}).to(DType::Float32);
    Tensor strided = (rank == 0 ? base : base.clone()).t();  // [3,2], non-contiguous
    Tensor ints = dfull({4}, rank + 1, DType::Int64);
    Tensor empty0 = dzeros({0, 5}, DType::Float16);
    Tensor halfs = dfull({3}, 0.5 * rank, DType::Float16);
    finish(backend.allreduce({strided, ints, empty0, halfs}));
    EXPECT_FALSE(strided.isContiguous());
    EXPECT_EQ(strided.toVector<float>(), (std::vector<float>{3, 12, 6, 15, 9, 18}));
    EXPECT_EQ(ints.toVector<int64_t>(), std::vector<int64_t>(4, 6));
    EXPECT_EQ(halfs.toVector<float>(), std::vector<float>(3, 1.5f));
    // Broadcast into a strided view.
    Tensor dst = dzeros({3, 2}, DType::Float64).t();
    if (rank == 1) dst.copy_(dfromVector<double>({7, 8, 9, 10, 11, 12}, {2, 3}));
    BroadcastOptions bo;
    bo.root = 1;
    finish(backend.broadcast({dst}, bo));
    EXPECT_EQ(dst.toVector<double>(), (std::vector<double>{7, 8, 9, 10, 11, 12}));
  });
}

TEST_P(BackendConformance, MixedSequenceIssuedWithoutWaiting) {
  withBackends(GetParam(), 4, [&](int rank, Backend& backend) {
    std::vector<WorkPtr> works;
    std::vector<std::function<void()>> checks;
    for (int step = 0; step < 40; ++step) {
      const int64_t n = 1 + (step * 37) % 300;
      switch (step % 5) {
        case 0: {
          Tensor t = makeInput(DType::Float32, ReduceOp::Sum, rank, n);
          works.push_back(backend.allreduce({t}));
          checks.push_back([=] { expectReduced(t, DType::Float32, ReduceOp::Sum, 4, str("step ", step)); });
          break;
        }
        case 1: {
          Tensor t = rank == step % 4 ? dfull({n}, step, DType::Int64) : dzeros({n}, DType::Int64);
          BroadcastOptions o;
          o.root = step % 4;
          works.push_back(backend.broadcast({t}, o));
          checks.push_back([=] { EXPECT_EQ(t.toVector<int64_t>(), std::vector<int64_t>(n, step)) << step; });
          break;
        }
        case 2: {
          Tensor in = dfull({n}, rank * 10 + step, DType::Int32);
          std::vector<Tensor> outs;
          for (int r = 0; r < 4; ++r) outs.push_back(dzeros({n}, DType::Int32));
          works.push_back(backend.allgather(outs, in));
          checks.push_back([=] {
            for (int r = 0; r < 4; ++r) EXPECT_EQ(outs[r].toVector<int32_t>(), std::vector<int32_t>(n, r * 10 + step));
          });
          break;
        }
        case 3: works.push_back(backend.barrier()); break;
        case 4: {
          Tensor t = makeInput(DType::BFloat16, ReduceOp::Min, rank, n);
          AllreduceOptions o;
          o.reduceOp = ReduceOp::Min;
          works.push_back(backend.allreduce({t}, o));
          checks.push_back([=] { expectReduced(t, DType::BFloat16, ReduceOp::Min, 4, str("step ", step)); });
          break;
        }
      }
    }
    // Completion follows issue order.
    for (size_t i = 0; i + 1 < works.size(); ++i) {
      finish(works[i + 1]);
      EXPECT_TRUE(works[i]->isCompleted()) << "op " << i << " completed after op " << i + 1;
    }
    for (auto& c : checks) c();
  });
}

TEST_P(BackendConformance, SeveralGroupsProgressIndependently) {
  // Per rank: a world group and a second group over the same ranks, driven
  // from two threads at once; plus, on ranks 1 and 3, a 2-rank subgroup.
  auto root = std::make_shared<HashStore>();
  const auto& factory = GetParam();
  if (const std::string reason = skipReason(factory, 4); !reason.empty()) GTEST_SKIP() << factory.name << ": " << reason;
  runRanks(4, [&](int rank) {
#if DT_HAVE_CUDA
    if (factory.device.isCuda()) {
      tRankDevice = Device::cuda(rank);
      cuda::setCurrentDevice(rank);
    }
#endif
    BackendTestOptions o;
    auto a = factory.make(std::make_shared<PrefixStore>("groups/a", root), rank, 4, o);
    auto b = factory.make(std::make_shared<PrefixStore>("groups/b", root), rank, 4, o);
    BackendPtr sub;
    if (rank == 1 || rank == 3) sub = factory.make(std::make_shared<PrefixStore>("groups/sub", root), rank / 2, 2, o);
    auto drive = [&](Backend& backend, int world, int seed) {
      for (int i = 0; i < 15; ++i) {
        Tensor t = dfull({257}, backend.rank() + seed + i, DType::Float64);
        finish(backend.allreduce({t}));
        const double want = world * (seed + i) + world * (world - 1) / 2.0;
        EXPECT_EQ(t.toVector<double>(), std::vector<double>(257, want)) << "seed " << seed << " iteration " << i;
      }
    };
    std::thread tb([&] { drive(*b, 4, 1000); });
    std::thread ts;
    if (sub) ts = std::thread([&] { drive(*sub, 2, 5000); });
    drive(*a, 4, 0);
    tb.join();
    if (ts.joinable()) ts.join();
    a->shutdown();
    b->shutdown();
    if (sub) sub->shutdown();
  });
}

TEST_P(BackendConformance, BadInputIsRejectedAtTheCall) {
  withBackends(GetParam(), 2, [&](int rank, Backend& backend) {
    Tensor t = dzeros({3});
    expectThrowsWith<InvalidArgument>([&] { backend.allgather({t}, t); }, {"allgather", "one output tensor per rank"});
    expectThrowsWith<InvalidArgument>([&] { backend.allgather({t, dzeros({4})}, t); }, {"does not match"});
    BroadcastOptions bo;
    bo.root = 5;
    expectThrowsWith<InvalidArgument>([&] { backend.broadcast({t}, bo); }, {"root 5"});
    expectThrowsWith<InvalidArgument>([&] { backend.send({t}, rank); }, {"peer rank"});
    AllreduceOptions ao;
    ao.reduceOp = ReduceOp::Avg;
    expectThrowsWith<InvalidArgument>([&] { backend.allreduce({dzeros({2}, DType::Bool)}, ao); }, {"avg", "bool"});
    // The group is still healthy afterwards.
    finish(backend.allreduce({t}));
  });
}

TEST_P(BackendConformance, TimeoutNamesWhoIsStuckAndBreaksTheGroup) {
  BackendTestOptions o;
  o.timeout = 2s;
  withBackends(GetParam(), 3, [&](int rank, Backend& backend) {
    Tensor t = dones({64});
    finish(backend.allreduce({t}));  // #1 on every rank
    if (rank == 2) {
      // Rank 2 never starts #2; wait until the others have given up.
      std::this_thread::sleep_for(4s);
      return;
    }
    const auto started = std::chrono::steady_clock::now();
    auto work = backend.allreduce({t});  // #2
    const std::string message =
        expectThrowsWith<TimeoutError>([&] { finish(work); }, {"allreduce", "#2", "timed out", "rank 2 never started #2",
                                                               "its last completed: #1"});
    EXPECT_LT(std::chrono::steady_clock::now() - started, 20s);
    EXPECT_TRUE(work->isCompleted());
    EXPECT_FALSE(work->isSuccess());
    EXPECT_NE(backend.brokenCause(), nullptr);
    // Later calls fail fast with the original cause.
    const auto t0 = std::chrono::steady_clock::now();
    auto later = backend.allreduce({t});
    expectThrowsWith<TimeoutError>([&] { finish(later); }, {"#3", "broken", "#2"});
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
    std::printf("rank %d: %s\n", rank, message.c_str());
  }, o);
}

// abort(cause): what an elastic job calls when it learns a member died. The
// op in flight, the op queued behind it and every later op fail with that
// cause, long before the group's timeout would end them (it is a minute here:
// the test would hang, not pass). Rank 2 plays a frozen member: it never
// starts #2 and holds its connections open until the others are done.
TEST_P(BackendConformance, AbortFailsInFlightQueuedAndLaterOpsWithItsCause) {
  BackendTestOptions o;
  o.timeout = 60s;
  std::atomic<int> done{0};
  withBackends(GetParam(), 3, [&](int rank, Backend& backend) {
    Tensor t = dones({64});
    finish(backend.allreduce({t}));  // #1 on every rank
    const auto cause = std::make_exception_ptr(MemberLostError("rank 2 exited: signal SIGKILL"));
    if (rank == 2) {
      while (done.load() < 2) std::this_thread::sleep_for(1ms);
      backend.abort(std::make_exception_ptr(BackendError("this rank is ending")));
      return;
    }
    auto stuck = backend.allreduce({t});   // #2: waits for rank 2
    auto queued = backend.broadcast({t});  // #3: behind it
    std::this_thread::sleep_for(50ms);     // let #2 start waiting
    backend.abort(cause);
    backend.abort(std::make_exception_ptr(BackendError("a second cause")));  // the first one wins
    expectThrowsWith<MemberLostError>([&] { finish(stuck); }, {"allreduce #2", "rank 2 exited: signal SIGKILL"});
    expectThrowsWith<MemberLostError>([&] { finish(queued); }, {"broadcast #3", "rank 2 exited: signal SIGKILL"});
    expectThrowsWith<MemberLostError>([&] { finish(backend.barrier()); }, {"rank 2 exited: signal SIGKILL"});
    EXPECT_NE(backend.brokenCause(), nullptr);
    ++done;
  }, o);
}

TEST_P(BackendConformance, DesyncDetectedOnEveryRankWithDetailChecks) {
  BackendTestOptions o;
  o.checkFingerprints = true;
  o.timeout = 20s;
  withBackends(GetParam(), 3, [&](int rank, Backend& backend) {
    Tensor t = dones({16});
    finish(backend.allreduce({t}));  // #1 agrees everywhere
    WorkPtr work;
    if (rank == 1) {
      BroadcastOptions bo;
      bo.root = 0;
      work = backend.broadcast({dzeros({4096})}, bo);
    } else {
      work = backend.allreduce({dzeros({1 << 10})});
    }
    const std::string message = expectThrowsWith<DesyncError>(
        [&] { finish(work); }, {"collective #2 mismatch", "broadcast(float32[4096], root 0)", "allreduce(float32[1024], sum)"});
    if (rank == 1) {
      EXPECT_NE(message.find("ranks 0 and 2 called allreduce"), std::string::npos) << message;
    } else {
      EXPECT_NE(message.find("rank 1 called broadcast"), std::string::npos) << message;
    }
  }, o);
}

}  // namespace
}  // namespace dt::testing
