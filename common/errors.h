// dtrain's exception hierarchy.
//
// Contract: library code reports every recoverable failure by throwing one of
// these (never exit()/abort()). On asynchronous paths the exception travels as
// a std::exception_ptr inside a Work until Work::wait() rethrows it.
// Messages are one readable line: what failed, who (rank/size, group, backend,
// op, sequence number), the values involved, and a hint. Build them with
// dt::str(...) from common/strings.h. All types are copyable and thread-safe
// to read.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

namespace dt {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
  // The class name as users see it in logs, e.g. "dt::TimeoutError".
  virtual const char* kind() const noexcept { return "dt::Error"; }
};

#define DT_DECLARE_ERROR(Name)                                             \
  class Name : public Error {                                              \
   public:                                                                 \
    explicit Name(const std::string& message) : Error(message) {}          \
    const char* kind() const noexcept override { return "dt::" #Name; }    \
  }

// A deadline passed: store waits, collectives, connects.
DT_DECLARE_ERROR(TimeoutError);
// A connection failed or a peer went away.
DT_DECLARE_ERROR(NetworkError);
// A communication backend (Gloo, NCCL) failed.
DT_DECLARE_ERROR(BackendError);
// Ranks disagree about which collective they are running.
DT_DECLARE_ERROR(DesyncError);
// The caller passed a bad value (shape, dtype, option, environment variable).
DT_DECLARE_ERROR(InvalidArgument);
// The operation exists in the vocabulary but not in this backend/device/build.
DT_DECLARE_ERROR(NotSupportedError);
// Anomaly mode found an op that made a NaN or Inf (tensor/autograd/anomaly.h):
// the computation ran as asked, its values went bad.
DT_DECLARE_ERROR(AnomalyError);
// A member of an elastic job is gone (exited, killed, frozen past its liveness
// timeout): the group it belonged to is broken, and the job goes on without it
// (elastic/elastic_group.h). The message names the rank and how it ended.
DT_DECLARE_ERROR(MemberLostError);
// An elastic job cannot go on as asked: fewer members than its minimum, or
// this process is no longer a member. The message names who is left and why.
DT_DECLARE_ERROR(MembershipError);
// A process that came to join a running elastic job found it finished before it
// was admitted: there is nothing left for it to do (a trainer exits 0).
DT_DECLARE_ERROR(JobFinishedError);

#undef DT_DECLARE_ERROR

// "dt::TimeoutError: <message>" for any exception, for logs and summaries.
std::string describe(const std::exception& e);

// The same error with `prefix` put before its message, keeping its dt type
// (another std::exception becomes a BackendError), for adding context while
// an error travels up; `suffix` goes after it.
std::exception_ptr withPrefix(const std::exception_ptr& cause, const std::string& prefix,
                              const std::string& suffix = "");

}  // namespace dt
