// The training state and its checkpoints (threads as ranks): exact round trips, sharded pieces
// written at world 4 and read at 2, 3 and 1, corruption named on every rank, keep-last-K,
// consolidation and the dtckpt tool, state as bytes, a broadcast to a joiner and the
// redistribution of shards to a new group.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/transfer.h"
#include "common/errors.h"
#include "common/strings.h"
#include "store/hash_store.h"
#include "tensor/nn/safetensors.h"
#include "tensor/optim/optim.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using namespace std::chrono_literals;
using testing::expectThrowsWith;
using testing::runRanks;
using testing::TempDir;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

bool bitwiseEqual(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.sizes() != b.sizes()) return false;
  const Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.dataPtr(), y.dataPtr(), x.nbytes()) == 0;
}

// Runs fn(rank, group) on `world` threads, each with a group of its own store.
void withGroups(int world, const std::function<void(int, const std::shared_ptr<ProcessGroup>&)>& fn) {
  auto store = std::make_shared<HashStore>();
  runRanks(world, [&](int rank) {
    ProcessGroupOptions o;
    o.timeout = 30s;
    auto group = ProcessGroup::create(store, rank, world, o);
    fn(rank, group);
    group->destroy();
  });
}

// The global tensor the sharded tests cut: 10 rows of 3, row i holding 10 i + j.
Tensor globalRows() { return arange(0.0, 30.0, 1.0).view({10, 3}); }

// Rank r's dim-0 shard of `rows` rows at world w: ceil(rows / w) rows from r * ceil(rows / w).
std::pair<int64_t, int64_t> rowRange(int64_t rows, int rank, int world) {
  const int64_t per = (rows + world - 1) / world;
  const int64_t begin = std::min<int64_t>(rows, rank * per);
  return {begin, std::min<int64_t>(rows, begin + per) - begin};
}

TEST(TrainingState, ModelOptimizerRngAndMetadataRoundTripBitwise) {
  TempDir dir;
  Generator init(1), rng(5);
  nn::Linear model(4, 3, true, init);
  optim::AdamW adamw(model.parameters(), {.lr = 0.1});
  const Tensor x = randn({2, 4}, init);
  sum(model(x)).backward();
  adamw.step();
  for (int i = 0; i < 3; ++i) rng.nextUint64();

  TrainingState state;
  state.addModule("model", model).addOptimizer("optim", adamw, ParameterMap::replicated(model)).addGenerator("rng", rng);
  state.step = 7;
  state.metadata["epoch"] = "2";
  const CheckpointDir checkpoints(dir.path() / "ck", 2);
  const CheckpointRef ref = checkpoints.save(state);
  EXPECT_TRUE(fs::exists(ref.manifest));
  EXPECT_TRUE(fs::exists(ref.tensors));
  // The data file is an ordinary safetensors file with the state's names.
  const SafetensorsFile file = loadSafetensors(ref.tensors);
  std::vector<std::string> names;
  for (const auto& [name, t] : file.tensors) names.push_back(name);
  EXPECT_THAT(names, ::testing::IsSupersetOf({"model.weight", "optim.weight.exp_avg", "optim.bias.step", "rng.rank0"}));

  const NamedTensors before = model.stateDict();
  const NamedTensors optimBefore = adamw.stateDict();
  const auto rngBefore = rng.state();
  {  // Disturb everything, then load.
    NoGradGuard noGrad;
    for (auto& [name, t] : model.stateDict()) Tensor(t).fill_(9.0);
    rng.nextUint64();
  }
  optim::AdamW fresh(model.parameters(), {.lr = 0.1});
  TrainingState target;
  target.addModule("model", model).addOptimizer("optim", fresh, ParameterMap::replicated(model)).addGenerator("rng", rng);
  const CheckpointManifest m = checkpoints.load(ref, target);
  EXPECT_EQ(target.step, 7);
  EXPECT_EQ(target.metadata.at("epoch"), "2");
  EXPECT_EQ(m.worldSize, 1);
  EXPECT_TRUE(target.notes().empty());
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(bitwiseEqual(model.stateDict()[i].second, before[i].second));
  const NamedTensors optimAfter = fresh.stateDict();
  ASSERT_EQ(optimAfter.size(), optimBefore.size());
  for (size_t i = 0; i < optimBefore.size(); ++i) {
    EXPECT_EQ(optimAfter[i].first, optimBefore[i].first);
    EXPECT_TRUE(bitwiseEqual(optimAfter[i].second, optimBefore[i].second)) << optimBefore[i].first;
  }
  EXPECT_EQ(rng.state(), rngBefore);

  // keep = 2: a third checkpoint removes the oldest (manifest and data file).
  for (int64_t step : {8, 9}) {
    state.step = step;
    checkpoints.save(state);
  }
  ASSERT_EQ(checkpoints.list().size(), 2u);
  EXPECT_EQ(checkpoints.list().front().step, 8);
  EXPECT_FALSE(fs::exists(ref.tensors));
  // A model without a tensor of the checkpoint refuses it, naming the tensor.
  nn::Linear other(4, 3, false, init);
  TrainingState wrong;
  wrong.addModule("model", other);
  expectThrowsWith<InvalidArgument>([&] { checkpoints.load(checkpoints.list().back(), wrong); },
                                    {"model.bias", "does not have"});
}

