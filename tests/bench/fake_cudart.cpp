// Stand-ins for the CUDA runtime's entry points that initialise CUDA (the device query first),
// for tests, put in front of libcudart with LD_PRELOAD: each appends the calling process's pid
// to the file $DT_FAKE_CUDART_LOG names and answers cudaErrorNoDevice, as on a machine without
// a GPU. Which processes initialised CUDA is then in that file. (The driver library is no
// marker: cuBLASLt loads libcuda.so.1 when it is itself loaded, in every process, without
// initialising it.)
#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <string>

namespace {

constexpr int kCudaErrorNoDevice = 100;  // cudaErrorNoDevice (cudaError_t is an int-sized enum)

int record() {
  const char* log = std::getenv("DT_FAKE_CUDART_LOG");
  if (log == nullptr) return kCudaErrorNoDevice;
  const int fd = ::open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return kCudaErrorNoDevice;
  const std::string line = std::to_string(::getpid()) + "\n";
  const ssize_t written = ::write(fd, line.data(), line.size());  // one append: lines never interleave
  (void)written;
  ::close(fd);
  return kCudaErrorNoDevice;
}

}  // namespace

extern "C" {
int cudaGetDeviceCount(int* count) {
  *count = 0;
  return record();
}
int cudaGetDevice(int*) { return record(); }
int cudaSetDevice(int) { return record(); }
int cudaFree(void*) { return record(); }
int cudaMalloc(void**, size_t) { return record(); }
}
