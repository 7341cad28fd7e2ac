#include "common/errors.h"

namespace dt {

std::string describe(const std::exception& e) {
  if (auto* dtError = dynamic_cast<const Error*>(&e)) {
    return std::string(dtError->kind()) + ": " + e.what();
  }
  return std::string("std::exception: ") + e.what();
}

std::exception_ptr withPrefix(const std::exception_ptr& cause, const std::string& prefix, const std::string& suffix) {
  try {
    std::rethrow_exception(cause);
  } catch (const TimeoutError& e) {
    return std::make_exception_ptr(TimeoutError(prefix + e.what() + suffix));
  } catch (const DesyncError& e) {
    return std::make_exception_ptr(DesyncError(prefix + e.what() + suffix));
  } catch (const NetworkError& e) {
    return std::make_exception_ptr(NetworkError(prefix + e.what() + suffix));
  } catch (const InvalidArgument& e) {
    return std::make_exception_ptr(InvalidArgument(prefix + e.what() + suffix));
  } catch (const NotSupportedError& e) {
    return std::make_exception_ptr(NotSupportedError(prefix + e.what() + suffix));
  } catch (const AnomalyError& e) {
    return std::make_exception_ptr(AnomalyError(prefix + e.what() + suffix));
  } catch (const MemberLostError& e) {
    return std::make_exception_ptr(MemberLostError(prefix + e.what() + suffix));
  } catch (const MembershipError& e) {
    return std::make_exception_ptr(MembershipError(prefix + e.what() + suffix));
  } catch (const JobFinishedError& e) {
    return std::make_exception_ptr(JobFinishedError(prefix + e.what() + suffix));
  } catch (const BackendError& e) {
    return std::make_exception_ptr(BackendError(prefix + e.what() + suffix));
  } catch (const Error& e) {
    return std::make_exception_ptr(Error(prefix + e.what() + suffix));
  } catch (const std::exception& e) {
    return std::make_exception_ptr(BackendError(prefix + e.what() + suffix));
  }
}

}  // namespace dt
