#include "checkpoint/checkpoint_dir.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include "checkpoint/exchange.h"
#include "checkpoint/internal/piece_source.h"
#include "common/errors.h"
#include "common/json.h"
#include "common/strings.h"
#include "tensor/nn/safetensors.h"

namespace dt {
namespace {

namespace fs = std::filesystem;

std::string stepName(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string dataFileName(int64_t step, int rank) {
  if (rank == 0) return stepName(step) + ".safetensors";
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%s.rank%05d.safetensors", stepName(step).c_str(), rank);
  return buf;
}

std::string crcText(uint32_t crc) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08x", crc);
  return buf;
}

// The name a piece has inside its data file.
// `piece`: the how-manieth piece of the tensor in this file (a rank may write several pieces of
// one sharded tensor, nestedState's runs); the first keeps the bare name, as files before
// pieces had it.
std::string keyInFile(const StateTensorInfo& info, int rank, int piece = 0) {
  if (info.placement == Placement::PerRank) return str(info.name, ".rank", rank);
  return piece == 0 ? info.name : str(info.name, "#", piece);
}

// Writes bytes to path via path.tmp + fsync + rename.
void writeFileAtomically(const fs::path& path, const std::string& bytes) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InvalidArgument(str("checkpoint: cannot create ", tmp.string(), ": ", std::strerror(errno)));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) throw InvalidArgument(str("checkpoint: writing ", tmp.string(), " failed (disk full?)"));
  }
  syncPath(tmp, "checkpoint");
  fs::rename(tmp, path);
}

std::string readWholeFile(const fs::path& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument(str(what, " ", path.string(), " cannot be read: ", std::strerror(errno)));
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

json::Value shapeJson(const Shape& shape) {
  json::Value out = json::Value::array();
  for (int64_t d : shape) out.push(d);
  return out;
}
// A checkpoint on disk as a StateSource: files opened (and checked against the manifest)
// when a piece of them is first read.
class CheckpointReader final : public detail::PieceSource {
 public:
  CheckpointReader(fs::path dir, const CheckpointManifest& manifest)
      : PieceSource(str("checkpoint ", manifest.path.string()), manifest.step, manifest.worldSize, manifest.metadata),
        dir_(std::move(dir)),
        manifest_(manifest),
        readers_(manifest.files.size()) {
    for (const CheckpointTensor& t : manifest.tensors) {
      addTensor(t.info);
      std::map<size_t, int> piecesInFile;  // the manifest lists a file's pieces of a tensor in the order written
      for (const CheckpointPiece& p : t.pieces) {
        if (p.file >= manifest.files.size()) {
          throw InvalidArgument(str("checkpoint manifest ", manifest.path.string(), ": a piece of \"", t.info.name,
                                    "\" names file #", p.file, " of ", manifest.files.size()));
        }
        const std::string key = keyInFile(t.info, p.rank, piecesInFile[p.file]++);
        const size_t file = p.file;
        const StateTensorInfo info = t.info;
        Piece piece{p.rank, p.offset, p.count, [this, file, key, info](int64_t from, int64_t n, void* dst) {
                      const SafetensorsReader& reader = open(file);
                      const SafetensorsEntry& entry = reader.entry(key);
                      if (entry.dtype != info.dtype) {
                        throw InvalidArgument(str(reader.path().string(), ": \"", key, "\" is ", toString(entry.dtype),
                                                  " but the manifest says ", toString(info.dtype)));
                      }
                      reader.readElements(entry, from, n, dst);
                    }};
        piece.stride = p.stride;
        piece.repeats = p.repeats;
        addPiece(t.info.name, std::move(piece));
      }
    }
    checkCoverage();
  }

  // Every file, checked (the CLI's verify).
  void openAll() const {
    for (size_t i = 0; i < readers_.size(); ++i) open(i);
  }

 private:
  const SafetensorsReader& open(size_t index) const {
    if (readers_[index]) return *readers_[index];
    const CheckpointFile& f = manifest_.files[index];
    const fs::path path = dir_ / f.name;
    std::error_code ec;
    if (!fs::exists(path, ec)) {
      throw InvalidArgument(str("checkpoint ", manifest_.path.string(), " names ", path.string(), ", which does not exist"));
    }
    uint64_t bytes = 0;
    const uint32_t crc = fileCrc32(path, &bytes);
    if (bytes != f.bytes || crc != f.crc32) {
      throw InvalidArgument(str("checkpoint file ", path.string(), " is corrupt: it has ", bytes, " bytes with CRC-32 ",
                                crcText(crc), " but its manifest ", manifest_.path.string(), " recorded ", f.bytes,
                                " bytes with CRC-32 ", crcText(f.crc32),
                                ". Remove this checkpoint (its manifest and data files) to resume from the one before"));
    }
    readers_[index] = std::make_unique<SafetensorsReader>(path);
    return *readers_[index];
  }

  fs::path dir_;
  CheckpointManifest manifest_;
  mutable std::vector<std::unique_ptr<SafetensorsReader>> readers_;
};

}  // namespace

