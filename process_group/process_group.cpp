#include "process_group/process_group.h"

#include <algorithm>

#include "common/check.h"
#include "common/config.h"
#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "store/prefix_store.h"

#if DT_HAVE_GLOO
#include "process_group/gloo/gloo_backend.h"
#endif

namespace dt {
namespace {

BackendPtr makeGloo(const StorePtr& store, int rank, int size, const ProcessGroupOptions& options,
                    std::chrono::milliseconds timeout, const std::vector<int>& parentRanks) {
#if DT_HAVE_GLOO
  GlooBackendOptions g;
  g.groupName = options.name;
  g.timeout = timeout;
  g.hostname = options.glooHostname.empty() ? "127.0.0.1" : options.glooHostname;
  g.checkFingerprints = options.checkFingerprints;
  g.globalRanks = parentRanks;
  g.watchdogStore = options.watchdogStore;
  g.watchdogKey = options.watchdogKey;
  g.progressInterval = options.progressInterval;
  return std::make_shared<GlooBackend>(store, rank, size, std::move(g));
#else
  (void)store, (void)rank, (void)size, (void)options, (void)timeout, (void)parentRanks;
  throw NotSupportedError(str("process group ", options.name,
                              ": this dtrain was built without Gloo (DT_HAVE_GLOO=0), so CPU tensors have no "
                              "backend; rebuild with -DDT_USE_GLOO=ON (needs libgloo-dev)"));
#endif
}

}  // namespace

std::shared_ptr<ProcessGroup> ProcessGroup::create(StorePtr store, int rank, int size, ProcessGroupOptions options) {
  DT_CHECK(store != nullptr, "ProcessGroup::create: store is null");
  DT_CHECK(size >= 1, "ProcessGroup::create: size must be >= 1, got ", size);
  DT_CHECK(rank >= 0 && rank < size, "ProcessGroup::create: rank ", rank, " is outside [0, ", size, ")");
  DT_CHECK(!options.name.empty() && options.name.find('/') == std::string::npos,
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
  const auto& backend = group->options_.backend;
  if (backend == "nccl") {
    throw NotSupportedError(str("process group ", group->options_.name,
                                ": backend nccl is not available in this build (DT_HAVE_NCCL=0); use gloo"));
  }
  DT_CHECK(backend.empty() || backend == "gloo", "process group ", group->options_.name, ": unknown backend ",
           quoteBytes(backend), "; use gloo or nccl");
  group->cpuBackend_ = makeGloo(scoped, rank, size, group->options_, group->timeout_, ranks);
  return group;
}

ProcessGroup::~ProcessGroup() { destroy(); }

uint64_t ProcessGroup::lastSeq() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return seq_;
}

std::string ProcessGroup::who() const {
  return str("rank ", rank_, "/", size_, " pg=", options_.name);
}

void ProcessGroup::requireMember(const char* op) const {
  if (!isMember()) {
    throw InvalidArgument(str(op, " on process group ", options_.name, " (ranks ", formatRanges(parentRanks_),
                              " of its parent): this rank is not a member; only members may use the group"));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (destroyed_) {
    throw InvalidArgument(str(op, " on process group ", options_.name, " [", who(),
                              "]: the group was destroyed; create a new one"));
  }
}

Backend& ProcessGroup::backendFor(const Device& device) {
  requireMember("backendFor");
  if (device.isCpu() || options_.backend == "gloo") return *cpuBackend_;
  throw NotSupportedError(str("[", who(), "] tensors on ", device.str(),
                              " need the nccl backend, which this build does not have (DT_HAVE_NCCL=0); "
                              "move the tensors to the CPU or build with CUDA and NCCL"));
}

template <typename Fn>
WorkPtr ProcessGroup::numbered(const char* op, const Device& device, uint64_t& seqField, Fn&& call) {
  requireMember(op);
  Backend& backend = backendFor(device);
  // Holding the lock across the call keeps issue order == sequence order
  // when several threads issue (backends only enqueue here).
  std::lock_guard<std::mutex> lock(mutex_);
  seqField = seq_ + 1;
  try {
    WorkPtr work = call(backend);
    ++seq_;
    return work;
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(str(op, " #", seqField, " (not issued): ", e.what()));
  }
}

namespace {
Device deviceOf(const std::vector<Tensor>& tensors) {
  return !tensors.empty() && tensors[0].defined() ? tensors[0].device() : Device::cpu();
}
}  // namespace

WorkPtr ProcessGroup::allreduce(const std::vector<Tensor>& tensors, AllreduceOptions options) {
  return numbered("allreduce", deviceOf(tensors), options.seq,
                  [&](Backend& b) { return b.allreduce(tensors, options); });
}

WorkPtr ProcessGroup::broadcast(const std::vector<Tensor>& tensors, BroadcastOptions options) {
  return numbered("broadcast", deviceOf(tensors), options.seq,
                  [&](Backend& b) { return b.broadcast(tensors, options); });
}

WorkPtr ProcessGroup::allgather(const std::vector<Tensor>& outputs, const Tensor& input, AllgatherOptions options) {
  return numbered("allgather", input.defined() ? input.device() : Device::cpu(), options.seq,
                  [&](Backend& b) { return b.allgather(outputs, input, options); });
}

WorkPtr ProcessGroup::reduceScatter(const Tensor& output, const std::vector<Tensor>& inputs,
                                    ReduceScatterOptions options) {
  return numbered("reduceScatter", output.defined() ? output.device() : Device::cpu(), options.seq,
                  [&](Backend& b) { return b.reduceScatter(output, inputs, options); });
}

WorkPtr ProcessGroup::reduce(const std::vector<Tensor>& tensors, ReduceOptions options) {
  return numbered("reduce", deviceOf(tensors), options.seq, [&](Backend& b) { return b.reduce(tensors, options); });
}

WorkPtr ProcessGroup::barrier(BarrierOptions options) {
  return numbered("barrier", Device::cpu(), options.seq, [&](Backend& b) { return b.barrier(options); });
}

WorkPtr ProcessGroup::allToAll(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                               AllToAllOptions options) {
  return numbered("allToAll", deviceOf(inputs), options.seq,
                  [&](Backend& b) { return b.allToAll(outputs, inputs, options); });
}

WorkPtr ProcessGroup::send(const std::vector<Tensor>& tensors, int dstRank, SendOptions options) {
  requireMember("send");
  return backendFor(deviceOf(tensors)).send(tensors, dstRank, options);
}

WorkPtr ProcessGroup::recv(const std::vector<Tensor>& tensors, int srcRank, RecvOptions options) {
  requireMember("recv");
  return backendFor(deviceOf(tensors)).recv(tensors, srcRank, options);
}

std::shared_ptr<ProcessGroup> ProcessGroup::newGroup(std::vector<int> ranks, ProcessGroupOptions options) {
  requireMember("newGroup");
  DT_CHECK(!ranks.empty(), "[", who(), "] newGroup: empty rank list");
  std::sort(ranks.begin(), ranks.end());
  DT_CHECK(std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end(), "[", who(),
           "] newGroup: duplicate ranks in ", join(ranks, ","));
  DT_CHECK(ranks.front() >= 0 && ranks.back() < size_, "[", who(), "] newGroup: ranks ", formatRanges(ranks),
           " must lie in [0, ", size_, ")");
  int index;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    index = ++subgroups_;
  }
  if (options.name == "default") options.name = str(options_.name, ".sub", index);
  if (!options.timeout) options.timeout = timeout_;
  if (!options.checkFingerprints) options.checkFingerprints = options_.checkFingerprints;
  if (options.glooHostname.empty()) options.glooHostname = options_.glooHostname;
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
  group->cpuBackend_ =
      makeGloo(group->store_, group->rank_, group->size_, group->options_, group->timeout_, group->parentRanks_);
  return group;
}

void ProcessGroup::destroy() {
  BackendPtr backend;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (destroyed_) return;
    destroyed_ = true;
    backend = std::move(cpuBackend_);
  }
  if (backend) backend->shutdown();
}

}  // namespace dt
