#include "examples/run_support.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"
#include "process_group/init.h"
#include "tensor/device.h"
#include "tensor/nn/safetensors.h"

namespace examples {

using dt::InvalidArgument;
using dt::str;

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

std::string exactText(double value) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", value);
  return buf;
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

std::string deviceName(const std::string& program, const std::string& value, const std::string& flag) {
  try {
    dt::Device::parse(value);
  } catch (const InvalidArgument&) {
    throw InvalidArgument(str(program, ": ", flag, " \"", value, "\" is not one of cpu, cuda, cuda:N"));
  }
  return value;
}

dt::Device deviceFor(const std::string& program, const std::string& text) {
  dt::Device device = dt::Device::parse(text);
  if (device.isCpu()) return device;
  if (text == "cuda") {
    const int localRank = dt::resolveInit({}).localRank;  // from dtrun, torchrun's or SLURM's variables
    const int count = dt::deviceCount(dt::DeviceType::CUDA);
    if (count > 0) device = dt::Device::cuda(localRank % count);
  }
  if (!dt::deviceAvailable(device)) {
    throw dt::NotSupportedError(str(program, ": --device ", text, " (", device.str(), ") is not usable here: ",
                                    dt::deviceUnavailableReason(device), "; use --device cpu"));
  }
  return device;
}

bool TestFlags::parse(const std::string& program, const std::string& flag, const std::string& value) {
  if (flag == "--fail-at") {
    for (const auto& spec : dt::split(value, ',')) failAt.push_back(spec);
    try {
      dt::train::TestSwitches::fromEnvironment({.failAt = failAt});  // checks each spec
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(str(program, ": --", e.what()));
    }
  } else if (flag == "--record-samples") {
    recordSamples = value;
  } else if (flag == "--step-log") {
    stepLog = value;
  } else if (flag == "--measure-transfer") {
    measureTransfer = true;
  } else if (flag == "--step-pause") {
    stepPauseMs = parsePositive(program, value, flag, 0);
  } else if (flag == "--dump-at") {
    for (const auto& part : dt::split(value, ',')) dumpAt.push_back(parsePositive(program, std::string(part), flag, 0));
  } else if (flag == "--dump-dir") {
    dumpDir = value;
  } else {
    return false;
  }
  return true;
}

void TestFlags::apply(dt::train::LoopOptions& options, std::function<std::shared_ptr<dt::nn::Module>()> model,
                      const std::string& program) const {
  auto& test = options.test;
  test.failAt = failAt;
  test.recordSamples = recordSamples;
  test.stepPauseMs = stepPauseMs;
  options.measureTransfer = measureTransfer;
  std::shared_ptr<FILE> log;
  if (!stepLog.empty()) {
    log.reset(std::fopen(stepLog.c_str(), "a"), &std::fclose);
    if (!log) throw dt::Error(str(program, ": cannot append to ", stepLog, ": ", std::strerror(errno)));
  }
  // A line and the time (CLOCK_REALTIME ns) in one write: the file is opened for appending, so
  // lines from several processes do not interleave.
  auto write = [log](const std::string& line) {
    if (!log) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch());
    std::fprintf(log.get(), "%s %lld\n", line.c_str(), static_cast<long long>(ns.count()));
    std::fflush(log.get());
  };
  const long long startNs =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  test.beforeKill = [write](int64_t step, int member) { write(str("kill ", step, " ", member)); };
  options.hooks.onJoined = [write, startNs](const dt::train::JoinInfo& j) {
    write(str("join ", j.member, " ", startNs, " ", j.step, " ", j.bytes, " ", static_cast<int64_t>(j.seconds * 1e9), " ",
              static_cast<int64_t>(j.broadcastSeconds * 1e9)));
  };
  const bool elastic = options.forceElastic || dt::env::getBool("DT_ELASTIC");
  const int64_t restarts = dt::env::getInt("DT_RESTART_COUNT");
  const std::string dir = dumpDir.empty() ? program + "-dumps" : dumpDir;
  options.hooks.afterStep = [write, elastic, restarts, model, dir, dumps = dumpAt](const dt::train::StepDone& done) {
    if (done.rank != 0) return;
    write(str(done.steps - 1, " ", elastic ? done.membershipEpoch : static_cast<uint64_t>(restarts), " ", done.worldSize));
    if (std::find(dumps.begin(), dumps.end(), done.steps) == dumps.end()) return;
    std::filesystem::create_directories(dir);
    dt::NamedTensors tensors;
    for (const auto& [name, t] : model()->namedParameters()) tensors.emplace_back(name, t.to(dt::Device::cpu()));
    dt::saveSafetensors(std::filesystem::path(dir) / str("step-", done.steps, ".safetensors"), tensors);
  };
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