// Each rank holds rows of the 10 x 3 tensor ("w", sharded), a replicated vector and its own
// generator; the checkpoint written at world 4 loads at 2, 3 and 1 with every element in place.
TEST(ShardedCheckpoint, WrittenAtFourLoadsAtTwoThreeAndOne) {
  TempDir dir;
  const CheckpointDir checkpoints(dir.path(), 3);
  withGroups(4, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    const auto [begin, rows] = rowRange(10, rank, 4);
    Tensor piece = globalRows().narrow(0, begin, rows).clone();
    Tensor shared = fromVector<float>({1.0f, 2.0f});
    Generator rng(100 + static_cast<uint64_t>(rank));
    TrainingState state(rank, 4);
    state.addTensor("w", piece, Placement::Sharded, {10, 3}, begin * 3).addTensor("v", shared).addGenerator("rng", rng);
    state.step = 50;
    checkpoints.save(state, group.get());
  });
  // Rank 3's file holds its single row; ranks 1..3 wrote one file each beside rank 0's.
  EXPECT_TRUE(fs::exists(dir.path() / "step-00000050.rank00003.safetensors"));
  EXPECT_EQ(loadSafetensors(dir.path() / "step-00000050.rank00003.safetensors").tensors.at(0).second.sizes(), (Shape{1, 3}));

  for (int world : {2, 3}) {
    std::mutex mu;
    std::vector<std::string> notes;
    withGroups(world, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
      const auto [begin, rows] = rowRange(10, rank, world);
      Tensor piece = zeros({rows, 3});
      Tensor shared = zeros({2});
      Generator rng(7);
      TrainingState state(rank, world);
      state.addTensor("w", piece, Placement::Sharded, {10, 3}, begin * 3).addTensor("v", shared).addGenerator("rng", rng);
      checkpoints.load(*checkpoints.latestAgreed(*group), state, group.get());
      EXPECT_TRUE(bitwiseEqual(piece, globalRows().narrow(0, begin, rows))) << "world " << world << " rank " << rank;
      EXPECT_EQ(shared.toVector<float>(), (std::vector<float>{1.0f, 2.0f}));
      EXPECT_EQ(rng.state().seed, 7u) << "another world size keeps each rank's own stream";
      std::lock_guard<std::mutex> lock(mu);
      notes.insert(notes.end(), state.notes().begin(), state.notes().end());
    });
    ASSERT_EQ(notes.size(), static_cast<size_t>(world));
    EXPECT_THAT(notes[0], HasSubstr("written by 4 rank(s), restored by"));
  }
  // One process, the whole tensor (a replicated target reads every piece).
  Tensor whole = zeros({10, 3});
  TrainingState single;
  single.addTensor("w", whole);
  checkpoints.load(*checkpoints.latest(), single);
  EXPECT_TRUE(bitwiseEqual(whole, globalRows()));
  // Consolidation: whole tensors under a prefix, as an ordinary file; and the tool.
  const fs::path out = dir.path() / "whole.safetensors";
  const auto n = consolidateCheckpoint(checkpoints, *checkpoints.latest(), out, "");
  EXPECT_EQ(n, 2u);
  const SafetensorsFile consolidated = loadSafetensors(out);
  EXPECT_TRUE(bitwiseEqual(consolidated.tensors.at(0).second, globalRows()));
  EXPECT_EQ(consolidated.metadata.at("step"), "50");
}

