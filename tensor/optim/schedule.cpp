#include "tensor/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "common/errors.h"
#include "common/strings.h"

namespace dt::optim {

WarmupCosineSchedule::WarmupCosineSchedule(double peakLr, int64_t warmupSteps, int64_t totalSteps, double minLr)
    : peakLr_(peakLr), warmupSteps_(warmupSteps), totalSteps_(totalSteps), minLr_(minLr) {
  if (!(peakLr >= 0) || !(minLr >= 0) || minLr > peakLr) {
    throw InvalidArgument(str("WarmupCosineSchedule: need 0 <= minLr <= peakLr, got peakLr ", peakLr, " and minLr ",
                              minLr));
  }
  if (warmupSteps < 0 || totalSteps < 1 || warmupSteps > totalSteps) {
    throw InvalidArgument(str("WarmupCosineSchedule: need 0 <= warmupSteps <= totalSteps and totalSteps >= 1, got ",
                              warmupSteps, " warm-up steps of ", totalSteps));
  }
}

double WarmupCosineSchedule::at(int64_t step) const {
  if (step < 0) throw InvalidArgument(str("WarmupCosineSchedule: step ", step, " is negative"));
  if (step < warmupSteps_) return peakLr_ * static_cast<double>(step + 1) / static_cast<double>(warmupSteps_);
  if (step >= totalSteps_) return minLr_;
  const double span = static_cast<double>(std::max<int64_t>(1, totalSteps_ - warmupSteps_));
  const double progress = static_cast<double>(step - warmupSteps_) / span;
  return minLr_ + 0.5 * (1.0 + std::cos(std::numbers::pi * progress)) * (peakLr_ - minLr_);
}

}  // namespace dt::optim