// ---- manifest ---------------------------------------------------------------------------------------------

const std::string& CheckpointManifest::text(const std::string& key) const {
  auto it = metadata.find(key);
  if (it == metadata.end()) {
    throw InvalidArgument(str("checkpoint manifest ", path.empty() ? std::string("(in memory)") : path.string(),
                              " has no \"", key, "\""));
  }
  return it->second;
}

int64_t CheckpointManifest::integer(const std::string& key) const {
  const std::string& t = text(key);
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), value);
  if (ec != std::errc() || end != t.data() + t.size()) {
    throw InvalidArgument(str("checkpoint manifest ", path.string(), ": \"", key, "\" is \"", t, "\", not an integer"));
  }
  return value;
}

void CheckpointManifest::requireSame(const std::vector<std::pair<std::string, std::string>>& settings,
                                     const std::string& keyPrefix, const std::string& hint) const {
  for (const auto& [key, value] : settings) {
    const std::string& saved = text(keyPrefix + key);
    if (saved != value) {
      throw InvalidArgument(str("checkpoint ", path.string(), " was written with ", key, " = ", saved,
                                " but this run has ", key, " = ", value, ". ", hint));
    }
  }
}

std::string CheckpointManifest::toJson() const {
  json::Value root = json::Value::object();
  root.set("format", kFormat);
  root.set("step", step);
  root.set("world_size", worldSize);
  json::Value meta = json::Value::object();
  for (const auto& [k, v] : metadata) meta.set(k, v);
  root.set("metadata", std::move(meta));
  json::Value fileList = json::Value::array();
  for (const auto& f : files) {
    json::Value j = json::Value::object();
    j.set("name", f.name);
    j.set("rank", f.rank);
    j.set("bytes", f.bytes);
    j.set("crc32", crcText(f.crc32));
    fileList.push(std::move(j));
  }
  root.set("files", std::move(fileList));
  json::Value tensorList = json::Value::object();
  for (const auto& t : tensors) {
    json::Value j = json::Value::object();
    j.set("placement", placementName(t.info.placement));
    j.set("dtype", safetensorsDType(t.info.dtype));
    j.set("shape", shapeJson(t.info.shape));
    json::Value pieces = json::Value::array();
    for (const auto& p : t.pieces) {
      // [file, offset, count], [file, offset, count, stride, repeats] for a strided piece, or
      // [file, rank] for a per-rank value.
      json::Value piece = json::Value::array();
      piece.push(static_cast<uint64_t>(p.file));
      if (t.info.placement == Placement::PerRank) {
        piece.push(p.rank);
      } else {
        piece.push(p.offset);
        piece.push(p.count);
        if (p.repeats > 1) {
          piece.push(p.stride);
          piece.push(p.repeats);
        }
      }
      pieces.push(std::move(piece));
    }
    j.set("pieces", std::move(pieces));
    tensorList.set(t.info.name, std::move(j));
  }
  root.set("tensors", std::move(tensorList));
  return root.dump(1) + "\n";
}

