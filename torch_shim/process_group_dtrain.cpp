// ProcessGroupDtrain: torch's c10d calls mapped onto dt::ProcessGroup. The one translation unit
// (besides the Python module) that sees both torch's and dtrain's headers; both compile as
// C++20 with torch's flags (-D_GLIBCXX_USE_CXX11_ABI=1 on Debian, which is also g++'s default).
#include "torch_shim/process_group_dtrain.h"

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <utility>

#include "common/errors.h"
#include "common/strings.h"
#include "process_group/init.h"
#include "process_group/process_group.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"
#include "tensor/tensor.h"

namespace dt::torch_shim {
namespace {

constexpr std::chrono::milliseconds kProgressInterval{250};
constexpr std::chrono::milliseconds kFailureReportWindow{750};

// The c10d::Work torch's callers get: a view of one dt::Work plus the at::Tensors the op
// writes (what getFuture() and result() hand back). The dt tensors it wraps keep their
// at::Tensors alive by themselves (wrap() below), so dropping this early is safe.
class WorkDtrain final : public c10d::Work {
 public:
  WorkDtrain(std::shared_ptr<dt::Work> work, std::vector<at::Tensor> outputs, int rank, c10d::OpType type)
      : c10d::Work(rank, type), work_(std::move(work)), outputs_(std::move(outputs)) {}

  bool isCompleted() override { return work_->isCompleted(); }
  bool isSuccess() const override { return work_->isSuccess(); }
  std::exception_ptr exception() const override { return work_->exception(); }
  std::vector<at::Tensor> result() override { return outputs_; }

  // c10d's kNoTimeout (0) waits for as long as it takes; dtrain's wait() then also runs a
  // small op that nobody has started on this thread (work.h's start helper).
  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout == ::kNoTimeout) {
      work_->wait();
    } else {
      work_->wait(timeout);
    }
    return true;
  }

  // Made on the first call only: registering a callback hands a small op to the group's
  // worker (work.h's start hints), which an op that is just waited for should not pay.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> lock(futureMutex_);
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
      work_->then([future = future_, outputs = outputs_](dt::Work& done) {
        if (auto error = done.exception()) {
          future->setError(error);
        } else {
          future->markCompleted(c10::IValue(outputs));
        }
      });
    }
    return future_;
  }

 private:
  std::shared_ptr<dt::Work> work_;
  std::vector<at::Tensor> outputs_;
  std::mutex futureMutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// torch's own wording for an op a backend lacks, so that code that matches it keeps working.
[[noreturn]] void notSupported(const std::string& what) {
  C10_THROW_ERROR(Error, c10::str("ProcessGroup dtrain does not support ", what));
}

// What the op does with the bytes: a reduction interprets them, the other ops only move them.
enum class Use { Reduce, Move };

// dtrain's dtype for a torch dtype. dtrain has no 8- or 16-bit integer types; ops that only
// move bytes carry uint8/int8 as bool (one byte) and int16 as float16 (two bytes), which
// neither backend interprets on the way.
std::optional<dt::DType> dtypeFor(at::ScalarType type, Use use) {
  switch (type) {
    case at::kFloat: return dt::DType::Float32;
    case at::kDouble: return dt::DType::Float64;
    case at::kHalf: return dt::DType::Float16;
    case at::kBFloat16: return dt::DType::BFloat16;
    case at::kInt: return dt::DType::Int32;
    case at::kLong: return dt::DType::Int64;
    case at::kBool: return dt::DType::Bool;
    case at::kByte:
    case at::kChar: return use == Use::Move ? std::optional(dt::DType::Bool) : std::nullopt;
    case at::kShort: return use == Use::Move ? std::optional(dt::DType::Float16) : std::nullopt;
    default: return std::nullopt;
  }
}

