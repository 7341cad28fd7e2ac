#include "process_group/process_group.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>

#include "common/check.h"
#include "common/config.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "store/prefix_store.h"

#include "common/logging.h"
#include "process_group/flight_recorder.h"
#include "process_group/shm/shm_backend.h"
#if DT_HAVE_GLOO
#include "process_group/gloo/gloo_backend.h"
#include "process_group/hierarchical_backend.h"
#endif
#if DT_HAVE_NCCL
#include "process_group/nccl/nccl_backend.h"
#include "tensor/cuda/cuda.h"
#endif

namespace dt {
namespace {

// The group's settings for any backend.
template <typename Options>
Options backendOptions(const ProcessGroupOptions& options, std::chrono::milliseconds timeout,
                       const std::vector<int>& parentRanks, int instance) {
  Options o;
  o.groupName = options.name;
  o.instance = instance;
  o.timeout = timeout;
  o.checkFingerprints = options.checkFingerprints;
  o.globalRanks = parentRanks;
  o.watchdogStore = options.watchdogStore;
  o.watchdogKey = options.watchdogKey;
  o.progressInterval = options.progressInterval;
  o.failureReportWindow = options.failureReportWindow;
  return o;
}

#if DT_HAVE_GLOO
GlooBackendOptions glooOptions(const ProcessGroupOptions& options, std::chrono::milliseconds timeout,
                               const std::vector<int>& parentRanks, int instance) {
  auto g = backendOptions<GlooBackendOptions>(options, timeout, parentRanks, instance);
  g.hostname = options.glooHostname.empty() ? "127.0.0.1" : options.glooHostname;
  return g;
}
#endif

// Every rank's host index (hosts numbered in order of first appearance).
std::vector<int> exchangeHosts(Store& store, int rank, int size, const std::string& hostId,
                               std::chrono::milliseconds timeout, std::vector<std::string>* names) {
  store.set(str("host/", rank), hostId.empty() ? localHostId() : hostId);
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(str("host/", r));
  store.wait(keys, timeout);
  *names = store.multiGet(keys);
  std::vector<int> hostOf(static_cast<size_t>(size));
  std::vector<std::string> seen;
  for (int r = 0; r < size; ++r) {
    auto it = std::find(seen.begin(), seen.end(), (*names)[r]);
    if (it == seen.end()) {
      seen.push_back((*names)[r]);
      it = seen.end() - 1;
    }
    hostOf[r] = static_cast<int>(it - seen.begin());
  }
  return hostOf;
}

// The CPU backend: shm when the group shares a host, gloo when every rank
// has a host of its own, shm within hosts + gloo across them otherwise;
// options.backend ("gloo", "shm") forces one.
BackendPtr makeCpuBackend(const StorePtr& store, int rank, int size, const ProcessGroupOptions& options,
                          std::chrono::milliseconds timeout, const std::vector<int>& parentRanks, int instance) {
  if (options.cpuBackendFactory) {
    BackendPtr made = options.cpuBackendFactory(BackendContext{store, rank, size, options.name, instance, timeout, parentRanks});
    if (!made || made->rank() != rank || made->size() != size) {
      throw InvalidArgument(str("process group ", options.name, " [rank ", rank, "/", size,
                                "]: cpuBackendFactory returned ",
                                made ? str("a backend of rank ", made->rank(), "/", made->size()) : std::string("null"),
                                "; it must return a backend of the group's rank and size"));
    }
    if (rank == 0 && size > 1) {
      logger("process_group")->info("process group {}: {} ranks, CPU collectives on {} (cpuBackendFactory)",
                                    options.name, size, made->name());
    }
    return made;
  }
  const std::string& forced = options.backend;
  std::vector<std::string> hostNames;
  std::vector<int> hostOf(static_cast<size_t>(size), 0);
  if (forced != "gloo" && size > 1) hostOf = exchangeHosts(*store, rank, size, options.hostId, timeout, &hostNames);
  const int hosts = *std::max_element(hostOf.begin(), hostOf.end()) + 1;
  std::string choice;
  if (forced == "gloo") {
    choice = "gloo";
  } else if (forced == "shm") {
    if (hosts > 1) {
      std::vector<int> elsewhere;
      for (int r = 0; r < size; ++r) {
        if (hostOf[r] != hostOf[0]) elsewhere.push_back(r);
      }
      throw InvalidArgument(str("process group ", options.name, ": backend shm needs every rank on one host, but ranks ",
                                formatRanges(elsewhere), " run on another host than rank 0 (", quoteBytes(hostNames[0]),
                                " vs ", quoteBytes(hostNames[elsewhere[0]]), "); use gloo or leave the backend unset"));
    }
    choice = "shm";
  } else {
    choice = hosts == 1 ? "shm" : hosts == size ? "gloo" : "shm+gloo";
  }
  if (rank == 0 && size > 1) {
    logger("process_group")->info("process group {}: {} ranks on {} host(s), CPU collectives on {}{}", options.name,
                                  size, hosts, choice, forced.empty() ? "" : " (requested)");
  }
  if (choice == "shm") return std::make_shared<ShmBackend>(store, rank, size, backendOptions<ShmBackendOptions>(options, timeout, parentRanks, instance));
#if DT_HAVE_GLOO
  if (choice == "gloo") return std::make_shared<GlooBackend>(store, rank, size, glooOptions(options, timeout, parentRanks, instance));
  return std::make_shared<HierarchicalBackend>(store, rank, size, hostOf, glooOptions(options, timeout, parentRanks, instance),
                                               backendOptions<ShmBackendOptions>(options, timeout, parentRanks, instance));
#else
  throw NotSupportedError(str("process group ", options.name, ": ", choice == "gloo" ? "backend gloo was requested" : "the group spans hosts",
                              ", which needs the gloo backend, and this dtrain was built without Gloo (DT_HAVE_GLOO=0); "
                              "rebuild with -DDT_USE_GLOO=ON (needs libgloo-dev)"));
#endif
}

// backend "nccl" puts barriers on NCCL too; CPU tensors still go to the CPU
// backend chosen by host layout, as with no backend named.
ProcessGroupOptions cpuOptions(ProcessGroupOptions options) {
  if (options.backend == "nccl") options.backend.clear();
  return options;
}

void checkBackendName(const ProcessGroupOptions& options) {
  const auto& backend = options.backend;
#if !DT_HAVE_NCCL
  if (backend == "nccl") {
    throw NotSupportedError(str("process group ", options.name,
                                ": backend nccl is not available in this build (DT_HAVE_NCCL=0); use gloo or shm, or "
                                "rebuild with -DDT_USE_CUDA=ON -DDT_USE_NCCL=ON"));
  }
#endif
  if (options.cpuBackendFactory && (backend == "gloo" || backend == "shm")) {
    throw InvalidArgument(str("process group ", options.name, ": backend ", backend,
                              " and a cpuBackendFactory both choose the CPU backend; set one of them"));
  }
  if (!backend.empty() && backend != "gloo" && backend != "shm" && backend != "nccl") {
    throw InvalidArgument(str("process group ", options.name, ": unknown backend ", quoteBytes(backend),
                              "; use gloo, shm or nccl (or leave it unset: shm within a host, gloo across hosts, "
                              "nccl for CUDA tensors)"));
  }
}

}  // namespace

std::string localHostId() {
  if (auto id = env::getRaw("DT_HOST_ID"); id && !id->empty()) return *id;
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  struct stat st {};
  const uint64_t netns = ::stat("/proc/self/ns/net", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
  return str(boot.empty() ? std::string("unknown-boot") : boot, "/netns:", netns);
}

std::shared_ptr<ProcessGroup> ProcessGroup::create(StorePtr store, int rank, int size, ProcessGroupOptions options) {
  DT_REQUIRE(store != nullptr, "ProcessGroup::create: store is null");
  DT_REQUIRE(size >= 1, "ProcessGroup::create: size must be >= 1, got ", size);
  DT_REQUIRE(rank >= 0 && rank < size, "ProcessGroup::create: rank ", rank, " is outside [0, ", size, ")");
  DT_REQUIRE(!options.name.empty() && options.name.find('/') == std::string::npos,
           "ProcessGroup::create: group name ", quoteBytes(options.name), " must be non-empty without '/'");
  // Every rank adds 1; creation k of this name sees values in
  // [k*size+1, (k+1)*size] because no rank can start creation k+1 before all
  // ranks have joined creation k (rendezvous needs them all).
  const int64_t arrival = store->add(str("pg/", options.name, "/instances"), 1);
  const int64_t instance = (arrival - 1) / size;
  auto scoped = std::make_shared<PrefixStore>(str("pg/", options.name, "/", instance), store);
  std::vector<int> ranks(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  std::shared_ptr<ProcessGroup> group(new ProcessGroup());
  group->store_ = scoped;
  group->rank_ = rank;
  group->size_ = size;
  group->options_ = std::move(options);
  group->timeout_ = group->options_.timeout.value_or(env::getDuration("DT_PG_TIMEOUT"));
  group->parentRanks_ = ranks;
  checkBackendName(group->options_);
  group->instance_ = static_cast<int>(instance);
  group->cpuBackend_ = makeCpuBackend(scoped, rank, size, cpuOptions(group->options_), group->timeout_, ranks, group->instance_);
  return group;
}

ProcessGroup::~ProcessGroup() { destroy(); }

uint64_t ProcessGroup::lastSeq() const { return seq_.load(std::memory_order_acquire); }

std::string ProcessGroup::who() const {
  return str("rank ", rank_, "/", size_, " pg=", options_.name);
}

void ProcessGroup::requireMember(const char* op) const {
  if (!isMember()) {
    throw InvalidArgument(str(op, " on process group ", options_.name, " (ranks ", formatRanges(parentRanks_),
                              " of its parent): this rank is not a member; only members may use the group"));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (destroyed_) throwDestroyed(op);
}

void ProcessGroup::throwDestroyed(const char* op) const {
  throw InvalidArgument(str(op, " on process group ", options_.name, " [", who(),
                            "]: the group was destroyed; create a new one"));
}

Backend& ProcessGroup::backendFor(const Device& device) { return *backendPtr("backendFor", device); }

BackendPtr ProcessGroup::backendPtr(const char* op, const Device& device) {
  if (device.isCpu() && isMember()) {
    // Every small op passes here: one lock, no more checks.
    std::lock_guard<std::mutex> lock(mutex_);
    if (destroyed_) throwDestroyed(op);
    return cpuBackend_;
  }
  requireMember(op);
  return ncclBackend(op, device);
}

BackendPtr ProcessGroup::ncclBackend([[maybe_unused]] const char* op, const Device& device) {
  if (options_.backend == "gloo" || options_.backend == "shm") {
    throw InvalidArgument(str("[", who(), "] tensors on ", device.str(), ": the group was created with backend ",
                              options_.backend, ", which takes CPU tensors only; move the tensors to the CPU, or "
                              "leave the backend unset (or \"nccl\") so that CUDA tensors go to NCCL"));
  }
#if DT_HAVE_NCCL
  if (cuda::deviceCount() == 0) {
    throw NotSupportedError(str("[", who(), "] tensors on ", device.str(), " need the nccl backend, which cannot run "
                                "here: ", cuda::unavailableReason()));
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (destroyed_) throwDestroyed(op);
    if (ncclBackend_) return ncclBackend_;
  }
  // Lazily: a CPU-only program never pays for it. Not collective (the
  // communicators are made by the first op on each device), but it talks to
  // the store, so not under mutex_: abort() must not wait for it.
  std::lock_guard<std::mutex> creating(ncclCreateMutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (destroyed_) throwDestroyed(op);
    if (ncclBackend_) return ncclBackend_;
  }
  NcclBackendOptions ncclOptions = backendOptions<NcclBackendOptions>(options_, timeout_, parentRanks_, instance_);
  ncclOptions.device = options_.device;
  BackendPtr made = std::make_shared<NcclBackend>(store_, rank_, size_, std::move(ncclOptions));
  bool destroyed;
  std::exception_ptr aborted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    destroyed = destroyed_;
    if (!destroyed) ncclBackend_ = made;
    aborted = abortCause_;
  }
  if (destroyed) {  // destroy() ran while it was being made
    made->shutdown();
    throwDestroyed(op);
  }
  // abort() before the first CUDA op: its "every later op fails" holds for CUDA ops too.
  if (aborted) made->abort(aborted);
  return made;
#else
  throw NotSupportedError(str("[", who(), "] tensors on ", device.str(),
                              " need the nccl backend, which this build does not have (DT_HAVE_NCCL=0); "
                              "move the tensors to the CPU or build with -DDT_USE_CUDA=ON -DDT_USE_NCCL=ON"));
#endif
}

template <typename Fn>
WorkPtr ProcessGroup::numbered(const char* op, const Device& device, uint64_t& seqField, std::vector<Tensor> result,
                               Fn&& call) {
  // Held across the call, so that issue order == sequence order when several
  // threads issue. The call may block (NCCL makes a device's communicator at
  // its first op, and waits for NCCL to enqueue): only the issue lock is held
  // meanwhile, never mutex_, which abort(), brokenCause() and destroy() take.
  std::lock_guard<std::mutex> issue(issueMutex_);
  const BackendPtr backend = backendPtr(op, device);  // alive even if destroy() runs meanwhile
  const uint64_t seq = seq_.load(std::memory_order_relaxed) + 1;
  seqField = seq;
  WorkPtr work;
  try {
    work = call(*backend);
  } catch (const InvalidArgument& e) {
    // The CPU backends already say "<op> #<seq> (not issued)"; others get it here.
    if (std::string(e.what()).find(" (not issued)") != std::string::npos) throw;
    throw InvalidArgument(str("[", who(), "] ", op, " #", seqField, " (not issued): ", e.what()));
  }
  seq_.store(seq, std::memory_order_release);
  work->setResult(std::move(result));
  return work;
}

namespace {
Device deviceOf(const Tensor& t) { return t.defined() ? t.device() : Device::cpu(); }
Device deviceOf(const std::vector<Tensor>& tensors) {
  return !tensors.empty() && tensors[0].defined() ? tensors[0].device() : Device::cpu();
}
}  // namespace

WorkPtr ProcessGroup::allreduce(const std::vector<Tensor>& tensors, AllreduceOptions options) {
  return numbered("allreduce", deviceOf(tensors), options.seq, tensors,
                  [&](Backend& b) { return b.allreduce(tensors, options); });
}

// The one-tensor forms build the list once and hand it to the Work as its
// result after the call (the list forms copy theirs). Built with (1, tensor),
// not {tensor}: an initializer list copies the tensor twice, and each copy is
// an atomic reference count update on a small op's path.
WorkPtr ProcessGroup::allreduce(const Tensor& tensor, AllreduceOptions options) {
  std::vector<Tensor> tensors(1, tensor);
  WorkPtr work = numbered("allreduce", deviceOf(tensor), options.seq, {},
                          [&](Backend& b) { return b.allreduce(tensors, options); });
  work->setResult(std::move(tensors));
  return work;
}

WorkPtr ProcessGroup::broadcast(const Tensor& tensor, BroadcastOptions options) {
  std::vector<Tensor> tensors(1, tensor);
  WorkPtr work = numbered("broadcast", deviceOf(tensor), options.seq, {},
                          [&](Backend& b) { return b.broadcast(tensors, options); });
  work->setResult(std::move(tensors));
  return work;
}

WorkPtr ProcessGroup::reduce(const Tensor& tensor, ReduceOptions options) {
  std::vector<Tensor> tensors(1, tensor);
  WorkPtr work = numbered("reduce", deviceOf(tensor), options.seq, {}, [&](Backend& b) { return b.reduce(tensors, options); });
  work->setResult(std::move(tensors));
  return work;
}

WorkPtr ProcessGroup::broadcast(const std::vector<Tensor>& tensors, BroadcastOptions options) {
  return numbered("broadcast", deviceOf(tensors), options.seq, tensors,
                  [&](Backend& b) { return b.broadcast(tensors, options); });
}

WorkPtr ProcessGroup::allgather(const std::vector<Tensor>& outputs, const Tensor& input, AllgatherOptions options) {
  return numbered("allgather", deviceOf(input), options.seq, outputs,
                  [&](Backend& b) { return b.allgather(outputs, input, options); });
}

WorkPtr ProcessGroup::reduceScatter(const Tensor& output, const std::vector<Tensor>& inputs,
                                    ReduceScatterOptions options) {
  return numbered("reduceScatter", deviceOf(output), options.seq, {output},
                  [&](Backend& b) { return b.reduceScatter(output, inputs, options); });
}

WorkPtr ProcessGroup::reduce(const std::vector<Tensor>& tensors, ReduceOptions options) {
  return numbered("reduce", deviceOf(tensors), options.seq, tensors, [&](Backend& b) { return b.reduce(tensors, options); });
}

WorkPtr ProcessGroup::barrier(BarrierOptions options) {
  // Any CUDA device routes to the one NCCL backend, which picks the device.
  const Device device = options_.backend == "nccl" ? Device::cuda(0) : Device::cpu();
  return numbered("barrier", device, options.seq, {}, [&](Backend& b) { return b.barrier(options); });
}

WorkPtr ProcessGroup::allToAll(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                               AllToAllOptions options) {
  return numbered("allToAll", deviceOf(inputs), options.seq, outputs,
                  [&](Backend& b) { return b.allToAll(outputs, inputs, options); });
}

WorkPtr ProcessGroup::gather(const std::vector<Tensor>& outputs, const Tensor& input, GatherOptions options) {
  return numbered("gather", deviceOf(input), options.seq, outputs,
                  [&](Backend& b) { return b.gather(outputs, input, options); });
}

WorkPtr ProcessGroup::scatter(const Tensor& output, const std::vector<Tensor>& inputs, ScatterOptions options) {
  return numbered("scatter", deviceOf(output), options.seq, {output},
                  [&](Backend& b) { return b.scatter(output, inputs, options); });
}

WorkPtr ProcessGroup::allgatherIntoTensor(const Tensor& output, const Tensor& input, AllgatherOptions options) {
  return numbered("allgatherIntoTensor", deviceOf(input), options.seq, {output},
                  [&](Backend& b) { return b.allgatherIntoTensor(output, input, options); });
}

WorkPtr ProcessGroup::reduceScatterTensor(const Tensor& output, const Tensor& input, ReduceScatterOptions options) {
  return numbered("reduceScatterTensor", deviceOf(output), options.seq, {output},
                  [&](Backend& b) { return b.reduceScatterTensor(output, input, options); });
}

WorkPtr ProcessGroup::allToAllSingle(const Tensor& output, const Tensor& input, const std::vector<int64_t>& outputSplits,
                                     const std::vector<int64_t>& inputSplits, AllToAllOptions options) {
  return numbered("allToAllSingle", deviceOf(input), options.seq, {output},
                  [&](Backend& b) { return b.allToAllSingle(output, input, outputSplits, inputSplits, options); });
}

WorkPtr ProcessGroup::monitoredBarrier(BarrierOptions options) {
  return numbered("monitoredBarrier", Device::cpu(), options.seq, {},
                  [&](Backend& b) { return b.monitoredBarrier(options); });
}

template <typename Fn>
WorkPtr ProcessGroup::recordedP2P(const char* op, const std::vector<Tensor>& tensors, int peer, Fn&& post) {
  if (!flight::enabled()) return post();
  // Point-to-point ops pass here on every backend; collectives are recorded by CollectiveRunner.
  const uint64_t id = flight::recordP2P(Work::internName(options_.name), instance_, rank_, size_,
                                        p2pSeq_.fetch_add(1, std::memory_order_relaxed) + 1, op, tensors, peer);
  WorkPtr work;
  try {
    work = post();
  } catch (...) {
    flight::finished(id, flight::State::Failed, flight::clockNs(0));
    throw;
  }
  work->thenInline([id](Work& done) {
    flight::finished(id, done.isSuccess() ? flight::State::Done : flight::State::Failed, flight::clockNs(0));
  });
  return work;
}

// Point-to-point ops take no issue lock (they are not numbered); each holds
// its backend for the call, which destroy() on another thread may outlast.
WorkPtr ProcessGroup::send(const std::vector<Tensor>& tensors, int dstRank, SendOptions options) {
  requireMember("send");
  return recordedP2P("send", tensors, dstRank,
                     [&] { return backendPtr("send", deviceOf(tensors))->send(tensors, dstRank, options); });
}

WorkPtr ProcessGroup::recv(const std::vector<Tensor>& tensors, int srcRank, RecvOptions options) {
  requireMember("recv");
  WorkPtr work = recordedP2P("recv", tensors, srcRank,
                             [&] { return backendPtr("recv", deviceOf(tensors))->recv(tensors, srcRank, options); });
  work->setResult(tensors);
  return work;
}

WorkPtr ProcessGroup::batchIsendIrecv(const std::vector<P2POp>& ops) {
  requireMember("batchIsendIrecv");
  WorkPtr work = recordedP2P("batchIsendIrecv", ops.empty() ? std::vector<Tensor>{} : ops[0].tensors,
                             ops.empty() ? -1 : ops[0].peer, [&] {
    return backendPtr("batchIsendIrecv", ops.empty() ? Device::cpu() : deviceOf(ops[0].tensors))->batchIsendIrecv(ops);
  });
  std::vector<Tensor> received;
  for (const auto& op : ops) {
    if (!op.isSend) received.insert(received.end(), op.tensors.begin(), op.tensors.end());
  }
  work->setResult(std::move(received));
  return work;
}

std::exception_ptr ProcessGroup::brokenCause() const {
  BackendPtr cpu, nccl;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    cpu = cpuBackend_;
    nccl = ncclBackend_;
  }
  if (std::exception_ptr cause = cpu ? cpu->brokenCause() : nullptr) return cause;
  return nccl ? nccl->brokenCause() : nullptr;
}

std::shared_ptr<ProcessGroup> ProcessGroup::newGroup(std::vector<int> ranks, ProcessGroupOptions options) {
  requireMember("newGroup");
  DT_REQUIRE(!ranks.empty(), "[", who(), "] newGroup: empty rank list");
  std::sort(ranks.begin(), ranks.end());
  DT_REQUIRE(std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end(), "[", who(),
           "] newGroup: duplicate ranks in ", join(ranks, ","));
  DT_REQUIRE(ranks.front() >= 0 && ranks.back() < size_, "[", who(), "] newGroup: ranks ", formatRanges(ranks),
           " must lie in [0, ", size_, ")");
  int index;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    index = ++subgroups_;
  }
  if (options.name == "default") options.name = str(options_.name, ".sub", index);
  if (!options.cpuBackendFactory && options.backend.empty()) options.cpuBackendFactory = options_.cpuBackendFactory;
  if (!options.timeout) options.timeout = timeout_;
  if (!options.checkFingerprints) options.checkFingerprints = options_.checkFingerprints;
  if (options.glooHostname.empty()) options.glooHostname = options_.glooHostname;
  if (options.backend.empty()) options.backend = options_.backend;
  if (options.hostId.empty()) options.hostId = options_.hostId;
  if (!options.device) options.device = options_.device;
  options.progressInterval = options_.progressInterval;
  std::shared_ptr<ProcessGroup> group(new ProcessGroup());
  group->options_ = std::move(options);
  group->timeout_ = *group->options_.timeout;
  group->parentRanks_ = ranks;
  group->size_ = static_cast<int>(ranks.size());
  const auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it == ranks.end()) return group;  // non-member handle
  group->rank_ = static_cast<int>(it - ranks.begin());
  group->store_ = std::make_shared<PrefixStore>(str("sub", index), store_);
  checkBackendName(group->options_);
  group->instance_ = instance_;  // "default.sub1" is unique within one creation of the parent
  group->cpuBackend_ = makeCpuBackend(group->store_, group->rank_, group->size_, cpuOptions(group->options_),
                                      group->timeout_, group->parentRanks_, group->instance_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::erase_if(children_, [](const std::weak_ptr<ProcessGroup>& c) { return c.expired(); });
    children_.push_back(group);
  }
  // Broken while the subgroup was being made: it is born broken, as abort() would have left it.
  if (std::exception_ptr cause = brokenCause()) group->abort(cause);
  return group;
}

// Neither abort() nor destroy() takes the issue lock: a call blocked in its
// backend holds it, and their purpose is to end such calls.
void ProcessGroup::abort(std::exception_ptr cause) {
  std::vector<std::shared_ptr<ProcessGroup>> children;
  BackendPtr cpu, nccl;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& weak : children_) {
      if (auto child = weak.lock()) children.push_back(std::move(child));
    }
    cpu = cpuBackend_;
    nccl = ncclBackend_;
    if (!abortCause_) abortCause_ = cause;
  }
  for (const auto& child : children) child->abort(cause);
  if (cpu) cpu->abort(cause);
  if (nccl) nccl->abort(cause);
}

void ProcessGroup::destroy() {
  BackendPtr cpu, nccl;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (destroyed_) return;
    destroyed_ = true;
    cpu = std::move(cpuBackend_);
    nccl = std::move(ncclBackend_);
  }
  if (nccl) nccl->shutdown();
  if (cpu) cpu->shutdown();
}

}  // namespace dt
