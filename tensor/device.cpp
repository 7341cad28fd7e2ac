#include "tensor/device.h"

#include <charconv>

#include "common/config.h"
#include "common/errors.h"
#include "common/strings.h"

#if DT_HAVE_CUDA
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/stream.h"
#endif

namespace dt {

std::string Device::str() const {
  if (isCpu()) return "cpu";
  return "cuda:" + std::to_string(index);
}

std::ostream& operator<<(std::ostream& out, const Device& device) { return out << device.str(); }

Device Device::parse(const std::string& text) {
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  if (text.starts_with("cuda:") && text.size() > 5) {
    int index = -1;
    const char* begin = text.data() + 5;
    const char* end = text.data() + text.size();
    const auto [ptr, ec] = std::from_chars(begin, end, index);
    if (ec == std::errc() && ptr == end && index >= 0) return cuda(index);
  }
  throw InvalidArgument(dt::str("device ", quoteBytes(text), " is not one of cpu, cuda, cuda:N (N = 0, 1, ...)"));
}

std::string deviceUnavailableReason(Device device) {
  if (device.isCpu()) return "";
#if DT_HAVE_CUDA
  const int count = cuda::deviceCount();
  if (count == 0) return cuda::unavailableReason();
  if (device.index < 0 || device.index >= count) {
    return str(device.str(), " does not exist: this machine has ", count, " CUDA device(s)");
  }
  return "";
#else
  return "this build of dtrain has no GPU support (configured without CUDA: DT_USE_CUDA)";
#endif
}

bool deviceAvailable(Device device) { return deviceUnavailableReason(device).empty(); }

int deviceCount(DeviceType type) {
  if (type == DeviceType::CPU) return 1;
#if DT_HAVE_CUDA
  return cuda::deviceCount();
#else
  return 0;
#endif
}

void setCurrentDevice(Device device) {
  if (device.isCpu()) return;
  if (const std::string why = deviceUnavailableReason(device); !why.empty()) {
    throw NotSupportedError(str("cannot make ", device.str(), " the current device: ", why));
  }
#if DT_HAVE_CUDA
  cuda::setCurrentDevice(device.index);
#endif
}

}  // namespace dt
