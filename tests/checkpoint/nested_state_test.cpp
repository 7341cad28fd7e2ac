// nestedState (threads as ranks): a data-parallel sharded part inside a tensor-parallel layout,
// as ZeRO or the fully sharded wrapper over a TP model hold their state. A [6, 8] weight split by
// columns over tp (each rank a [6, 8/tp] block: 6 runs of the flattened global tensor) and its
// block's elements split unevenly over dp, so shards start and end inside runs; a weight whose
// block is replicated over dp (ZeRO's parameters); a TP-replicated bias sharded over dp; a
// scalar that passes through. Written at TP=2 x DP=2, read whole by one process, at TP=4 x DP=1
// and at TP=2 x DP=2 with other dp cuts; as bytes; and redistributed to another layout.
#include <map>
#include <mutex>

#include <gtest/gtest.h>

#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/nested_state.h"
#include "checkpoint/transfer.h"
#include "common/errors.h"
#include "store/hash_store.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using testing::expectThrowsWith;
using testing::runRanks;
using testing::TempDir;

constexpr int64_t kRows = 6, kCols = 8, kBias = 5;

Tensor globalW() { return arange(0.0, 48.0, 1.0).view({kRows, kCols}); }
Tensor globalR() { return arange(100.0, 148.0, 1.0).view({kRows, kCols}); }
Tensor globalB() { return arange(200.0, 205.0, 1.0); }

bool equal(const Tensor& a, const Tensor& b) { return a.sizes() == b.sizes() && a.toVector<float>() == b.toVector<float>(); }

// A rank's place: tp coordinate of tp, dp coordinate of dp, and its dp cut of each local
// tensor's flattened elements (cuts[d] = first element of dp rank d; the last ends at numel).
struct Place {
  int tp, tps, dp, dps;
  std::vector<int64_t> cutsW, cutsB;
};

std::pair<int64_t, int64_t> cutOf(const std::vector<int64_t>& cuts, int dp, int64_t numel) {
  const int64_t begin = cuts[static_cast<size_t>(dp)];
  const int64_t end = dp + 1 < static_cast<int>(cuts.size()) ? cuts[static_cast<size_t>(dp) + 1] : numel;
  return {begin, end - begin};
}

Tensor block(const Tensor& global, const Place& p) {
  const int64_t width = kCols / p.tps;
  return global.narrow(1, p.tp * width, width).contiguous();
}

// The inner part: what a sharded wrapper over the TP model holds, by local names and shapes.
class InnerPart final : public StateProvider {
 public:
  struct Held {
    std::string name;
    Shape localShape;
    Placement placement;
    int64_t offset;
    Tensor local;
  };
  explicit InnerPart(std::vector<Held> held) : held_(std::move(held)) {}
  std::vector<StateTensor> collect() override {
    std::vector<StateTensor> out;
    for (const Held& h : held_) out.push_back({h.name, h.placement, h.localShape, h.offset, h.local});
    return out;
  }
  void restore(const StateSource& source, const std::string& prefix, const RestoreContext&) override {
    for (Held& h : held_) restoreTensor(source, prefix + "." + h.name, h.localShape, h.offset, h.local);
  }
  const Tensor& local(const std::string& name) const {
    for (const Held& h : held_) {
      if (h.name == name) return h.local;
    }
    throw InvalidArgument(name);
  }

 private:
  std::vector<Held> held_;
};

// Holds the rank's pieces: filled with the global values, or zeros to be restored.
std::shared_ptr<InnerPart> innerFor(const Place& p, bool filled) {
  const int64_t width = kCols / p.tps;
  const auto [wBegin, wCount] = cutOf(p.cutsW, p.dp, kRows * width);
  const auto [bBegin, bCount] = cutOf(p.cutsB, p.dp, kBias);
  const auto pick = [&](const Tensor& whole, int64_t begin, int64_t count) {
    return filled ? whole.reshape({-1}).narrow(0, begin, count).clone() : zeros({count});
  };
  return std::make_shared<InnerPart>(std::vector<InnerPart::Held>{
      {"w", {kRows, width}, Placement::Sharded, wBegin, pick(block(globalW(), p), wBegin, wCount)},
      {"r", {kRows, width}, Placement::Replicated, 0, filled ? block(globalR(), p) : zeros({kRows, width})},
      {"b", {kBias}, Placement::Sharded, bBegin, pick(globalB(), bBegin, bCount)},
      {"s", {}, Placement::Replicated, 0, filled ? scalarTensor(7.0) : zeros({})},
  });
}

