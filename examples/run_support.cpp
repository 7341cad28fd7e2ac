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

Flags::Flags(std::string program, std::string intro) : program_(std::move(program)), text_(std::move(intro)) {}

Flags& Flags::section(const std::string& title) {
  text_ += title + "\n";
  return *this;
}

void Flags::describe(const std::string& left, const std::string& help, const std::string& defaultText) {
  constexpr size_t kColumn = 26;
  std::string line = "  " + left;
  line += line.size() + 1 < kColumn ? std::string(kColumn - line.size(), ' ') : "\n" + std::string(kColumn, ' ');
  std::string body = help;
  if (!defaultText.empty() && help.find("(default") == std::string::npos) body += str(body.empty() ? "" : " ", "(default ", defaultText, ")");
  for (size_t at = 0; (at = body.find('\n', at)) != std::string::npos; at += kColumn + 1) body.insert(at + 1, kColumn, ' ');
  text_ += line + body + "\n";
}

Flags& Flags::bind(const std::string& name, const std::string& metavar, const std::string& help, const std::string& defaultText,
                   bool isSwitch, std::function<void(const std::string&)> set) {
  describe(metavar.empty() ? name : name + " " + metavar, help, defaultText);
  flags_.push_back({name, isSwitch, std::move(set)});
  return *this;
}

Flags& Flags::add(const std::string& name, int64_t& target, const std::string& metavar, const std::string& help, int64_t minimum) {
  return bind(name, metavar, help, std::to_string(target), false,
              [this, &target, name, minimum](const std::string& v) { target = parsePositive(program_, v, name, minimum); });
}

Flags& Flags::add(const std::string& name, int& target, const std::string& metavar, const std::string& help, int64_t minimum) {
  return bind(name, metavar, help, std::to_string(target), false, [this, &target, name, minimum](const std::string& v) {
    target = static_cast<int>(std::min<int64_t>(parsePositive(program_, v, name, minimum), 1 << 30));
  });
}

Flags& Flags::add(const std::string& name, uint64_t& target, const std::string& metavar, const std::string& help) {
  return bind(name, metavar, help, std::to_string(target), false,
              [this, &target, name](const std::string& v) { target = static_cast<uint64_t>(parsePositive(program_, v, name, 0)); });
}

Flags& Flags::add(const std::string& name, double& target, const std::string& metavar, const std::string& help, double minimum,
                  double maximum) {
  return bind(name, metavar, help, str(target), false, [this, &target, name, minimum, maximum](const std::string& v) {
    target = parseDouble(program_, v, name, minimum, maximum);
  });
}

Flags& Flags::add(const std::string& name, std::optional<double>& target, const std::string& metavar, const std::string& help,
                  double minimum, double maximum) {
  return bind(name, metavar, help, "", false, [this, &target, name, minimum, maximum](const std::string& v) {
    target = parseDouble(program_, v, name, minimum, maximum);
  });
}

Flags& Flags::add(const std::string& name, std::string& target, const std::string& metavar, const std::string& help,
                  std::vector<std::string> allowed) {
  const std::string shown = metavar.empty() ? dt::join(allowed, "|") : metavar;
  return bind(name, shown, help, target.empty() ? "" : target.find(' ') != std::string::npos ? str("\"", target, "\"") : target, false,
              [this, &target, name, allowed](const std::string& v) { target = allowed.empty() ? v : choice(program_, v, name, allowed); });
}

Flags& Flags::add(const std::string& name, bool& target, const std::string& help, bool value) {
  return bind(name, "", help, "", true, [&target, value](const std::string&) { target = value; });
}

Flags& Flags::add(const std::string& name, const std::string& metavar, const std::string& help,
                  std::function<void(const std::string& value)> set) {
  return bind(name, metavar, help, "", false, std::move(set));
}

Flags& Flags::alsoAccept(std::function<bool(const std::string& flag, const std::string& value)> take,
                         std::vector<std::string> switches, std::string usage) {
  others_.push_back(std::move(take));
  otherSwitches_.insert(otherSwitches_.end(), switches.begin(), switches.end());
  otherUsage_ += usage;
  return *this;
}

std::string Flags::usage() const { return text_ + otherUsage_; }

bool Flags::parse(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::optional<std::string> inlineValue;
    if (const auto eq = flag.find('='); flag.starts_with("--") && eq != std::string::npos) {
      inlineValue = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    }
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage().c_str(), stdout);
      return false;
    }
    if (!flag.starts_with("--")) throw InvalidArgument(str(program_, ": unexpected argument \"", flag, "\"; see --help"));
    const auto own = std::find_if(flags_.begin(), flags_.end(), [&](const Flag& f) { return f.name == flag; });
    const bool isSwitch = own != flags_.end() ? own->isSwitch
                                              : std::find(otherSwitches_.begin(), otherSwitches_.end(), flag) != otherSwitches_.end();
    if (!isSwitch && !inlineValue && i + 1 >= argc) throw InvalidArgument(str(program_, ": ", flag, " needs a value; see --help"));
    const std::string value = isSwitch ? std::string() : inlineValue ? *inlineValue : std::string(argv[++i]);
    if (own != flags_.end()) {
      own->set(value);
      continue;
    }
    if (std::none_of(others_.begin(), others_.end(), [&](const auto& take) { return take(flag, value); })) {
      throw InvalidArgument(str(program_, ": unknown flag ", flag, "; see --help"));
    }
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

void BenchWindow::attach(dt::train::LoopOptions& options, int64_t warmup, std::function<void()> onFirstStep) {
  auto at = options.hooks.at;
  options.hooks.at = [this, at, warmup, onFirstStep](int64_t step, dt::train::Phase phase) {
    if (at) at(step, phase);
    if (phase != dt::train::Phase::Begin) return;
    if (from_ < 0) {
      from_ = step + warmup;
      if (onFirstStep) onFirstStep();
    }
    if (step == from_) start_ = std::chrono::steady_clock::now();
  };
  auto afterStep = options.hooks.afterStep;
  options.hooks.afterStep = [this, afterStep, total = options.steps](const dt::train::StepDone& done) {
    if (afterStep) afterStep(done);
    if (done.steps != total) return;
    end_ = std::chrono::steady_clock::now();
    steps_ = done.steps - from_;
  };
}

double BenchWindow::seconds() const {
  return measured() ? std::chrono::duration<double>(*end_ - *start_).count() : 0.0;
}

int reportParameters(const std::string& program, const dt::train::Loop& loop, const dt::train::LoopResult& r, bool quiet) {
  if (!quiet) {
    std::printf("%s: rank %d/%d final parameters fingerprint %016llx (spread across ranks %.3g)\n", program.c_str(), loop.rank(),
                loop.worldSize(), static_cast<unsigned long long>(r.fingerprint), r.parameterSpread);
  }
  if (r.parameterSpread == 0.0) return 0;
  std::fprintf(stderr, "%s: rank %d/%d: parameters differ across ranks (max difference %g)\n", program.c_str(), loop.rank(),
               loop.worldSize(), r.parameterSpread);
  return 1;
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