CheckpointManifest CheckpointManifest::parse(const std::string& text, const fs::path& path) {
  const std::string what = str("checkpoint manifest ", path.string());
  const json::Value root = json::parse(text, what);
  if (!root.isObject()) throw InvalidArgument(str(what, " is corrupt: it is not a JSON object"));
  const std::string& format = root.get("format", what).asString(what, "format");
  if (format != kFormat) {
    throw InvalidArgument(str(what, " has format \"", format, "\"; this dtrain reads \"", kFormat,
                              "\" (a checkpoint of an older dtrain cannot be resumed: start afresh)"));
  }
  CheckpointManifest m;
  m.path = path;
  m.step = root.get("step", what).asInt(what, "step");
  m.worldSize = static_cast<int>(root.get("world_size", what).asInt(what, "world_size"));
  for (const auto& [k, v] : root.get("metadata", what).members(what, "metadata")) m.metadata[k] = v.asString(what, k);
  for (const auto& f : root.get("files", what).items(what, "files")) {
    CheckpointFile file;
    file.name = f.get("name", what).asString(what, "name");
    file.rank = static_cast<int>(f.get("rank", what).asInt(what, "rank"));
    file.bytes = static_cast<uint64_t>(f.get("bytes", what).asInt(what, "bytes"));
    const std::string& crc = f.get("crc32", what).asString(what, "crc32");
    file.crc32 = static_cast<uint32_t>(std::strtoul(crc.c_str(), nullptr, 16));
    if (file.name.find('/') != std::string::npos || file.name.empty()) {
      throw InvalidArgument(str(what, ": file name \"", file.name, "\" must be a plain name in the checkpoint folder"));
    }
    m.files.push_back(std::move(file));
  }
  for (const auto& [name, t] : root.get("tensors", what).members(what, "tensors")) {
    CheckpointTensor tensor;
    tensor.info.name = name;
    tensor.info.placement = placementFromName(t.get("placement", what).asString(what, "placement"), what);
    tensor.info.dtype = dtypeFromSafetensors(t.get("dtype", what).asString(what, "dtype"));
    for (const auto& d : t.get("shape", what).items(what, "shape")) tensor.info.shape.push_back(d.asInt(what, "shape"));
    for (const auto& p : t.get("pieces", what).items(what, "pieces")) {
      const auto& v = p.items(what, "pieces");
      CheckpointPiece piece;
      const bool perRank = tensor.info.placement == Placement::PerRank;
      if (perRank ? v.size() != 2u : (v.size() != 3u && v.size() != 5u)) {
        throw InvalidArgument(str(what, ": a piece of \"", name, "\" has ", v.size(), " numbers, not ",
                                  perRank ? "2" : "3 (or 5 when strided)"));
      }
      piece.file = static_cast<size_t>(v[0].asInt(what, "pieces"));
      if (perRank) {
        piece.rank = static_cast<int>(v[1].asInt(what, "pieces"));
        piece.count = shapeNumel(tensor.info.shape);
      } else {
        piece.offset = v[1].asInt(what, "pieces");
        piece.count = v[2].asInt(what, "pieces");
        if (v.size() == 5u) {
          piece.stride = v[3].asInt(what, "pieces");
          piece.repeats = v[4].asInt(what, "pieces");
        }
      }
      tensor.pieces.push_back(piece);
    }
    m.tensors.push_back(std::move(tensor));
  }
  return m;
}

// ---- the folder -------------------------------------------------------------------------------------------

uint32_t fileCrc32(const fs::path& path, uint64_t* size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument(str("checkpoint: cannot read ", path.string(), ": ", std::strerror(errno)));
  uLong crc = crc32(0L, Z_NULL, 0);
  uint64_t total = 0;
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const auto got = in.gcount();
    if (got <= 0) break;
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buffer.data()), static_cast<uInt>(got));
    total += static_cast<uint64_t>(got);
  }
  if (in.bad()) throw InvalidArgument(str("checkpoint: reading ", path.string(), " failed"));
  if (size) *size = total;
  return static_cast<uint32_t>(crc);
}

