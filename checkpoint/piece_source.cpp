#include "checkpoint/internal/piece_source.h"

#include <algorithm>
#include <utility>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/autograd.h"
#include "tensor/nn/safetensors.h"

namespace dt::detail {

PieceDescriptor descriptorOf(const StateTensor& tensor, int rank) {
  return {{tensor.name, tensor.placement, tensor.shape, tensor.local.dtype()}, rank, tensor.offset, tensor.local.numel(),
          tensor.stride, tensor.repeats};
}

json::Value toJson(const PieceDescriptor& piece) {
  json::Value p = json::Value::object();
  p.set("name", piece.info.name);
  p.set("placement", placementName(piece.info.placement));
  p.set("dtype", safetensorsDType(piece.info.dtype));
  json::Value shape = json::Value::array();
  for (int64_t d : piece.info.shape) shape.push(d);
  p.set("shape", std::move(shape));
  p.set("rank", piece.rank);
  p.set("offset", piece.offset);
  p.set("count", piece.count);
  if (piece.repeats > 1) {
    p.set("stride", piece.stride);
    p.set("repeats", piece.repeats);
  }
  return p;
}

PieceDescriptor pieceFromJson(const json::Value& value, const std::string& what) {
  PieceDescriptor piece;
  piece.info.name = value.get("name", what).asString(what, "name");
  piece.info.placement = placementFromName(value.get("placement", what).asString(what, "placement"), what);
  piece.info.dtype = dtypeFromSafetensors(value.get("dtype", what).asString(what, "dtype"));
  for (const auto& d : value.get("shape", what).items(what, "shape")) piece.info.shape.push_back(d.asInt(what, "shape"));
  piece.rank = static_cast<int>(value.get("rank", what).asInt(what, "rank"));
  piece.offset = value.get("offset", what).asInt(what, "offset");
  piece.count = value.get("count", what).asInt(what, "count");
  if (value.find("repeats")) {
    piece.stride = value.get("stride", what).asInt(what, "stride");
    piece.repeats = value.get("repeats", what).asInt(what, "repeats");
  }
  return piece;
}

PieceSource::PieceSource(std::string description, int64_t step, int worldSize,
                         std::map<std::string, std::string> metadata)
    : description_(std::move(description)), step_(step), worldSize_(worldSize), metadata_(std::move(metadata)) {}

void PieceSource::addTensor(StateTensorInfo info) {
  const std::string name = info.name;
  if (!entries_.emplace(name, Entry{std::move(info), {}}).second) {
    throw InvalidArgument(str(description_, " lists tensor \"", name, "\" twice"));
  }
  order_.push_back(name);
}

void PieceSource::addPiece(const std::string& name, Piece piece) {
  auto it = entries_.find(name);
  if (it == entries_.end()) throw InvalidArgument(str(description_, ": a piece of \"", name, "\", which it does not list"));
  const StateTensorInfo& info = it->second.info;
  const int64_t numel = shapeNumel(info.shape);
  const bool strided = piece.repeats > 1;
  const int64_t run = strided ? piece.count / piece.repeats : piece.count;
  const int64_t end = piece.offset + (strided ? (piece.repeats - 1) * piece.stride : 0) + run;
  if (piece.offset < 0 || piece.count < 0 || end > numel || piece.repeats < 1 ||
      (strided && (piece.count % piece.repeats != 0 || piece.stride < run || info.placement != Placement::Sharded)) ||
      (info.placement == Placement::PerRank && (piece.offset != 0 || piece.count != numel))) {
    throw InvalidArgument(str(description_, ": a piece of \"", name, "\" holds elements [", piece.offset, ", ", end,
                              strided ? str(") in ", piece.repeats, " runs every ", piece.stride) : std::string(")"),
                              " of ", describeShape(info.shape)));
  }
  it->second.pieces.push_back(std::move(piece));
}

void PieceSource::checkCoverage() const {
  for (const auto& name : order_) {
    const Entry& e = entries_.at(name);
    std::vector<const Piece*> pieces;
    for (const Piece& p : e.pieces) pieces.push_back(&p);
    if (e.info.placement == Placement::PerRank) {
      std::vector<int> ranks;
      for (const Piece* p : pieces) ranks.push_back(p->rank);
      std::sort(ranks.begin(), ranks.end());
      for (int r = 0; r < worldSize_; ++r) {
        if (!std::binary_search(ranks.begin(), ranks.end(), r)) {
          throw InvalidArgument(str(description_, " has no value of rank ", r, " for per-rank tensor \"", name,
                                    "\" (written by ", worldSize_, " ranks)"));
        }
      }
      continue;
    }
    // Every run of every piece, [begin, end), sorted.
    std::vector<std::pair<int64_t, int64_t>> runs;
    for (const Piece* p : pieces) {
      const int64_t run = p->count / p->repeats;
      for (int64_t i = 0; i < p->repeats; ++i) runs.emplace_back(p->offset + i * p->stride, p->offset + i * p->stride + run);
    }
    std::sort(runs.begin(), runs.end());
    int64_t covered = 0;
    for (const auto& [begin, end] : runs) {
      if (begin > covered) break;
      covered = std::max(covered, end);
    }
    if (covered < shapeNumel(e.info.shape)) {
      throw InvalidArgument(str(description_, ": no piece holds element ", covered, " of \"", name, "\" ",
                                describeShape(e.info.shape), " (", e.pieces.size(), " pieces)"));
    }
  }
}

std::vector<StateTensorInfo> PieceSource::tensors() const {
  std::vector<StateTensorInfo> out;
  for (const auto& name : order_) out.push_back(entries_.at(name).info);
  return out;
}

std::optional<StateTensorInfo> PieceSource::find(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) return std::nullopt;
  return it->second.info;
}

