// The profiler (tensor/profiler.h) and memory statistics (tensor/memory_stats.h):
// totals consistent with wall time, self <= total, nesting, a trace that is
// valid JSON with balanced events per thread, backward events, and memory
// counters that follow tensors being made and freed.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <thread>
#include <vector>

#include <unistd.h>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "tensor/memory_stats.h"
#include "tensor/nn/module.h"
#include "tensor/ops.h"
#include "tensor/profiler.h"
#include "tensor/storage.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

int64_t steadyNs() { return profiler::nowNs(); }

// Exit status and combined output of a shell command.
std::pair<int, std::string> runCommand(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed: " + command};
  std::string output;
  char buffer[4096];
  while (fgets(buffer, sizeof buffer, pipe) != nullptr) output += buffer;
  return {pclose(pipe), output};
}

// Runs a small MLP step (forward, loss, backward) under recordFunction ranges.
void trainingStep(int steps = 2) {
  Generator gen(7);
  nn::Linear first(16, 32, true, gen), second(32, 4, true, gen);
  Tensor x = randn({8, 16}, gen);
  Tensor y = randint(0, 4, {8}, gen);
  for (int i = 0; i < steps; ++i) {
    auto step = recordFunction("step");
    Tensor loss;
    {
      auto forward = recordFunction("forward");
      loss = crossEntropy(second.forward(relu(first.forward(x))), y);
    }
    auto backward = recordFunction("backward");
    loss.backward();
  }
}

const ProfileRow* findRow(const std::vector<ProfileRow>& rows, const std::string& name) {
  for (const auto& row : rows) {
    if (row.name == name) return &row;
  }
  return nullptr;
}

// Events on one (rank, thread) must nest: any two either do not overlap or one contains the other.
void expectNestingPerThread(const std::vector<ProfileEvent>& events) {
  std::map<std::pair<int, uint64_t>, std::vector<const ProfileEvent*>> byThread;
  for (const auto& e : events) byThread[{e.rank, e.threadId}].push_back(&e);
  for (auto& [key, list] : byThread) {
    std::vector<const ProfileEvent*> open;
    for (const ProfileEvent* e : list) {  // events() is sorted by thread, then start
      while (!open.empty() && open.back()->startNs + open.back()->durationNs <= e->startNs) open.pop_back();
      if (!open.empty()) {
        EXPECT_LE(e->startNs + e->durationNs, open.back()->startNs + open.back()->durationNs)
            << e->name << " overlaps " << open.back()->name << " on rank " << key.first << " thread " << key.second
            << " without nesting";
      }
      open.push_back(e);
    }
  }
}

TEST(Profiler, TotalsAreConsistentWithWallTimeAndSelfNeverExceedsTotal) {
  const int64_t wallStart = steadyNs();
  Profiler profiler;
  trainingStep();
  profiler.stop();
  const int64_t wall = steadyNs() - wallStart;

  ASSERT_FALSE(profiler.events().empty());
  // Top-level events of a thread cannot add up to more than the profiled region.
  std::map<uint64_t, int64_t> topLevelByThread;
  std::map<uint64_t, int64_t> openUntil;
  for (const auto& e : profiler.events()) {
    EXPECT_GE(e.startNs, wallStart) << e.name;
    EXPECT_GE(e.durationNs, 0) << e.name;
    if (e.startNs >= openUntil[e.threadId]) {
      topLevelByThread[e.threadId] += e.durationNs;
      openUntil[e.threadId] = e.startNs + e.durationNs;
    }
  }
  for (const auto& [thread, total] : topLevelByThread) EXPECT_LE(total, wall) << "thread " << thread;

  int64_t selfSum = 0;
  for (const auto& row : profiler.rows()) {
    EXPECT_LE(row.selfNs, row.totalNs) << row.name;
    EXPECT_GE(row.selfNs, 0) << row.name;
    EXPECT_GT(row.calls, 0) << row.name;
    selfSum += row.selfNs;
  }
  // Self times partition the top-level time exactly (every nanosecond belongs to one event).
  int64_t topSum = 0;
  for (const auto& [thread, total] : topLevelByThread) topSum += total;
  EXPECT_EQ(selfSum, topSum);

  // The table is sorted by self time.
  const auto rows = profiler.rows();
  for (size_t i = 1; i < rows.size(); ++i) EXPECT_GE(rows[i - 1].selfNs, rows[i].selfNs);
  const std::string table = profiler.table();
  EXPECT_NE(table.find("linear"), std::string::npos) << table;
  EXPECT_NE(table.find("self"), std::string::npos) << table;
}

