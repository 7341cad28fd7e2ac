#include "checkpoint/transfer.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "checkpoint/exchange.h"
#include "checkpoint/internal/piece_source.h"
#include "common/errors.h"
#include "common/json.h"
#include "common/strings.h"
#include "tensor/nn/safetensors.h"

namespace dt {
namespace {

using detail::PieceDescriptor;
using detail::PieceSource;

constexpr const char* kStateFormat = "dtrain-state/1";
// broadcastState: a replicated tensor of at least this many bytes is broadcast on its own,
// from and into the tensors themselves (no packing); smaller ones share a bucket.
constexpr size_t kAloneBytes = size_t{1} << 20;

// The step, metadata and world size of a state, as JSON (the header of encoded state and of
// a broadcast).
json::Value headerOf(const TrainingState& state) {
  json::Value h = json::Value::object();
  h.set("format", kStateFormat);
  h.set("step", state.step);
  h.set("world_size", state.worldSize());
  json::Value meta = json::Value::object();
  for (const auto& [k, v] : state.metadata) meta.set(k, v);
  h.set("metadata", std::move(meta));
  return h;
}

struct Header {
  int64_t step = 0;
  int worldSize = 1;
  std::map<std::string, std::string> metadata;
  std::vector<PieceDescriptor> pieces;
};

Header parseHeader(const std::string& text, const std::string& what) {
  const json::Value h = json::parse(text, what);
  const std::string& format = h.get("format", what).asString(what, "format");
  if (format != kStateFormat) throw InvalidArgument(str(what, " has format \"", format, "\", not \"", kStateFormat, "\""));
  Header out;
  out.step = h.get("step", what).asInt(what, "step");
  out.worldSize = static_cast<int>(h.get("world_size", what).asInt(what, "world_size"));
  for (const auto& [k, v] : h.get("metadata", what).members(what, "metadata")) out.metadata[k] = v.asString(what, k);
  for (const auto& p : h.get("tensors", what).items(what, "tensors")) out.pieces.push_back(detail::pieceFromJson(p, what));
  return out;
}

// A piece read from a host tensor holding its elements. `adoptable`: the tensor is memory of
// its own (received just now, referenced by nothing else) that a restore may keep.
PieceSource::Piece memoryPiece(const PieceDescriptor& d, Tensor data, bool adoptable) {
  PieceSource::Piece piece{d.info.placement == Placement::PerRank ? d.rank : -1, d.offset, d.count,
                           [data](int64_t from, int64_t n, void* dst) {
                             const size_t width = itemSize(data.dtype());
                             const char* src = static_cast<const char*>(data.dataPtr()) + static_cast<size_t>(from) * width;
                             // The same address: the bytes were received into the tensor restored.
                             if (src != dst) std::memcpy(dst, src, static_cast<size_t>(n) * width);
                           },
                           Tensor()};
  piece.stride = d.stride;
  piece.repeats = d.repeats;
  if (adoptable) piece.adoptable = std::move(data);
  return piece;
}

// Adds the tensor (once) and the piece to `source`.
void addDescribed(PieceSource& source, std::map<std::string, StateTensorInfo>& seen, const PieceDescriptor& d,
                  Tensor data, bool adoptable = false) {
  auto [it, fresh] = seen.emplace(d.info.name, d.info);
  if (fresh) {
    source.addTensor(d.info);
  } else if (it->second.shape != d.info.shape || it->second.dtype != d.info.dtype ||
             it->second.placement != d.info.placement) {
    throw InvalidArgument(str(source.describe(), ": the ranks describe tensor \"", d.info.name, "\" differently (",
                              toString(d.info.dtype), describeShape(d.info.shape), " and ", toString(it->second.dtype),
                              describeShape(it->second.shape), ")"));
  }
  source.addPiece(d.info.name, memoryPiece(d, std::move(data), adoptable));
}

Tensor hostFlat(const Tensor& t) { return t.detach().to(Device::cpu()).contiguous().view({-1}); }

// The key of a rank's `piece`-th piece of tensor `name` in encoded bytes (nestedState's ranks
// hold several pieces of one sharded tensor).
std::string pieceKey(const std::string& name, int piece) { return piece == 0 ? name : str(name, "#", piece); }

// A source that records what restore() asks for and writes nothing (redistribution's first
// pass); per-rank values are left to the second pass.
class PlanningSource final : public StateSource {
 public:
  PlanningSource(const TrainingState& state, std::map<std::string, StateTensorInfo> index)
      : state_(state), index_(std::move(index)) {}
  struct Request {
    std::string name;
    int64_t offset;
    int64_t count;
  };
  std::string describe() const override { return "the ranks' held state"; }
  int64_t step() const override { return state_.step; }
  int worldSize() const override { return state_.worldSize(); }
  const std::map<std::string, std::string>& metadata() const override { return state_.metadata; }
  std::vector<StateTensorInfo> tensors() const override {
    std::vector<StateTensorInfo> out;
    for (const auto& [name, info] : index_) out.push_back(info);
    return out;
  }
  std::optional<StateTensorInfo> find(const std::string& name) const override {
    auto it = index_.find(name);
    if (it == index_.end()) return std::nullopt;
    return it->second;
  }
  void read(const std::string& name, int64_t offset, Tensor& dst, int) const override {
    auto it = index_.find(name);
    if (it == index_.end()) throw InvalidArgument(str("redistributeState: no rank holds \"", name, "\""));
    if (it->second.placement != Placement::PerRank && dst.numel() > 0) requests.push_back({name, offset, dst.numel()});
  }
  mutable std::vector<Request> requests;