TEST(ShardedCheckpoint, ACorruptFileOfOneRankFailsTheLoadOnEveryRank) {
  TempDir dir;
  const CheckpointDir checkpoints(dir.path(), 3);
  withGroups(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    Tensor piece = full({5, 3}, static_cast<double>(rank));
    TrainingState state(rank, 2);
    state.addTensor("w", piece, Placement::Sharded, {10, 3}, rank * 15);
    state.step = 3;
    checkpoints.save(state, group.get());
  });
  const fs::path file = dir.path() / "step-00000003.rank00001.safetensors";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(file) - 4));
    f.write("XXXX", 4);
  }
  std::vector<std::string> messages(2);
  withGroups(2, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    Tensor piece = zeros({5, 3});
    TrainingState state(rank, 2);
    state.addTensor("w", piece, Placement::Sharded, {10, 3}, rank * 15);
    try {
      checkpoints.load(checkpoints.refFor(3), state, group.get());
    } catch (const InvalidArgument& e) {
      messages[static_cast<size_t>(rank)] = e.what();
    }
  });
  EXPECT_THAT(messages[1], HasSubstr(str("checkpoint file ", file.string(), " is corrupt")));
  EXPECT_THAT(messages[0], HasSubstr("failed on rank 1"));
  EXPECT_THAT(messages[0], HasSubstr("is corrupt"));
  // The tool verifies and names the file too.
  const std::string command = str(DTCKPT_PATH, " verify ", dir.path().string(), " 2>&1");
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  char buffer[4096];
  std::string output;
  while (size_t got = std::fread(buffer, 1, sizeof buffer, pipe)) output.append(buffer, got);
  EXPECT_NE(::pclose(pipe), 0);
  EXPECT_THAT(output, HasSubstr("is corrupt"));
  // A truncated manifest names the manifest.
  const fs::path manifest = dir.path() / "step-00000003.json";
  fs::resize_file(manifest, 50);
  expectThrowsWith<InvalidArgument>([&] { checkpoints.readManifest(checkpoints.refFor(3)); },
                                    {str("checkpoint manifest ", manifest.string(), " is corrupt")});
}

TEST(StateTransfer, BytesRoundTripAndABroadcastReachesAJoiner) {
  Generator init(3);
  nn::Linear model(3, 2, true, init);
  TrainingState state;
  state.addModule("model", model);
  state.step = 11;
  state.metadata["k"] = "v";
  const std::string bytes = encodeState(state);
  nn::Linear copy(3, 2, true, init);
  TrainingState target;
  target.addModule("model", copy);
  decodeState(bytes, target);
  EXPECT_EQ(target.step, 11);
  EXPECT_EQ(target.metadata.at("k"), "v");
  EXPECT_TRUE(bitwiseEqual(copy.weight, model.weight));

  // Rank 0 trained; ranks 1 and 2 (joiners) receive its model and optimizer state; every
  // rank keeps its own random stream.
  withGroups(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    Generator g(static_cast<uint64_t>(rank) + 1), rng(50 + static_cast<uint64_t>(rank));
    nn::Linear m(3, 2, true, g);
    optim::SGD sgd(m.parameters(), {.lr = 0.1, .momentum = 0.9});
    if (rank == 0) {
      sum(m(ones({1, 3}))).backward();
      sgd.step();
    }
    TrainingState s(rank, 3);
    s.addModule("model", m).addOptimizer("optim", sgd, ParameterMap::replicated(m)).addGenerator("rng", rng);
    s.step = rank == 0 ? 40 : 0;
    broadcastState(s, *group, 0, rank != 0, {.bucketBytes = 16});  // several buckets
    Tensor spread = m.weight.detach().clone();
    Tensor high = spread.clone(), low = spread.clone();
    group->allreduce(high, {.reduceOp = ReduceOp::Max})->wait();
    group->allreduce(low, {.reduceOp = ReduceOp::Min})->wait();
    EXPECT_TRUE(bitwiseEqual(high, low)) << "rank " << rank;
    EXPECT_EQ(s.step, 40);
    EXPECT_EQ(sgd.stateDict().size(), 2u) << "the momentum buffers arrived";
    EXPECT_EQ(rng.state().seed, 50u + static_cast<uint64_t>(rank));
  });
}