TEST(Profiler, RecordsOpsUserRangesAndBackwardNodesThatNest) {
  Profiler profiler;
  trainingStep(/*steps=*/3);
  profiler.stop();
  const auto rows = profiler.rows();
  const ProfileRow* step = findRow(rows, "step");
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->calls, 3);
  EXPECT_EQ(step->category, EventCategory::User);
  const ProfileRow* linear = findRow(rows, "linear");
  ASSERT_NE(linear, nullptr);
  EXPECT_EQ(linear->calls, 6);
  EXPECT_EQ(linear->category, EventCategory::Op);
  // loss.backward() ran a node per op; each is a backward event named by its node.
  const ProfileRow* crossEntropyBackward = nullptr;
  int backwardRows = 0;
  for (const auto& row : rows) {
    if (row.category != EventCategory::Backward) continue;
    ++backwardRows;
    if (row.name.find("CrossEntropy") != std::string::npos) crossEntropyBackward = &row;
  }
  EXPECT_GE(backwardRows, 3);
  ASSERT_NE(crossEntropyBackward, nullptr);
  EXPECT_EQ(crossEntropyBackward->calls, 3);
  expectNestingPerThread(profiler.events());

  // "forward" and "backward" lie inside "step"; linear lies inside "forward".
  const auto& events = profiler.events();
  auto inside = [](const ProfileEvent& inner, const ProfileEvent& outer) {
    return inner.startNs >= outer.startNs && inner.startNs + inner.durationNs <= outer.startNs + outer.durationNs;
  };
  for (const auto& e : events) {
    if (e.name != "forward" && e.name != "backward" && e.name != "linear") continue;
    const std::string parent = e.name == "linear" ? "forward" : "step";
    const bool nested = std::any_of(events.begin(), events.end(), [&](const ProfileEvent& o) {
      return o.name == parent && o.threadId == e.threadId && inside(e, o);
    });
    EXPECT_TRUE(nested) << e.name << " is not inside a " << parent << " range";
  }
}

TEST(Profiler, RecordsShapesOnlyWhenAsked) {
  Tensor a = ones({2, 3}), b = ones({3, 4});
  {
    Profiler plain;
    Tensor c = mm(a, b);
    plain.stop();
    const auto rows = plain.rows(/*groupByShapes=*/true);
    const ProfileRow* mmRow = findRow(rows, "mm");
    ASSERT_NE(mmRow, nullptr);
    EXPECT_EQ(mmRow->shapes, "");
  }
  Profiler withShapes(ProfilerOptions{.recordShapes = true});
  Tensor c = mm(a, b);
  Tensor d = mm(b.t(), a.t());
  withShapes.stop();
  const auto rows = withShapes.rows(/*groupByShapes=*/true);
  int mmRows = 0;
  for (const auto& row : rows) {
    if (row.name != "mm") continue;
    ++mmRows;
    EXPECT_TRUE(row.shapes == "[2, 3], [3, 4]" || row.shapes == "[4, 3], [3, 2]") << row.shapes;
  }
  EXPECT_EQ(mmRows, 2);
  EXPECT_NE(withShapes.table({.groupByShapes = true}).find("[2, 3], [3, 4]"), std::string::npos);
}

TEST(Profiler, RecordsNothingWhenOffAndEachProfilerSeesItsOwnWindow) {
  Tensor a = ones({4});
  Tensor before = add(a, a);  // no profiler: not recorded anywhere
  Profiler outer;
  Tensor first = add(a, a);
  std::vector<ProfileEvent> innerEvents;
  {
    Profiler inner;
    Tensor second = mul(a, a);
    inner.stop();
    innerEvents = inner.events();
  }
  Tensor third = sub(a, a);
  outer.stop();
  auto names = [](const std::vector<ProfileEvent>& events) {
    std::vector<std::string> out;
    for (const auto& e : events) out.push_back(e.name);
    return out;
  };
  EXPECT_EQ(names(innerEvents), std::vector<std::string>({"mul"}));
  auto outerNames = names(outer.events());
  EXPECT_EQ(std::count(outerNames.begin(), outerNames.end(), "add"), 1);
  EXPECT_EQ(std::count(outerNames.begin(), outerNames.end(), "mul"), 1);
  EXPECT_EQ(std::count(outerNames.begin(), outerNames.end(), "sub"), 1);
  EXPECT_FALSE(profiler::recording());
}

