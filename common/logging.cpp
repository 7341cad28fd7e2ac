#include "common/logging.h"

#include <mutex>
#include <unordered_map>

#include <spdlog/sinks/stdout_color_sinks.h>

#include "common/env.h"
#include "common/errors.h"
#include "common/strings.h"

namespace dt {
namespace {

spdlog::level::level_enum levelFromEnv() {
  const std::string name = env::getString("DT_LOG_LEVEL");
  const auto level = spdlog::level::from_str(name == "warning" ? "warn" : name);
  if (level == spdlog::level::off && name != "off") {
    throw InvalidArgument(str("DT_LOG_LEVEL=", quoteBytes(name),
                              " is not a log level; use trace, debug, info, warn, error or off"));
  }
  return level;
}

std::string processPrefix() {
  const std::string rank = env::getString("RANK");
  const std::string world = env::getString("WORLD_SIZE");
  if (rank.empty()) return {};
  return world.empty() ? str("rank ", rank) : str("rank ", rank, "/", world);
}

struct Registry {
  std::mutex mutex;
  std::unordered_map<std::string, Logger> processLoggers;
  std::vector<std::weak_ptr<spdlog::logger>> all;
};

Registry& registry() {
  static Registry instance;
  return instance;
}

spdlog::sink_ptr sharedSink() {
  static auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  return sink;
}

}  // namespace

Logger makeLogger(const std::string& module, const std::string& prefix) {
  auto made = std::make_shared<spdlog::logger>(module, sharedSink());
  const std::string tag = prefix.empty() ? "" : " [" + prefix + "]";
  made->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n]" + tag + " [%l] %v");
  made->set_level(levelFromEnv());
  made->flush_on(spdlog::level::warn);
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  std::erase_if(reg.all, [](const auto& weak) { return weak.expired(); });
  reg.all.push_back(made);
  return made;
}

Logger logger(const std::string& module) {
  auto& reg = registry();
  {
    std::lock_guard<std::mutex> lock(reg.mutex);
    auto it = reg.processLoggers.find(module);
    if (it != reg.processLoggers.end()) return it->second;
  }
  Logger made = makeLogger(module, processPrefix());
  std::lock_guard<std::mutex> lock(reg.mutex);
  return reg.processLoggers.try_emplace(module, made).first->second;
}

void reloadLogLevel() {
  const auto level = levelFromEnv();
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  for (auto& weak : reg.all) {
    if (auto alive = weak.lock()) alive->set_level(level);
  }
}

}  // namespace dt
