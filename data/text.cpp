#include "data/text.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string_view>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/ops.h"

namespace dt::data {
namespace {

uint64_t fnv1a(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string readFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument(str("text: cannot read ", path.string(), ": ", std::strerror(errno)));
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A fortune file: entries separated by lines holding only "%". Each entry keeps its text and
// the separator line after it; blank entries are dropped.
void appendFortunes(const std::string& text, std::vector<std::string>& out) {
  std::string entry;
  auto flush = [&] {
    if (entry.find_first_not_of(" \t\n") != std::string::npos) out.push_back(entry + "%\n");
    entry.clear();
  };
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string_view line(text.data() + begin, end - begin);
    if (line == "%") {
      flush();
    } else {
      entry.append(line);
      entry += '\n';
    }
    begin = end + 1;
  }
  flush();
}

}  // namespace

TextSplit splitDocuments(const std::vector<std::string>& documents, double validationShare, std::string source) {
  if (!(validationShare > 0 && validationShare < 1)) {
    throw InvalidArgument(str("text: the validation share must be in (0, 1), got ", validationShare));
  }
  TextSplit split;
  split.source = std::move(source);
  const auto threshold = static_cast<uint64_t>(validationShare * 18446744073709551615.0);
  for (const std::string& d : documents) {
    if (fnv1a(d) < threshold) {
      split.validation += d;
      ++split.validationDocuments;
    } else {
      split.train += d;
      ++split.trainDocuments;
    }
  }
  return split;
}

TextSplit loadFortunes(const std::filesystem::path& dir, double validationShare) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    throw InvalidArgument(str("text: ", dir.string(), " is not a folder of fortune files (Debian's fortunes package "
                              "installs them in ", kFortunesDir, "; scripts/setup.sh installs it)"));
  }
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.is_symlink() || !entry.is_regular_file() || entry.path().extension() == ".dat") continue;
    files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> documents;
  for (const auto& f : files) appendFortunes(readFile(f), documents);
  if (documents.empty()) throw InvalidArgument(str("text: no fortunes found in ", dir.string()));
  return splitDocuments(documents, validationShare, str(files.size(), " fortune files in ", dir.string()));
}

TextWindows::TextWindows(std::string text, int64_t contextLength, std::string name)
    : text_(std::move(text)), contextLength_(contextLength), name_(std::move(name)) {
  if (contextLength_ < 1) throw InvalidArgument(str("text ", name_, ": context length ", contextLength_, " must be positive"));
  if (static_cast<int64_t>(text_.size()) <= contextLength_) {
    throw InvalidArgument(str("text ", name_, ": ", text_.size(), " bytes hold no window of ", contextLength_,
                              " tokens and its next token"));
  }
}

Batch TextWindows::get(std::span<const int64_t> indices) const {
  const auto b = static_cast<int64_t>(indices.size());
  Tensor inputs = empty({b, contextLength_}, DType::Int64);
  Tensor targets = empty({b, contextLength_}, DType::Int64);
  int64_t* in = inputs.data<int64_t>();
  int64_t* out = targets.data<int64_t>();
  const auto* bytes = reinterpret_cast<const unsigned char*>(text_.data());
  for (int64_t i = 0; i < b; ++i) {
    const int64_t start = indices[static_cast<size_t>(i)];
    if (start < 0 || start >= size()) {
      throw InvalidArgument(str("text ", name_, ": window ", start, " outside [0, ", size(), ")"));
    }
    for (int64_t t = 0; t < contextLength_; ++t) {
      in[i * contextLength_ + t] = bytes[start + t];
      out[i * contextLength_ + t] = bytes[start + t + 1];
    }
  }
  return {inputs, targets};
}

std::string TextWindows::describe() const {
  return str(name_, ": ", text_.size(), " bytes, windows of ", contextLength_, " tokens");
}

}  // namespace dt::data
