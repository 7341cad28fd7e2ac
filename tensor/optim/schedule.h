// Learning-rate schedules: the rate as a pure function of the step, so a job that resumes at
// step s continues on exactly the curve it left (nothing to save in a checkpoint).
//
// Contract: at() is const and thread-safe; the constructor checks its numbers and throws
// InvalidArgument naming the bad one.
#pragma once

#include <cstdint>

namespace dt::optim {

// Linear warm-up from peakLr / warmupSteps to peakLr over steps [0, warmupSteps), then a half
// cosine from peakLr down to minLr over [warmupSteps, totalSteps); minLr from there on. With
// warmupSteps 0 it is the plain cosine schedule.
class WarmupCosineSchedule {
 public:
  WarmupCosineSchedule(double peakLr, int64_t warmupSteps, int64_t totalSteps, double minLr = 0.0);
  // The rate for step `step` (0-based: the rate the step-th optimizer step uses).
  double at(int64_t step) const;
  double peakLr() const { return peakLr_; }
  double minLr() const { return minLr_; }
  int64_t warmupSteps() const { return warmupSteps_; }
  int64_t totalSteps() const { return totalSteps_; }

 private:
  double peakLr_;
  int64_t warmupSteps_;
  int64_t totalSteps_;
  double minLr_;
};

}  // namespace dt::optim
