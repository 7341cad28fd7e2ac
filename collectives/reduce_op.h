// ReduceOp: how a collective combines the ranks' values.
//
// Contract: plain enum plus pure helpers, thread-safe. Avg is Sum followed by
// a division by the number of contributing ranks (integer division truncating
// toward zero for integer dtypes, as NCCL does). For Bool, Sum/Max are logical
// or, Product/Min are logical and, and Avg is rejected.
#pragma once

#include <ostream>
#include <string_view>

namespace dt {

enum class ReduceOp { Sum, Avg, Min, Max, Product };

// "sum", "avg", "min", "max", "product"
std::string_view toString(ReduceOp op);
std::ostream& operator<<(std::ostream& out, ReduceOp op);
// Parses the names above (throws InvalidArgument listing them otherwise).
ReduceOp parseReduceOp(std::string_view name);

}  // namespace dt