// Where each local tensor sits in the global one: the TP layouts parallel/checkpoint.h makes.
OuterPlacementOf outerFor(const Place& p) {
  return [p](const std::string& name) -> std::optional<OuterPlacement> {
    const int64_t width = kCols / p.tps;
    if (name == "w" || name == "r") {
      ParameterLayout layout{name, Placement::Sharded, {kRows, kCols}, p.tp * width};
      if (p.tps > 1) layout.stride = kCols, layout.repeats = kRows;
      return OuterPlacement{{kRows, width}, layout, p.dp == 0, true};
    }
    if (name == "b") return OuterPlacement{{kBias}, {name, Placement::Replicated, {kBias}}, true, p.tp == 0};
    return std::nullopt;
  };
}

void withGroups(int world, const std::function<void(int, ProcessGroup&)>& fn) {
  auto store = std::make_shared<HashStore>();
  runRanks(world, [&](int rank) {
    ProcessGroupOptions o;
    o.timeout = 30s;
    auto group = ProcessGroup::create(store, rank, world, o);
    fn(rank, *group);
    group->destroy();
  });
}

// TP=2 x DP=2, rank = 2 dp + tp; dp cuts inside runs (a block's run is 4 elements).
Place twoByTwo(int rank) { return {rank % 2, 2, rank / 2, 2, {0, 10}, {0, 2}}; }

void expectRestored(const InnerPart& inner, const Place& p) {
  const int64_t width = kCols / p.tps;
  const auto [wBegin, wCount] = cutOf(p.cutsW, p.dp, kRows * width);
  const auto [bBegin, bCount] = cutOf(p.cutsB, p.dp, kBias);
  EXPECT_TRUE(equal(inner.local("w"), block(globalW(), p).reshape({-1}).narrow(0, wBegin, wCount)))
      << "tp " << p.tp << " dp " << p.dp;
  EXPECT_TRUE(equal(inner.local("r"), block(globalR(), p))) << "tp " << p.tp << " dp " << p.dp;
  EXPECT_TRUE(equal(inner.local("b"), globalB().narrow(0, bBegin, bCount))) << "tp " << p.tp << " dp " << p.dp;
  EXPECT_EQ(inner.local("s").item<float>(), 7.0f);
}

TEST(NestedState, GlobalRunsCutALocalRangeAtRunBoundaries) {
  // A [6, 4] block at column 4 of a [6, 8] tensor: runs of 4 every 8 from element 4.
  const ParameterLayout layout{"w", Placement::Sharded, {6, 8}, 4, -1, 8, 6};
  const auto runs = [&](int64_t begin, int64_t count) {
    std::vector<std::vector<int64_t>> out;
    for (const GlobalRuns& r : globalRunsOf(layout, 24, begin, count)) out.push_back({r.offset, r.stride, r.repeats, r.count});
    return out;
  };
  EXPECT_EQ(runs(0, 24), (std::vector<std::vector<int64_t>>{{4, 8, 6, 24}}));
  EXPECT_EQ(runs(0, 10), (std::vector<std::vector<int64_t>>{{4, 8, 2, 8}, {20, 0, 1, 2}}));
  EXPECT_EQ(runs(10, 14), (std::vector<std::vector<int64_t>>{{22, 0, 1, 2}, {28, 8, 3, 12}}));
  EXPECT_EQ(runs(5, 2), (std::vector<std::vector<int64_t>>{{13, 0, 1, 2}}));
  EXPECT_EQ(runs(4, 4), (std::vector<std::vector<int64_t>>{{12, 0, 1, 4}}));
  EXPECT_TRUE(runs(3, 0).empty());
  // One run (a dim-0 block): the range as it is, shifted.
  const ParameterLayout rows{"w", Placement::Sharded, {6, 8}, 24};
  EXPECT_EQ(globalRunsOf(rows, 24, 5, 7).size(), 1u);
  EXPECT_EQ(globalRunsOf(rows, 24, 5, 7)[0].offset, 29);
  expectThrowsWith<InvalidArgument>([&] { globalRunsOf(layout, 24, 20, 5); }, {"[20, 25)", "\"w\"", "24 elements"});
}

