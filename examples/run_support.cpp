#include "examples/run_support.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/env.h"
#include "common/errors.h"
#include "collectives/coalesce.h"
#include "common/strings.h"
#include "tensor/ops.h"

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

bool forEachFlag(const std::string& program, int argc, char** argv, const std::vector<std::string>& switches,
                 const std::function<void(const std::string& flag, const std::string& value)>& onFlag) {
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::optional<std::string> inlineValue;
    if (const auto eq = flag.find('='); flag.starts_with("--") && eq != std::string::npos) {
      inlineValue = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    }
    if (flag == "--help" || flag == "-h") return false;
    if (std::find(switches.begin(), switches.end(), flag) != switches.end()) {
      onFlag(flag, "");
      continue;
    }
    if (!flag.starts_with("--")) throw InvalidArgument(str(program, ": unexpected argument \"", flag, "\"; see --help"));
    if (!inlineValue && i + 1 >= argc) throw InvalidArgument(str(program, ": ", flag, " needs a value; see --help"));
    onFlag(flag, inlineValue ? *inlineValue : std::string(argv[++i]));
  }
  return true;
}

void clearCheckpoints(dt::ProcessGroup& group, const dt::CheckpointDir& dir, const std::string& program, bool quiet) {
  const int removed = dir.clear(group);
  if (group.rank() == 0 && removed > 0 && !quiet) {
    std::printf("%s: --resume never: removed %d checkpoint(s) of an earlier run from %s\n", program.c_str(), removed,
                dir.path().string().c_str());
  }
}

double parameterSpread(dt::ProcessGroup& group, const std::vector<dt::Tensor>& params) {
  const dt::Tensor flat = dt::flattenTensors(params);
  dt::Tensor highest = flat.clone(), lowest = flat.clone();
  group.allreduce(highest, {.reduceOp = dt::ReduceOp::Max})->wait();
  group.allreduce(lowest, {.reduceOp = dt::ReduceOp::Min})->wait();
  return dt::max(dt::abs(highest - lowest)).to(dt::Device::cpu()).item<double>();
}

int runMain(const std::string& program, const std::function<int()>& body) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  try {
    return body();
  } catch (const std::exception& e) {
    const char* rank = std::getenv("RANK");
    const char* world = std::getenv("WORLD_SIZE");
    const std::string who = rank && world ? str(" (rank ", rank, "/", world, ")") : std::string();
    std::fprintf(stderr, "%s%s: %s\n", program.c_str(), who.c_str(), dt::describe(e).c_str());
    return 1;
  }
}

}  // namespace examples