CheckpointDir::CheckpointDir(fs::path dir, int keep) : dir_(std::move(dir)), keep_(keep) {
  if (keep_ < 1) throw InvalidArgument(str("checkpoint: keep ", keep_, " must be at least 1"));
}

CheckpointRef CheckpointDir::refFor(int64_t step) const {
  return {step, dir_ / (stepName(step) + ".json"), dir_ / dataFileName(step, 0)};
}

std::vector<CheckpointRef> CheckpointDir::list() const {
  std::vector<CheckpointRef> out;
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) return out;
  static const std::regex pattern(R"(step-(\d{8,})\.json)");
  for (const auto& entry : fs::directory_iterator(dir_)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, m, pattern)) out.push_back(refFor(std::stoll(m[1].str())));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointRef& a, const CheckpointRef& b) { return a.step < b.step; });
  return out;
}

std::optional<CheckpointRef> CheckpointDir::latest() const {
  auto all = list();
  if (all.empty()) return std::nullopt;
  return all.back();
}

CheckpointRef CheckpointDir::save(const TrainingState& state, ProcessGroup* group) const {
  const int rank = group ? group->rank() : 0;
  const int world = group ? group->size() : 1;
  if (state.rank() != rank || state.worldSize() != world) {
    throw InvalidArgument(str("checkpoint: the TrainingState was made for rank ", state.rank(), " of ", state.worldSize(),
                              " but is saved by rank ", rank, " of ", world));
  }
  const CheckpointRef ref = refFor(state.step);
  const std::string fileName = dataFileName(state.step, rank);
  const std::vector<StateTensor> tensors = state.collect();
  const Device cpu = Device::cpu();

  // Per-rank values travel to rank 0, which writes them with the replicated tensors.
  std::vector<std::vector<Tensor>> perRank;
  for (const StateTensor& t : tensors) {
    if (t.placement != Placement::PerRank) continue;
    std::vector<Tensor> all;
    if (group && world > 1) {
      for (int r = 0; r < world; ++r) all.push_back(empty(t.local.sizes(), t.local.dtype()));
      group->allgather(all, t.local.to(cpu).contiguous())->wait();
    } else {
      all.push_back(t.local.to(cpu));
    }
    perRank.push_back(std::move(all));
  }

  json::Value report = json::Value::object();
  try {
    std::error_code ec;
    fs::create_directories(dir_, ec);
    if (ec) throw InvalidArgument(str("checkpoint: cannot create the folder ", dir_.string(), ": ", ec.message()));
    NamedTensors contents;
    json::Value pieces = json::Value::array();
    size_t perRankIndex = 0;
    std::map<std::string, int> piecesOf;
    for (const StateTensor& t : tensors) {
      if (t.placement == Placement::PerRank) {
        const auto& all = perRank[perRankIndex++];
        if (rank != 0) continue;
        for (int r = 0; r < world; ++r) contents.emplace_back(str(t.name, ".rank", r), all[static_cast<size_t>(r)]);
        pieces.push(detail::toJson(detail::descriptorOf(t, rank)));
      } else if (t.placement == Placement::Sharded || rank == 0) {
        const StateTensorInfo info{t.name, t.placement, t.shape, t.local.dtype()};
        contents.emplace_back(keyInFile(info, rank, piecesOf[t.name]++), t.local.detach().to(cpu));
        pieces.push(detail::toJson(detail::descriptorOf(t, rank)));
      }
    }
    if (rank == 0 || !contents.empty()) {
      saveSafetensors(dir_ / fileName, contents,
                      {{"format", CheckpointManifest::kFormat}, {"step", std::to_string(state.step)},
                       {"rank", std::to_string(rank)}, {"world_size", std::to_string(world)}});
      uint64_t bytes = 0;
      const uint32_t crc = fileCrc32(dir_ / fileName, &bytes);
      report.set("file", fileName);
      report.set("bytes", bytes);
      report.set("crc32", crcText(crc));
      report.set("pieces", std::move(pieces));
    }
  } catch (const std::exception& e) {
    report = json::Value::object();
    report.set("error", describe(e));
  }
  const std::vector<std::string> reports =
      group ? allgatherStrings(*group, report.dump()) : std::vector<std::string>{report.dump()};

  std::string status;  // rank 0's verdict: "" or why the checkpoint does not exist
  if (rank == 0) {
    try {
      CheckpointManifest manifest;
      manifest.step = state.step;
      manifest.worldSize = world;
      manifest.metadata = state.metadata;
      std::map<std::string, size_t> tensorIndex;
      for (int r = 0; r < world; ++r) {
        const json::Value rep = json::parse(reports[static_cast<size_t>(r)], str("rank ", r, "'s checkpoint report"));
        if (const json::Value* error = rep.find("error")) {
          throw InvalidArgument(str("checkpoint step ", state.step, ": rank ", r, " could not write its file: ",
                                    error->asString()));
        }
        if (!rep.find("file")) continue;
        const size_t file = manifest.files.size();
        manifest.files.push_back({rep.get("file").asString(), r, static_cast<uint64_t>(rep.get("bytes").asInt()),
                                  static_cast<uint32_t>(std::strtoul(rep.get("crc32").asString().c_str(), nullptr, 16))});
        for (const auto& p : rep.get("pieces").items()) {
          const detail::PieceDescriptor piece = detail::pieceFromJson(p, "checkpoint report");
          const StateTensorInfo& info = piece.info;
          auto [it, fresh] = tensorIndex.emplace(info.name, manifest.tensors.size());
          if (fresh) manifest.tensors.push_back({info, {}});
          CheckpointTensor& entry = manifest.tensors[it->second];
          if (entry.info.shape != info.shape || entry.info.dtype != info.dtype || entry.info.placement != info.placement) {
            throw InvalidArgument(str("checkpoint step ", state.step, ": ranks disagree about tensor \"", info.name,
                                      "\" (rank ", r, " has ", placementName(info.placement), " ", toString(info.dtype),
                                      describeShape(info.shape), ", an earlier rank ",
                                      placementName(entry.info.placement), " ", toString(entry.info.dtype),
                                      describeShape(entry.info.shape), ")"));
          }
          if (info.placement == Placement::PerRank) {
            for (int owner = 0; owner < world; ++owner) {
              entry.pieces.push_back({file, owner, 0, shapeNumel(info.shape)});
            }
          } else {
            entry.pieces.push_back({file, -1, piece.offset, piece.count, piece.stride, piece.repeats});
          }
        }
      }
      writeFileAtomically(ref.manifest, manifest.toJson());
      syncPath(dir_, "checkpoint");
      prune();
    } catch (const std::exception& e) {
      status = describe(e);
      // The data files of a checkpoint without a manifest are of no use.
      std::error_code ec;
      for (int r = 0; r < world; ++r) fs::remove(dir_ / dataFileName(state.step, r), ec);
    }
  }
  if (group) broadcastString(*group, status, 0);
  if (!status.empty()) throw InvalidArgument(status);
  return ref;
}