TEST(Profiler, ThreadsRecordIntoTheirOwnTracks) {
  Profiler profiler;
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([] {
      auto range = recordFunction("worker");
      Tensor x = ones({64});
      for (int i = 0; i < 10; ++i) x = add(x, x);
    });
  }
  for (auto& t : threads) t.join();
  profiler.stop();
  std::map<uint64_t, int> addsByThread;
  for (const auto& e : profiler.events()) {
    if (e.name == "add") addsByThread[e.threadId]++;
  }
  ASSERT_EQ(addsByThread.size(), 3u);
  for (const auto& [thread, adds] : addsByThread) EXPECT_EQ(adds, 10) << "thread " << thread;
  expectNestingPerThread(profiler.events());
}

TEST(Profiler, ChromeTraceIsValidJsonWithCompleteEventsPerRankAndThread) {
  Profiler::setRank(3);
  Profiler profiler(ProfilerOptions{.recordShapes = true});
  trainingStep(1);
  { auto range = recordFunction("a \"quoted\" \\ name\n"); }
  profiler.stop();
  Profiler::setRank(0);
  testing::TempDir dir;
  const std::string path = (dir.path() / "trace.json").string();
  profiler.writeChromeTrace(path);

  // Python's json module is the judge of validity; it also checks each event's fields and nesting.
  const std::string checker = (dir.path() / "check.py").string();
  std::ofstream(checker) << R"(import json, sys
trace = json.load(open(sys.argv[1]))
events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
assert events, "no complete events"
for e in events:
    for key in ("name", "cat", "ts", "dur", "pid", "tid"):
        assert key in e, (key, e)
    assert e["pid"] == 3, e
    assert e["dur"] >= 0, e
by_thread = {}
for e in events:
    by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
for key, evs in by_thread.items():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack = []
    for e in evs:
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"] + 1e-3:
            stack.pop()
        if stack:
            assert e["ts"] + e["dur"] <= stack[-1]["ts"] + stack[-1]["dur"] + 1e-3, (e, stack[-1])
        stack.append(e)
names = {e["name"] for e in events}
assert 'a "quoted" \\ name\n' in names, names
assert any(e["cat"] == "backward" for e in events)
assert any("shapes" in e.get("args", {}) for e in events)
meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
assert any(m["name"] == "process_name" and m["args"]["name"] == "rank 3" for m in meta), meta
print("ok", len(events))
)";
  const auto [status, output] = runCommand("python3 " + checker + " " + path);
  EXPECT_EQ(status, 0) << output;
  EXPECT_EQ(output.rfind("ok", 0), 0u) << output;
}

// The test runs itself again as a child with DT_PROFILE set (the variable is
// read once per process); the child does one training step and exits.
TEST(Profiler, ProcessProfileIsWrittenAtExit) {
  if (std::getenv("DT_PROFILE") != nullptr) {
    EXPECT_TRUE(profiler::recording());
    trainingStep(1);
    return;
  }
  testing::TempDir dir;
  const std::string pattern = (dir.path() / "trace-{rank}.json").string();
  const auto [status, output] = runCommand("DT_PROFILE=" + pattern +
                                           " RANK=2 /proc/" + std::to_string(getpid()) +
                                           "/exe --gtest_filter=Profiler.ProcessProfileIsWrittenAtExit");
  ASSERT_EQ(status, 0) << output;
  const std::filesystem::path trace = dir.path() / "trace-2.json";
  ASSERT_TRUE(std::filesystem::exists(trace)) << output;
  std::ifstream in(trace);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"name\": \"linear\""), std::string::npos);
  EXPECT_NE(text.find("\"pid\": 2"), std::string::npos);
  std::ifstream tableFile(trace.string() + ".txt");
  const std::string table((std::istreambuf_iterator<char>(tableFile)), std::istreambuf_iterator<char>());
  EXPECT_NE(table.find("linear"), std::string::npos) << table;
}

TEST(Profiler, WritingToAnUnwritablePathNamesThePath) {
  Profiler profiler;
  profiler.stop();
  testing::expectThrowsWith<Error>([&] { profiler.writeChromeTrace("/nonexistent-dir/trace.json"); },
                                   {"/nonexistent-dir/trace.json"});
}

// ---- memory statistics ----------------------------------------------------------------------------------

