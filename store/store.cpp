#include "store/store.h"

#include "common/env.h"

namespace dt {

Store::Duration Store::defaultTimeout() { return env::getDuration("DT_STORE_TIMEOUT"); }

Bytes Store::get(const std::string& key, Duration timeout) {
  const Duration saved = timeout_;
  setTimeout(timeout);
  try {
    Bytes value = get(key);
    setTimeout(saved);
    return value;
  } catch (...) {
    setTimeout(saved);
    throw;
  }
}

}  // namespace dt