// The at::Tensor's memory as a dt::Tensor (no copy). The deleter holds a reference to the
// at::Tensor, so the memory lives as long as dtrain's op needs it.
dt::Tensor wrap(const at::Tensor& tensor, const char* op, Use use) {
  TORCH_CHECK(tensor.defined(), "ProcessGroup dtrain: ", op, " got an undefined tensor");
  if (!tensor.device().is_cpu()) {
    notSupported(c10::str(op, " on ", tensor.device(), " tensors: it takes CPU tensors (CUDA tensors need a group on \"nccl\")"));
  }
  if (tensor.layout() != at::kStrided) notSupported(c10::str(op, " of ", tensor.layout(), " tensors"));
  const auto dtype = dtypeFor(tensor.scalar_type(), use);
  if (!dtype) {
    notSupported(c10::str(op, " of ", tensor.scalar_type(), " tensors",
                          use == Use::Reduce ? " (reductions take float32, float64, float16, bfloat16, int32, int64, bool)"
                                             : " (it moves float, integer and bool tensors)"));
  }
  return dt::fromBlob(tensor.data_ptr(), tensor.sizes().vec(), tensor.strides().vec(), *dtype,
                      [keep = tensor](void*) {});
}

std::vector<dt::Tensor> wrapAll(const std::vector<at::Tensor>& tensors, const char* op, Use use) {
  std::vector<dt::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(wrap(t, op, use));
  return out;
}

const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op) {
  // c10d's lists of several tensors per rank are its multi-GPU form; with CPU tensors every
  // torch API passes one, and dtrain's list forms mean something else (one reduction each).
  TORCH_CHECK(tensors.size() == 1, "ProcessGroup dtrain: ", op, " takes one tensor per rank, got ", tensors.size());
  return tensors[0];
}

dt::ReduceOp reduceOpFor(const c10d::ReduceOp& op, const char* opName) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return dt::ReduceOp::Sum;
    case c10d::ReduceOp::AVG: return dt::ReduceOp::Avg;
    case c10d::ReduceOp::PRODUCT: return dt::ReduceOp::Product;
    case c10d::ReduceOp::MIN: return dt::ReduceOp::Min;
    case c10d::ReduceOp::MAX: return dt::ReduceOp::Max;
    case c10d::ReduceOp::BAND: notSupported(c10::str(opName, " with reduce op BAND"));
    case c10d::ReduceOp::BOR: notSupported(c10::str(opName, " with reduce op BOR"));
    case c10d::ReduceOp::BXOR: notSupported(c10::str(opName, " with reduce op BXOR"));
    case c10d::ReduceOp::PREMUL_SUM: notSupported(c10::str(opName, " with reduce op PREMUL_SUM"));
    default: notSupported(c10::str(opName, " with reduce op #", static_cast<int>(op.op_)));
  }
}

dt::OpTimeout timeoutFor(std::chrono::milliseconds timeout) {
  if (timeout == c10d::kUnsetTimeout) return std::nullopt;
  return timeout;
}

int rootFor(int64_t root, int64_t rootTensor, const char* op) {
  TORCH_CHECK(rootTensor == 0, "ProcessGroup dtrain: ", op, " takes one tensor per rank; rootTensor must be 0, got ",
              rootTensor);
  return static_cast<int>(root);
}

uint32_t tagFor(int tag, const char* op) {
  TORCH_CHECK(tag >= 0, "ProcessGroup dtrain: ", op, " tag must be >= 0, got ", tag);
  return static_cast<uint32_t>(tag);
}

std::string randomToken() {
  std::random_device device;
  std::ostringstream out;
  out << std::hex;
  for (int i = 0; i < 4; ++i) out << device();
  return out.str();
}

