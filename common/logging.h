// Loggers: one spdlog logger per module, with a rank prefix.
//
// Lines look like
//   [2026-11-29 08:15:02.123] [store] [rank 1/4] [warning] waiting for the store at 10.0.0.1:29500
//
// Two ways to get one:
//  * dt::logger("store"): the process's logger for a module. Its rank prefix
//    comes from RANK/WORLD_SIZE at first use (empty when unset). Cheap after
//    the first call; thread-safe.
//  * dt::makeLogger("store", "rank 1/4"): a fresh logger with an explicit
//    prefix, for code that runs several ranks in one process (tests with
//    threads as ranks). Pass it in; never stash it in a global.
// The level comes from DT_LOG_LEVEL (trace, debug, info, warn, error, off;
// default warn). Output goes to stderr.
#pragma once

#include <memory>
#include <string>

#include <spdlog/spdlog.h>

namespace dt {

using Logger = std::shared_ptr<spdlog::logger>;

Logger logger(const std::string& module);
Logger makeLogger(const std::string& module, const std::string& prefix);

// Re-reads DT_LOG_LEVEL and applies it to every logger made so far.
void reloadLogLevel();

}  // namespace dt
