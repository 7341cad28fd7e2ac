// Names the calling thread, so that `top -H`, `ps -L`, gdb, perf and
// /proc/<pid>/task/<tid>/comm tell dtrain's threads apart
// ("dt-pg-worker", "dt-shm-beat", ...). Linux limits a name to 15 bytes; a
// longer one is cut. Best effort: never throws, thread-safe.
#pragma once

namespace dt {

void setThreadName(const char* name) noexcept;

}  // namespace dt
