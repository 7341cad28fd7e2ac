#include "train/support.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "collectives/coalesce.h"
#include "common/errors.h"
#include "common/strings.h"
#include "tensor/ops.h"

namespace dt::train {
namespace {

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

std::atomic<int>& stopSignal() { return gStopSignal; }

void installStopHandlers(const std::string& program) {
  struct sigaction sa {};
  sa.sa_handler = onStopSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGTERM, SIGUSR1, SIGINT}) {
    if (sigaction(sig, &sa, nullptr) != 0) {
      throw Error(str(program, ": sigaction(", sig, ") failed: ", std::strerror(errno)));
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

uint64_t fingerprint(const std::vector<Tensor>& tensors) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const Tensor& t : tensors) {
    const Tensor c = t.detach().to(Device::cpu()).contiguous();
    const auto* p = static_cast<const unsigned char*>(c.dataPtr());
    for (size_t i = 0; i < c.nbytes(); ++i) {
      h ^= p[i];
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

double parameterSpread(ProcessGroup& group, const std::vector<Tensor>& params) {
  const Tensor flat = flattenTensors(params);
  Tensor highest = flat.clone(), lowest = flat.clone();
  group.allreduce(highest, {.reduceOp = ReduceOp::Max})->wait();
  group.allreduce(lowest, {.reduceOp = ReduceOp::Min})->wait();
  return max(abs(highest - lowest)).to(Device::cpu()).item<double>();
}

void clearCheckpoints(ProcessGroup& group, const CheckpointDir& dir, const std::string& program, bool quiet) {
  const int removed = dir.clear(group);
  if (group.rank() == 0 && removed > 0 && !quiet) {
    std::printf("%s: --resume never: removed %d checkpoint(s) of an earlier run from %s\n", program.c_str(), removed,
                dir.path().string().c_str());
  }
}

MetricsFile::MetricsFile(const std::string& path, int64_t keepThrough, const std::string& program) {
  std::vector<std::string> kept;
  if (keepThrough > 0) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      const auto at = line.find("\"step\": ");
      if (at != std::string::npos && std::strtoll(line.c_str() + at + 8, nullptr, 10) <= keepThrough) kept.push_back(line);
    }
  }
  out_.open(path, std::ios::trunc);
  if (!out_) throw InvalidArgument(str(program, ": cannot write the metrics file ", path));
  for (const auto& l : kept) out_ << l << "\n";
  out_.flush();
}

void MetricsFile::write(int64_t step, const std::vector<std::pair<std::string, double>>& values,
                        const std::vector<std::pair<std::string, std::string>>& texts) {
  std::string line = str("{\"step\": ", step);
  for (const auto& [key, v] : values) {
    char number[32] = "null";
    if (std::isfinite(v)) std::snprintf(number, sizeof(number), "%.6g", v);
    line += str(", \"", key, "\": ", number);
  }
  for (const auto& [key, text] : texts) line += str(", \"", key, "\": \"", jsonEscape(text), "\"");
  out_ << line << "}\n";
  out_.flush();
}

}  // namespace dt::train