const char* getEnv(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

bool isLoopbackHost(const std::string& host) {
  return host == "localhost" || host == "::1" || host.starts_with("127.");
}

// A plain torchrun job has no dtrain store: group rank 0 starts one (port 0, a fresh token) and
// the others read its address from the store torch gave the group, which is the only one they
// all know. Rank 0's host is MASTER_ADDR (the address the job already uses to reach rank 0's
// machine), loopback when it is unset.
dt::StorePtr bootstrapStore(c10d::Store& torchStore, int rank, int size, std::chrono::milliseconds timeout) {
  const std::string key = "dtrain/store";
  dt::TcpStoreOptions options;
  options.timeout = timeout;
  options.rank = rank;
  if (rank == 0) {
    const char* master = getEnv("MASTER_ADDR");
    const std::string host = master != nullptr ? master : "127.0.0.1";
    options.isServer = true;
    options.numWorkers = size;
    options.waitForWorkers = false;
    options.token = randomToken();
    auto store = std::make_shared<dt::TcpStore>(host, 0, options);
    const std::string address = dt::str(host, " ", store->port(), " ", *options.token);
    torchStore.set(key, std::vector<uint8_t>(address.begin(), address.end()));
    return store;
  }
  const std::vector<uint8_t> value = torchStore.get(key);
  std::istringstream in(std::string(value.begin(), value.end()));
  std::string host, token;
  int port = 0;
  if (!(in >> host >> port >> token) || port <= 0 || port > 65535) {
    throw dt::InvalidArgument(dt::str("ProcessGroup dtrain: rank 0's store address under key \"", key,
                                      "\" of torch's store is malformed: \"", std::string(value.begin(), value.end()),
                                      "\""));
  }
  options.token = token;
  return std::make_shared<dt::TcpStore>(host, static_cast<uint16_t>(port), options);
}

// The dtrain store each torch store stands for, so that a subgroup (torch hands it the same
// store under another prefix) runs on the default group's dtrain store instead of making one.
struct KnownStore {
  c10::weak_intrusive_ptr<c10d::Store> torchStore;
  dt::StorePtr store;
};
std::mutex knownStoresMutex;
std::vector<KnownStore> knownStores;

dt::StorePtr knownStore(const c10::intrusive_ptr<c10d::Store>& torchStore) {
  std::lock_guard<std::mutex> lock(knownStoresMutex);
  std::erase_if(knownStores, [](const KnownStore& k) { return k.torchStore.expired(); });
  for (const auto& k : knownStores) {
    if (k.torchStore.lock().get() == torchStore.get()) return k.store;
  }
  return nullptr;
}

void rememberStore(const c10::intrusive_ptr<c10d::Store>& torchStore, dt::StorePtr store) {
  std::lock_guard<std::mutex> lock(knownStoresMutex);
  knownStores.push_back({c10::weak_intrusive_ptr<c10d::Store>(torchStore), std::move(store)});
}

std::vector<uint8_t> toBytes(const dt::Bytes& value) { return {value.begin(), value.end()}; }
dt::Bytes fromBytes(const std::vector<uint8_t>& value) { return {value.begin(), value.end()}; }

}  // namespace

// ---- DtrainStore ----------------------------------------------------------------------------

DtrainStore::DtrainStore(std::shared_ptr<dt::Store> store) : c10d::Store(store->timeout()), store_(std::move(store)) {}
DtrainStore::~DtrainStore() = default;

void DtrainStore::set(const std::string& key, const std::vector<uint8_t>& value) { store_->set(key, fromBytes(value)); }

std::vector<uint8_t> DtrainStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                             const std::vector<uint8_t>& desired) {
  return toBytes(store_->compareSet(key, fromBytes(expected), fromBytes(desired)));
}

std::vector<uint8_t> DtrainStore::get(const std::string& key) { return toBytes(store_->get(key, timeout_)); }
int64_t DtrainStore::add(const std::string& key, int64_t value) { return store_->add(key, value); }
bool DtrainStore::deleteKey(const std::string& key) { return store_->deleteKey(key); }
bool DtrainStore::check(const std::vector<std::string>& keys) { return store_->check(keys); }
int64_t DtrainStore::getNumKeys() { return store_->numKeys(); }
void DtrainStore::wait(const std::vector<std::string>& keys) { store_->wait(keys, timeout_); }

void DtrainStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  store_->wait(keys, timeout);
}

void DtrainStore::setTimeout(const std::chrono::milliseconds& timeout) {
  c10d::Store::setTimeout(timeout);
  store_->setTimeout(timeout);
}