 private:
  const TrainingState& state_;
  std::map<std::string, StateTensorInfo> index_;
};

}  // namespace

std::string encodeState(const TrainingState& state) {
  json::Value header = headerOf(state);
  json::Value list = json::Value::array();
  NamedTensors tensors;
  std::map<std::string, int> piecesOf;
  for (const StateTensor& t : state.collect()) {
    list.push(detail::toJson(detail::descriptorOf(t, state.rank())));
    tensors.emplace_back(pieceKey(t.name, piecesOf[t.name]++), t.local.detach().to(Device::cpu()));
  }
  header.set("tensors", std::move(list));
  return encodeSafetensors(tensors, {{"dtrain_state", header.dump()}});
}

std::unique_ptr<StateSource> stateFromBytes(std::string bytes, const std::string& description) {
  SafetensorsFile file = decodeSafetensors(bytes, description);
  auto it = file.metadata.find("dtrain_state");
  if (it == file.metadata.end()) throw InvalidArgument(str(description, " carry no dtrain_state header"));
  const Header header = parseHeader(it->second, description);
  auto source = std::make_unique<PieceSource>(description, header.step, header.worldSize, header.metadata);
  std::map<std::string, StateTensorInfo> seen;
  std::map<std::string, int> piecesOf;
  for (const PieceDescriptor& d : header.pieces) {
    const std::string key = pieceKey(d.info.name, piecesOf[d.info.name]++);
    auto t = std::find_if(file.tensors.begin(), file.tensors.end(), [&](const auto& e) { return e.first == key; });
    if (t == file.tensors.end()) throw InvalidArgument(str(description, " list \"", d.info.name, "\" but do not hold it"));
    addDescribed(*source, seen, d, t->second.view({-1}));
  }
  return source;
}

void decodeState(std::string bytes, TrainingState& state) { state.restore(*stateFromBytes(std::move(bytes))); }

void broadcastState(TrainingState& state, ProcessGroup& group, int root, bool restoreHere,
                    const BroadcastStateOptions& options) {
  const int rank = group.rank();
  const std::vector<StateTensor> mine = state.collect();
  for (const StateTensor& t : mine) {
    if (t.placement == Placement::Sharded) {
      throw InvalidArgument(str("broadcastState: \"", t.name, "\" is sharded; a sharded state moves by "
                                "redistributeState (or a checkpoint) after its wrapper is rebound"));
    }
  }
  // The root's description of its replicated tensors, step and metadata.
  std::string text;
  if (rank == root) {
    json::Value header = headerOf(state);
    json::Value list = json::Value::array();
    for (const StateTensor& t : mine) {
      if (t.placement == Placement::Replicated) list.push(detail::toJson(detail::descriptorOf(t, root)));
    }
    header.set("tensors", std::move(list));
    text = header.dump();
  }
  broadcastString(group, text, root);
  const Header header = parseHeader(text, str("the state header from rank ", root));

  auto source = std::make_unique<PieceSource>(str("state broadcast by rank ", root), header.step, group.size(),
                                              header.metadata);
  std::map<std::string, StateTensorInfo> seen;
  std::map<std::string, const StateTensor*> mineByName;
  for (const StateTensor& t : mine) mineByName[t.name] = &t;
  const bool onHost = options.device.isCpu();
  const bool keep = restoreHere;  // a rank that only takes part keeps nothing
  // The root's tensor, flat on the transfer's device (no copy when it lies there already).
  auto rootFlat = [&](const PieceDescriptor& d) {
    return mineByName.at(d.info.name)->local.detach().to(options.device).contiguous().view({-1});
  };
  // Where a restoring rank's bytes land: its own live tensor when it is contiguous host memory
  // of the stored dtype and size (the restore then finds them in place), else nothing.
  auto landing = [&](const PieceDescriptor& d) -> Tensor {
    auto it = mineByName.find(d.info.name);
    if (!onHost || it == mineByName.end()) return {};
    const Tensor& t = it->second->local;
    if (!t.device().isCpu() || !t.isContiguous() || t.dtype() != d.info.dtype || t.numel() != d.count) return {};
    return t.detach().view({-1});
  };
  auto grow = [&](Tensor& buffer, int64_t elements, DType dtype) {
    if (!buffer.defined() || buffer.numel() < elements) buffer = empty({elements}, dtype, options.device);
    return buffer.narrow(0, 0, elements);
  };
  // Replicated tensors in header order per dtype: a large one travels alone, straight from the
  // root's tensor into the receiver's; small ones are packed into buckets of up to bucketBytes.
  std::map<DType, std::vector<size_t>> byType;
  for (size_t i = 0; i < header.pieces.size(); ++i) byType[header.pieces[i].info.dtype].push_back(i);
  for (const auto& entry : byType) {
    // Named, not a structured binding: clang before 16 cannot capture those in the lambda below.
    const DType dtype = entry.first;
    const std::vector<size_t>& indices = entry.second;
    const size_t width = itemSize(dtype);
    const int64_t limit = std::max<int64_t>(1, static_cast<int64_t>(options.bucketBytes / width));
    auto travelsAlone = [&](size_t k) {
      return static_cast<size_t>(header.pieces[indices[k]].count) * width >= kAloneBytes;
    };
    Tensor staging;  // the packed buckets, reused (receivers unpack each before the next)
    Tensor scratch;  // where a rank that keeps nothing receives lone tensors, reused
    size_t begin = 0;
    while (begin < indices.size()) {
      size_t end = begin;
      int64_t elements = 0;
      if (travelsAlone(begin)) {
        elements = header.pieces[indices[end++]].count;
      } else {
        while (end < indices.size() && !travelsAlone(end) &&
               (end == begin || elements + header.pieces[indices[end]].count <= limit)) {
          elements += header.pieces[indices[end]].count;
          ++end;
        }
      }
      if (end - begin == 1 && travelsAlone(begin)) {
        const PieceDescriptor& d = header.pieces[indices[begin]];
        Tensor buffer;
        bool own = false;
        if (rank == root) {
          buffer = rootFlat(d);
        } else if (keep) {
          buffer = landing(d);
          own = !buffer.defined();
          if (own) buffer = empty({d.count}, dtype, options.device);
        } else {
          buffer = grow(scratch, d.count, dtype);
        }
        group.broadcast(buffer, {.root = root})->wait();
        if (keep) addDescribed(*source, seen, d, buffer.to(Device::cpu()), own && onHost);
      } else {
        Tensor bucket = grow(staging, std::max<int64_t>(elements, 1), dtype);
        if (rank == root) {
          int64_t at = 0;
          for (size_t k = begin; k < end; ++k) {
            const PieceDescriptor& d = header.pieces[indices[k]];
            bucket.narrow(0, at, d.count).copy_(rootFlat(d));
            at += d.count;
          }
        }
        group.broadcast(bucket, {.root = root})->wait();
        int64_t at = 0;
        for (size_t k = begin; k < end && keep; ++k) {
          const PieceDescriptor& d = header.pieces[indices[k]];
          const Tensor arrived = bucket.narrow(0, at, d.count);
          at += d.count;
          if (rank == root) {
            addDescribed(*source, seen, d, rootFlat(d).to(Device::cpu()));
          } else if (Tensor into = landing(d); into.defined()) {
            into.copy_(arrived);
            addDescribed(*source, seen, d, into);
          } else {
            addDescribed(*source, seen, d, onHost ? arrived.clone() : arrived.to(Device::cpu()), onHost);
          }
        }
      }
      begin = end;
    }
  }
  // Per-rank values: every rank's own.
  for (const StateTensor& t : mine) {
    if (t.placement != Placement::PerRank) continue;
    std::vector<Tensor> all;
    for (int r = 0; r < group.size(); ++r) all.push_back(empty(t.local.sizes(), t.local.dtype()));
    group.allgather(all, t.local.detach().to(Device::cpu()).contiguous())->wait();
    for (int r = 0; r < group.size(); ++r) {
      PieceDescriptor d = detail::descriptorOf(t, r);
      addDescribed(*source, seen, d, all[static_cast<size_t>(r)].view({-1}));
    }
  }
  if (keep) state.restore(*source);
}

void redistributeState(const std::vector<StateTensor>& held, TrainingState& state, ProcessGroup& group) {
  const int rank = group.rank();
  const int world = group.size();
  // 1. Every rank's held pieces.
  json::Value list = json::Value::array();
  std::vector<Tensor> myPieces;  // this rank's held pieces, in the order heldBy[rank] lists them
  for (const StateTensor& t : held) {
    if (t.placement == Placement::PerRank) continue;
    list.push(detail::toJson(detail::descriptorOf(t, rank)));
    myPieces.push_back(hostFlat(t.local));
  }
  std::vector<std::vector<PieceDescriptor>> heldBy(static_cast<size_t>(world));
  std::map<std::string, StateTensorInfo> index;
  const auto heldTexts = allgatherStrings(group, list.dump());
  for (int r = 0; r < world; ++r) {
    const json::Value theirs = json::parse(heldTexts[static_cast<size_t>(r)], "held state");
    for (const auto& p : theirs.items()) {
      heldBy[static_cast<size_t>(r)].push_back(detail::pieceFromJson(p, "held state"));
      heldBy[static_cast<size_t>(r)].back().rank = r;
      index.emplace(heldBy[static_cast<size_t>(r)].back().info.name, heldBy[static_cast<size_t>(r)].back().info);
    }
  }
  // Per-rank tensors stay with their rank: this rank's held value, else its current one.
  std::map<std::string, Tensor> perRank;
  for (const StateTensor& t : state.collect()) {
    if (t.placement == Placement::PerRank) {
      perRank[t.name] = hostFlat(t.local);
      index.emplace(t.name, StateTensorInfo{t.name, t.placement, t.shape, t.local.dtype()});
    }
  }
  for (const StateTensor& t : held) {
    if (t.placement == Placement::PerRank) perRank[t.name] = hostFlat(t.local);
  }

  // 2. What this rank's new layout needs (a restore that records and writes nothing).
  PlanningSource planning(state, index);
  state.restore(planning);
  json::Value wanted = json::Value::array();
  for (const auto& req : planning.requests) {
    json::Value r = json::Value::array();
    r.push(req.name);
    r.push(req.offset);
    r.push(req.count);
    wanted.push(std::move(r));
  }
  const auto wantedTexts = allgatherStrings(group, wanted.dump());

  // 3. Every rank computes the same plan: each needed run from the lowest rank that holds it.
  struct Run {
    std::string name;
    int from, to;
    int64_t offset, count;
    size_t piece;     // which of heldBy[from]
    int64_t localAt;  // where element `offset` is among that piece's elements
  };
  // Whether piece `p` holds element `at`; if so where among its elements, and how many from
  // `at` on lie in one run (a strided piece holds `repeats` runs every `stride`).
  const auto holds = [](const PieceDescriptor& p, int64_t at, int64_t* localAt, int64_t* inRun) {
    const int64_t runs = std::max<int64_t>(p.repeats, 1);
    const int64_t run = p.count / runs;
    if (at < p.offset || run == 0) return false;
    const int64_t i = runs == 1 ? 0 : (at - p.offset) / p.stride;
    const int64_t within = at - p.offset - i * (runs == 1 ? 0 : p.stride);
    if (i >= runs || within >= run) return false;
    *localAt = i * run + within;
    *inRun = run - within;
    return true;
  };
  std::vector<Run> runs;
  for (int to = 0; to < world; ++to) {
    const json::Value wantedBy = json::parse(wantedTexts[static_cast<size_t>(to)], "wanted state");
    for (const auto& r : wantedBy.items()) {
      const auto& v = r.items();
      const std::string name = v.at(0).asString();
      int64_t at = v.at(1).asInt();
      const int64_t end = at + v.at(2).asInt();
      while (at < end) {
        const PieceDescriptor* best = nullptr;
        size_t bestIndex = 0;
        int64_t localAt = 0, inRun = 0;
        for (int from = 0; from < world && best == nullptr; ++from) {
          const auto& theirs = heldBy[static_cast<size_t>(from)];
          for (size_t k = 0; k < theirs.size(); ++k) {
            if (theirs[k].info.name == name && holds(theirs[k], at, &localAt, &inRun)) {
              best = &theirs[k];
              bestIndex = k;
              break;
            }
          }
        }
        if (best == nullptr) {
          throw InvalidArgument(str("redistributeState: rank ", to, " needs element ", at, " of \"", name,
                                    "\", which no rank holds (a lost rank's shards have no other copy: load them from "
                                    "the newest checkpoint instead)"));
        }
        const int64_t n = std::min(end - at, inRun);
        runs.push_back({name, best->rank, to, at, n, bestIndex, localAt});
        at += n;
      }
    }
  }

  // 4. One allToAll per dtype moves the runs; buffers carry one spare element so none is empty.
  auto source = std::make_unique<PieceSource>("redistributed state", state.step, world, state.metadata);
  std::map<std::string, StateTensorInfo> seen;
  std::map<DType, std::vector<const Run*>> byType;
  for (const Run& run : runs) {
    if (run.from == rank || run.to == rank) byType[index.at(run.name).dtype].push_back(&run);
  }
  // Every rank must issue the same allToAlls: the dtypes of all runs, not only this rank's.
  std::set<DType> dtypes;
  for (const Run& run : runs) dtypes.insert(index.at(run.name).dtype);
  for (DType dtype : dtypes) {
    std::vector<int64_t> sendCount(static_cast<size_t>(world), 1), recvCount(static_cast<size_t>(world), 1);
    for (const Run* run : byType[dtype]) {
      if (run->from == rank) sendCount[static_cast<size_t>(run->to)] += run->count;
      if (run->to == rank) recvCount[static_cast<size_t>(run->from)] += run->count;
    }
    std::vector<Tensor> inputs, outputs;
    for (int r = 0; r < world; ++r) {
      inputs.push_back(zeros({sendCount[static_cast<size_t>(r)]}, dtype));
      outputs.push_back(empty({recvCount[static_cast<size_t>(r)]}, dtype));
    }
    std::vector<int64_t> sendAt(static_cast<size_t>(world), 0), recvAt(static_cast<size_t>(world), 0);
    const size_t width = itemSize(dtype);
    for (const Run* run : byType[dtype]) {
      if (run->from != rank) continue;
      const Tensor& data = myPieces.at(run->piece);
      int64_t& at = sendAt[static_cast<size_t>(run->to)];
      std::memcpy(static_cast<char*>(inputs[static_cast<size_t>(run->to)].dataPtr()) + static_cast<size_t>(at) * width,
                  static_cast<const char*>(data.dataPtr()) + static_cast<size_t>(run->localAt) * width,
                  static_cast<size_t>(run->count) * width);
      at += run->count;
    }
    group.allToAll(outputs, inputs)->wait();
    for (const Run* run : byType[dtype]) {
      if (run->to != rank) continue;
      int64_t& at = recvAt[static_cast<size_t>(run->from)];
      PieceDescriptor d{index.at(run->name), run->from, run->offset, run->count};
      addDescribed(*source, seen, d, outputs[static_cast<size_t>(run->from)].narrow(0, at, run->count));
      at += run->count;
    }
  }
  for (const auto& [name, value] : perRank) {
    PieceDescriptor d{index.at(name), rank, 0, value.numel()};
    addDescribed(*source, seen, d, value);
  }
  // Tensors this rank needs none of still belong in the index (restore checks names).
  for (const auto& [name, info] : index) {
    if (!seen.count(name)) {
      source->addTensor(info);
      seen.emplace(name, info);
    }
  }
  state.restore(*source);
}

}  // namespace dt
