// cuda::gemm through cuBLAS. One handle per thread and device (a handle is not safe to share
// between threads that set different streams), created on first use and kept for the
// thread's life; each call binds it to the caller's current stream.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <memory>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/cuda/kernels.h"
#include "tensor/cuda/stream.h"

namespace dt::cuda {
namespace {

void checkBlas(cublasStatus_t status, const char* what, Device device) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw BackendError(str("cuBLAS ", what, " on ", device.str(), " failed: ", cublasGetStatusString(status),
                           " (", static_cast<int>(status), ")"));
  }
}

struct Handles {
  std::array<cublasHandle_t, 64> byDevice{};
  ~Handles() {
    for (cublasHandle_t h : byDevice) {
      if (h != nullptr) cublasDestroy(h);
    }
  }
};

cublasHandle_t handleFor(Device device) {
  thread_local Handles handles;
  if (device.index < 0 || device.index >= static_cast<int>(handles.byDevice.size())) {
    throw InvalidArgument(str("gemm: device ", device.str(), " is out of the supported range"));
  }
  cublasHandle_t& h = handles.byDevice[static_cast<size_t>(device.index)];
  if (h == nullptr) {
    checkBlas(cublasCreate(&h), "create handle", device);
    // Default math: float32 products are not rounded to TF32, so results follow the cpu's.
    checkBlas(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "set math mode", device);
  }
  return h;
}

cublasHandle_t boundHandle(Device device) {
  cublasHandle_t h = handleFor(device);
  checkBlas(cublasSetStream(h, static_cast<cudaStream_t>(currentStream(device).handle())), "set stream",
            device);
  return h;
}

}  // namespace

void gemmStridedBatched(Device device, DType type, bool transA, bool transB, int64_t m, int64_t n, int64_t k,
                        double alpha, const void* a, int64_t lda, int64_t strideA, const void* b, int64_t ldb,
                        int64_t strideB, double beta, void* c, int64_t ldc, int64_t strideC, int64_t batch) {
  if (m == 0 || n == 0 || batch == 0) return;
  DeviceGuard guard(device);
  cublasHandle_t h = boundHandle(device);
  // The same operand swap as gemm(): B first, then A, each with its own flag.
  const cublasOperation_t opB = transB ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opA = transA ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const int bi = static_cast<int>(batch);
  if (type == DType::Float32) {
    const float al = static_cast<float>(alpha), be = static_cast<float>(beta);
    checkBlas(cublasGemmStridedBatchedEx(h, opB, opA, ni, mi, ki, &al, b, CUDA_R_32F, static_cast<int>(ldb),
                                         strideB, a, CUDA_R_32F, static_cast<int>(lda), strideA, &be, c,
                                         CUDA_R_32F, static_cast<int>(ldc), strideC, bi, CUBLAS_COMPUTE_32F,
                                         CUBLAS_GEMM_DEFAULT),
              "sgemm strided batched", device);
  } else if (type == DType::Float64) {
    checkBlas(cublasGemmStridedBatchedEx(h, opB, opA, ni, mi, ki, &alpha, b, CUDA_R_64F,
                                         static_cast<int>(ldb), strideB, a, CUDA_R_64F, static_cast<int>(lda),
                                         strideA, &beta, c, CUDA_R_64F, static_cast<int>(ldc), strideC, bi,
                                         CUBLAS_COMPUTE_64F, CUBLAS_GEMM_DEFAULT),
              "dgemm strided batched", device);
  } else {
    throw InvalidArgument(
        str("bmm: the CUDA path multiplies float32/float64 (16-bit floats are converted first), not ", type));
  }
}

void gemm(Device device, DType type, bool transA, bool transB, int64_t m, int64_t n, int64_t k, double alpha,
          const void* a, int64_t lda, const void* b, int64_t ldb, double beta, void* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  DeviceGuard guard(device);
  cublasHandle_t h = boundHandle(device);
  // Row-major C = A.B is column-major C^T = B^T.A^T: a row-major matrix read column-major is its
  // transpose, so B goes first and each operand keeps its own transpose flag.
  const cublasOperation_t opB = transB ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opA = transA ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  if (type == DType::Float32) {
    const float al = static_cast<float>(alpha), be = static_cast<float>(beta);
    checkBlas(cublasGemmEx(h, opB, opA, ni, mi, ki, &al, b, CUDA_R_32F, static_cast<int>(ldb), a, CUDA_R_32F,
                           static_cast<int>(lda), &be, c, CUDA_R_32F, static_cast<int>(ldc),
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              "sgemm", device);
  } else if (type == DType::Float64) {
    checkBlas(cublasGemmEx(h, opB, opA, ni, mi, ki, &alpha, b, CUDA_R_64F, static_cast<int>(ldb), a,
                           CUDA_R_64F, static_cast<int>(lda), &beta, c, CUDA_R_64F, static_cast<int>(ldc),
                           CUBLAS_COMPUTE_64F, CUBLAS_GEMM_DEFAULT),
              "dgemm", device);
  } else {
    throw InvalidArgument(str(
        "gemm: the CUDA path multiplies float32/float64 (16-bit floats are converted first), not ", type));
  }
}

}  // namespace dt::cuda