c10::intrusive_ptr<DtrainStore> connectLauncherStore(int rank, int worldSize, std::chrono::milliseconds timeout) {
  dt::InitOptions init;
  init.rank = rank;
  init.worldSize = worldSize;
  init.timeout = timeout;
  auto store = dt::connectJob(init).store;
  store->setTimeout(timeout);
  return c10::make_intrusive<DtrainStore>(std::move(store));
}

// ---- ProcessGroupDtrain ---------------------------------------------------------------------

ProcessGroupDtrain::ProcessGroupDtrain(std::shared_ptr<dt::ProcessGroup> group)
    : TorchBackendBase(group->rank(), group->size()), group_(std::move(group)) {}

ProcessGroupDtrain::~ProcessGroupDtrain() { group_->destroy(); }

c10::intrusive_ptr<ProcessGroupDtrain> ProcessGroupDtrain::create(const c10::intrusive_ptr<c10d::Store>& store,
                                                                  int rank, int size, CreateOptions options) {
  TORCH_CHECK(store, "ProcessGroup dtrain: create() needs a store");
  // torch hands a group its store inside PrefixStores (the group's name around "default_pg");
  // the store under them is what identifies the job (and may be dtrain's own).
  c10::intrusive_ptr<c10d::Store> underlying = store;
  while (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(underlying.get())) underlying = prefixed->getUnderlyingStore();
  dt::StorePtr jobStore;
  if (auto* ours = dynamic_cast<DtrainStore*>(underlying.get())) {
    jobStore = ours->store();
  } else {
    jobStore = knownStore(underlying);
  }
  const bool isDefault = options.globalRanks.empty();
  const bool underLauncher = getEnv("DT_STORE_ADDR") != nullptr || getEnv("DT_ETCD_ENDPOINTS") != nullptr;
  dt::InitOptions init;
  init.rank = rank;
  init.worldSize = size;
  init.timeout = options.timeout;
  init.name = isDefault ? "default" : "torch-" + options.groupId;
  dt::ProcessGroupOptions groupOptions;
  if (underLauncher && isDefault) {
    // dtrun's store, and with it the launcher's hang watchdog keys (init.h).
    dt::JobConnection job = dt::connectJob(init);
    if (!jobStore) {
      jobStore = job.store;
      rememberStore(underlying, jobStore);
    }
    groupOptions = std::move(job.group);
  } else {
    if (!jobStore) {
      jobStore = bootstrapStore(*store, rank, size, options.timeout);
      rememberStore(underlying, jobStore);
      const char* master = getEnv("MASTER_ADDR");
      if (master != nullptr && !isLoopbackHost(master) && getEnv("DT_GLOO_HOSTNAME") == nullptr) {
        char name[256] = {};
        if (::gethostname(name, sizeof name - 1) == 0) init.glooHostname = name;
      }
    }
    init.store = jobStore;
    groupOptions = dt::connectJob(init).group;
  }
  // A rank that lost a peer waits this window for the others' failure reports before it names
  // the silent ones, and a heartbeat that moves within it clears a rank. Over Gloo (where the
  // closed socket does not say who died) dtrain's defaults (1 s heartbeat, 2.5 s window) put
  // the survivors' error 2.5 s after the death; a PyTorch job, which has no launcher telling
  // it who died, gets it within a second: a 250 ms heartbeat (four small store writes a second
  // per rank) and a 750 ms window, three heartbeats long.
  groupOptions.progressInterval = std::min(groupOptions.progressInterval, kProgressInterval);
  groupOptions.failureReportWindow = std::min(groupOptions.failureReportWindow, kFailureReportWindow);
  auto scoped = std::make_shared<dt::PrefixStore>("torch/" + options.groupId, jobStore);
  return c10::make_intrusive<ProcessGroupDtrain>(dt::ProcessGroup::create(scoped, rank, size, std::move(groupOptions)));
}