TEST(MemoryStats, RiseAndFallAsTensorsAreMadeAndFreed) {
  const MemoryStats start = memoryStats();
  EXPECT_EQ(start.device, Device::cpu());
  const size_t bytes = 256 * 1024 * sizeof(float);  // 1 MiB: a cached block size, reused exactly
  MemoryStats during;
  {
    Tensor big = empty({256 * 1024});
    during = memoryStats();
    EXPECT_EQ(during.allocatedBytes, start.allocatedBytes + bytes);
    EXPECT_EQ(during.allocations, start.allocations + 1);
    EXPECT_GE(during.totalAllocatedBytes, start.totalAllocatedBytes + bytes);
    EXPECT_GE(during.peakAllocatedBytes, during.allocatedBytes);
    EXPECT_GE(during.reservedBytes, during.allocatedBytes);
    ASSERT_FALSE(during.largestLiveBlocks.empty());
    EXPECT_GE(during.largestLiveBlocks.front(), bytes);
  }
  const MemoryStats after = memoryStats();
  EXPECT_EQ(after.allocatedBytes, start.allocatedBytes);
  EXPECT_EQ(after.frees, start.frees + 1);
  EXPECT_EQ(after.totalAllocatedBytes, during.totalAllocatedBytes);
  // The freed block stays cached: reserved, not allocated.
  EXPECT_GE(after.reservedBytes, after.allocatedBytes + bytes);

  // Small tensors are counted too.
  {
    Tensor small = empty({10});
    EXPECT_EQ(memoryStats().allocatedBytes, start.allocatedBytes + 64);
  }
  EXPECT_EQ(memoryStats().allocatedBytes, start.allocatedBytes);
}

TEST(MemoryStats, CountsFromManyThreadsAddUp) {
  const MemoryStats start = memoryStats();
  constexpr int kThreads = 4, kTensors = 100;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([] {
      for (int i = 0; i < kTensors; ++i) Tensor small = empty({10});  // one 64-byte block each
    });
  }
  for (auto& t : threads) t.join();
  const MemoryStats after = memoryStats();
  EXPECT_EQ(after.allocations - start.allocations, uint64_t{kThreads * kTensors});
  EXPECT_EQ(after.frees - start.frees, uint64_t{kThreads * kTensors});
  EXPECT_EQ(after.totalAllocatedBytes - start.totalAllocatedBytes, size_t{kThreads * kTensors * 64});
  EXPECT_EQ(after.allocatedBytes, start.allocatedBytes);
}

TEST(MemoryStats, PeakTracksTheHighestPointUntilReset) {
  resetPeakMemoryStats();
  const size_t base = memoryStats().allocatedBytes;
  EXPECT_EQ(memoryStats().peakAllocatedBytes, base);
  {
    Tensor a = empty({512 * 1024});  // 2 MiB
    Tensor b = empty({512 * 1024});
  }
  const MemoryStats afterTwo = memoryStats();
  EXPECT_EQ(afterTwo.allocatedBytes, base);
  EXPECT_EQ(afterTwo.peakAllocatedBytes, base + 2 * 512 * 1024 * sizeof(float));
  resetPeakMemoryStats();
  EXPECT_EQ(memoryStats().peakAllocatedBytes, base);
}

TEST(MemoryStats, SnapshotNamesTheOpThatMadeEachBlockWhileProfiling) {
  Tensor a = ones({64, 64}), b = ones({64, 64});
  Tensor product, sum;
  {
    Profiler profiler;
    product = mm(a, b);         // 16 KiB: a small block, listed only while profiling
    sum = add(product, product);
  }
  Tensor unprofiled = mul(a, b);
  const MemorySnapshot snap = memorySnapshot();
  auto opOf = [&](const Tensor& t) -> std::string {
    for (const auto& block : snap.blocks) {
      if (block.address == t.storage().data()) return block.op;
    }
    return "(not listed)";
  };
  EXPECT_EQ(opOf(product), "mm");
  EXPECT_EQ(opOf(sum), "add");
  EXPECT_EQ(opOf(unprofiled), "(not listed)");
  EXPECT_GE(snap.unlistedBlocks, 3u);  // a, b, unprofiled at least
  for (size_t i = 1; i < snap.blocks.size(); ++i) EXPECT_GE(snap.blocks[i - 1].bytes, snap.blocks[i].bytes);

  const std::string summary = memorySummary();
  EXPECT_NE(summary.find("peak allocated"), std::string::npos) << summary;
  EXPECT_NE(summary.find("mm"), std::string::npos) << summary;
  // Freeing a listed block removes it from the next snapshot.
  const void* productAddress = product.storage().data();
  product = Tensor();
  for (const auto& block : memorySnapshot().blocks) EXPECT_NE(block.address, productAddress);
}

