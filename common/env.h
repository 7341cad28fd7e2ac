// Environment knobs: every DT_* variable dtrain reads is declared once, in
// common/env.cpp, with its default and meaning. docs/env.md is generated from
// that table (`dt_env_doc > docs/env.md`; a test keeps them in sync).
//
// Reading an undeclared DT_* name is a programming error (dt::Error), so the
// table cannot drift from the code. Other names (RANK, SLURM_PROCID, ...) are
// read as they are. A value that does not parse throws dt::InvalidArgument
// naming the variable, the value and what is accepted.
// Reads go to the live process environment each time; thread-safe as long as
// nobody calls setenv concurrently.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace dt::env {

struct Knob {
  std::string_view name;
  std::string_view defaultValue;  // as the user would write it; "" = unset
  std::string_view meaning;       // one or two sentences
  std::string_view setBy;         // "user", "dtrun", ...
};

// All declared knobs, in the order they are documented.
std::span<const Knob> knobs();
const Knob* findKnob(std::string_view name);

// The variable's value if set (even to ""), else nullopt.
std::optional<std::string> getRaw(std::string_view name);
// The value if set and non-empty, else the declared default ("" when none).
std::string getString(std::string_view name);
int64_t getInt(std::string_view name);
bool getBool(std::string_view name);
// Accepts "250ms", "30s", "30", "5m", "5min", "1h"; a bare number is seconds.
std::chrono::milliseconds getDuration(std::string_view name);

// The parsers behind the getters; `what` names the value in error messages.
int64_t parseInt(std::string_view text, std::string_view what);
bool parseBool(std::string_view text, std::string_view what);
std::chrono::milliseconds parseDuration(std::string_view text, std::string_view what);

// Markdown page listing every knob (what docs/env.md holds).
std::string markdownListing();

}  // namespace dt::env