namespace {
c10::intrusive_ptr<c10d::Work> makeWork(std::shared_ptr<dt::Work> work, std::vector<at::Tensor> outputs, int rank,
                                        c10d::OpType type) {
  return c10::make_intrusive<WorkDtrain>(std::move(work), std::move(outputs), rank, type);
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = single(tensors, "broadcast");
  dt::BroadcastOptions o;
  o.root = rootFor(opts.rootRank, opts.rootTensor, "broadcast");
  o.timeout = timeoutFor(opts.timeout);
  return makeWork(group_->broadcast(wrap(t, "broadcast", Use::Move), o), tensors, rank_, c10d::OpType::BROADCAST);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = single(tensors, "allreduce");
  dt::AllreduceOptions o;
  o.reduceOp = reduceOpFor(opts.reduceOp, "allreduce");
  o.timeout = timeoutFor(opts.timeout);
  return makeWork(group_->allreduce(wrap(t, "allreduce", Use::Reduce), o), tensors, rank_, c10d::OpType::ALLREDUCE);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                       const c10d::AllreduceCoalescedOptions& opts) {
  dt::AllreduceOptions o;
  o.reduceOp = reduceOpFor(opts.reduceOp, "allreduce_coalesced");
  o.timeout = timeoutFor(opts.timeout);
  return makeWork(group_->allreduce(wrapAll(tensors, "allreduce_coalesced", Use::Reduce), o), tensors, rank_,
                  c10d::OpType::ALLREDUCE_COALESCED);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  const at::Tensor& t = single(tensors, "reduce");
  dt::ReduceOptions o;
  o.reduceOp = reduceOpFor(opts.reduceOp, "reduce");
  o.root = rootFor(opts.rootRank, opts.rootTensor, "reduce");
  o.timeout = timeoutFor(opts.timeout);
  return makeWork(group_->reduce(wrap(t, "reduce", Use::Reduce), o), tensors, rank_, c10d::OpType::REDUCE);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions& opts) {
  const at::Tensor& input = single(inputs, "allgather");
  TORCH_CHECK(outputs.size() == 1, "ProcessGroup dtrain: allgather takes one output list per rank, got ",
              outputs.size());
  dt::AllgatherOptions o;
  o.timeout = timeoutFor(opts.timeout);
  auto work = group_->allgather(wrapAll(outputs[0], "allgather", Use::Move), wrap(input, "allgather", Use::Move), o);
  return makeWork(std::move(work), outputs[0], rank_, c10d::OpType::ALLGATHER);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions& opts) {
  dt::AllgatherOptions o;
  o.timeout = timeoutFor(opts.timeout);
  auto work = group_->allgatherIntoTensor(wrap(output, "_allgather_base", Use::Move),
                                          wrap(input, "_allgather_base", Use::Move), o);
  return makeWork(std::move(work), {output}, rank_, c10d::OpType::_ALLGATHER_BASE);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::GatherOptions& opts) {
  const at::Tensor& input = single(inputs, "gather");
  TORCH_CHECK(outputs.size() <= 1, "ProcessGroup dtrain: gather takes at most one output list per rank, got ",
              outputs.size());
  std::vector<at::Tensor> gathered = outputs.empty() ? std::vector<at::Tensor>{} : outputs[0];
  dt::GatherOptions o;
  o.root = static_cast<int>(opts.rootRank);
  o.timeout = timeoutFor(opts.timeout);
  auto work = group_->gather(wrapAll(gathered, "gather", Use::Move), wrap(input, "gather", Use::Move), o);
  return makeWork(std::move(work), std::move(gathered), rank_, c10d::OpType::GATHER);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ScatterOptions& opts) {
  const at::Tensor& output = single(outputs, "scatter");
  TORCH_CHECK(inputs.size() <= 1, "ProcessGroup dtrain: scatter takes at most one input list per rank, got ",
              inputs.size());
  dt::ScatterOptions o;
  o.root = static_cast<int>(opts.rootRank);
  o.timeout = timeoutFor(opts.timeout);
  auto work = group_->scatter(wrap(output, "scatter", Use::Move),
                              inputs.empty() ? std::vector<dt::Tensor>{} : wrapAll(inputs[0], "scatter", Use::Move), o);
  return makeWork(std::move(work), outputs, rank_, c10d::OpType::SCATTER);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& output = single(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1, "ProcessGroup dtrain: reduce_scatter takes one input list per rank, got ",
              inputs.size());
  dt::ReduceScatterOptions o;
  o.reduceOp = reduceOpFor(opts.reduceOp, "reduce_scatter");
  o.timeout = timeoutFor(opts.timeout);
  auto work = group_->reduceScatter(wrap(output, "reduce_scatter", Use::Reduce),
                                    wrapAll(inputs[0], "reduce_scatter", Use::Reduce), o);
  return makeWork(std::move(work), outputs, rank_, c10d::OpType::REDUCE_SCATTER);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
  dt::ReduceScatterOptions o;
  o.reduceOp = reduceOpFor(opts.reduceOp, "_reduce_scatter_base");
  o.timeout = timeoutFor(opts.timeout);
  auto work = group_->reduceScatterTensor(wrap(output, "_reduce_scatter_base", Use::Reduce),
                                          wrap(input, "_reduce_scatter_base", Use::Reduce), o);
  return makeWork(std::move(work), {output}, rank_, c10d::OpType::_REDUCE_SCATTER_BASE);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                 std::vector<int64_t>& outputSplitSizes,
                                                                 std::vector<int64_t>& inputSplitSizes,
                                                                 const c10d::AllToAllOptions& opts) {
  dt::AllToAllOptions o;
  o.timeout = timeoutFor(opts.timeout);
  auto work = group_->allToAllSingle(wrap(output, "alltoall_base", Use::Move), wrap(input, "alltoall_base", Use::Move),
                                     outputSplitSizes, inputSplitSizes, o);
  return makeWork(std::move(work), {output}, rank_, c10d::OpType::ALLTOALL_BASE);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::alltoall(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllToAllOptions& opts) {
  dt::AllToAllOptions o;
  o.timeout = timeoutFor(opts.timeout);
  auto work =
      group_->allToAll(wrapAll(outputs, "alltoall", Use::Move), wrapAll(inputs, "alltoall", Use::Move), o);
  return makeWork(std::move(work), outputs, rank_, c10d::OpType::ALLTOALL);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  dt::SendOptions o;
  o.tag = tagFor(tag, "send");
  return makeWork(group_->send(wrapAll(tensors, "send", Use::Move), dstRank, o), {}, rank_, c10d::OpType::SEND);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  dt::RecvOptions o;
  o.tag = tagFor(tag, "recv");
  return makeWork(group_->recv(wrapAll(tensors, "recv", Use::Move), srcRank, o), tensors, rank_, c10d::OpType::RECV);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupDtrain::barrier(const c10d::BarrierOptions& opts) {
  dt::BarrierOptions o;
  o.timeout = timeoutFor(opts.timeout);
  return makeWork(group_->barrier(o), {}, rank_, c10d::OpType::BARRIER);
}

void ProcessGroupDtrain::monitoredBarrier(const c10d::BarrierOptions& opts, bool /*waitAllRanks*/) {
  // dtrain's monitored barrier always names every rank that did not arrive.
  dt::BarrierOptions o;
  o.timeout = timeoutFor(opts.timeout);
  group_->monitoredBarrier(o)->wait();
}

uint64_t ProcessGroupDtrain::getSequenceNumberForGroup() { return group_->lastSeq(); }

std::exception_ptr ProcessGroupDtrain::brokenCause() const { return group_->brokenCause(); }

void ProcessGroupDtrain::abort(const std::string& reason) {
  group_->abort(std::make_exception_ptr(dt::BackendError(dt::str("[rank ", rank_, "/", size_,
                                                                 " pg=", group_->name(), "] aborted: ", reason))));
}

}  // namespace dt::torch_shim
