#include "process_group/backend.h"

#include "common/errors.h"
#include "common/strings.h"

namespace dt {

void Backend::throwNotSupported(const std::string& op) const {
  throw NotSupportedError(str("backend ", name(), " does not support ", op, " (rank ", rank(), "/", size(),
                              "); use another backend for this op"));
}

WorkPtr Backend::allreduce(const std::vector<Tensor>&, const AllreduceOptions&) { throwNotSupported("allreduce"); }
WorkPtr Backend::broadcast(const std::vector<Tensor>&, const BroadcastOptions&) { throwNotSupported("broadcast"); }
WorkPtr Backend::allgather(const std::vector<Tensor>&, const Tensor&, const AllgatherOptions&) {
  throwNotSupported("allgather");
}
WorkPtr Backend::reduceScatter(const Tensor&, const std::vector<Tensor>&, const ReduceScatterOptions&) {
  throwNotSupported("reduceScatter");
}
WorkPtr Backend::reduce(const std::vector<Tensor>&, const ReduceOptions&) { throwNotSupported("reduce"); }
WorkPtr Backend::barrier(const BarrierOptions&) { throwNotSupported("barrier"); }
WorkPtr Backend::send(const std::vector<Tensor>&, int, const SendOptions&) { throwNotSupported("send"); }
WorkPtr Backend::recv(const std::vector<Tensor>&, int, const RecvOptions&) { throwNotSupported("recv"); }
WorkPtr Backend::allToAll(const std::vector<Tensor>&, const std::vector<Tensor>&, const AllToAllOptions&) {
  throwNotSupported("allToAll");
}
WorkPtr Backend::gather(const std::vector<Tensor>&, const Tensor&, const GatherOptions&) { throwNotSupported("gather"); }
WorkPtr Backend::scatter(const Tensor&, const std::vector<Tensor>&, const ScatterOptions&) {
  throwNotSupported("scatter");
}
WorkPtr Backend::allgatherIntoTensor(const Tensor&, const Tensor&, const AllgatherOptions&) {
  throwNotSupported("allgatherIntoTensor");
}
WorkPtr Backend::reduceScatterTensor(const Tensor&, const Tensor&, const ReduceScatterOptions&) {
  throwNotSupported("reduceScatterTensor");
}
WorkPtr Backend::allToAllSingle(const Tensor&, const Tensor&, const std::vector<int64_t>&, const std::vector<int64_t>&,
                                const AllToAllOptions&) {
  throwNotSupported("allToAllSingle");
}
WorkPtr Backend::monitoredBarrier(const BarrierOptions&) { throwNotSupported("monitoredBarrier"); }

void Backend::checkBatch(const std::vector<P2POp>& ops) const {
  const std::string who = str("rank ", rank(), "/", size(), " ", name());
  if (ops.empty()) throw InvalidArgument(str("[", who, "] batchIsendIrecv: empty batch"));
  // Everything is checked before the first post, so bad input loses nothing.
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2POp& op = ops[i];
    const char* kind = op.isSend ? "send" : "recv";
    if (op.peer < 0 || op.peer >= size() || op.peer == rank()) {
      throw InvalidArgument(str("[", who, "] batchIsendIrecv: op ", i, " (", kind, ") names peer rank ", op.peer,
                                "; it must be another rank of the group (size ", size(), ")"));
    }
    if (op.tensors.empty()) throw InvalidArgument(str("[", who, "] batchIsendIrecv: op ", i, " (", kind, ") has no tensors"));
    for (const auto& t : op.tensors) {
      if (!t.defined() || t.dtype() != op.tensors[0].dtype() || t.device() != op.tensors[0].device()) {
        throw InvalidArgument(str("[", who, "] batchIsendIrecv: op ", i, " (", kind,
                                  ") needs defined tensors of one dtype and device"));
      }
    }
  }
}

WorkPtr Backend::batchIsendIrecv(const std::vector<P2POp>& ops) {
  checkBatch(ops);
  std::vector<WorkPtr> works;
  works.reserve(ops.size());
  for (const P2POp& op : ops) {
    if (op.isSend) {
      works.push_back(send(op.tensors, op.peer, SendOptions{op.tag, op.timeout, 0}));
    } else {
      works.push_back(recv(op.tensors, op.peer, RecvOptions{op.tag, op.timeout, 0}));
    }
  }
  return allOf(str("batchIsendIrecv of ", ops.size(), " ops (rank ", rank(), "/", size(), " ", name(), ")"), std::move(works));
}

}  // namespace dt
