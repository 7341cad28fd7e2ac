#include "tensor/device.h"

namespace dt {

std::string Device::str() const {
  if (isCpu()) return "cpu";
  return "cuda:" + std::to_string(index);
}

std::ostream& operator<<(std::ostream& out, const Device& device) { return out << device.str(); }

}  // namespace dt
