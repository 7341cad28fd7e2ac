#include "common/errors.h"

namespace dt {

std::string describe(const std::exception& e) {
  if (auto* dtError = dynamic_cast<const Error*>(&e)) {
    return std::string(dtError->kind()) + ": " + e.what();
  }
  return std::string("std::exception: ") + e.what();
}

}  // namespace dt
