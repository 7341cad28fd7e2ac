#include "tensor/autograd/anomaly.h"

#include <cctype>
#include <cmath>
#include <mutex>

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "tensor/nn/module.h"

namespace dt {

namespace detail {
// Starts at 1: the environment has not been read yet, so the first op must look.
std::atomic<int> gAnomalyMayBeActive{1};
}  // namespace detail

namespace {

constexpr std::string_view kEnvName = "DT_DETECT_ANOMALY";

std::once_flag gEnvironmentRead;
AnomalyOptions gEnvironmentOptions{.enabled = false};

// Constant-initialised with trivial destructors, so reading them costs no TLS initialisation check.
thread_local bool tGuardActive = false;
thread_local AnomalyOptions tGuardOptions{};
// Set while a check runs ops of its own (copies, contiguous), so they are not checked in turn.
thread_local bool tInsideCheck = false;

AnomalyOptions parseEnvironment(const std::string& value) {
  std::string lower;
  for (char c : trim(value)) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "forward") return AnomalyOptions{.enabled = true, .checkForward = true};
  try {
    return AnomalyOptions{.enabled = env::parseBool(value, kEnvName), .checkForward = false};
  } catch (const InvalidArgument&) {
    throw InvalidArgument(str(kEnvName, "=", quoteBytes(value),
                              " is not an anomaly mode; use 1 (on), forward (on, with the forward check) or 0 (off)"));
  }
}

void readEnvironmentOnce() {
  // A throw leaves the flag unset, so the next op reports the bad value again.
  std::call_once(gEnvironmentRead, [] {
    gEnvironmentOptions = parseEnvironment(env::getString(kEnvName));
    if (!gEnvironmentOptions.enabled) detail::gAnomalyMayBeActive.fetch_sub(1, std::memory_order_relaxed);
  });
}

class CheckScope {
 public:
  CheckScope() { tInsideCheck = true; }
  ~CheckScope() { tInsideCheck = false; }
  CheckScope(const CheckScope&) = delete;
  CheckScope& operator=(const CheckScope&) = delete;

 private:
  NoGradGuard noGrad_;
};

// Where a tensor first holds a NaN or Inf, and how many such elements it has.
struct NonFinite {
  int64_t count = 0;
  int64_t firstIndex = -1;  // flat, in row-major order
  double firstValue = 0;
  explicit operator bool() const { return count > 0; }
};

template <typename T>
NonFinite scan(const T* data, int64_t n) {
  NonFinite found;
  for (int64_t i = 0; i < n; ++i) {
    const double v = convertScalar<double>(data[i]);
    if (std::isfinite(v)) continue;
    if (found.count++ == 0) {
      found.firstIndex = i;
      found.firstValue = v;
    }
  }
  return found;
}

// Callers hold a CheckScope: the copies below must neither record nor be checked.
NonFinite findNonFinite(const Tensor& t) {
  if (!t.defined() || !isFloatingPoint(t.dtype()) || t.numel() == 0) return {};
  const Tensor host = (t.device().isCpu() ? t : t.to(Device::cpu())).contiguous();
  switch (host.dtype()) {
    case DType::Float32: return scan(host.data<float>(), host.numel());
    case DType::Float64: return scan(host.data<double>(), host.numel());
    case DType::Float16: return scan(host.data<Half>(), host.numel());
    case DType::BFloat16: return scan(host.data<BFloat16>(), host.numel());
    default: return {};
  }
}

std::string valueWord(double v) {
  if (std::isnan(v)) return "nan";
  return v > 0 ? "inf" : "-inf";
}

std::string flatIndexToPosition(int64_t flat, const Shape& sizes) {
  std::vector<int64_t> position(sizes.size());
  for (size_t d = sizes.size(); d-- > 0;) {
    position[d] = flat % sizes[d];
    flat /= sizes[d];
  }
  return str("[", join(position), "]");
}

// "inf (2 of 6 elements non-finite, the first at [1, 0])"
std::string describeNonFinite(const NonFinite& found, const Tensor& t) {
  if (t.numel() == 1) return valueWord(found.firstValue);
  return str(valueWord(found.firstValue), " (", found.count, " of ", t.numel(), " elements non-finite, the first at ",
             flatIndexToPosition(found.firstIndex, t.sizes()), ")");
}

// Built-in ops name their nodes "<Op>Backward" after the free function "<op>"
// ("LogBackward" -> "log"); a node named otherwise keeps its name.
std::string forwardOpName(std::string_view backwardName) {
  constexpr std::string_view kSuffix = "Backward";
  if (backwardName.size() <= kSuffix.size() || !backwardName.ends_with(kSuffix)) return std::string(backwardName);
  std::string op(backwardName.substr(0, backwardName.size() - kSuffix.size()));
  op[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(op[0])));
  return op;
}

AnomalyRecord makeRecord(std::string_view backwardName, const TensorList& inputs) {
  AnomalyRecord record;
  record.op = forwardOpName(backwardName);
  std::vector<std::string> described;
  described.reserve(inputs.size());
  for (const Tensor& t : inputs) described.push_back(t.defined() ? t.describe() : "undefined");
  record.inputs = join(described);
  nn::ModulePath module = nn::currentModulePath();
  record.modulePath = std::move(module.path);
  record.moduleTypes = std::move(module.types);
  return record;
}