Tensor PieceSource::adoptable(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end() || it->second.info.placement == Placement::PerRank || it->second.pieces.size() != 1) return {};
  const Piece& piece = it->second.pieces.front();
  if (!piece.adoptable.defined() || piece.offset != 0 || piece.count != shapeNumel(it->second.info.shape)) return {};
  return piece.adoptable.view(it->second.info.shape);
}

const PieceSource::Entry& PieceSource::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) throw InvalidArgument(str(description_, " has no tensor \"", name, "\""));
  return it->second;
}

const PieceSource::Piece* PieceSource::holding(const Entry& e, int64_t at, int64_t* local, int64_t* inRun) {
  for (const Piece& p : e.pieces) {
    if (at < p.offset) continue;
    if (p.repeats <= 1) {
      if (at < p.offset + p.count) {
        *local = at - p.offset;
        *inRun = p.offset + p.count - at;
        return &p;
      }
      continue;
    }
    const int64_t run = p.count / p.repeats;
    const int64_t index = (at - p.offset) / p.stride, within = (at - p.offset) % p.stride;
    if (index < p.repeats && within < run) {
      *local = index * run + within;
      *inRun = run - within;
      return &p;
    }
  }
  return nullptr;
}

void PieceSource::read(const std::string& name, int64_t offset, Tensor& dst, int rank) const {
  const Entry& e = entry(name);
  const int64_t count = dst.numel();
  const int64_t numel = shapeNumel(e.info.shape);
  if (offset < 0 || offset + count > numel) {
    throw InvalidArgument(str(description_, ": elements [", offset, ", ", offset + count, ") of \"", name, "\" ",
                              describeShape(e.info.shape), " are out of range"));
  }
  // Straight into dst when it is host memory of the stored dtype, else through a staging copy.
  const bool direct = dst.device().isCpu() && dst.isContiguous() && dst.dtype() == e.info.dtype;
  Tensor staging = direct ? dst : empty({count}, e.info.dtype);
  auto* bytes = static_cast<char*>(staging.dataPtr());
  const size_t width = itemSize(e.info.dtype);
  if (e.info.placement == Placement::PerRank) {
    const Piece* piece = nullptr;
    for (const Piece& p : e.pieces) {
      if (p.rank == rank) piece = &p;
    }
    if (piece == nullptr) {
      throw InvalidArgument(str(description_, " has no value of rank ", rank, " for per-rank tensor \"", name,
                                "\" (written by ", worldSize_, " ranks)"));
    }
    if (count > 0) piece->read(offset, count, bytes);
  } else {
    int64_t done = 0;  // elements [offset, offset + done) are in place
    while (done < count) {
      const int64_t at = offset + done;
      int64_t local = 0, inRun = 0;
      const Piece* piece = holding(e, at, &local, &inRun);
      if (piece == nullptr) {
        throw InvalidArgument(str(description_, ": no piece holds element ", at, " of \"", name, "\" ",
                                  describeShape(e.info.shape)));
      }
      const int64_t n = std::min(count - done, inRun);
      piece->read(local, n, bytes + static_cast<size_t>(done) * width);
      done += n;
    }
  }
  if (!direct) {
    NoGradGuard noGrad;
    dst.copy_(staging.view(dst.sizes()));
  }
}

}  // namespace dt::detail
