// What the NCCL backend does beyond the conformance suite: Work's device
// wait, the watchdog's timeout report, communicator rendezvous timeouts,
// ProcessGroup's routing of CUDA tensors, and the cases of issue 24's review
// (no context on cuda:0, an aborted op fails, shutdown during a creation,
// destroy() right after a device wait, allgather's two paths) and of issue
// 43's (a first-op barrier on each rank's own GPU). Their rules also run
// without a GPU in nccl_lifecycle_test. Built in every configuration: the
// Work and routing-error cases run everywhere; the others need NCCL and a
// GPU and skip with the reason otherwise.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/errors.h"
#include "process_group/process_group.h"
#include "process_group/work.h"
#include "store/hash_store.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"
#include "tests/testing/testing.h"
#if DT_HAVE_CUDA
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/stream.h"
#endif
#if DT_HAVE_NCCL
#include <cuda_runtime.h>

#include "process_group/nccl/nccl_backend.h"
#endif

namespace dt {
namespace {

using namespace std::chrono_literals;
using testing::expectThrowsWith;
using testing::runRanks;

// ---- Work's device wait (no GPU needed: the wait is a stand-in) -------------------------------

TEST(NcclWork, WaitWithoutTimeoutCallsTheDeviceWaitAndDoesNotBlock) {
  auto work = std::make_shared<Work>("allreduce #1 (test)");
  std::atomic<int> deviceWaits{0};
  work->setDeviceWait([&] { deviceWaits.fetch_add(1); });
  EXPECT_TRUE(work->hasDeviceWait());
  const auto t0 = std::chrono::steady_clock::now();
  work->wait();  // still running: only the caller's stream would wait
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  EXPECT_EQ(deviceWaits.load(), 1);
  EXPECT_FALSE(work->isCompleted());
  // wait(timeout) blocks the host as for any Work.
  expectThrowsWith<TimeoutError>([&] { work->wait(50ms); }, {"allreduce #1", "still running after 50 ms"});
  std::atomic<bool> calledBack{false};
  work->then([&](Work& w) { calledBack = w.isSuccess(); });
  auto future = work->future();
  Work::markCompleted(work);
  EXPECT_TRUE(work->isCompleted());
  work->wait();  // complete: nothing left to wait for on the device either
  EXPECT_EQ(deviceWaits.load(), 1);
  work->wait(1s);
  future.get();
  for (int i = 0; i < 200 && !calledBack; ++i) std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(calledBack.load());
}

TEST(NcclWork, WaitRethrowsAFailureInsteadOfWaitingOnTheDevice) {
  auto work = std::make_shared<Work>("broadcast #4 (test)");
  std::atomic<int> deviceWaits{0};
  work->setDeviceWait([&] { deviceWaits.fetch_add(1); });
  Work::markFailed(work, std::make_exception_ptr(BackendError("broadcast #4 failed: ncclRemoteError")));
  expectThrowsWith<BackendError>([&] { work->wait(); }, {"broadcast #4", "ncclRemoteError"});
  expectThrowsWith<BackendError>([&] { work->wait(1s); }, {"ncclRemoteError"});
  EXPECT_EQ(deviceWaits.load(), 0);
}

// ---- routing: the error a user gets where NCCL cannot run ----------------------------------------

TEST(NcclRouting, CudaTensorsWhereNcclCannotRunNameTheDeviceAndTheReason) {
#if DT_HAVE_NCCL
  if (cuda::deviceCount() > 0) GTEST_SKIP() << "this machine runs NCCL; ProcessGroupNccl.* covers routing there";
  const std::string reason = cuda::unavailableReason();
#else
  const std::string reason = "DT_HAVE_NCCL=0";
#endif
  auto pg = ProcessGroup::create(std::make_shared<HashStore>(), 0, 1);
  const std::string message =
      expectThrowsWith<NotSupportedError>([&] { pg->backendFor(Device::cuda(0)); }, {"cuda:0", "nccl", reason});
  EXPECT_NE(message.find("pg=default"), std::string::npos) << message;
  EXPECT_EQ(pg->backendFor(Device::cpu()).name(), "shm");  // CPU tensors are unaffected
  pg->destroy();
}

TEST(NcclRouting, BackendOptionNcclIsAcceptedWhereBuiltAndCpuTensorsStayOnTheCpuBackend) {
  auto store = std::make_shared<HashStore>();
  ProcessGroupOptions o;
  o.backend = "nccl";
  o.timeout = 30s;
#if DT_HAVE_NCCL
  // Creating the group touches no GPU (NCCL starts with the first CUDA op),
  // so this runs on a machine without one too.
  runRanks(2, [&](int rank) {
    auto pg = ProcessGroup::create(store, rank, 2, o);
    EXPECT_EQ(pg->backendFor(Device::cpu()).name(), "shm");
    Tensor t = full({4}, rank + 1);
    pg->allreduce(t)->wait();
    EXPECT_EQ(t.toVector<float>(), std::vector<float>(4, 3));
    pg->destroy();
  });
#else
  expectThrowsWith<NotSupportedError>([&] { ProcessGroup::create(store, 0, 1, o); },
                                      {"backend nccl", "DT_HAVE_NCCL=0", "DT_USE_NCCL=ON"});
#endif
}

TEST(NcclRouting, CpuBackendOptionsRejectCudaTensorsSayingWhy) {
  ProcessGroupOptions o;
  o.backend = "shm";
  auto pg = ProcessGroup::create(std::make_shared<HashStore>(), 0, 1, o);
  expectThrowsWith<InvalidArgument>([&] { pg->backendFor(Device::cuda(0)); }, {"cuda:0", "backend shm", "CPU tensors"});
  pg->destroy();
}

#if DT_HAVE_NCCL

// "" when this machine can run NCCL on `gpus` GPUs, else why not.
std::string gpuSkipReason(int gpus = 1) {
  const int devices = cuda::deviceCount();
  if (devices == 0) return "needs a CUDA device: " + cuda::unavailableReason();
  if (devices < gpus) {
    return "needs " + std::to_string(gpus) + " GPUs: NCCL 2.28 rejects two ranks on one GPU; this machine has " +
           std::to_string(devices);
  }
  return "";
}

// ---- NcclBackend without a GPU: the checks at the call ------------------------------------------

NcclBackendOptions fastOptions(const std::string& group, std::chrono::milliseconds timeout = 30s) {
  NcclBackendOptions o;
  o.groupName = group;
  o.timeout = timeout;
  o.progressInterval = 100ms;
  o.failureReportWindow = 1000ms;
  return o;
}

TEST(NcclBackend, RejectsWhatNcclCannotTakeAtTheCallWithoutAGpu) {
  // Construction is not collective and touches no GPU; the checks come
  // before any communicator exists.
  NcclBackend backend(std::make_shared<HashStore>(), 0, 2, fastOptions("checks"));
  EXPECT_EQ(backend.name(), "nccl");
  Tensor cpu = zeros({3});
  expectThrowsWith<InvalidArgument>([&] { backend.allreduce({cpu}, {.seq = 5}); },
                                    {"[rank 0/2 pg=checks nccl] allreduce #5 (not issued)", "takes CUDA tensors",
                                     "tensor 0 float32[3] on cpu"});
  expectThrowsWith<InvalidArgument>([&] { backend.allreduce({}); }, {"allreduce", "empty tensor list"});
  expectThrowsWith<InvalidArgument>([&] { backend.broadcast({cpu}, {.root = 3}); }, {"broadcast", "root 3"});
  expectThrowsWith<InvalidArgument>([&] { backend.send({cpu}, 0); }, {"send", "on cpu"});
  expectThrowsWith<InvalidArgument>([&] { backend.allgather({cpu}, cpu); }, {"allgather", "on cpu"});
  EXPECT_EQ(backend.brokenCause(), nullptr);  // bad input breaks nothing
  backend.shutdown();
  backend.shutdown();  // idempotent
  // A barrier's device (issue 43, item 3) comes from the options first: a CPU one is refused in
  // one line naming rank, group, op and seq, before any CUDA call.
  NcclBackendOptions onCpu = fastOptions("bound");
  onCpu.device = Device::cpu();
  NcclBackend bound(std::make_shared<HashStore>(), 1, 2, onCpu);
  expectThrowsWith<InvalidArgument>([&] { bound.barrier({.seq = 7}); },
                                    {"[rank 1/2 pg=bound nccl] barrier #7 (not issued)",
                                     "NcclBackendOptions::device is cpu", "Device::cuda(i)"});
  bound.shutdown();
}

// ---- with a GPU --------------------------------------------------------------------------------

#define DT_NEED_GPUS(n)                                                         \
  do {                                                                          \
    if (const std::string why = gpuSkipReason(n); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

TEST(NcclBackend, WorkWaitOrdersTheCallersStreamAndTheHostSeesCompletion) {
  DT_NEED_GPUS(1);
  NcclBackend backend(std::make_shared<HashStore>(), 0, 1, fastOptions("work"));
  Tensor t = full({1 << 20}, 3.0, DType::Float32, Device::cuda(0));
  auto work = backend.allreduce({t}, {.reduceOp = ReduceOp::Avg});
  EXPECT_TRUE(work->hasDeviceWait());
  std::atomic<bool> calledBack{false};
  work->then([&](Work& w) { calledBack = w.isSuccess(); });
  work->wait();  // the default stream now waits for the op; the copy below runs after it
  EXPECT_EQ(t.toVector<float>(), std::vector<float>(1 << 20, 3.0f));
  work->wait(60s);  // the host: the watchdog completes the Work once the event has
  EXPECT_TRUE(work->isCompleted());
  EXPECT_TRUE(work->isSuccess());
  for (int i = 0; i < 200 && !calledBack; ++i) std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(calledBack.load());
  // Bad input on a GPU: dtype, layout, devices.
  expectThrowsWith<InvalidArgument>(
      [&] { backend.allreduce({zeros({2}, DType::Bool, Device::cuda(0))}, {.reduceOp = ReduceOp::Max}); },
      {"allreduce", "bool", "max"});
  Tensor strided = zeros({4, 3}, DType::Float32, Device::cuda(0)).t();
  expectThrowsWith<InvalidArgument>([&] { backend.broadcast({strided}); }, {"broadcast", "not contiguous"});
  EXPECT_EQ(backend.brokenCause(), nullptr);
  backend.barrier()->wait();  // host-blocking
  backend.shutdown();
}

// allgather is one ncclAllGather (finding 6 of issue 24): into the outputs themselves when they
// are consecutive blocks of one buffer, else into a staging buffer copied out after the op. Both
// paths, and outputs read right after wait() on the caller's stream.
TEST(NcclBackend, AllgatherFillsSeparateOutputsAndViewsOfOneBufferAlike) {
  DT_NEED_GPUS(1);
  const int world = std::min(cuda::deviceCount(), 2);
  auto store = std::make_shared<HashStore>();
  runRanks(world, [&](int rank) {
    cuda::setCurrentDevice(rank);
    const Device gpu = Device::cuda(rank);
    NcclBackend backend(store, rank, world, fastOptions("allgather"));
    constexpr int64_t n = 100003;
    Tensor input = add(arange(n, TensorOptions().dtype(DType::Float32)), rank * 1e6).to(gpu);
    std::vector<Tensor> separate;
    for (int r = 0; r < world; ++r) separate.push_back(full({n}, -1.0, DType::Float32, gpu));
    Tensor flat = full({world * n}, -1.0, DType::Float32, gpu);
    std::vector<Tensor> views;
    for (int r = 0; r < world; ++r) views.push_back(flat.slice(0, r * n, (r + 1) * n));
    backend.allgather(separate, input)->wait();
    backend.allgather(views, input)->wait();
    for (int r = 0; r < world; ++r) {
      const std::vector<float> want = add(arange(n, TensorOptions().dtype(DType::Float32)), r * 1e6).toVector<float>();
      EXPECT_EQ(separate[r].toVector<float>(), want) << "separate output " << r;
      EXPECT_EQ(views[r].toVector<float>(), want) << "view " << r << " of one buffer";
    }
    backend.shutdown();
  });
}

// Each rank's batch receives before it sends: launched op by op on one
// stream every rank would wait in its recv; as one NCCL group it completes.
TEST(NcclBackend, BatchIsendIrecvRecvsFirstInARingWithoutDeadlock) {
  DT_NEED_GPUS(2);
  const int world = std::min(cuda::deviceCount(), 3);
  auto store = std::make_shared<HashStore>();
  runRanks(world, [&](int rank) {
    cuda::setCurrentDevice(rank);
    const Device device = Device::cuda(rank);
    NcclBackend backend(store, rank, world, fastOptions("ring"));
    const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
    Tensor fromPrev = full({1000}, -1.0, DType::Float32, device);
    Tensor mine = full({1000}, rank, DType::Float32, device);
    WorkPtr batch = backend.batchIsendIrecv({P2POp::recv({fromPrev}, prev), P2POp::send({mine}, next)});
    batch->wait(60s);
    EXPECT_TRUE(batch->isSuccess());
    EXPECT_EQ(fromPrev.toVector<float>(), std::vector<float>(1000, static_cast<float>(prev)));
    expectThrowsWith<InvalidArgument>([&] { backend.batchIsendIrecv({P2POp::send({mine}, next, 7)}); },
                                      {"batchIsendIrecv", "tag 7"});
    backend.shutdown();
  });
}

// A host function on the caller's stream holds it (and so the NCCL stream,
// which waits for it) until released: the op cannot complete, as if a peer
// never joined.
void CUDART_CB holdStream(void* arg) {
  auto* released = static_cast<std::atomic<bool>*>(arg);
  while (!released->load()) std::this_thread::sleep_for(1ms);
}

TEST(NcclBackend, WatchdogTimesOutAStuckOpNamingGroupOpAndSequenceNumber) {
  DT_NEED_GPUS(1);
  NcclBackend backend(std::make_shared<HashStore>(), 0, 1, fastOptions("stuck", 1s));
  Tensor t = ones({1024}, DType::Float32, Device::cuda(0));
  backend.allreduce({t}, {.seq = 6})->wait(60s);  // creates the communicator before the stream is held
  cuda::Stream user = cuda::Stream::create(Device::cuda(0));
  cuda::StreamGuard guard(user);
  // Static: the host function may read it after this test returned.
  static std::atomic<bool> released{false};
  ASSERT_EQ(cudaLaunchHostFunc(static_cast<cudaStream_t>(user.handle()), holdStream, &released), cudaSuccess);
  // Released well after the timeout: an abort that waits for the stream must not hang the test.
  std::thread releaser([&] {
    std::this_thread::sleep_for(4s);
    released = true;
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto work = backend.allreduce({t}, {.seq = 7});
  const std::string message = expectThrowsWith<TimeoutError>(
      [&] { work->wait(60s); }, {"[rank 0/1 pg=stuck nccl] allreduce #7", "float32[1024]", "timed out after 1000 ms",
                                 "NCCL reports no error", "broken"});
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
  EXPECT_NE(backend.brokenCause(), nullptr);
  // Later ops fail at once with the cause, on the host and for wait().
  auto later = backend.allreduce({t}, {.seq = 8});
  expectThrowsWith<TimeoutError>([&] { later->wait(); }, {"allreduce #8", "broken", "#7"});
  releaser.join();
  // The op queued behind the held stream starts on an aborted communicator
  // once released; CUDA may report that as a sticky error, so this process
  // (ctest runs each test in its own) touches the GPU no more.
  backend.shutdown();
  std::printf("%s\n", message.c_str());
}

// Finding 2 of issue 24 on GPUs: rank 0's allreduce runs on the GPU waiting for rank 1, which
// never joins it; rank 0's recv from rank 1 (never sent) times out and aborts the communicator.
// The abort ends the allreduce's kernel early, so its completion event fires: the op must fail,
// not pass as a success with a half-reduced buffer.
TEST(NcclBackend, AnOpAbortedFromElsewhereFailsAlthoughItsEventFires) {
  DT_NEED_GPUS(2);
  auto store = std::make_shared<HashStore>();
  runRanks(2, [&](int rank) {
    cuda::setCurrentDevice(rank);
    const Device gpu = Device::cuda(rank);
    NcclBackend backend(store, rank, 2, fastOptions("abort-elsewhere"));
    Tensor t = full({1 << 20}, rank + 1, DType::Float32, gpu);
    backend.allreduce({t})->wait(60s);  // both ranks: the communicator exists, the ring is connected
    if (rank == 0) {
      auto running = backend.allreduce({t}, {.timeout = 60s});
      Tensor never = zeros({16}, DType::Float32, gpu);
      auto recv = backend.recv({never}, 1, {.timeout = 1s});
      EXPECT_THROW(recv->wait(60s), Error);
      const auto t0 = std::chrono::steady_clock::now();
      EXPECT_THROW(running->wait(60s), Error);
      EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
      EXPECT_FALSE(running->isSuccess()) << "an op cut short by an abort passed as a success";
      EXPECT_NE(backend.brokenCause(), nullptr);
      store->set("abort-elsewhere/done", "1");
    } else {
      store->get("abort-elsewhere/done", 60s);
    }
    backend.shutdown();
  });
}

// A rank on cuda:1 (rank 1 of a host): the runner's worker that watches its ops, the callback
// threads, the watchdog's abort and the p2p thread all make CUDA calls on threads that never
// chose a device; none may open a context on cuda:0 (GPU 0 would lose memory to every rank).
// ctest runs each test in its own process, so nothing else touched cuda:0 here.
TEST(NcclBackend, ARankOnCuda1OpensNoContextOnCuda0FromAnyOfItsThreads) {
  DT_NEED_GPUS(2);
  ASSERT_FALSE(cuda::primaryContextActive(0)) << "cuda:0 had a context before the test started";
  cuda::setCurrentDevice(1);
  const Device gpu = Device::cuda(1);
  {
    NcclBackend backend(std::make_shared<HashStore>(), 0, 1, fastOptions("ctx"));
    Tensor t = full({1 << 16}, 2.0, DType::Float32, gpu);
    std::atomic<bool> calledBack{false};
    auto work = backend.allreduce({t});
    work->then([&](Work& w) { calledBack = w.isSuccess(); });
    work->wait(60s);
    backend.barrier()->wait();
    for (int i = 0; i < 200 && !calledBack; ++i) std::this_thread::sleep_for(5ms);
    EXPECT_TRUE(calledBack.load());
    backend.shutdown();
  }
  if (cuda::deviceCount() >= 3) {
    // Two ranks on cuda:1 and cuda:2 exchange through send/recv (the p2p thread).
    auto store = std::make_shared<HashStore>();
    runRanks(2, [&](int rank) {
      cuda::setCurrentDevice(rank + 1);
      NcclBackend backend(store, rank, 2, fastOptions("ctx-p2p"));
      Tensor t = full({256}, rank, DType::Float32, Device::cuda(rank + 1));
      auto w = rank == 0 ? backend.send({t}, 1) : backend.recv({t}, 0);
      w->wait(60s);
      backend.shutdown();
    });
  }
  {
    // The watchdog aborts the communicator from the runner's worker (a deadline passes). Last:
    // the op held behind the stream starts on an aborted communicator once released.
    // 5 s: room for NCCL's initialisation, which the group timeout bounds too.
    NcclBackend backend(std::make_shared<HashStore>(), 0, 1, fastOptions("ctx-abort", 5s));
    Tensor t = ones({1024}, DType::Float32, gpu);
    backend.allreduce({t})->wait(60s);
    cuda::Stream user = cuda::Stream::create(gpu);
    cuda::StreamGuard guard(user);
    static std::atomic<bool> released{false};
    ASSERT_EQ(cudaLaunchHostFunc(static_cast<cudaStream_t>(user.handle()), holdStream, &released), cudaSuccess);
    std::thread releaser([&] {
      std::this_thread::sleep_for(8s);
      released = true;
    });
    auto stuck = backend.allreduce({t});
    EXPECT_THROW(stuck->wait(60s), TimeoutError);
    releaser.join();
    backend.shutdown();
  }
  EXPECT_FALSE(cuda::primaryContextActive(0)) << "a CUDA call for cuda:1 opened a context on cuda:0";
}

TEST(NcclBackend, CommunicatorRendezvousTimeoutNamesTheRanksThatNeverArrived) {
  DT_NEED_GPUS(1);
  // Rank 0 of a group of 3 whose ranks 1 and 2 never come.
  auto store = std::make_shared<HashStore>();
  NcclBackend backend(store, 0, 3, fastOptions("lonely", 2s));
  Tensor t = ones({8}, DType::Float32, Device::cuda(0));
  const auto t0 = std::chrono::steady_clock::now();
  expectThrowsWith<TimeoutError>([&] { backend.allreduce({t}); },
                                 {"pg=lonely nccl", "creating NCCL communicator #0", "cuda:0", "timed out after 2000 ms",
                                  "ranks 1-2 never started to join"});
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  EXPECT_NE(backend.brokenCause(), nullptr);
  backend.shutdown();
  // Rank 1 of a group whose rank 0 never comes waits for the ncclUniqueId.
  NcclBackend other(std::make_shared<HashStore>(), 1, 2, fastOptions("orphan", 1s));
  expectThrowsWith<TimeoutError>([&] { other.allreduce({t}); },
                                 {"waiting for rank 0's ncclUniqueId", "rank 0 never started to join"});
  other.shutdown();
}

// Finding 4 of issue 24 on a GPU: rank 0 of a group of 2 whose rank 1 never comes is inside
// NCCL's (nonblocking) initialisation with a 60 s timeout when shutdown() aborts; the abort must
// get through at once (it needed the lock held across the whole initialisation before) and the
// creation must give up instead of running out its timeout.
TEST(NcclBackend, ShutdownGetsThroughWhileACommunicatorIsBeingCreated) {
  DT_NEED_GPUS(1);
  auto store = std::make_shared<HashStore>();
  NcclBackend backend(store, 0, 2, fastOptions("creating", 60s));
  Tensor t = ones({8}, DType::Float32, Device::cuda(0));
  std::string error;
  std::thread issuer([&] {
    try {
      backend.allreduce({t})->wait(120s);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  store->wait({"nccl/comm/0/id"}, 30s);  // rank 0 published the id: its initialisation has begun
  std::this_thread::sleep_for(500ms);
  const auto t0 = std::chrono::steady_clock::now();
  backend.shutdown();
  issuer.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  // The op fails with the creation's "given up", or with "shut down" when the runner's shutdown
  // got there first; either way it did not wait out its 60 s.
  EXPECT_TRUE(error.find("given up") != std::string::npos || error.find("shut down") != std::string::npos) << error;
}

// Issue 43, item 3: a barrier as a group's first NCCL op, issued from threads that never chose a
// device (init, then barrier). It took cudaGetDevice()'s default, cuda:0, on every rank, and NCCL
// refused the duplicate GPU. Now rank r takes cuda:LOCAL_RANK (read when the backend is made; set
// here one rank at a time, as dtrun sets it per process), or the options' device; the allreduce
// after it reuses the barrier's communicator, which it could not if that were on another GPU.
TEST(NcclBackend, AFirstOpBarrierOnThreadsWithoutADeviceTakesEachRanksOwnGpu) {
  DT_NEED_GPUS(2);
  auto store = std::make_shared<HashStore>();
  std::vector<std::unique_ptr<NcclBackend>> backends;
  for (int rank = 0; rank < 2; ++rank) {
    testing::ScopedEnv localRank("LOCAL_RANK", std::to_string(rank));
    backends.push_back(std::make_unique<NcclBackend>(store, rank, 2, fastOptions("first-barrier")));
  }
  auto boundStore = std::make_shared<HashStore>();  // a second group: its own rendezvous keys
  std::vector<NcclBackendOptions> bound(2, fastOptions("first-barrier-bound"));
  for (int rank = 0; rank < 2; ++rank) bound[rank].device = Device::cuda(rank);
  runRanks(2, [&](int rank) {
    backends[rank]->barrier({.seq = 1})->wait(60s);
    Tensor t = full({64}, rank + 1, DType::Float32, Device::cuda(rank));
    backends[rank]->allreduce({t}, {.seq = 2})->wait(60s);
    EXPECT_EQ(t.toVector<float>(), std::vector<float>(64, 3.0f));
    backends[rank]->shutdown();
    NcclBackend withDevice(boundStore, rank, 2, bound[rank]);
    withDevice.barrier()->wait(60s);
    withDevice.shutdown();
  });
}

// With no hint at all (no LOCAL_RANK, no op yet, no device chosen, cuda:0 unused) at world 2 the
// barrier is refused in one line instead of reaching NCCL on cuda:0.
TEST(NcclBackend, AFirstOpBarrierWithNoKnownDeviceIsRefusedWithAHint) {
  DT_NEED_GPUS(1);
  if (cuda::primaryContextActive(0)) GTEST_SKIP() << "cuda:0 already has a context in this process (run alone)";
  testing::ScopedEnv localRank("LOCAL_RANK", "");
  testing::ScopedEnv slurmLocalId("SLURM_LOCALID", "");
  NcclBackend backend(std::make_shared<HashStore>(), 1, 2, fastOptions("no-device"));
  std::thread fresh([&] {
    expectThrowsWith<InvalidArgument>([&] { backend.barrier({.seq = 3}); },
                                      {"[rank 1/2 pg=no-device nccl] barrier #3 (not issued)",
                                       "no CUDA device is known", "LOCAL_RANK is unset", "setCurrentDevice"});
  });
  fresh.join();
  EXPECT_EQ(backend.brokenCause(), nullptr);
  EXPECT_FALSE(cuda::primaryContextActive(0)) << "refusing opened a context on cuda:0";
  backend.shutdown();
}

TEST(ProcessGroupNccl, RoutesCudaTensorsToNcclAndCpuTensorsToTheCpuBackend) {
  DT_NEED_GPUS(1);
  ProcessGroupOptions o;
  o.backend = "nccl";
  o.timeout = 60s;
  auto pg = ProcessGroup::create(std::make_shared<HashStore>(), 0, 1, o);
  EXPECT_EQ(pg->backendFor(Device::cuda(0)).name(), "nccl");
  EXPECT_EQ(pg->backendFor(Device::cpu()).name(), "shm");
  Tensor gpu = full({16}, 2.0, DType::Float32, Device::cuda(0));
  Tensor cpu = full({16}, 5.0);
  auto a = pg->allreduce(gpu);
  auto b = pg->allreduce(cpu);
  a->wait();
  b->wait();
  EXPECT_EQ(gpu.toVector<float>(), std::vector<float>(16, 2.0f));
  EXPECT_EQ(cpu.toVector<float>(), std::vector<float>(16, 5.0f));
  EXPECT_EQ(pg->lastSeq(), 2u);  // one numbering across both backends
  EXPECT_EQ(a->result().size(), 1u);
  pg->barrier()->wait();  // backend "nccl": on the GPU, host-blocking
  EXPECT_EQ(pg->lastSeq(), 3u);
  EXPECT_FALSE(pg->isBroken());
  pg->destroy();
}

// Finding 3 of issue 24 on GPUs: wait() only orders the caller's stream, so destroy() right after
// it is legal with the op still running; it must finish the op (and flush NCCL's proxy) and
// finalize, not abort: the tensor holds the full result and the Work reads as a success.
TEST(ProcessGroupNccl, DestroyRightAfterADeviceWaitFinishesTheOpInsteadOfAbortingIt) {
  DT_NEED_GPUS(1);
  const int world = std::min(cuda::deviceCount(), 2);
  auto store = std::make_shared<HashStore>();
  runRanks(world, [&](int rank) {
    cuda::setCurrentDevice(rank);
    ProcessGroupOptions o;
    o.backend = "nccl";
    o.timeout = 60s;
    auto pg = ProcessGroup::create(store, rank, world, o);
    const Device gpu = Device::cuda(rank);
    pg->allreduce(full({16}, 1.0, DType::Float32, gpu))->wait(60s);  // the communicator exists
    constexpr int64_t n = int64_t{1} << 26;  // 256 MiB: still on the wire when destroy() begins
    Tensor t = full({n}, rank + 1, DType::Float32, gpu);
    WorkPtr work = pg->allreduce(t);
    work->wait();
    pg->destroy();
    EXPECT_TRUE(work->isCompleted());
    EXPECT_TRUE(work->isSuccess()) << "shut down with the op in flight";
    const float expected = static_cast<float>(world * (world + 1) / 2);
    const std::vector<float> host = t.toVector<float>();
    int wrong = 0;
    for (int64_t i = 0; i < n; i += 4093) wrong += host[static_cast<size_t>(i)] != expected;
    wrong += host.back() != expected;
    EXPECT_EQ(wrong, 0) << "the allreduce was cut short by destroy()";
  });
}

#endif  // DT_HAVE_NCCL

}  // namespace
}  // namespace dt
