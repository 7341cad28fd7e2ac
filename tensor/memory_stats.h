// Memory statistics of a device's allocator: how much is live now, the peak,
// how much was ever handed out, and which blocks are live (and, while a
// profiler records, which op made each).
//
// Contract:
//  * Every allocator reports through the same functions: memoryStats(device)
//    asks allocatorFor(device) (tensor/storage.h). The CPU allocator and
//    CUDA's caching allocator report; an allocator that does not (a test's
//    fake) throws NotSupportedError naming the device.
//  * Bytes are the allocator's block sizes (requests rounded up to its
//    alignment), the memory actually held for tensors. Reserved bytes add the
//    idle blocks the allocator keeps cached for reuse.
//  * Counting is always on and costs one relaxed atomic add per allocation
//    and per free (plus unlocked stores to the calling thread's counters).
//    The per-block list behind memorySnapshot() holds every live block of
//    64 KiB and more at all times (the CPU allocator tracks those for its
//    cache anyway) and, while a profiler with profileMemory (the default)
//    records, also the smaller blocks made then. A block made while a
//    profiler records carries the op that made it (the innermost profiled op
//    on the allocating thread, or a backward node). Blocks smaller than 64 KiB
//    made while no profiler recorded are counted, not listed.
//  * Thread-safe; each call is a consistent-enough view (counters are read
//    one by one while other threads allocate).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tensor/device.h"

namespace dt {

struct MemoryStats {
  Device device = Device::cpu();
  size_t allocatedBytes = 0;       // live blocks now
  size_t peakAllocatedBytes = 0;   // highest allocatedBytes since start or resetPeakMemoryStats()
  size_t totalAllocatedBytes = 0;  // every block ever handed out (cumulative)
  size_t reservedBytes = 0;        // allocatedBytes plus idle cached blocks
  uint64_t allocations = 0;        // blocks handed out
  uint64_t frees = 0;              // blocks given back
  std::vector<size_t> largestLiveBlocks;  // the largest listed live blocks, largest first (at most 8)
};

struct MemoryBlock {
  const void* address = nullptr;
  size_t bytes = 0;
  std::string op;  // the op that allocated it, "" when no profiler recorded then
};

struct MemorySnapshot {
  Device device = Device::cpu();
  std::vector<MemoryBlock> blocks;  // live, largest first
  // Live blocks not listed (smaller than 64 KiB and made while no profiler recorded).
  uint64_t unlistedBlocks = 0;
  size_t unlistedBytes = 0;
};

MemoryStats memoryStats(Device device = Device::cpu());
// Sets the peak to what is allocated now.
void resetPeakMemoryStats(Device device = Device::cpu());
MemorySnapshot memorySnapshot(Device device = Device::cpu());
// A printable table: the statistics, the largest live blocks, and live bytes
// per op when the snapshot knows ops.
std::string memorySummary(Device device = Device::cpu());
// "1.50 MiB"
std::string formatBytes(size_t bytes);

}  // namespace dt
