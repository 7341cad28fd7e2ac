#include "tensor/autocast.h"

#include "common/errors.h"
#include "common/strings.h"

namespace dt {

namespace {
thread_local std::optional<DType> tAutocast;
}  // namespace

autocast::autocast(DType dtype, bool enabled) : previous_(tAutocast) {
  if (dtype != DType::BFloat16) {
    throw InvalidArgument(str("autocast: dtype ", dtype, " is not supported; only bfloat16 (DType::BFloat16) is"));
  }
  tAutocast = enabled ? std::optional<DType>(dtype) : std::nullopt;
}

autocast::~autocast() { tAutocast = previous_; }

std::optional<DType> autocastDType() { return tAutocast; }

}  // namespace dt
