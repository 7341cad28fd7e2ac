#include "examples/run_support.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"

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