TEST(MemoryStats, BlocksMadeInBackwardNameAnOpThatWasRecorded) {
  Tensor w = ones({32, 32}).setRequiresGrad(true);
  std::vector<std::string> recorded;
  {
    Profiler profiler;
    sum(mul(w, w)).backward();
    profiler.stop();
    for (const auto& e : profiler.events()) recorded.push_back(e.name);
  }
  // The nodes are gone by now; the names their blocks carry must still read.
  ASSERT_TRUE(w.grad().defined());
  bool found = false;
  for (const auto& block : memorySnapshot().blocks) {
    if (block.address != w.grad().storage().data()) continue;
    found = true;
    EXPECT_NE(std::find(recorded.begin(), recorded.end(), block.op), recorded.end()) << block.op;
  }
  EXPECT_TRUE(found);
}

TEST(MemoryStats, WithoutProfileMemorySmallBlocksAreOnlyCounted) {
  Tensor a = ones({8, 8});
  Tensor product;
  {
    Profiler profiler(ProfilerOptions{.profileMemory = false});
    product = mm(a, a);
  }
  for (const auto& block : memorySnapshot().blocks) EXPECT_NE(block.address, product.storage().data());
}

TEST(MemoryStats, BigBlocksAreListedEvenWithoutProfilingAndCountsStayConsistent) {
  Tensor big = empty({1 << 20});  // 4 MiB
  const MemorySnapshot snap = memorySnapshot();
  const auto it = std::find_if(snap.blocks.begin(), snap.blocks.end(),
                               [&](const MemoryBlock& b) { return b.address == big.storage().data(); });
  ASSERT_NE(it, snap.blocks.end());
  EXPECT_EQ(it->bytes, size_t{4} << 20);
  EXPECT_EQ(it->op, "");
  size_t listed = 0;
  for (const auto& block : snap.blocks) listed += block.bytes;
  EXPECT_EQ(listed + snap.unlistedBytes, memoryStats().allocatedBytes);
}

// /proc/self/statm's resident pages, in bytes.
size_t residentBytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

TEST(MemoryStats, CachedBlocksServeOtherSizesAndNeverHoldMoreThanTheLivePeak) {
  constexpr size_t MiB = size_t{1} << 20;
  auto floats = [](size_t bytes) { return static_cast<int64_t>(bytes / sizeof(float)); };
  emptyCpuCache();
  const size_t base = memoryStats().allocatedBytes;
  {
    std::vector<Tensor> blocks;
    for (int i = 0; i < 4; ++i) blocks.push_back(empty({floats(4 * MiB)}));  // 16 MiB live at the peak
  }
  // Freed, they stay cached for later requests.
  EXPECT_EQ(cpuCachedBytes(), 16 * MiB);
  {
    // A smaller request of another size is carved out of a cached block: no new memory.
    Tensor part = empty({floats(3 * MiB)});
    EXPECT_EQ(memoryStats().reservedBytes, base + 16 * MiB);
  }
  {
    // A request no cached block fits: idle memory goes back to the system first, so that
    // live and cached together stay within the peak.
    Tensor big = empty({floats(12 * MiB)});
    EXPECT_LE(memoryStats().reservedBytes, base + 16 * MiB);
  }
  emptyCpuCache();
  EXPECT_EQ(cpuCachedBytes(), 0u);
  EXPECT_EQ(memoryStats().reservedBytes, memoryStats().allocatedBytes);
}

TEST(MemoryStats, EmptyingTheCacheGivesTheMemoryBackToTheSystem) {
  constexpr size_t MiB = size_t{1} << 20;
  emptyCpuCache();
  const size_t before = residentBytes();
  {
    std::vector<Tensor> blocks;
    for (int i = 0; i < 16; ++i) blocks.push_back(ones({static_cast<int64_t>(4 * MiB / sizeof(float))}));  // touched
  }
  const size_t cached = residentBytes();
  EXPECT_GE(cached, before + 48 * MiB) << "the 64 MiB of freed blocks stay resident while cached";
  emptyCpuCache();
  const size_t after = residentBytes();
  EXPECT_LE(after, cached - 48 * MiB) << "resident " << cached / MiB << " MiB before emptyCpuCache(), " << after / MiB
                                      << " MiB after";
}

TEST(MemoryStats, DevicesWhoseAllocatorDoesNotReportSaySo) {
  struct SilentAllocator final : Allocator {
    DataPtr allocate(size_t) override { return {}; }
    DeviceType deviceType() const override { return DeviceType::CUDA; }
  } silent;
  registerAllocator(DeviceType::CUDA, &silent);
  testing::expectThrowsWith<NotSupportedError>([] { memoryStats(Device::cuda(0)); }, {"cuda:0", "memory statistics"});
  registerAllocator(DeviceType::CUDA, nullptr);
}

}  // namespace
}  // namespace dt