// A joiner (rank 1) receives a large tensor straight into its own parameter and keeps the
// AdamW moments it received as its optimizer state (no second copy); rank 2 only takes part.
// One more identical step on every rank keeps them bitwise equal.
TEST(StateTransfer, AJoinerReceivesIntoItsOwnTensorsAndItsOptimizerKeepsWhatArrived) {
  withGroups(3, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    Generator g(rank == 1 ? 2 : 1);
    nn::Linear m(600, 600, true, g);  // 1.44 MB of weight: travels alone; the bias shares a bucket
    optim::AdamW adam(m.parameters(), {.lr = 0.01});
    auto step = [&] {
      adam.zeroGrad();
      sum(m(ones({2, 600}))).backward();
      adam.step();
    };
    if (rank != 1) step();
    const void* weightBefore = m.weight.dataPtr();
    TrainingState s(rank, 3);
    s.addModule("model", m).addOptimizer("optim", adam, ParameterMap::replicated(m));
    broadcastState(s, *group, 0, rank == 1);
    EXPECT_EQ(m.weight.dataPtr(), weightBefore) << "rank " << rank << ": the weight was replaced, not written";
    EXPECT_EQ(adam.stateDict().size(), 6u) << "rank " << rank;
    step();
    for (const auto& [name, t] : adam.stateDict()) {
      Tensor high = t.to(DType::Float64).clone(), low = high.clone();
      group->allreduce(high, {.reduceOp = ReduceOp::Max})->wait();
      group->allreduce(low, {.reduceOp = ReduceOp::Min})->wait();
      EXPECT_TRUE(bitwiseEqual(high, low)) << "rank " << rank << " " << name;
    }
    Tensor high = m.weight.detach().clone(), low = high.clone();
    group->allreduce(high, {.reduceOp = ReduceOp::Max})->wait();
    group->allreduce(low, {.reduceOp = ReduceOp::Min})->wait();
    EXPECT_TRUE(bitwiseEqual(high, low)) << "rank " << rank;
  });
}

// Restoring into an optimizer that has state writes its tensors in place.
TEST(TrainingState, AnOptimizerWithStateIsRestoredInPlace) {
  Generator init(4);
  nn::Linear model(5, 3, true, init);
  optim::AdamW adam(model.parameters(), {.lr = 0.1});
  sum(model(ones({1, 5}))).backward();
  adam.step();
  TrainingState state;
  state.addModule("model", model).addOptimizer("optim", adam, ParameterMap::replicated(model));
  const std::string bytes = encodeState(state);
  const NamedTensors before = adam.stateDict();
  std::vector<Tensor> saved;
  for (const auto& [name, t] : before) saved.push_back(t.clone());
  for (const auto& [name, t] : before) t.detach().fill_(7.0);
  decodeState(bytes, state);
  const NamedTensors after = adam.stateDict();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(after[i].second.dataPtr(), before[i].second.dataPtr()) << after[i].first;
    EXPECT_TRUE(bitwiseEqual(after[i].second, saved[i])) << after[i].first;
  }
}

// Three ranks hold a world-3 layout; a fourth joins: every rank of the new group of four gets
// its world-4 rows from the others. Then a lost rank: the survivors cannot rebuild its rows.
TEST(StateTransfer, RedistributeMovesShardsToANewLayoutAndNamesWhatIsLost) {
  withGroups(4, [&](int rank, const std::shared_ptr<ProcessGroup>& group) {
    std::vector<StateTensor> held;
    if (rank < 3) {
      const auto [begin, rows] = rowRange(10, rank, 3);
      held.push_back({"w", Placement::Sharded, {10, 3}, begin * 3, globalRows().narrow(0, begin, rows).clone()});
      held.push_back({"v", Placement::Replicated, {2}, 0, fromVector<float>({4.0f, 5.0f})});
    }
    const auto [begin, rows] = rowRange(10, rank, 4);
    Tensor piece = zeros({rows, 3});
    Tensor shared = zeros({2});
    TrainingState state(rank, 4);
    state.addTensor("w", piece, Placement::Sharded, {10, 3}, begin * 3).addTensor("v", shared);
    redistributeState(held, state, *group);
    EXPECT_TRUE(bitwiseEqual(piece, globalRows().narrow(0, begin, rows))) << "rank " << rank;
    EXPECT_EQ(shared.toVector<float>(), (std::vector<float>{4.0f, 5.0f}));

    // Rank 1's old rows are gone (it "died"; the others cover only theirs).
    std::vector<StateTensor> partial;
    if (rank == 0 || rank == 2) {
      const auto [b3, r3] = rowRange(10, rank, 3);
      partial.push_back({"w", Placement::Sharded, {10, 3}, b3 * 3, globalRows().narrow(0, b3, r3).clone()});
    }
    TrainingState again(rank, 4);
    again.addTensor("w", piece, Placement::Sharded, {10, 3}, begin * 3);
    expectThrowsWith<InvalidArgument>([&] { redistributeState(partial, again, *group); },
                                      {"no rank holds", "\"w\"", "newest checkpoint"});
  });
}

}  // namespace
}  // namespace dt
