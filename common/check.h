// Check macros: validate input and invariants, throwing (never aborting).
//
//   DT_CHECK(cond, "context ", value)         -> dt::InvalidArgument
//   DT_CHECK_EQ(a, b, "context")  (also _NE, _LT, _LE, _GT, _GE)
//   DT_INTERNAL_CHECK(cond, ...)              -> dt::Error ("internal error")
//   DT_REQUIRE(cond, "what is wrong ", value) -> dt::InvalidArgument with that
//       message alone: for a caller's bad value, where the condition and
//       file:line would only say "internal problem" to a user.
//
// The message names the condition, both operands with their values, and
// file:line, e.g.
//   "tensor sizes differ: check failed: a.numel() == b.numel() (6 vs 8) at tensor/ops.cpp:42"
// Operands are evaluated exactly once. Thread-safe.
#pragma once

#include <sstream>
#include <string>

#include "common/errors.h"
#include "common/strings.h"

namespace dt::detail {

template <typename ErrorType>
[[noreturn]] void throwCheckFailure(const char* file, int line, const std::string& condition,
                                    const std::string& context) {
  std::string message = context;
  if (!message.empty()) message += ": ";
  message += "check failed: " + condition + " at " + file + ":" + std::to_string(line);
  throw ErrorType(message);
}

template <typename T>
std::string checkOperand(const T& value) {
  std::ostringstream out;
  if constexpr (requires { out << value; }) {
    out << value;
  } else {
    out << "<unprintable>";
  }
  return out.str();
}

}  // namespace dt::detail

#define DT_CHECK(cond, ...)                                                           \
  do {                                                                                \
    if (!(cond)) [[unlikely]] {                                                       \
      ::dt::detail::throwCheckFailure<::dt::InvalidArgument>(__FILE__, __LINE__, #cond, \
                                                             ::dt::str(__VA_ARGS__)); \
    }                                                                                 \
  } while (0)

#define DT_REQUIRE(cond, ...)                                  \
  do {                                                         \
    if (!(cond)) [[unlikely]] {                                \
      throw ::dt::InvalidArgument(::dt::str(__VA_ARGS__));     \
    }                                                          \
  } while (0)

#define DT_INTERNAL_CHECK(cond, ...)                                                           \
  do {                                                                                         \
    if (!(cond)) [[unlikely]] {                                                                \
      ::dt::detail::throwCheckFailure<::dt::Error>(__FILE__, __LINE__,                         \
                                                   std::string(#cond) + " (internal error, please report)", \
                                                   ::dt::str(__VA_ARGS__));                 \
    }                                                                                          \
  } while (0)

#define DT_CHECK_OP_(op, a, b, ...)                                                        \
  do {                                                                                     \
    const auto& dtCheckA_ = (a);                                                           \
    const auto& dtCheckB_ = (b);                                                           \
    if (!(dtCheckA_ op dtCheckB_)) [[unlikely]] {                                          \
      ::dt::detail::throwCheckFailure<::dt::InvalidArgument>(                              \
          __FILE__, __LINE__,                                                              \
          std::string(#a " " #op " " #b " (") + ::dt::detail::checkOperand(dtCheckA_) +    \
              " vs " + ::dt::detail::checkOperand(dtCheckB_) + ")",                        \
          ::dt::str(__VA_ARGS__));                                                      \
    }                                                                                      \
  } while (0)

#define DT_CHECK_EQ(a, b, ...) DT_CHECK_OP_(==, a, b, __VA_ARGS__)
#define DT_CHECK_NE(a, b, ...) DT_CHECK_OP_(!=, a, b, __VA_ARGS__)
#define DT_CHECK_LT(a, b, ...) DT_CHECK_OP_(<, a, b, __VA_ARGS__)
#define DT_CHECK_LE(a, b, ...) DT_CHECK_OP_(<=, a, b, __VA_ARGS__)
#define DT_CHECK_GT(a, b, ...) DT_CHECK_OP_(>, a, b, __VA_ARGS__)
#define DT_CHECK_GE(a, b, ...) DT_CHECK_OP_(>=, a, b, __VA_ARGS__)
