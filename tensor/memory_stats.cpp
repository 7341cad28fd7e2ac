#include "tensor/memory_stats.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "common/strings.h"

namespace dt {

std::string formatBytes(size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(units)) {
    value /= 1024.0;
    ++unit;
  }
  char buf[32];
  if (unit == 0) std::snprintf(buf, sizeof buf, "%zu B", bytes);
  else std::snprintf(buf, sizeof buf, "%.2f %s", value, units[unit]);
  return buf;
}

std::string memorySummary(Device device) {
  const MemoryStats stats = memoryStats(device);
  const MemorySnapshot snap = memorySnapshot(device);
  std::string out = str("memory on ", device.str(), "\n");
  char line[160];
  auto row = [&](const char* what, const std::string& value) {
    std::snprintf(line, sizeof line, "  %-30s %s\n", what, value.c_str());
    out += line;
  };
  row("allocated now", formatBytes(stats.allocatedBytes));
  row("peak allocated", formatBytes(stats.peakAllocatedBytes));
  row("reserved (allocated + cached)", formatBytes(stats.reservedBytes));
  row("allocated in total", formatBytes(stats.totalAllocatedBytes));
  row("allocations / frees", str(stats.allocations, " / ", stats.frees));
  std::string largest;
  for (size_t bytes : stats.largestLiveBlocks) largest += (largest.empty() ? "" : ", ") + formatBytes(bytes);
  row("largest live blocks", largest.empty() ? "(none listed)" : largest);
  row("live blocks not listed", str(snap.unlistedBlocks, " (", formatBytes(snap.unlistedBytes), ")"));

  // Live bytes per op, for the blocks whose op is known (made while a profiler recorded).
  std::map<std::string, std::pair<size_t, uint64_t>> byOp;
  for (const MemoryBlock& block : snap.blocks) {
    if (block.op.empty()) continue;
    byOp[block.op].first += block.bytes;
    byOp[block.op].second += 1;
  }
  if (!byOp.empty()) {
    std::vector<std::pair<std::string, std::pair<size_t, uint64_t>>> ops(byOp.begin(), byOp.end());
    std::sort(ops.begin(), ops.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
    out += "  live bytes by the op that allocated them:\n";
    for (const auto& [op, bytesAndBlocks] : ops) {
      std::snprintf(line, sizeof line, "    %-28s %12s in %llu blocks\n", op.c_str(),
                    formatBytes(bytesAndBlocks.first).c_str(), static_cast<unsigned long long>(bytesAndBlocks.second));
      out += line;
    }
  }
  return out;
}

}  // namespace dt
