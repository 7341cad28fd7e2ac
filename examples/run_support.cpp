#include "examples/run_support.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"

namespace examples {
namespace {

using dt::InvalidArgument;
using dt::str;

std::atomic<int> gStopSignal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");

// The first stop signal asks for a graceful stop at the next step; a second one (a user
// pressing Ctrl-C again, a job manager losing patience) takes the default action at once.
// Only async-signal-safe calls here.
extern "C" void onStopSignal(int sig) {
  int expected = 0;
  if (!gStopSignal.compare_exchange_strong(expected, sig)) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
}

}  // namespace

int64_t parsePositive(const std::string& program, const std::string& value, const std::string& flag, int64_t minimum) {
  const int64_t v = dt::env::parseInt(value, flag);
  if (v < minimum) throw InvalidArgument(str(program, ": ", flag, " ", value, " must be at least ", minimum));
  return v;
}

double parseDouble(const std::string& program, const std::string& value, const std::string& flag, double minimum,
                   double maximum) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != value.size() || !std::isfinite(v)) {
    throw InvalidArgument(str(program, ": ", flag, " \"", value, "\" is not a number"));
  }
  if (v < minimum || v > maximum) {
    throw InvalidArgument(str(program, ": ", flag, " ", value, " must be within [", minimum, ", ", maximum, "]"));
  }
  return v;
}

std::string choice(const std::string& program, const std::string& value, const std::string& flag,
                   const std::vector<std::string>& allowed) {
  for (const auto& a : allowed) {
    if (value == a) return value;
  }
  throw InvalidArgument(str(program, ": ", flag, " \"", value, "\" is not one of ", dt::join(allowed, ", ")));
}

std::atomic<int>& stopSignal() { return gStopSignal; }

void installStopHandlers(const std::string& program) {
  struct sigaction sa {};
  sa.sa_handler = onStopSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGTERM, SIGUSR1, SIGINT}) {
    if (sigaction(sig, &sa, nullptr) != 0) {
      throw dt::Error(str(program, ": sigaction(", sig, ") failed: ", std::strerror(errno)));
    }
  }
}

std::string signalName(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case SIGINT: return "SIGINT";
    default: return str("signal ", sig);
  }
}

std::string formatSeconds(double seconds) {
  const auto s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", static_cast<long long>(s / 3600), static_cast<long long>(s / 60 % 60));
  } else if (s >= 60) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%.1fs", std::max(0.0, seconds));
  }
  return buf;
}

std::string exactText(double value) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", value);
  return buf;
}

uint64_t fingerprint(const std::vector<dt::Tensor>& tensors) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const dt::Tensor& t : tensors) {
    const dt::Tensor c = t.detach().to(dt::Device::cpu()).contiguous();
    const auto* p = static_cast<const unsigned char*>(c.dataPtr());
    for (size_t i = 0; i < c.nbytes(); ++i) {
      h ^= p[i];
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

std::vector<dt::Tensor> gatherRngStates(dt::ProcessGroup& group, const dt::Generator& generator) {
  const auto words = generator.state().toWords();
  dt::Tensor mine = dt::fromVector<int64_t>({static_cast<int64_t>(words[0]), static_cast<int64_t>(words[1]),
                                             static_cast<int64_t>(words[2]), static_cast<int64_t>(words[3])});
  std::vector<dt::Tensor> all;
  for (int r = 0; r < group.size(); ++r) all.push_back(dt::empty({4}, dt::DType::Int64));
  group.allgather(all, mine)->wait();
  return all;
}

void restoreRngState(dt::Generator& generator, const std::optional<dt::Tensor>& saved, int rank,
                     const std::string& program, const std::string& file) {
  if (!saved || saved->numel() != 4 || saved->dtype() != dt::DType::Int64) {
    throw InvalidArgument(str(program, ": checkpoint ", file, " lacks rng.rank", rank, " (int64[4])"));
  }
  const auto w = saved->toVector<int64_t>();
  generator.setState(dt::GeneratorState::fromWords(
      {static_cast<uint64_t>(w[0]), static_cast<uint64_t>(w[1]), static_cast<uint64_t>(w[2]), static_cast<uint64_t>(w[3])},
      str(file, " rng.rank", rank)));
}

}  // namespace examples