void CheckpointDir::prune() const {
  auto all = list();
  while (all.size() > static_cast<size_t>(keep_)) {
    // The manifest goes first: a crash in between leaves data files no one reads.
    const int64_t step = all.front().step;
    fs::remove(all.front().manifest);
    const std::string head = stepName(step) + ".";
    for (const auto& entry : fs::directory_iterator(dir_)) {
      const std::string name = entry.path().filename().string();
      if (name.starts_with(head) && name.ends_with(".safetensors")) fs::remove(entry.path());
    }
    all.erase(all.begin());
  }
}

CheckpointManifest CheckpointDir::readManifest(const CheckpointRef& ref) const {
  CheckpointManifest m = CheckpointManifest::parse(readWholeFile(ref.manifest, "checkpoint manifest"), ref.manifest);
  if (m.step != ref.step) {
    throw InvalidArgument(str("checkpoint manifest ", ref.manifest.string(), " says step ", m.step, " but its name says ",
                              ref.step));
  }
  return m;
}

std::unique_ptr<StateSource> CheckpointDir::open(const CheckpointRef& ref) const {
  return std::make_unique<CheckpointReader>(dir_, readManifest(ref));
}

CheckpointManifest CheckpointDir::verify(const CheckpointRef& ref) const {
  CheckpointManifest manifest = readManifest(ref);
  CheckpointReader(dir_, manifest).openAll();
  return manifest;
}

