// What dtrun asks of the machine: device and core counts, host name, random
// tokens and free ports. Each function is small and side-effect free apart
// from what its name says.
// Thread safety: all functions are thread-safe.
#pragma once

#include <cstdint>
#include <string>

namespace dt::launcher {

// CUDA devices without linking CUDA: /proc/driver/nvidia/gpus entries, else
// the lines of `nvidia-smi -L`; CUDA_VISIBLE_DEVICES (when set) limits the
// count to the devices it lists. 0 when there is none.
int countGpus();
// Cores this process may run on (sched_getaffinity).
int countCpus();
std::string hostName();
// `bytes` random bytes from /dev/urandom as lowercase hex.
std::string randomHex(size_t bytes);
// Binds port 0 on `address` (empty: all interfaces), reads the port the kernel
// chose and closes the socket: a port that is free right now, for the workers'
// MASTER_PORT. Throws dt::NetworkError.
uint16_t pickFreePort(const std::string& address);
// A listening TCP socket (non-blocking, close-on-exec) on `address` (empty:
// all interfaces) and port 0; `port` receives the bound port. Throws NetworkError.
int listenTcp(const std::string& address, uint16_t& port);
// A connected TCP socket (close-on-exec) to host:port, trying each address the
// name resolves to; -1 on failure (`error` says why).
int connectTcp(const std::string& host, uint16_t port, std::string& error);
// Milliseconds since the epoch.
int64_t wallMs();

}  // namespace dt::launcher
