#include "train/straggler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"

namespace dt::train {

StragglerOptions StragglerOptions::fromEnvironment(StragglerOptions given) {
  if (const auto raw = env::getRaw("DT_STRAGGLER_EVERY"); raw && !raw->empty()) given.every = env::getInt("DT_STRAGGLER_EVERY");
  if (const auto raw = env::getRaw("DT_STRAGGLER_WINDOW"); raw && !raw->empty()) given.window = env::getInt("DT_STRAGGLER_WINDOW");
  if (const auto raw = env::getRaw("DT_STRAGGLER_THRESHOLD"); raw && !raw->empty()) {
    char* end = nullptr;
    const double v = std::strtod(raw->c_str(), &end);
    if (end == raw->c_str() || *end != '\0') {
      throw InvalidArgument(str("DT_STRAGGLER_THRESHOLD=\"", *raw, "\" is not a number; use e.g. 1.5 (own time over the median's)"));
    }
    given.threshold = v;
  }
  if (given.every < 0) {
    throw InvalidArgument(str("straggler detection: every ", given.every, " steps is negative; use 0 (off) or a positive count"));
  }
  if (!(given.threshold > 1) || !std::isfinite(given.threshold)) {
    throw InvalidArgument(str("straggler detection: threshold ", given.threshold,
                              " must be a finite ratio above 1 (a rank slower than threshold x the median)"));
  }
  if (given.window < 1) {
    throw InvalidArgument(str("straggler detection: window ", given.window, " steps must be at least 1"));
  }
  return given;
}

std::string StragglerVerdict::bound() const { return section == "data wait" ? "data-bound" : "compute-bound"; }

namespace {

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// The sections of a rank's own time, in the order a tie is broken.
constexpr const char* kSections[] = {"forward", "backward", "data wait", "other"};
double sectionOf(const StepFigures& f, int s) {
  switch (s) {
    case 0: return f.forwardMs;
    case 1: return f.backwardMs;
    case 2: return f.dataMs;
    default: return std::max(0.0, f.ownMs() - f.dataMs - f.forwardMs - f.backwardMs);
  }
}

}  // namespace

StragglerDetector::StragglerDetector(double threshold, int64_t window) : threshold_(threshold), window_(window) {}

void StragglerDetector::reset() {
  slowSteps_.clear();
  reported_.clear();
}

std::vector<StragglerVerdict> StragglerDetector::add(const std::vector<StepFigures>& figures, const std::vector<int>& roles,
                                                     int64_t steps) {
  const size_t n = figures.size();
  if (slowSteps_.size() != n) {  // a new world: nothing carries over
    slowSteps_.assign(n, 0);
    reported_.assign(n, false);
  }
  std::map<int, std::vector<size_t>> byRole;
  for (size_t r = 0; r < n; ++r) byRole[roles.size() == n ? roles[r] : 0].push_back(r);
  std::vector<StragglerVerdict> found;
  for (const auto& [role, ranks] : byRole) {
    if (ranks.size() < 2) {  // nobody to compare with
      for (size_t r : ranks) slowSteps_[r] = 0, reported_[r] = false;
      continue;
    }
    std::vector<double> own;
    for (size_t r : ranks) own.push_back(figures[r].ownMs());
    const double mid = median(own);
    for (size_t r : ranks) {
      const double mine = figures[r].ownMs();
      const bool slow = mine > threshold_ * mid && mine - mid >= kMinExcessMs;
      if (!slow) {  // the episode, if any, is over
        slowSteps_[r] = 0;
        reported_[r] = false;
        continue;
      }
      slowSteps_[r] += steps;
      if (slowSteps_[r] < window_ || reported_[r]) continue;
      reported_[r] = true;
      StragglerVerdict v;
      v.rank = static_cast<int>(r);
      v.slowSteps = slowSteps_[r];
      v.ownMs = mine;
      v.medianOwnMs = mid;
      v.ratio = mid > 0 ? mine / mid : INFINITY;
      double best = -INFINITY;
      for (int s = 0; s < 4; ++s) {
        std::vector<double> values;
        for (size_t q : ranks) values.push_back(sectionOf(figures[q], s));
        const double sectionMedian = median(values), excess = sectionOf(figures[r], s) - sectionMedian;
        if (excess > best) {
          best = excess;
          v.section = kSections[s];
          v.sectionMs = sectionOf(figures[r], s);
          v.sectionMedianMs = sectionMedian;
        }
      }
      found.push_back(std::move(v));
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
  return found;
}

namespace {
std::string formatFixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}
std::string ms(double v) { return v >= 10 ? str(static_cast<int64_t>(std::lround(v)), " ms") : str(formatFixed(v, 1), " ms"); }
std::string times(double v) { return std::isfinite(v) ? str(formatFixed(v, 1), "x") : std::string("far over"); }
}  // namespace

std::string describeStraggler(const std::string& program, const StragglerVerdict& v, const std::string& host, int64_t step) {
  const double sectionRatio = v.sectionMedianMs > 0 ? v.sectionMs / v.sectionMedianMs : INFINITY;
  return str(program, ": rank ", v.rank, host.empty() ? std::string() : str(" (host ", host, ")"), " is a straggler at step ",
             step, ": its own time (the step less its communication wait) ", ms(v.ownMs), " a step is ", times(v.ratio),
             " the median (", ms(v.medianOwnMs), ") for ", v.slowSteps, " steps; ", v.section, " ", ms(v.sectionMs),
             " against ", ms(v.sectionMedianMs), " (", times(sectionRatio), "): ", v.bound());
}

}  // namespace dt::train