CheckpointManifest CheckpointDir::load(const CheckpointRef& ref, TrainingState& state, ProcessGroup* group) const {
  CheckpointManifest manifest;
  std::exception_ptr failure;
  try {
    manifest = readManifest(ref);
    CheckpointReader reader(dir_, manifest);
    state.restore(reader);
  } catch (...) {
    failure = std::current_exception();
  }
  agreeOnFailure(group, failure, str("loading checkpoint ", ref.manifest.string()));
  return manifest;
}

std::optional<CheckpointRef> CheckpointDir::latestAgreed(ProcessGroup& group) const {
  Tensor chosen = fromVector<int64_t>({-1});
  if (group.rank() == 0) {
    if (auto newest = latest()) chosen = fromVector<int64_t>({newest->step});
  }
  group.broadcast(chosen, {.root = 0})->wait();
  const int64_t step = chosen.item<int64_t>();
  if (step < 0) return std::nullopt;
  return refFor(step);
}

int CheckpointDir::clear(ProcessGroup& group) const {
  const int removed = group.rank() == 0 ? removeAll() : 0;
  group.barrier()->wait();
  return removed;
}

int CheckpointDir::removeTemporaries() const {
  int n = 0;
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) return 0;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("step-") && name.ends_with(".tmp")) n += fs::remove(entry.path()) ? 1 : 0;
  }
  return n;
}

int CheckpointDir::removeAll() const {
  int n = 0;
  for (const auto& ref : list()) {
    fs::remove(ref.manifest);
    ++n;
  }
  // Data files (with or without a manifest) and temporaries.
  std::error_code ec;
  if (fs::is_directory(dir_, ec)) {
    static const std::regex data(R"(step-\d{8,}(\.rank\d+)?\.safetensors(\.tmp)?|step-\d{8,}\.json\.tmp)");
    for (const auto& entry : fs::directory_iterator(dir_)) {
      if (std::regex_match(entry.path().filename().string(), data)) fs::remove(entry.path());
    }
  }
  return n;
}

size_t consolidateCheckpoint(const CheckpointDir& dir, const CheckpointRef& ref, const fs::path& out,
                             const std::string& prefix) {
  const CheckpointManifest manifest = dir.readManifest(ref);
  const CheckpointReader reader(dir.path(), manifest);
  const std::string head = prefix.empty() ? "" : prefix + ".";
  NamedTensors whole;
  for (const CheckpointTensor& t : manifest.tensors) {
    if (t.info.placement == Placement::PerRank || !t.info.name.starts_with(head)) continue;
    Tensor full = empty(t.info.shape, t.info.dtype);
    reader.read(t.info.name, 0, full);
    whole.emplace_back(t.info.name.substr(head.size()), full);
  }
  if (whole.empty()) {
    throw InvalidArgument(str("consolidate: checkpoint ", ref.manifest.string(), " has no tensor under \"", prefix,
                              "\" (", manifest.tensors.size(), " tensors)"));
  }
  saveSafetensors(out, whole, {{"format", "dtrain-consolidated/1"}, {"step", std::to_string(manifest.step)},
                               {"source", ref.manifest.string()}, {"world_size", std::to_string(manifest.worldSize)}});
  return whole.size();
}

}  // namespace dt
