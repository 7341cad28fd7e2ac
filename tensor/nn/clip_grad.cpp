#include "tensor/nn/clip_grad.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/ops.h"

namespace dt::nn {
namespace {

// max that keeps a NaN (std::max drops one in its second argument).
inline double maxKeepNan(double a, double b) { return (b > a || b != b) ? b : a; }

// The gradient's sum of squares (or max |g|) in float64: a direct loop over contiguous cpu
// memory (no float64 copy of the gradient), tensor ops elsewhere.
double statistic(const Tensor& g, bool maxMode) {
  if (g.device().isCpu() && g.isContiguous() && (g.dtype() == DType::Float32 || g.dtype() == DType::Float64)) {
    return dispatchDType(g.dtype(), [&]<typename T>() -> double {
      if constexpr (std::is_floating_point_v<T>) {
        const T* p = g.data<T>();
        constexpr int kLanes = 8;
        double lanes[kLanes] = {};
        const int64_t n = g.numel();
        int64_t i = 0;
        for (; i + kLanes <= n; i += kLanes) {
          for (int l = 0; l < kLanes; ++l) {
            const double v = static_cast<double>(p[i + l]);
            lanes[l] = maxMode ? maxKeepNan(lanes[l], std::fabs(v)) : lanes[l] + v * v;
          }
        }
        double s = 0;
        for (; i < n; ++i) {
          const double v = static_cast<double>(p[i]);
          s = maxMode ? maxKeepNan(s, std::fabs(v)) : s + v * v;
        }
        for (double l : lanes) s = maxMode ? maxKeepNan(s, l) : s + l;
        return s;
      } else {
        return 0.0;
      }
    });
  }
  const Tensor g64 = g.to(DType::Float64);
  return maxMode ? max(abs(g64)).item<double>() : sum(mul(g64, g64)).item<double>();
}

// The same on the gradient's device, as a float64 0-dim tensor there (no host read).
Tensor deviceStatistic(const Tensor& g, bool maxMode) {
  const Tensor g64 = g.to(DType::Float64);
  return maxMode ? max(abs(g64)) : sum(mul(g64, g64));
}

// One device's statistics, summed (or maxed, NaN kept) on the device.
Tensor combined(const std::vector<Tensor>& statistics, bool maxMode, Device device) {
  if (statistics.empty()) return zeros({}, DType::Float64, device);
  const Tensor all = stack(statistics);
  return maxMode ? max(all) : sum(all);
}

}  // namespace

double clipGradNorm(const std::vector<Tensor>& parameters, double maxNorm, const ClipGradNormOptions& options) {
  const bool maxMode = std::isinf(options.normType) && options.normType > 0;
  if (!maxMode && options.normType != 2.0) {
    throw NotSupportedError(str("clipGradNorm: norm type ", options.normType, " is not supported (2 or infinity)"));
  }
  if (!(maxNorm > 0)) throw InvalidArgument(str("clipGradNorm: maxNorm must be positive, got ", maxNorm));
  NoGradGuard ng;
  if (static_cast<bool>(options.isSplit) != static_cast<bool>(options.reduceSplitPartial)) {
    throw InvalidArgument("clipGradNorm: isSplit and reduceSplitPartial go together (one is set without the other)");
  }
  std::vector<Tensor> grads;
  double local = 0.0;  // the whole parameters' (all of them without isSplit)
  double split = 0.0;
  // Gradients on a GPU: each parameter's statistic stays on its device and the device adds
  // them up, so the host waits once per device (a read of two values), not once per
  // parameter. {device, {whole parameters' statistics, split ones'}}, in first-seen order.
  std::vector<std::pair<Device, std::pair<std::vector<Tensor>, std::vector<Tensor>>>> onDevices;
  for (size_t i = 0; i < parameters.size(); ++i) {
    Tensor g = parameters[i].grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    const bool isSplit = options.isSplit && options.isSplit(i);
    if (!g.device().isCpu()) {
      auto it = std::find_if(onDevices.begin(), onDevices.end(), [&](const auto& d) { return d.first == g.device(); });
      if (it == onDevices.end()) it = onDevices.insert(onDevices.end(), {g.device(), {}});
      (isSplit ? it->second.second : it->second.first).push_back(deviceStatistic(g, maxMode));
      continue;
    }
    const double s = statistic(g, maxMode);
    double& into = isSplit ? split : local;
    into = maxMode ? maxKeepNan(into, s) : into + s;
  }
  for (const auto& [device, statistics] : onDevices) {
    const std::vector<double> both =
        stack({combined(statistics.first, maxMode, device), combined(statistics.second, maxMode, device)})
            .toVector<double>();  // this device's one host wait
    local = maxMode ? maxKeepNan(local, both[0]) : local + both[0];
    split = maxMode ? maxKeepNan(split, both[1]) : split + both[1];
  }
  if (options.reduceSplitPartial) {
    Tensor partial = scalarTensor(split, DType::Float64);
    options.reduceSplitPartial(partial, maxMode);
    const double splitTotal = partial.to(Device::cpu()).item<double>();
    local = maxMode ? maxKeepNan(local, splitTotal) : local + splitTotal;
  }
  double total = local;
  if (options.reducePartial) {
    Tensor partial = scalarTensor(local, DType::Float64);
    options.reducePartial(partial, maxMode);
    total = partial.to(Device::cpu()).item<double>();
  }
  const double norm = maxMode ? total : std::sqrt(total);
  if (!std::isfinite(norm) && options.errorIfNonfinite) {
    for (size_t i = 0; i < parameters.size(); ++i) {
      const Tensor g = parameters[i].grad();
      if (g.defined() && !std::isfinite(sum(abs(g.to(DType::Float64))).item<double>())) {
        throw InvalidArgument(str("clipGradNorm: the total gradient norm is ", norm, "; parameter ", i, " (",
                                  parameters[i].describe(), ") has a non-finite gradient"));
      }
    }
    throw InvalidArgument(str("clipGradNorm: the total gradient norm is ", norm,
                              " (non-finite over the shard group; this rank's gradients are finite)"));
  }
  const double coefficient = maxNorm / (norm + 1e-6);
  if (coefficient < 1.0 || std::isnan(coefficient)) {
    for (Tensor& g : grads) mul_(g, coefficient);
  }
  return norm;
}

}  // namespace dt::nn
