#include "collectives/reduce_op.h"

#include "common/errors.h"
#include "common/strings.h"

namespace dt {

std::string_view toString(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
    case ReduceOp::Product: return "product";
  }
  return "unknown-reduce-op";
}

std::ostream& operator<<(std::ostream& out, ReduceOp op) { return out << toString(op); }

ReduceOp parseReduceOp(std::string_view name) {
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max, ReduceOp::Product}) {
    if (toString(op) == name) return op;
  }
  throw InvalidArgument(str("unknown reduce op ", quoteBytes(name), "; use sum, avg, min, max or product"));
}

}  // namespace dt
