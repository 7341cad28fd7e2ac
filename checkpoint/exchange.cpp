#include "checkpoint/exchange.h"

#include <cstring>
#include <map>

#include "collectives/coalesce.h"
#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/autograd.h"

namespace dt {

std::vector<std::string> allgatherStrings(ProcessGroup& group, const std::string& mine) {
  if (group.size() == 1) return {mine};
  Tensor length = fromVector<int64_t>({static_cast<int64_t>(mine.size())});
  std::vector<Tensor> lengths;
  for (int r = 0; r < group.size(); ++r) lengths.push_back(empty({1}, DType::Int64));
  group.allgather(lengths, length)->wait();
  int64_t longest = 1;
  for (const auto& l : lengths) longest = std::max(longest, l.item<int64_t>());
  Tensor bytes = zeros({longest}, DType::Bool);
  if (!mine.empty()) std::memcpy(bytes.dataPtr(), mine.data(), mine.size());
  std::vector<Tensor> all;
  for (int r = 0; r < group.size(); ++r) all.push_back(empty({longest}, DType::Bool));
  group.allgather(all, bytes)->wait();
  std::vector<std::string> out;
  for (int r = 0; r < group.size(); ++r) {
    out.emplace_back(static_cast<const char*>(all[r].dataPtr()), static_cast<size_t>(lengths[r].item<int64_t>()));
  }
  return out;
}

void broadcastString(ProcessGroup& group, std::string& text, int root) {
  if (group.size() == 1) return;
  Tensor length = fromVector<int64_t>({static_cast<int64_t>(group.rank() == root ? text.size() : 0)});
  group.broadcast(length, {.root = root})->wait();
  const int64_t n = length.item<int64_t>();
  Tensor bytes = zeros({std::max<int64_t>(n, 1)}, DType::Bool);
  if (group.rank() == root && n > 0) std::memcpy(bytes.dataPtr(), text.data(), static_cast<size_t>(n));
  group.broadcast(bytes, {.root = root})->wait();
  if (group.rank() != root) text.assign(static_cast<const char*>(bytes.dataPtr()), static_cast<size_t>(n));
}

void agreeOnFailure(ProcessGroup* group, std::exception_ptr failure, const std::string& what) {
  if (group == nullptr || group->size() == 1) {
    if (failure) std::rethrow_exception(failure);
    return;
  }
  std::string mine;
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      mine = describe(e);
    }
    if (mine.empty()) mine = "unknown error";
  }
  const auto all = allgatherStrings(*group, mine);
  if (failure) std::rethrow_exception(failure);
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) throw InvalidArgument(str(what, " failed on rank ", r, ": ", all[r]));
  }
}

namespace {

uint64_t fnv1a(const std::string& text, uint64_t hash) {
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return hash;
}

}  // namespace

void requireSameOnAllRanks(ProcessGroup& group, const std::vector<std::string>& lines, const std::string& prefix,
                           const std::string& item, const std::string& hint) {
  if (group.size() == 1) return;
  uint64_t hash = fnv1a(std::to_string(lines.size()), 1469598103934665603ull);
  for (const auto& line : lines) hash = fnv1a(line + '\n', hash);
  Tensor summary = fromVector<int64_t>({static_cast<int64_t>(lines.size()), static_cast<int64_t>(hash)});
  std::vector<Tensor> summaries;
  for (int r = 0; r < group.size(); ++r) summaries.push_back(empty({2}, DType::Int64));
  group.allgather(summaries, summary)->wait();
  bool same = true;
  for (const auto& s : summaries) same = same && s.toVector<int64_t>() == summaries[0].toVector<int64_t>();
  if (same) return;

  std::string text;
  for (const auto& line : lines) text += line + '\n';
  std::vector<std::vector<std::string>> all;
  for (const std::string& theirs : allgatherStrings(group, text)) {
    std::vector<std::string> list;
    for (const auto& line : split(theirs, '\n')) {
      if (!line.empty()) list.emplace_back(line);
    }
    all.push_back(std::move(list));
  }
  size_t longest = 0;
  for (const auto& list : all) longest = std::max(longest, list.size());
  const auto entry = [&](int rank, size_t i) {
    return i < all[rank].size() ? all[rank][i] : str("no ", item, " #", i, " (it has ", all[rank].size(), ")");
  };
  for (size_t i = 0; i < longest; ++i) {
    std::map<std::string, std::vector<int>> holders;  // line -> ranks
    for (int r = 0; r < group.size(); ++r) holders[entry(r, i)].push_back(r);
    if (holders.size() == 1) continue;
    const std::string reference = entry(0, i);
    std::string others;
    for (const auto& [line, ranks] : holders) {
      if (line == reference) continue;
      others += str("; rank", ranks.size() > 1 ? "s " : " ", formatRanges(ranks), ranks.size() > 1 ? " have " : " has ", line);
    }
    throw InvalidArgument(str(prefix, " ", item, " #", i, ": rank 0 has ", reference, others, ". ", hint));
  }
  throw InvalidArgument(str(prefix, ": the ranks' lists hash differently but read the same; is the build or the "
                            "platform the same on every rank?"));
}

void broadcastTensors(ProcessGroup& group, const std::vector<Tensor>& tensors, int root) {
  if (group.size() == 1 || tensors.empty()) return;
  std::map<std::pair<int, std::string>, std::vector<Tensor>> kinds;
  for (const auto& t : tensors) kinds[{static_cast<int>(t.dtype()), t.device().str()}].push_back(t);
  NoGradGuard noGrad;
  for (auto& [kind, members] : kinds) {
    Tensor flat = flattenTensors(members);
    group.broadcast(flat, {.root = root})->wait();
    if (group.rank() != root) unflattenInto(flat, members);
  }
}

}  // namespace dt
