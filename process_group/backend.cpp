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

}  // namespace dt
