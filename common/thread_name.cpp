#include "common/thread_name.h"

#include <pthread.h>

#include <cstring>

namespace dt {

void setThreadName(const char* name) noexcept {
  char cut[16];
  std::strncpy(cut, name, sizeof cut - 1);
  cut[sizeof cut - 1] = '\0';
  (void)::pthread_setname_np(::pthread_self(), cut);
}

}  // namespace dt
