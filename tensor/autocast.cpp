#include "tensor/autocast.h"

#include <atomic>

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"

namespace dt {

namespace {
thread_local std::optional<DType> tAutocast;
// -1: DT_AUTOCAST_ATTENTION not read yet; else 0 or 1.
std::atomic<int> gAttention{-1};
}  // namespace

autocast::autocast(DType dtype, bool enabled) : previous_(tAutocast) {
  if (dtype != DType::BFloat16) {
    throw InvalidArgument(str("autocast: dtype ", dtype, " is not supported; only bfloat16 (DType::BFloat16) is"));
  }
  tAutocast = enabled ? std::optional<DType>(dtype) : std::nullopt;
}

autocast::~autocast() { tAutocast = previous_; }

std::optional<DType> autocastDType() { return tAutocast; }

bool autocastAttention() {
  const int v = gAttention.load(std::memory_order_acquire);
  if (v >= 0) return v == 1;
  const bool on = env::getBool("DT_AUTOCAST_ATTENTION");
  // Two threads reading it at once store the same value.
  gAttention.store(on ? 1 : 0, std::memory_order_release);
  return on;
}

void setAutocastAttention(bool bf16) { gAttention.store(bf16 ? 1 : 0, std::memory_order_release); }

}  // namespace dt