// Why the node returned a non-finite gradient: the first bad incoming gradient,
// else the first bad saved tensor, else the node itself.
std::string causeOf(const Node& node, const TensorList& incoming, const std::string& forwardOp,
                    const NonFinite& produced) {
  for (size_t k = 0; k < incoming.size(); ++k) {
    if (const NonFinite bad = findNonFinite(incoming[k])) {
      return str("its incoming gradient ", k, " (for output ", k, " of ", forwardOp, ") already held ",
                 describeNonFinite(bad, incoming[k]),
                 " when it started; every function before it returned finite gradients, so the value came in as "
                 "the gradient given to backward(), from a tensor hook, or from a sum of gradients that overflowed");
    }
  }
  const std::optional<TensorList> saved = node.savedTensorsForReport();
  if (saved) {
    for (size_t k = 0; k < saved->size(); ++k) {
      const Tensor& t = (*saved)[k];
      if (const NonFinite bad = findNonFinite(t)) {
        return str("its incoming gradients were finite but its saved tensor ", k, " (", t.describe(), ") held ",
                   describeNonFinite(bad, t),
                   ": the forward pass had already made a non-finite value (AnomalyOptions{.checkForward = true} "
                   "names the op that made it)");
      }
    }
  }
  return str("its incoming gradients", saved ? " and saved tensors were" : " were",
             " all finite, so ", node.name(), " itself produced the ", valueWord(produced.firstValue),
             saved ? "" : " (it exposes no saved tensors to check)", ". Hint: look at the values ", forwardOp,
             " got in forward; some have an infinite derivative (log, division and sqrt at 0)");
}

}  // namespace

// ---- guard ----------------------------------------------------------------------------------------------

AnomalyMode::AnomalyMode(AnomalyOptions options)
    : previousSet_(tGuardActive), previous_(tGuardOptions), counted_(options.enabled) {
  if (counted_) detail::gAnomalyMayBeActive.fetch_add(1, std::memory_order_relaxed);
  tGuardActive = true;
  tGuardOptions = options;
}

AnomalyMode::~AnomalyMode() {
  tGuardActive = previousSet_;
  tGuardOptions = previous_;
  if (counted_) detail::gAnomalyMayBeActive.fetch_sub(1, std::memory_order_relaxed);
}

AnomalyOptions AnomalyMode::current() {
  readEnvironmentOnce();
  AnomalyOptions options = tGuardActive ? tGuardOptions : gEnvironmentOptions;
  if (!options.enabled) options.checkForward = false;
  return options;
}

std::string AnomalyRecord::describe() const {
  std::string where;
  if (moduleTypes.empty()) {
    where = "outside any module";
  } else if (modulePath.empty()) {
    where = str("in the outermost module (", moduleTypes, ")");
  } else {
    where = str("in module ", modulePath, " (", moduleTypes, ")");
  }
  return str(op, "(", inputs, ") ", where);
}

// ---- hooks ----------------------------------------------------------------------------------------------

namespace detail {

void anomalyCheckForward(std::string_view backwardName, const TensorList& inputs,
                         const std::vector<Tensor*>& outputs) {
  if (tInsideCheck) return;
  const AnomalyOptions options = AnomalyMode::current();
  if (!options.checkForward || inBackward()) return;
  CheckScope scope;
  for (size_t k = 0; k < outputs.size(); ++k) {
    const Tensor& out = *outputs[k];
    const NonFinite bad = findNonFinite(out);
    if (!bad) continue;
    for (const Tensor& in : inputs) {
      if (findNonFinite(in)) return;  // not this op's doing: the value was bad before it
    }
    const AnomalyRecord record = makeRecord(backwardName, inputs);
    throw AnomalyError(str("anomaly mode (forward check): ", record.describe(), " returned ",
                           describeNonFinite(bad, out), outputs.size() > 1 ? str(" in output ", k) : "",
                           " from finite inputs. Hint: look at the values it got (log of 0 or of a negative "
                           "number, 0/0, exp or a product that overflows)"));
  }
}

std::shared_ptr<const AnomalyRecord> anomalyRecordFor(std::string_view backwardName, const TensorList& inputs) {
  if (tInsideCheck || !AnomalyMode::isEnabled()) return nullptr;
  return std::make_shared<const AnomalyRecord>(makeRecord(backwardName, inputs));
}

void anomalyCheckBackwardSlow(const Node& node, const IncomingGradients& incoming, const TensorList& gradInputs) {
  if (tInsideCheck || !AnomalyMode::isEnabled()) return;
  CheckScope scope;
  for (size_t i = 0; i < gradInputs.size(); ++i) {
    const NonFinite bad = findNonFinite(gradInputs[i]);
    if (!bad) continue;
    const std::shared_ptr<const AnomalyRecord>& record = node.anomalyRecord();
    const std::string forwardOp = record ? record->op : "its forward op";
    const std::string madeBy =
        record ? record->describe() : str(forwardOp, " (no record: anomaly mode was off when the op ran)");
    throw AnomalyError(str("anomaly mode: ", node.name(), " returned ", describeNonFinite(bad, gradInputs[i]),
                           " in gradient ", i, ", the gradient for input ", i, " of ", madeBy, "; ",
                           causeOf(node, incoming.grads(), forwardOp, bad)));
  }
}

}  // namespace detail
}  // namespace dt
