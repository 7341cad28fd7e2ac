// DeviceMesh: the ranks of a group laid out on N named dimensions, with one process group along
// each dimension (PyTorch's DeviceMesh / init_device_mesh, Megatron-Core's parallel_state).
//
//   auto mesh = dt::DeviceMesh::create(world, {{"dp", 2}, {"tp", 2}});   // collective over world
//   dt::ProcessGroupPtr tp = mesh["tp"];      // this rank's tensor-parallel group
//   int dpRank = mesh.coordinate("dp");       // this rank's index along dp
//   auto dp = mesh.flatten({"dp_replicate", "dp_shard"}, "dp");  // collective: the merged group
//
// Layout:
//  * Row-major over the parent group's ranks, the LAST dimension innermost: along it ranks are
//    adjacent. Rank r's coordinate along dimension d is (r / stride_d) % size_d with
//    stride_d the product of the sizes after d. With torchtitan's order [pp, dp_replicate,
//    dp_shard, cp, tp] tp holds adjacent ranks (one host, shared memory) and pp the farthest.
//    Megatron's 16-rank example (TP=2, PP=4, DP=2; tp innermost, then dp, then pp) is the mesh
//    [pp=4, dp=2, tp=2]: tp groups [0,1],[2,3],...; dp groups [0,2],[1,3],[4,6],...; pp groups
//    [0,4,8,12],[1,5,9,13],... A pipeline dimension is just one more name.
//  * "Rank" here always means a rank of the parent group (the group create() was given), and
//    ranks(dim) lists parent ranks. The group along a dimension numbers its members in
//    ascending parent rank, which is the order of their coordinates along it.
//
// Contract:
//  * create() is collective over the parent group: every rank calls it with the same
//    dimensions and options. It validates first (every rank throws the same InvalidArgument
//    before any communication, so a bad shape never hangs), exchanges host ids when a
//    host-local dimension has to be checked (two allgathers over the parent), then creates
//    every sub-group eagerly, in one fixed order: dimension by dimension in mesh order, and
//    within a dimension the groups in order of their lowest rank. Every rank calls
//    parent->newGroup for every group (ranks outside one get a non-member handle, see
//    process_group/process_group.h), so all ranks issue the same creations in the same order
//    and no order can deadlock. Each creation waits for its members to connect and throws
//    TimeoutError after the parent's timeout (MeshOptions::groupOptions.timeout when set).
//  * Host check: dimensions listed in MeshOptions::hostLocal (default: "tp") must keep every
//    group on one host, since their traffic is meant for shared memory. Host ids are what
//    ProcessGroup routes by: MeshOptions::hostId, or localHostId() when it is empty (a
//    ProcessGroup learns them the same way at creation but does not expose the table, so the
//    mesh allgathers them over the parent). A group that spans hosts is an InvalidArgument
//    naming the dimension, the ranks and their hosts, unless allowCrossHost. Tests that
//    pretend hosts with ProcessGroupOptions::hostId must pass the same id in MeshOptions.
//  * flatten(dims, name) is collective over the parent group too: every rank calls it with
//    the same arguments in the same order. It creates one group per combination of the other
//    dimensions' coordinates (ordered by lowest rank, as create()), caches it under `name`,
//    and returns this rank's; later calls with the same name and dimensions return the cached
//    group without communication, and mesh[name] / size / coordinate / ranks accept the name.
//  * Errors: InvalidArgument in one line naming the mesh and the value: sizes whose product
//    differs from the group size, a name used twice, an empty name, a size below 1, an unknown
//    name (listing the known ones), a parent on which this rank is not a member.
//  * Ownership: the mesh holds the parent and every sub-group it created (shared pointers);
//    groups handed out stay valid after the mesh is gone. Destroying a group is the holder's
//    business (ProcessGroup's destructor destroys it when the last handle goes).
//  * Thread safety: the const queries may run from any thread. flatten() mutates the mesh and
//    issues collectives: call it from the thread that owns the mesh, never concurrently with
//    other calls on the same mesh.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "process_group/process_group.h"

namespace dt {

struct MeshDimension {
  std::string name;
  int size = 1;
};

struct MeshOptions {
  // Dimensions whose groups must stay on one host (their traffic goes over shared memory).
  // Names not in the mesh are ignored, so the default fits meshes without "tp".
  std::vector<std::string> hostLocal = {"tp"};
  // Lets a host-local dimension span hosts anyway (slower, e.g. a test on two machines).
  bool allowCrossHost = false;
  // This rank's host identity for the check; "" -> localHostId(), as ProcessGroup does.
  std::string hostId;
  // Options for every sub-group (timeout, backend, ...); the name is set per group
  // ("<parent>.<dimension><index>"). An unset timeout takes the parent's.
  ProcessGroupOptions groupOptions;
};

class DeviceMesh {
 public:
  // Collective over `parent` (see the contract).
  static DeviceMesh create(ProcessGroupPtr parent, std::vector<MeshDimension> dimensions, MeshOptions options = {});

  // This rank's group along a dimension (or a flattened name); InvalidArgument if unknown.
  const ProcessGroupPtr& group(const std::string& name) const;
  const ProcessGroupPtr& operator[](const std::string& name) const { return group(name); }
  int size(const std::string& name) const;
  // This rank's index along the dimension (its rank in group(name)).
  int coordinate(const std::string& name) const;
  // The parent ranks of this rank's group along the dimension, ascending.
  const std::vector<int>& ranks(const std::string& name) const;
  // The mesh's own dimensions, in mesh order (flattened names are not dimensions).
  std::vector<std::string> names() const;
  std::vector<int> shape() const;
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  const ProcessGroupPtr& parent() const { return parent_; }
  // "[dp=2, tp=2]"
  std::string describe() const;

  // Collective: the group merging `dimensions` (any of the mesh's own, each once), cached under
  // `name` ("" -> the names joined by "_"). Its members are ordered by parent rank.
  const ProcessGroupPtr& flatten(const std::vector<std::string>& dimensions, std::string name = "");

  // Pure layout, for tests and planners: the rank lists of the groups along `dimensions`
  // (indices into `shape`) over ranks 0..product(shape)-1, each ascending, the groups ordered
  // by their lowest rank. One index gives the groups along that dimension.
  static std::vector<std::vector<int>> groupsAlong(const std::vector<int>& shape, const std::vector<size_t>& dimensions);

 private:
  struct Entry {
    ProcessGroupPtr group;
    std::vector<int> ranks;
    std::vector<size_t> dimensions;  // the mesh dimensions it spans (one, or several when flattened)
    int coordinate = 0;
  };
  DeviceMesh() = default;
  const Entry& entry(const std::string& name) const;
  std::string who() const;
  const ProcessGroupPtr& addEntry(const std::string& name, std::vector<size_t> dimensions);

  ProcessGroupPtr parent_;
  std::vector<MeshDimension> dimensions_;
  MeshOptions options_;
  std::map<std::string, Entry> entries_;
};

}  // namespace dt
