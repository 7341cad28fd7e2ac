#include "parallel/mesh.h"

#include <algorithm>
#include <set>

#include "common/check.h"
#include "common/strings.h"
#include "tensor/tensor.h"

namespace dt {
namespace {

std::vector<int64_t> stridesOf(const std::vector<int>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  return strides;
}

// Every rank's host id, gathered over `group`: the lengths first, then the bytes padded to the
// longest (carried as int32 elements: every backend moves every dtype, and the table is tiny).
std::vector<std::string> exchangeHostIds(ProcessGroup& group, const std::string& hostId) {
  const int n = group.size();
  std::vector<Tensor> lengths;
  for (int r = 0; r < n; ++r) lengths.push_back(empty({1}, DType::Int64));
  group.allgather(lengths, fromVector<int64_t>({static_cast<int64_t>(hostId.size())}))->wait();
  int64_t longest = 1;
  for (const Tensor& length : lengths) longest = std::max(longest, length.item<int64_t>());
  std::vector<int32_t> mine(static_cast<size_t>(longest), 0);
  for (size_t i = 0; i < hostId.size(); ++i) mine[i] = static_cast<unsigned char>(hostId[i]);
  std::vector<Tensor> all;
  for (int r = 0; r < n; ++r) all.push_back(empty({longest}, DType::Int32));
  group.allgather(all, fromVector<int32_t>(mine))->wait();
  std::vector<std::string> hosts;
  for (int r = 0; r < n; ++r) {
    const std::vector<int32_t> bytes = all[r].toVector<int32_t>();
    std::string id(static_cast<size_t>(lengths[r].item<int64_t>()), '\0');
    for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<char>(bytes[i]);
    hosts.push_back(std::move(id));
  }
  return hosts;
}

}  // namespace

std::vector<std::vector<int>> DeviceMesh::groupsAlong(const std::vector<int>& shape,
                                                      const std::vector<size_t>& dimensions) {
  const std::vector<int64_t> strides = stridesOf(shape);
  int64_t total = 1;
  for (int size : shape) total *= size;
  // Offsets of a group's members from its lowest rank: every combination of the coordinates
  // along `dimensions`.
  std::vector<int> offsets{0};
  for (size_t d : dimensions) {
    std::vector<int> next;
    for (int offset : offsets) {
      for (int k = 0; k < shape[d]; ++k) next.push_back(offset + static_cast<int>(k * strides[d]));
    }
    offsets = std::move(next);
  }
  std::sort(offsets.begin(), offsets.end());
  std::vector<std::vector<int>> groups;
  for (int rank = 0; rank < total; ++rank) {
    const bool lowest = std::all_of(dimensions.begin(), dimensions.end(),
                                    [&](size_t d) { return (rank / strides[d]) % shape[d] == 0; });
    if (!lowest) continue;
    std::vector<int> members;
    for (int offset : offsets) members.push_back(rank + offset);
    groups.push_back(std::move(members));
  }
  return groups;
}

DeviceMesh DeviceMesh::create(ProcessGroupPtr parent, std::vector<MeshDimension> dimensions, MeshOptions options) {
  DT_REQUIRE(parent != nullptr, "DeviceMesh: the parent group is null");
  DeviceMesh mesh;
  mesh.parent_ = std::move(parent);
  mesh.dimensions_ = std::move(dimensions);
  mesh.options_ = std::move(options);
  const std::string who = mesh.who();
  DT_REQUIRE(mesh.parent_->isMember(), who, ": this process is not a member of group ", mesh.parent_->name(),
             "; create the mesh on a group this rank belongs to");
  DT_REQUIRE(!mesh.dimensions_.empty(), who, ": no dimensions; give at least one, e.g. {{\"dp\", ",
             mesh.parent_->size(), "}}");
  std::set<std::string> seen;
  int64_t product = 1;
  for (const MeshDimension& dimension : mesh.dimensions_) {
    DT_REQUIRE(!dimension.name.empty(), who, ": a dimension has an empty name; name every dimension");
    DT_REQUIRE(seen.insert(dimension.name).second, who, ": dimension name \"", dimension.name,
               "\" is used twice; each name must be unique");
    DT_REQUIRE(dimension.size >= 1, who, ": dimension \"", dimension.name, "\" has size ", dimension.size,
               "; every size must be at least 1");
    product *= dimension.size;
  }
  DT_REQUIRE(product == mesh.parent_->size(), who, ": the sizes multiply to ", product, " but group ",
             mesh.parent_->name(), " has ", mesh.parent_->size(), " ranks; choose sizes whose product is ",
             mesh.parent_->size());

  if (!mesh.options_.allowCrossHost) {
    std::vector<size_t> hostLocal;
    for (size_t d = 0; d < mesh.dimensions_.size(); ++d) {
      const auto& listed = mesh.options_.hostLocal;
      if (mesh.dimensions_[d].size > 1 &&
          std::find(listed.begin(), listed.end(), mesh.dimensions_[d].name) != listed.end()) {
        hostLocal.push_back(d);
      }
    }
    if (!hostLocal.empty()) {
      const std::string& hostId = mesh.options_.hostId;
      const std::vector<std::string> hosts = exchangeHostIds(*mesh.parent_, hostId.empty() ? localHostId() : hostId);
      const std::vector<int> shape = mesh.shape();
      for (size_t d : hostLocal) {
        for (const std::vector<int>& members : groupsAlong(shape, {d})) {
          for (int rank : members) {
            if (hosts[rank] == hosts[members.front()]) continue;
            throw InvalidArgument(str(who, ": dimension \"", mesh.dimensions_[d].name, "\" would span hosts: its group ",
                                      formatRanges(members), " has rank ", members.front(), " on host ",
                                      hosts[members.front()], " and rank ", rank, " on host ", hosts[rank],
                                      "; make it an inner dimension whose size divides the ranks per host, or set "
                                      "MeshOptions::allowCrossHost"));
          }
        }
      }
    }
  }
  for (size_t d = 0; d < mesh.dimensions_.size(); ++d) mesh.addEntry(mesh.dimensions_[d].name, {d});
  return mesh;
}

const ProcessGroupPtr& DeviceMesh::addEntry(const std::string& name, std::vector<size_t> dimensions) {
  const std::vector<std::vector<int>> groups = groupsAlong(shape(), dimensions);
  Entry mine;
  mine.dimensions = std::move(dimensions);
  for (size_t index = 0; index < groups.size(); ++index) {
    ProcessGroupOptions groupOptions = options_.groupOptions;
    groupOptions.name = str(parent_->name(), ".", name, index);
    ProcessGroupPtr group = parent_->newGroup(groups[index], std::move(groupOptions));
    if (!group->isMember()) continue;
    mine.group = std::move(group);
    mine.ranks = groups[index];
    mine.coordinate = mine.group->rank();
  }
  DT_INTERNAL_CHECK(mine.group != nullptr, who(), ": rank ", parent_->rank(), " is in no group along ", name);
  return entries_.insert_or_assign(name, std::move(mine)).first->second.group;
}

const ProcessGroupPtr& DeviceMesh::flatten(const std::vector<std::string>& dimensions, std::string name) {
  DT_REQUIRE(!dimensions.empty(), who(), ": flatten needs at least one dimension");
  std::vector<size_t> indices;
  for (const std::string& dimension : dimensions) {
    const auto it = std::find_if(dimensions_.begin(), dimensions_.end(),
                                 [&](const MeshDimension& d) { return d.name == dimension; });
    DT_REQUIRE(it != dimensions_.end(), who(), ": flatten: \"", dimension, "\" is not a dimension of the mesh; known: ",
               join(names()));
    const size_t index = static_cast<size_t>(it - dimensions_.begin());
    DT_REQUIRE(std::find(indices.begin(), indices.end(), index) == indices.end(), who(), ": flatten: dimension \"",
               dimension, "\" is listed twice in [", join(dimensions), "]");
    indices.push_back(index);
  }
  std::sort(indices.begin(), indices.end());
  if (name.empty()) name = join(dimensions, "_");
  if (const auto it = entries_.find(name); it != entries_.end()) {
    DT_REQUIRE(it->second.dimensions == indices, who(), ": flatten: the name \"", name,
               "\" is taken (by a dimension or another flattening); choose another name");
    return it->second.group;
  }
  return addEntry(name, std::move(indices));
}

const DeviceMesh::Entry& DeviceMesh::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  if (it != entries_.end()) return it->second;
  std::vector<std::string> known = names();
  for (const auto& [flattened, unused] : entries_) {
    if (std::find(known.begin(), known.end(), flattened) == known.end()) known.push_back(flattened);
  }
  throw InvalidArgument(str(who(), ": no dimension \"", name, "\"; known: ", join(known)));
}

const ProcessGroupPtr& DeviceMesh::group(const std::string& name) const { return entry(name).group; }
int DeviceMesh::size(const std::string& name) const { return entry(name).group->size(); }
int DeviceMesh::coordinate(const std::string& name) const { return entry(name).coordinate; }
const std::vector<int>& DeviceMesh::ranks(const std::string& name) const { return entry(name).ranks; }

std::vector<std::string> DeviceMesh::names() const {
  std::vector<std::string> out;
  for (const MeshDimension& dimension : dimensions_) out.push_back(dimension.name);
  return out;
}

std::vector<int> DeviceMesh::shape() const {
  std::vector<int> out;
  for (const MeshDimension& dimension : dimensions_) out.push_back(dimension.size);
  return out;
}

std::string DeviceMesh::describe() const {
  std::vector<std::string> parts;
  for (const MeshDimension& dimension : dimensions_) parts.push_back(str(dimension.name, "=", dimension.size));
  return str("[", join(parts), "]");
}

std::string DeviceMesh::who() const {
  return str("DeviceMesh ", describe(), " (rank ", parent_->rank(), "/", parent_->size(), " pg=", parent_->name(), ")");
}

}  // namespace dt
