// DeviceMesh (threads as ranks on shm): layouts at 4, 8 and 16 ranks against tables written
// from the references (torchtitan's [pp, dp_replicate, dp_shard, cp, tp] order with tp
// innermost, Megatron-LM's 16-rank TP=2 / PP=4 example), each group a working group (an
// all-reduce over it sums exactly its members), flatten, the host check, and every error.
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/errors.h"
#include "parallel/mesh.h"
#include "tests/fsdp/harness.h"
#include "tests/parallel/harness.h"
#include "tests/testing/testing.h"

namespace dt::testing {
namespace {

using Groups = std::vector<std::vector<int>>;
using Table = std::map<std::string, Groups>;

// Checks this rank's view of every dimension in `table` against it, then runs one all-reduce
// of the parent rank over each group: the sum is that of the table's members.
void expectLayout(const DeviceMesh& mesh, int rank, const Table& table) {
  for (const auto& [name, groups] : table) {
    const std::vector<int>* mine = nullptr;
    for (const auto& members : groups) {
      if (std::find(members.begin(), members.end(), rank) != members.end()) mine = &members;
    }
    ASSERT_NE(mine, nullptr) << "table for " << name << " lacks rank " << rank;
    EXPECT_EQ(mesh.ranks(name), *mine) << "rank " << rank << " along " << name;
    EXPECT_EQ(mesh.size(name), static_cast<int>(mine->size())) << name;
    EXPECT_EQ(mesh.coordinate(name), std::find(mine->begin(), mine->end(), rank) - mine->begin()) << name;
    EXPECT_EQ(mesh[name]->parentRanks(), *mine) << name;
    Tensor value = fromVector<int64_t>({rank});
    mesh[name]->allreduce(value)->wait();
    int64_t expected = 0;
    for (int member : *mine) expected += member;
    EXPECT_EQ(value.item<int64_t>(), expected) << "all-reduce along " << name << " on rank " << rank;
  }
}

void expectMeshLayout(int world, const std::vector<MeshDimension>& dimensions, const Table& table) {
  std::vector<int> shape;
  for (const auto& dimension : dimensions) shape.push_back(dimension.size);
  for (size_t d = 0; d < dimensions.size(); ++d) {
    EXPECT_EQ(DeviceMesh::groupsAlong(shape, {d}), table.at(dimensions[d].name)) << dimensions[d].name;
  }
  withRanks(world, [&](int rank, const ProcessGroupPtr& group) {
    const DeviceMesh mesh = DeviceMesh::create(group, dimensions);
    expectLayout(mesh, rank, table);
  });
}

TEST(DeviceMesh, FourRanksDpByTp) {
  expectMeshLayout(4, {{"dp", 2}, {"tp", 2}}, {{"tp", {{0, 1}, {2, 3}}}, {"dp", {{0, 2}, {1, 3}}}});
}

TEST(DeviceMesh, EightRanksTorchtitanOrderPpDpTp) {
  expectMeshLayout(8, {{"pp", 2}, {"dp", 2}, {"tp", 2}},
                   {{"tp", {{0, 1}, {2, 3}, {4, 5}, {6, 7}}},
                    {"dp", {{0, 2}, {1, 3}, {4, 6}, {5, 7}}},
                    {"pp", {{0, 4}, {1, 5}, {2, 6}, {3, 7}}}});
}

// Megatron-LM's parallel_state example: 16 GPUs, TP=2, PP=4 (so DP=2), tp innermost, then dp,
// then pp: "7 data_parallel groups ... 8 tensor model-parallel groups: [g0, g1], [g2, g3], ...
// 4 pipeline model-parallel groups: [g0, g4, g8, g12], [g1, g5, g9, g13], ...".
TEST(DeviceMesh, SixteenRanksMegatronExampleTp2Pp4) {
  expectMeshLayout(16, {{"pp", 4}, {"dp", 2}, {"tp", 2}},
                   {{"tp", {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}},
                    {"dp", {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}},
                    {"pp", {{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}}});
}

TEST(DeviceMesh, SixteenRanksFourDimensions) {
  expectMeshLayout(16, {{"pp", 2}, {"dp_replicate", 2}, {"dp_shard", 2}, {"tp", 2}},
                   {{"tp", {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}},
                    {"dp_shard", {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}},
                    {"dp_replicate", {{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}},
                    {"pp", {{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}}});
}

TEST(DeviceMesh, FlattenMergesDimensionsOnceAndCachesTheGroup) {
  const Table flattened{{"dp", {{0, 2, 4, 6}, {1, 3, 5, 7}}}};
  EXPECT_EQ(DeviceMesh::groupsAlong({2, 2, 2}, {0, 1}), flattened.at("dp"));
  withRanks(8, [&](int rank, const ProcessGroupPtr& group) {
    DeviceMesh mesh = DeviceMesh::create(group, {{"dp_replicate", 2}, {"dp_shard", 2}, {"tp", 2}});
    const ProcessGroupPtr dp = mesh.flatten({"dp_replicate", "dp_shard"}, "dp");
    expectLayout(mesh, rank, flattened);
    EXPECT_EQ(dp, mesh["dp"]);
    // Again: the cached group, no new one (the parent's creations would desync otherwise).
    EXPECT_EQ(mesh.flatten({"dp_replicate", "dp_shard"}, "dp"), dp);
    // Flattened names are not dimensions.
    EXPECT_EQ(mesh.names(), (std::vector<std::string>{"dp_replicate", "dp_shard", "tp"}));
    EXPECT_EQ(mesh.shape(), (std::vector<int>{2, 2, 2}));
    // The default name joins the parts; the members follow the coordinates of both.
    const ProcessGroupPtr dpTp = mesh.flatten({"dp_shard", "tp"});
    EXPECT_EQ(mesh.ranks("dp_shard_tp"), (rank < 4 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{4, 5, 6, 7}));
    EXPECT_EQ(dpTp->rank(), rank % 4);
  });
}

TEST(DeviceMesh, ASizeOneDimensionAndAOneDimensionalMesh) {
  withRanks(4, [&](int rank, const ProcessGroupPtr& group) {
    const DeviceMesh mesh = DeviceMesh::create(group, {{"pp", 1}, {"dp", 4}, {"tp", 1}});
    expectLayout(mesh, rank, {{"pp", {{0}, {1}, {2}, {3}}}, {"dp", {{0, 1, 2, 3}}}, {"tp", {{0}, {1}, {2}, {3}}}});
    const DeviceMesh flat = DeviceMesh::create(group, {{"dp", 4}});
    expectLayout(flat, rank, {{"dp", {{0, 1, 2, 3}}}});
    EXPECT_EQ(flat.describe(), "[dp=4]");
  });
}

TEST(DeviceMesh, BadShapesNamesAndSizesAreRefusedBeforeAnyCommunication) {
  withRanks(4, [&](int, const ProcessGroupPtr& group) {
    expectThrowsWith<InvalidArgument>([&] { DeviceMesh::create(group, {{"dp", 2}, {"tp", 3}}); },
                                      {"DeviceMesh [dp=2, tp=3]", "multiply to 6", "group default has 4 ranks"});
    expectThrowsWith<InvalidArgument>([&] { DeviceMesh::create(group, {{"tp", 2}, {"tp", 2}}); },
                                      {"dimension name \"tp\" is used twice"});
    expectThrowsWith<InvalidArgument>([&] { DeviceMesh::create(group, {{"dp", 4}, {"tp", 0}}); },
                                      {"dimension \"tp\" has size 0", "at least 1"});
    expectThrowsWith<InvalidArgument>([&] { DeviceMesh::create(group, {{"dp", 4}, {"", 1}}); }, {"empty name"});
    expectThrowsWith<InvalidArgument>([&] { DeviceMesh::create(group, {}); }, {"no dimensions"});
    expectThrowsWith<InvalidArgument>([&] { DeviceMesh::create(nullptr, {{"dp", 4}}); }, {"parent group is null"});
    // The group is still usable: nothing was issued on it.
    DeviceMesh mesh = DeviceMesh::create(group, {{"dp", 2}, {"tp", 2}});
    expectThrowsWith<InvalidArgument>([&] { (void)mesh["pp"]; }, {"no dimension \"pp\"", "known: dp, tp"});
    expectThrowsWith<InvalidArgument>([&] { (void)mesh.coordinate("cp"); }, {"no dimension \"cp\""});
    expectThrowsWith<InvalidArgument>([&] { mesh.flatten({"dp", "pp"}); },
                                      {"flatten: \"pp\" is not a dimension", "known: dp, tp"});
    expectThrowsWith<InvalidArgument>([&] { mesh.flatten({"dp", "dp"}); }, {"\"dp\" is listed twice"});
    expectThrowsWith<InvalidArgument>([&] { mesh.flatten({"dp", "tp"}, "tp"); }, {"the name \"tp\" is taken"});
    mesh.flatten({"dp", "tp"}, "all");
    expectThrowsWith<InvalidArgument>([&] { (void)mesh.size("none"); }, {"known: dp, tp, all"});
  });
}

MeshOptions onHost(int rank, int ranksPerHost) {
  MeshOptions options;
  options.hostId = "host" + std::to_string(rank / ranksPerHost);
  return options;
}

TEST(DeviceMesh, ATensorParallelGroupAcrossHostsIsRefusedUnlessAllowed) {
  withRanks(4, [&](int rank, const ProcessGroupPtr& group) {
    // Two hosts of two ranks: tp=2 innermost stays on each host, so it is accepted.
    const DeviceMesh fits = DeviceMesh::create(group, {{"dp", 2}, {"tp", 2}}, onHost(rank, 2));
    EXPECT_EQ(fits.ranks("tp"), (rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}));
    // tp outermost puts ranks 0 and 2 together, across the hosts.
    expectThrowsWith<InvalidArgument>(
        [&] { DeviceMesh::create(group, {{"tp", 2}, {"dp", 2}}, onHost(rank, 2)); },
        {"dimension \"tp\" would span hosts", "group 0, 2", "rank 0 on host host0", "rank 2 on host host1",
         "allowCrossHost"});
    expectThrowsWith<InvalidArgument>([&] { DeviceMesh::create(group, {{"tp", 4}}, onHost(rank, 2)); },
                                      {"\"tp\" would span hosts", "group 0-3"});
    // Other host-local names, and the escape hatch.
    MeshOptions cp = onHost(rank, 2);
    cp.hostLocal = {"cp"};
    expectThrowsWith<InvalidArgument>([&] { DeviceMesh::create(group, {{"cp", 4}}, cp); },
                                      {"dimension \"cp\" would span hosts"});
    MeshOptions allowed = onHost(rank, 2);
    allowed.allowCrossHost = true;
    const DeviceMesh across = DeviceMesh::create(group, {{"tp", 4}}, allowed);
    EXPECT_EQ(across.size("tp"), 4);
  });
}

}  // namespace
}  // namespace dt::testing