TEST(NestedState, WrittenAtTwoByTwoLoadsWholeAtFourByOneAndAtOtherCuts) {
  TempDir dir;
  const CheckpointDir checkpoints(dir.path(), 2);
  withGroups(4, [&](int rank, ProcessGroup& group) {
    const Place p = twoByTwo(rank);
    TrainingState state(rank, 4);
    state.add("m", nestedState(innerFor(p, true), outerFor(p)));
    state.step = 3;
    checkpoints.save(state, &group);
  });
  const CheckpointRef ref = *checkpoints.latest();

  // One process reads the global tensors whole.
  Tensor w = zeros({kRows, kCols}), r = zeros({kRows, kCols}), b = zeros({kBias}), s = zeros({});
  TrainingState whole;
  whole.addTensor("m.w", w).addTensor("m.r", r).addTensor("m.b", b).addTensor("m.s", s);
  checkpoints.load(ref, whole);
  EXPECT_TRUE(equal(w, globalW()));
  EXPECT_TRUE(equal(r, globalR()));
  EXPECT_TRUE(equal(b, globalB()));
  EXPECT_EQ(s.item<float>(), 7.0f);

  // TP=4 x DP=1 (every rank's dp shard the whole block), and TP=2 x DP=2 cut elsewhere.
  for (const bool tp4 : {true, false}) {
    withGroups(4, [&](int rank, ProcessGroup& group) {
      const Place p = tp4 ? Place{rank, 4, 0, 1, {0}, {0}} : Place{rank % 2, 2, rank / 2, 2, {0, 17}, {0, 4}};
      auto inner = innerFor(p, false);
      TrainingState state(rank, 4);
      state.add("m", nestedState(inner, outerFor(p)));
      checkpoints.load(ref, state, &group);
      expectRestored(*inner, p);
    });
  }

  // A global shape that differs is named (the checkpoint's, and the block held here).
  Place narrow = twoByTwo(0);
  auto inner = innerFor(narrow, false);
  TrainingState wrong;
  wrong.add("m", nestedState(inner, [&](const std::string& name) -> std::optional<OuterPlacement> {
    auto o = outerFor(narrow)(name);
    if (o && name == "w") o->layout.shape = {kRows, 2 * kCols};
    return o;
  }));
  expectThrowsWith<InvalidArgument>([&] { checkpoints.load(ref, wrong); }, {"\"m.w\"", "[6, 8] there", "[6, 4] here"});
}

TEST(NestedState, BytesAndRedistributionCarrySeveralPiecesOfATensorFromOneRank) {
  // Bytes: the pieces of one rank that writes every tensor (tp 0, dp 0: two whole runs of w's
  // block, then part of one) round trip.
  const Place p = twoByTwo(0);
  TrainingState sent(0, 4);
  sent.add("m", nestedState(innerFor(p, true), outerFor(p)));
  size_t piecesOfW = 0;
  for (const StateTensor& t : sent.collect()) piecesOfW += t.name == "m.w";
  EXPECT_EQ(piecesOfW, 2u);
  auto back = innerFor(p, false);
  TrainingState received(0, 4);
  received.add("m", nestedState(back, outerFor(p)));
  received.restore(*stateFromBytes(encodeState(sent)));
  expectRestored(*back, p);

  // Redistribution from TP=2 x DP=2 to the same mesh cut elsewhere: strided pieces move too.
  withGroups(4, [&](int rank, ProcessGroup& group) {
    const Place before = twoByTwo(rank);
    TrainingState old(rank, 4);
    old.add("m", nestedState(innerFor(before, true), outerFor(before)));
    const std::vector<StateTensor> held = old.collect();
    const Place after{rank % 2, 2, rank / 2, 2, {0, 5}, {0, 3}};
    auto inner = innerFor(after, false);
    TrainingState state(rank, 4);
    state.add("m", nestedState(inner, outerFor(after)));
    redistributeState(held, state, group);
    expectRestored(*inner, after);
  });
}

}  // namespace
}  // namespace dt
