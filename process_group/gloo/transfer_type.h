// withTransferType: calls fn with an unsigned integer of the element width,
// for Gloo's typed setters, which only use sizeof(T); the arithmetic is ours
// (collectives/reduce_kernels). Throws NotSupportedError for other widths.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/errors.h"
#include "common/strings.h"

namespace dt {

template <typename Fn>
void withTransferType(size_t width, Fn&& fn) {
  switch (width) {
    case 1: fn(uint8_t{}); return;
    case 2: fn(uint16_t{}); return;
    case 4: fn(uint32_t{}); return;
    case 8: fn(uint64_t{}); return;
  }
  throw NotSupportedError(str("gloo backend: no transfer type of ", width, " bytes"));
}

}  // namespace dt
