#include "collectives/fingerprint.h"

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"

namespace dt {
namespace {

std::string shapeText(const Dims& sizes) {
  return str("[", join(std::vector<int64_t>(sizes.begin(), sizes.end()), ","), "]");
}

DType parseDType(const std::string& name, const std::string& text) {
  for (DType d : {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16, DType::Int32, DType::Int64,
                  DType::Bool}) {
    if (toString(d) == name) return d;
  }
  throw InvalidArgument(str("fingerprint ", quoteBytes(text), ": unknown dtype ", quoteBytes(name)));
}

}  // namespace

std::string CollectiveFingerprint::describe() const {
  std::vector<std::string> parts;
  // Collapse runs of identical signatures: "float32[4] x3".
  for (size_t i = 0; i < tensors.size();) {
    size_t j = i;
    while (j < tensors.size() && tensors[j] == tensors[i]) ++j;
    std::string part = str(toString(tensors[i].dtype), shapeText(tensors[i].sizes));
    if (j - i > 1) part += str(" x", j - i);
    parts.push_back(part);
    i = j;
  }
  if (reduceOp) parts.push_back(std::string(toString(*reduceOp)));
  if (root) parts.push_back(str(op == "send" || op == "recv" ? "peer " : "root ", *root));
  return str(op, "(", join(parts, ", "), ")");
}

std::string CollectiveFingerprint::serialize() const {
  std::vector<std::string> sigs;
  for (const auto& t : tensors) sigs.push_back(str(toString(t.dtype), shapeText(t.sizes)));
  return str(seq, ";", op, ";", join(sigs, "+"), ";", reduceOp ? std::string(toString(*reduceOp)) : "", ";",
             root ? std::to_string(*root) : "");
}

CollectiveFingerprint CollectiveFingerprint::parse(const std::string& text) {
  const auto fields = split(text, ';');
  if (fields.size() != 5) {
    throw InvalidArgument(str("fingerprint ", quoteBytes(text), " does not have 5 ';'-separated fields"));
  }
  CollectiveFingerprint fp;
  fp.seq = static_cast<uint64_t>(env::parseInt(fields[0], "fingerprint sequence number"));
  fp.op = fields[1];
  if (!fields[2].empty()) {
    for (const auto& sig : split(fields[2], '+')) {
      const auto open = sig.find('[');
      if (open == std::string::npos || sig.back() != ']') {
        throw InvalidArgument(str("fingerprint ", quoteBytes(text), ": bad tensor signature ", quoteBytes(sig)));
      }
      TensorSignature ts;
      ts.dtype = parseDType(sig.substr(0, open), text);
      const auto dims = sig.substr(open + 1, sig.size() - open - 2);
      if (!dims.empty()) {
        for (const auto& d : split(dims, ',')) ts.sizes.push_back(env::parseInt(d, "fingerprint dimension"));
      }
      fp.tensors.push_back(std::move(ts));
    }
  }
  if (!fields[3].empty()) fp.reduceOp = parseReduceOp(fields[3]);
  if (!fields[4].empty()) fp.root = static_cast<int>(env::parseInt(fields[4], "fingerprint root"));
  return fp;
}

bool CollectiveFingerprint::agreesWith(const CollectiveFingerprint& other) const {
  if (!sizesMayDiffer()) return *this == other;
  if (op != other.op || seq != other.seq || reduceOp != other.reduceOp || root != other.root ||
      tensors.size() != other.tensors.size()) {
    return false;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].dtype != other.tensors[i].dtype) return false;
  }
  return true;
}

}  // namespace dt
