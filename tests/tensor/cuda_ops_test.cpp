// Every CUDA op, forward and backward, against the cpu implementation. Runs on a machine with
// a CUDA device; elsewhere each test skips and says why (a cpu-only build, no device).
//
// Tolerances (relative to the cpu value, plus an absolute floor for values near zero):
//  * float64: rtol 1e-12, atol 1e-12 (summation order only).
//  * float32: rtol 1e-5, atol 1e-5 (summation order in reductions and gemm, fused
//    multiply-add in elementwise kernels; gemm runs without TF32).
//  * float16: rtol 5e-3, atol 1e-3; bfloat16: rtol 3e-2, atol 1e-2 (one rounding of the
//    16-bit result may land on the neighbouring value when the float32 math differs in its
//    last bits).
//  * AdamW: the update avoids fused multiply-add, so a step from equal inputs gives equal bits;
//    after a gemm-fed backward the parameters are compared at the float32 tolerance.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/errors.h"
#include "common/strings.h"
#include "tensor/deferred_checks.h"
#include "tensor/nn/clip_grad.h"
#include "tensor/ops.h"
#include "tensor/optim/optim.h"
#include "tensor/storage.h"
#include "tensor/tensor.h"
#include "tests/testing/testing.h"

#if DT_HAVE_CUDA
#include "tensor/cuda/cuda.h"
#include "tensor/cuda/kernels.h"
#include "tensor/cuda/stream.h"
#endif

namespace dt {
namespace {

using testing::expectThrowsWith;

int cudaDevices() {
#if DT_HAVE_CUDA
  return cuda::deviceCount();
#else
  return 0;
#endif
}

std::string whyNoCuda() {
#if DT_HAVE_CUDA
  return cuda::unavailableReason();
#else
  return "this build has no CUDA (configured with DT_USE_CUDA=OFF or without nvcc)";
#endif
}

#define REQUIRE_CUDA() \
  if (cudaDevices() == 0) GTEST_SKIP() << "needs a CUDA device: " << whyNoCuda()

const Device kGpu = Device::cuda(0);

struct Tol {
  double rtol;
  double atol;
};
constexpr Tol kF64{1e-12, 1e-12};
constexpr Tol kF32{1e-5, 1e-5};
constexpr Tol kF16{5e-3, 1e-3};
constexpr Tol kBF16{3e-2, 1e-2};

Tol tolFor(DType t) {
  switch (t) {
    case DType::Float64:
      return kF64;
    case DType::Float16:
      return kF16;
    case DType::BFloat16:
      return kBF16;
    default:
      return kF32;
  }
}

// gpu (on cuda:0) matches ref (on the cpu) in shape, dtype and values.
void expectMatches(const Tensor& ref, const Tensor& gpu, Tol tol, const std::string& what) {
  ASSERT_TRUE(ref.defined()) << what << ": cpu result undefined";
  ASSERT_TRUE(gpu.defined()) << what << ": cuda result undefined";
  ASSERT_EQ(gpu.device(), kGpu) << what;
  ASSERT_EQ(ref.device(), Device::cpu()) << what;
  ASSERT_EQ(gpu.sizes(), ref.sizes()) << what << ": " << gpu.describe() << " vs " << ref.describe();
  ASSERT_EQ(gpu.dtype(), ref.dtype()) << what;
  const std::vector<double> x = gpu.to(Device::cpu()).toVector<double>();
  const std::vector<double> y = ref.toVector<double>();
  int reported = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(y[i]) && std::isnan(x[i])) continue;
    if (std::isinf(y[i]) && x[i] == y[i]) continue;
    const bool close = std::abs(x[i] - y[i]) <= tol.atol + tol.rtol * std::abs(y[i]);
    if (!close && reported++ < 5) {
      ADD_FAILURE() << what << ": element " << i << " is " << x[i] << " on cuda, " << y[i] << " on the cpu";
    }
  }
}

using Fn = std::function<Tensor(const TensorList&)>;

// Runs f on cpu inputs and on their cuda copies, compares the outputs, then backpropagates
// sum(out * w) for a fixed random w and compares the gradient of every floating input.
void checkOp(const std::string& what, const Fn& f, const TensorList& inputs, bool backward = true) {
  TensorList cpuIn, gpuIn;
  for (const Tensor& t : inputs) {
    Tensor c = t.detach().clone();
    Tensor g = t.detach().to(kGpu);
    if (backward && isFloatingPoint(t.dtype())) {
      c.setRequiresGrad(true);
      g.setRequiresGrad(true);
    }
    cpuIn.push_back(c);
    gpuIn.push_back(g);
  }
  const Tensor outCpu = f(cpuIn);
  const Tensor outGpu = f(gpuIn);
  const Tol tol = tolFor(outCpu.dtype());
  expectMatches(outCpu, outGpu, tol, what + " forward");
  if (!backward || !isFloatingPoint(outCpu.dtype())) return;
  Generator gen(1234);
  const Tensor w = randn(outCpu.sizes(), gen).to(outCpu.dtype());
  sum(mul(outCpu, w)).backward();
  sum(mul(outGpu, w.to(kGpu))).backward();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!cpuIn[i].requiresGrad()) continue;
    expectMatches(cpuIn[i].grad(), gpuIn[i].grad(), tolFor(inputs[i].dtype()),
                  what + " gradient of input " + std::to_string(i));
  }
}

Tensor randomTensor(Shape shape, uint64_t seed, DType dtype = DType::Float32) {
  Generator gen(seed);
  return randn(std::move(shape), gen, DType::Float64).to(dtype);
}

TEST(CudaOps, ElementwiseBinaryWithBroadcasting) {
  REQUIRE_CUDA();
  const Tensor a = randomTensor({4, 5, 6}, 1), b = randomTensor({5, 1}, 2), c = randomTensor({6}, 3);
  checkOp("add", [](const TensorList& t) { return add(t[0], t[1]); }, {a, b});
  checkOp("add alpha", [](const TensorList& t) { return add(t[0], t[1], 2.5); }, {a, c});
  checkOp("sub alpha", [](const TensorList& t) { return sub(t[0], t[1], -0.5); }, {b, a});
  checkOp("mul", [](const TensorList& t) { return mul(t[0], t[1]); }, {a, c});
  checkOp("div", [](const TensorList& t) { return div(t[0], add(abs(t[1]), 1.0)); }, {a, b});
  checkOp("pow", [](const TensorList& t) { return pow(add(abs(t[0]), 0.5), t[1]); }, {a, c});
  checkOp("pow scalar", [](const TensorList& t) { return pow(t[0], 3.0); }, {a});
  checkOp("maximum", [](const TensorList& t) { return maximum(t[0], t[1]); }, {a, b});
  checkOp("minimum", [](const TensorList& t) { return minimum(t[0], t[1]); }, {a, c});
  checkOp("scalars", [](const TensorList& t) { return rsub(mul(add(t[0], 2.0), 3.0), 1.0) / 4.0; }, {a});
  checkOp(
      "eq", [](const TensorList& t) { return eq(t[0], t[0]); }, {a}, false);
  checkOp(
      "lt", [](const TensorList& t) { return lt(t[0], t[1]); }, {a, b}, false);
  checkOp(
      "ge", [](const TensorList& t) { return ge(t[0], t[1]); }, {a, c}, false);
  checkOp(
      "gt scalar", [](const TensorList& t) { return gt(t[0], 0.25); }, {a}, false);
  checkOp("float64", [](const TensorList& t) { return mul(add(t[0], t[1]), t[1]); },
          {a.to(DType::Float64), b.to(DType::Float64)});
  checkOp(
      "int64", [](const TensorList& t) { return add(mul(t[0], t[1]), t[0]); },
      {arange(12, TensorOptions().dtype(DType::Int64)).reshape({3, 4}),
       arange(4, TensorOptions().dtype(DType::Int64))},
      false);
}

TEST(CudaOps, ElementwiseUnary) {
  REQUIRE_CUDA();
  const Tensor a = randomTensor({7, 9}, 4);
  checkOp("neg", [](const TensorList& t) { return neg(t[0]); }, {a});
  checkOp("exp", [](const TensorList& t) { return exp(t[0]); }, {a});
  checkOp("log", [](const TensorList& t) { return log(add(abs(t[0]), 0.1)); }, {a});
  checkOp("sqrt", [](const TensorList& t) { return sqrt(add(abs(t[0]), 0.1)); }, {a});
  checkOp("abs", [](const TensorList& t) { return abs(t[0]); }, {a});
  checkOp("clamp", [](const TensorList& t) { return clamp(t[0], -0.5, 0.7); }, {a});
  checkOp("relu", [](const TensorList& t) { return relu(t[0]); }, {a});
  checkOp("gelu", [](const TensorList& t) { return gelu(t[0]); }, {a});
  checkOp("tanh", [](const TensorList& t) { return tanh(t[0]); }, {a});
  checkOp("sigmoid", [](const TensorList& t) { return sigmoid(t[0]); }, {a});
  checkOp("where", [](const TensorList& t) { return where(gt(t[0], 0.0), t[0], t[1]); },
          {a, randomTensor({9}, 5)});
}

TEST(CudaOps, NonContiguousInputs) {
  REQUIRE_CUDA();
  const Tensor a = randomTensor({6, 8}, 6), b = randomTensor({8, 6}, 7);
  checkOp("transposed add", [](const TensorList& t) { return add(t[0].t(), t[1]); }, {a, b});
  checkOp("narrowed mul",
          [](const TensorList& t) { return mul(t[0].narrow(1, 2, 4), t[1].narrow(0, 1, 4).t()); }, {a, b});
  checkOp("sliced relu", [](const TensorList& t) { return relu(t[0].slice(0, 0, 6, 2)); }, {a});
  checkOp("permuted sum",
          [](const TensorList& t) {
            return sum(t[0].reshape({2, 3, 8}).permute({2, 0, 1}), {1});
          },
          {a});
  checkOp("expanded contiguous",
          [](const TensorList& t) {
            return t[0].narrow(0, 0, 1).expand({5, 8}).contiguous();
          },
          {a});
}

TEST(CudaOps, InPlaceOps) {
  REQUIRE_CUDA();
  const Tensor a = randomTensor({5, 4}, 8), b = randomTensor({4}, 9);
  Tensor x = a.clone(), y = a.to(kGpu);
  add_(x, b, 0.5);
  add_(y, b.to(kGpu), 0.5);
  mul_(x, 1.5);
  mul_(y, 1.5);
  relu_(x);
  relu_(y);
  clamp_(x, 0.1, std::nullopt);
  clamp_(y, 0.1, std::nullopt);
  sqrt_(x);
  sqrt_(y);
  addcmul_(x, x, x, 0.25);
  addcmul_(y, y, y, 0.25);
  expectMatches(x, y, kF32, "in-place chain");
}

TEST(CudaOps, Reductions) {
  REQUIRE_CUDA();
  const Tensor a = randomTensor({4, 5, 6}, 10);
  checkOp("sum all", [](const TensorList& t) { return sum(t[0]); }, {a});
  checkOp("sum dims", [](const TensorList& t) { return sum(t[0], {0, 2}); }, {a});
  checkOp("sum keepdim", [](const TensorList& t) { return sum(t[0], {1}, true); }, {a});
  checkOp("mean", [](const TensorList& t) { return mean(t[0], {-1}); }, {a});
  checkOp("mean all", [](const TensorList& t) { return mean(t[0]); }, {a});
  checkOp("max dim", [](const TensorList& t) { return max(t[0], 1).values; }, {a});
  checkOp("min dim keepdim", [](const TensorList& t) { return min(t[0], 2, true).values; }, {a});
  checkOp("max all", [](const TensorList& t) { return max(t[0]); }, {a});
  checkOp("amax", [](const TensorList& t) { return amax(t[0], {0, 2}); }, {a});
  checkOp(
      "argmax", [](const TensorList& t) { return argmax(t[0], 1); }, {a}, false);
  checkOp(
      "argmin", [](const TensorList& t) { return argmin(t[0], 0); }, {a}, false);
  checkOp(
      "sum int32", [](const TensorList& t) { return sum(t[0], {1}); },
      {arange(20, TensorOptions().dtype(DType::Int32)).reshape({4, 5})}, false);
  checkOp("sum float64", [](const TensorList& t) { return sum(t[0], {1}); }, {a.to(DType::Float64)});
}

TEST(CudaOps, SoftmaxFamily) {
  REQUIRE_CUDA();
  const Tensor a = mul(randomTensor({6, 300}, 11), 4.0);
  checkOp("softmax last", [](const TensorList& t) { return softmax(t[0], -1); }, {a});
  checkOp("softmax dim 0", [](const TensorList& t) { return softmax(t[0], 0); }, {a});
  checkOp("logSoftmax last", [](const TensorList& t) { return logSoftmax(t[0], 1); }, {a});
  checkOp("logSoftmax dim 0", [](const TensorList& t) { return logSoftmax(t[0], 0); }, {a});
}

TEST(CudaOps, CrossEntropy) {
  REQUIRE_CUDA();
  const Tensor logits = mul(randomTensor({8, 10}, 12), 3.0);
  const Tensor target = fromVector<int64_t>({0, 3, 9, 3, -100, 5, 1, 2});
  for (Reduction r : {Reduction::Mean, Reduction::Sum, Reduction::None}) {
    for (double smoothing : {0.0, 0.1}) {
      CrossEntropyOptions o;
      o.reduction = r;
      o.labelSmoothing = smoothing;
      checkOp(str("crossEntropy reduction ", static_cast<int>(r), " smoothing ", smoothing),
              [o](const TensorList& t) { return crossEntropy(t[0], t[1], o); }, {logits, target});
    }
  }
  checkOp("crossEntropy single row", [](const TensorList& t) { return crossEntropy(t[0], t[1]); },
          {randomTensor({10}, 13), scalarTensor(4.0, DType::Int64)});
  // The target check is deferred (tensor/deferred_checks.h): raised at the loss's read.
  const Tensor bad = fromVector<int64_t>({0, 1, 10, 2, 3, 4, 5, 6}).to(kGpu);
  expectThrowsWith<InvalidArgument>([&] { crossEntropy(logits.to(kGpu), bad).item<float>(); },
                                    {"crossEntropy", "target 10 at position 2", "10 classes", "found on cuda:0"});
}

TEST(CudaOps, LayerNormAndEmbedding) {
  REQUIRE_CUDA();
  const Tensor x = randomTensor({3, 4, 16}, 14), w = randomTensor({16}, 15), b = randomTensor({16}, 16);
  checkOp("layerNorm", [](const TensorList& t) { return layerNorm(t[0], {16}, t[1], t[2], 1e-5); },
          {x, w, b});
  checkOp("layerNorm 2 dims no affine", [](const TensorList& t) { return layerNorm(t[0], {4, 16}); }, {x});
  const Tensor table = randomTensor({10, 7}, 17);
  const Tensor idx = fromVector<int64_t>({1, 3, 3, 9, 0, 1}, {2, 3});
  checkOp("embedding", [](const TensorList& t) { return embedding(t[0], t[1]); }, {table, idx});
  checkOp("embedding int32 indices", [](const TensorList& t) { return embedding(t[0], t[1]); },
          {table, idx.to(DType::Int32)});
  expectThrowsWith<InvalidArgument>(
      [&] {
        embedding(table.to(kGpu), fromVector<int64_t>({2, 10}).to(kGpu)).to(Device::cpu());
      },
      {"embedding", "index 10 at position 1", "10 rows", "found on cuda:0"});
}

// Issue 43 item 7: the index checks and the gradient norm do not make the host wait per call.
TEST(CudaOps, IndexChecksQueueWithoutWaitingAndRaiseAtTheNextRead) {
  REQUIRE_CUDA();
#if DT_HAVE_CUDA
  const Tensor logits = randomTensor({8, 10}, 12).to(kGpu);
  const Tensor good = fromVector<int64_t>({0, 3, 9, 3, -100, 5, 1, 2}).to(kGpu);
  const Tensor bad = fromVector<int64_t>({0, 3, 9, 3, -100, 5, 12, 2}).to(kGpu);
  const Tensor table = randomTensor({10, 7}, 17).to(kGpu);
  const Tensor idx = fromVector<int64_t>({1, 3, 3, 9, 0, 1}).to(kGpu);
  Tensor leaf = logits.detach();
  leaf.setRequiresGrad(true);
  uint64_t before = cuda::hostSyncCount();
  Tensor loss = add(crossEntropy(leaf, good), sum(embedding(table, idx)));
  loss.backward();
  EXPECT_EQ(cuda::hostSyncCount(), before) << "crossEntropy / embedding forward and backward waited";
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  EXPECT_EQ(detail::deferredChecks().pending(kGpu), 0u) << "a read drops the finished checks";
  // A bad target: the op returns, the loss's read raises (at the latest the optimizer step would).
  before = cuda::hostSyncCount();
  Tensor badLoss = crossEntropy(logits, bad);
  EXPECT_EQ(cuda::hostSyncCount(), before);
  expectThrowsWith<InvalidArgument>([&] { badLoss.item<double>(); },
                                    {"crossEntropy: target 12 at position 6 is out of range for 10 classes",
                                     "found on cuda:0", "raised at the next copy between the host and this device"});
  // Raised once; the device is still usable.
  EXPECT_NO_THROW(crossEntropy(logits, good).item<double>());
  // Meanwhile the bad rows read nothing out of bounds: zeros for an embedding row.
  const Tensor rows = embedding(table, fromVector<int64_t>({2, 10, -3}).to(kGpu));
  expectThrowsWith<InvalidArgument>([&] { rows.to(Device::cpu()); }, {"embedding: index 10 at position 1"});
  const std::vector<double> got = rows.to(Device::cpu()).toVector<double>();
  for (size_t j = 7; j < 21; ++j) EXPECT_EQ(got[j], 0.0) << j;
#endif
}

TEST(CudaOps, ABadBatchNeverReachesTheWeights) {
  REQUIRE_CUDA();
#if DT_HAVE_CUDA
  Tensor table = randomTensor({10, 7}, 17).to(kGpu);
  table.setRequiresGrad(true);
  optim::SGDOptions o;
  o.lr = 0.1;
  optim::SGD sgd({table}, o);
  sum(embedding(table, fromVector<int64_t>({1, 11}).to(kGpu))).backward();
  const Tensor saved = table.detach().clone();  // on the device: no read, no raise
  expectThrowsWith<InvalidArgument>([&] { sgd.step(); },
                                    {"embedding: index 11 at position 1", "raised at the optimizer step"});
  expectMatches(saved.to(Device::cpu()), table.detach(), Tol{0.0, 0.0}, "the weights after the refused step");
#endif
}

TEST(CudaOps, ClipGradNormReadsTheNormOnce) {
  REQUIRE_CUDA();
#if DT_HAVE_CUDA
  std::vector<Tensor> cpuParams, gpuParams;
  for (int i = 0; i < 6; ++i) {
    const Tensor p = randomTensor({3 + i, 4}, 60 + i);
    const Tensor g = randomTensor({3 + i, 4}, 70 + i);
    cpuParams.push_back(p.clone());
    cpuParams.back().setGrad(g.clone());
    gpuParams.push_back(p.to(kGpu));
    gpuParams.back().setGrad(g.to(kGpu));
  }
  const Tensor one = scalarTensor(1.0, DType::Float64).to(kGpu);
  uint64_t before = cuda::hostSyncCount();
  (void)one.item<double>();
  const uint64_t perRead = cuda::hostSyncCount() - before;
  for (double normType : {2.0, std::numeric_limits<double>::infinity()}) {
    const double cpuNorm = nn::clipGradNorm(cpuParams, 0.5, {.normType = normType});
    before = cuda::hostSyncCount();
    const double gpuNorm = nn::clipGradNorm(gpuParams, 0.5, {.normType = normType});
    EXPECT_EQ(cuda::hostSyncCount() - before, perRead) << "normType " << normType;
    EXPECT_NEAR(gpuNorm, cpuNorm, 1e-5 * cpuNorm);
  }
  for (size_t i = 0; i < cpuParams.size(); ++i) {
    expectMatches(cpuParams[i].grad(), gpuParams[i].grad(), kF32, str("clipped gradient ", i));
  }
#endif
}

TEST(CudaOps, MatrixProducts) {
  REQUIRE_CUDA();
  const Tensor a = randomTensor({5, 7}, 18), b = randomTensor({7, 3}, 19);
  checkOp("mm", [](const TensorList& t) { return mm(t[0], t[1]); }, {a, b});
  checkOp("mm transposed operands", [](const TensorList& t) { return mm(t[1].t(), t[0].t()); }, {a, b});
  checkOp("mm strided copy",
          [](const TensorList& t) { return mm(t[0].slice(1, 0, 7, 2), t[1].slice(0, 0, 7, 2)); }, {a, b});
  checkOp("mm float64", [](const TensorList& t) { return mm(t[0], t[1]); },
          {a.to(DType::Float64), b.to(DType::Float64)});
  checkOp("bmm", [](const TensorList& t) { return bmm(t[0], t[1]); },
          {randomTensor({4, 3, 5}, 20), randomTensor({4, 5, 2}, 21)});
  // Transposed batches go to cuBLAS as CUBLAS_OP_T; a strided slice gets one contiguous copy.
  checkOp("bmm transposed operands",
          [](const TensorList& t) {
            return bmm(t[0].permute({0, 2, 1}), t[1].permute({0, 2, 1}));
          },
          {randomTensor({4, 5, 3}, 56), randomTensor({4, 2, 5}, 57)});
  checkOp("bmm strided operand", [](const TensorList& t) { return bmm(t[0].slice(2, 0, 10, 2), t[1]); },
          {randomTensor({3, 4, 10}, 58), randomTensor({3, 5, 2}, 59)});
  checkOp("matmul broadcast", [](const TensorList& t) { return matmul(t[0], t[1]); },
          {randomTensor({2, 1, 3, 5}, 22), randomTensor({4, 5, 6}, 23)});
  checkOp("matmul vector", [](const TensorList& t) { return matmul(t[0], t[1]); },
          {a, randomTensor({7}, 24)});
  checkOp("linear", [](const TensorList& t) { return linear(t[0], t[1], t[2]); },
          {randomTensor({2, 3, 7}, 25), randomTensor({4, 7}, 26), randomTensor({4}, 27)});
  checkOp("linear no bias", [](const TensorList& t) { return linear(t[0], t[1]); },
          {randomTensor({6, 7}, 28), randomTensor({4, 7}, 29)});
}

TEST(CudaOps, JoinsAndIndexing) {
  REQUIRE_CUDA();
  const Tensor a = randomTensor({3, 4}, 30), b = randomTensor({2, 4}, 31);
  checkOp("cat", [](const TensorList& t) { return cat({t[0], t[1]}, 0); }, {a, b});
  checkOp("stack", [](const TensorList& t) { return stack({t[0], t[0]}, 1); }, {a});
  checkOp("indexSelect", [](const TensorList& t) { return indexSelect(t[0], 1, t[1]); },
          {a, fromVector<int64_t>({3, 0, 3})});
  checkOp("mseLoss", [](const TensorList& t) { return mseLoss(t[0], t[1]); }, {a, randomTensor({3, 4}, 32)});
}

TEST(CudaOps, CopiesConversionsAndFills) {
  REQUIRE_CUDA();
  const std::vector<DType> types = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16,
                                    DType::Int32,   DType::Int64,   DType::Bool};
  const Tensor source = mul(randomTensor({3, 5}, 33, DType::Float64), 10.0);
  for (DType from : types) {
    const Tensor cpuFrom = source.to(from);
    const Tensor gpuFrom = cpuFrom.to(kGpu);
    expectMatches(cpuFrom, gpuFrom, kF64, str("upload ", from));
    for (DType to : types) {
      // The conversion itself runs on the device; the cpu's conversion is the reference.
      expectMatches(cpuFrom.to(to), gpuFrom.to(to), kF64, str("convert ", from, " -> ", to));
    }
  }
  // Strided destinations and sources across devices.
  Tensor host = zeros({5, 3});
  Tensor dev = randomTensor({3, 5}, 34).to(kGpu);
  host.t().copy_(dev);
  expectMatches(host.t().contiguous(), dev, kF64, "copy into a transposed cpu view");
  Tensor devDst = zeros({4, 6}, DType::Float32, kGpu);
  devDst.narrow(1, 1, 3).copy_(ones({4, 1}));
  Tensor expect = zeros({4, 6});
  expect.narrow(1, 1, 3).copy_(ones({4, 1}));
  expectMatches(expect, devDst, kF64, "broadcast copy into a narrowed cuda view");
  Tensor filled = empty({3, 4}, DType::BFloat16, kGpu);
  filled.fill_(1.75);
  expectMatches(full({3, 4}, 1.75, DType::BFloat16), filled, kF64, "fill bfloat16");
  filled.t().narrow(0, 1, 2).fill_(-3.0);
  Tensor filledRef = full({3, 4}, 1.75, DType::BFloat16);
  filledRef.t().narrow(0, 1, 2).fill_(-3.0);
  expectMatches(filledRef, filled, kF64, "fill a strided view");
  expectMatches(zeros({2, 2}, DType::Int64), zeros({2, 2}, DType::Int64, kGpu), kF64, "zeros");
  EXPECT_EQ(full({}, 2.5, DType::Float32, kGpu).item<float>(), 2.5f);
  EXPECT_EQ(arange(5, TensorOptions().dtype(DType::Int64).device(kGpu)).toVector<int64_t>(),
            (std::vector<int64_t>{0, 1, 2, 3, 4}));
  // to(Device) is differentiable: the gradient comes back to the source's device.
  Tensor leaf = randomTensor({4}, 35).setRequiresGrad(true);
  sum(mul(leaf.to(kGpu), 3.0)).backward();
  ASSERT_EQ(leaf.grad().device(), Device::cpu());
  expectMatches(full({4}, 3.0), leaf.grad().to(kGpu), kF64, "gradient through to(cuda)");
}

TEST(CudaOps, SixteenBitFloats) {
  REQUIRE_CUDA();
  for (DType t : {DType::Float16, DType::BFloat16}) {
    const Tensor a = randomTensor({6, 8}, 36, t), b = randomTensor({8}, 37, t);
    const std::string name = str(t);
    checkOp(name + " add", [](const TensorList& x) { return add(x[0], x[1]); }, {a, b});
    checkOp(name + " mul scalar", [](const TensorList& x) { return mul(x[0], 0.3); }, {a});
    checkOp(name + " relu", [](const TensorList& x) { return relu(x[0]); }, {a});
    checkOp(name + " gelu", [](const TensorList& x) { return gelu(x[0]); }, {a});
    checkOp(name + " sum", [](const TensorList& x) { return sum(x[0], {0}); }, {a});
    checkOp(name + " softmax", [](const TensorList& x) { return softmax(x[0], 1); }, {a});
    checkOp(name + " logSoftmax", [](const TensorList& x) { return logSoftmax(x[0], 1); }, {a});
    checkOp(name + " layerNorm", [](const TensorList& x) { return layerNorm(x[0], {8}, x[1]); }, {a, b});
    checkOp(name + " linear", [](const TensorList& x) { return linear(x[0], x[1]); },
            {a, randomTensor({3, 8}, 38, t)});
    checkOp(name + " crossEntropy", [](const TensorList& x) { return crossEntropy(x[0], x[1]); },
            {a, fromVector<int64_t>({1, 7, 0, 3, 3, 5})});
    checkOp(name + " embedding", [](const TensorList& x) { return embedding(x[0], x[1]); },
            {a, fromVector<int64_t>({5, 0, 5})});
  }
}

// Parameters and their cuda twins, trained by the same steps.
struct Twin {
  std::vector<Tensor> cpu, gpu;
};

Twin makeTwin(const std::vector<Tensor>& init) {
  Twin t;
  for (const Tensor& p : init) {
    t.cpu.push_back(p.detach().clone().setRequiresGrad(true));
    t.gpu.push_back(p.detach().to(kGpu).setRequiresGrad(true));
  }
  return t;
}

TEST(CudaOps, OptimizerUpdates) {
  REQUIRE_CUDA();
  const std::vector<Tensor> init = {randomTensor({5, 3}, 40), randomTensor({7}, 41)};
  const std::vector<Tensor> grads = {randomTensor({5, 3}, 42), randomTensor({7}, 43)};
  auto setGrads = [&](std::vector<Tensor>& params, Device d, int step) {
    for (size_t i = 0; i < params.size(); ++i) {
      NoGradGuard ng;
      Tensor g = mul(grads[i], 1.0 + 0.5 * step).to(d);
      params[i].setGrad(g);
    }
  };
  optim::SGDOptions sgdOptions;
  sgdOptions.lr = 0.1;
  sgdOptions.momentum = 0.9;
  sgdOptions.weightDecay = 0.01;
  sgdOptions.nesterov = true;
  Twin sgd = makeTwin(init);
  optim::SGD sgdCpu(sgd.cpu, sgdOptions), sgdGpu(sgd.gpu, sgdOptions);
  optim::AdamWOptions adamOptions;
  adamOptions.lr = 0.01;
  Twin adam = makeTwin(init);
  optim::AdamW adamCpu(adam.cpu, adamOptions), adamGpu(adam.gpu, adamOptions);
  for (int step = 0; step < 3; ++step) {
    setGrads(sgd.cpu, Device::cpu(), step);
    setGrads(sgd.gpu, kGpu, step);
    sgdCpu.step();
    sgdGpu.step();
    setGrads(adam.cpu, Device::cpu(), step);
    setGrads(adam.gpu, kGpu, step);
    adamCpu.step();
    adamGpu.step();
  }
  for (size_t i = 0; i < init.size(); ++i) {
    expectMatches(sgd.cpu[i].detach(), sgd.gpu[i].detach(), kF32, str("SGD parameter ", i));
    // Same inputs, unfused arithmetic: the same bits.
    expectMatches(adam.cpu[i].detach(), adam.gpu[i].detach(), Tol{0.0, 0.0}, str("AdamW parameter ", i));
  }
}

TEST(CudaOps, MlpTrainingStepMatchesCpu) {
  REQUIRE_CUDA();
  // Linear(12 -> 16) + ReLU + Linear(16 -> 5) + cross-entropy + AdamW, three steps.
  Twin net = makeTwin({mul(randomTensor({16, 12}, 50), 0.3), mul(randomTensor({16}, 51), 0.1),
                       mul(randomTensor({5, 16}, 52), 0.3), mul(randomTensor({5}, 53), 0.1)});
  optim::AdamWOptions o;
  o.lr = 0.05;
  optim::AdamW optCpu(net.cpu, o), optGpu(net.gpu, o);
  const Tensor x = randomTensor({32, 12}, 54);
  Generator gen(55);
  const Tensor y = randint(0, 5, {32}, gen, DType::Int64);
  auto step = [](const std::vector<Tensor>& p, optim::AdamW& opt, const Tensor& xs, const Tensor& ys) {
    opt.zeroGrad();
    Tensor h = relu(linear(xs, p[0], p[1]));
    Tensor loss = crossEntropy(linear(h, p[2], p[3]), ys);
    loss.backward();
    opt.step();
    return loss;
  };
  const Tensor xg = x.to(kGpu), yg = y.to(kGpu);
  for (int i = 0; i < 3; ++i) {
    const Tensor lossCpu = step(net.cpu, optCpu, x, y);
    const Tensor lossGpu = step(net.gpu, optGpu, xg, yg);
    expectMatches(lossCpu.detach(), lossGpu.detach(), kF32, str("loss at step ", i));
  }
  for (size_t i = 0; i < net.cpu.size(); ++i) {
    expectMatches(net.cpu[i].detach(), net.gpu[i].detach(), Tol{1e-4, 1e-5},
                  str("parameter ", i, " after 3 steps"));
  }
}

TEST(CudaOps, RunsOnTheCurrentStream) {
  REQUIRE_CUDA();
#if DT_HAVE_CUDA
  // Kernels queue on a non-blocking stream; the copy back must still see their results.
  const cuda::Stream stream = cuda::Stream::create(kGpu);
  const Tensor a = randomTensor({256, 256}, 60);
  Tensor result;
  {
    cuda::StreamGuard guard(stream);
    Tensor g = a.to(kGpu);
    for (int i = 0; i < 8; ++i) g = add(mm(g, g.t()), 1.0) / 256.0;
    result = g.to(Device::cpu());
  }
  Tensor ref = a;
  for (int i = 0; i < 8; ++i) ref = add(mm(ref, ref.t()), 1.0) / 256.0;
  expectMatches(ref.to(kGpu).to(Device::cpu()), result.to(kGpu), Tol{1e-4, 1e-5}, "chain on a side stream");
#endif
}

// The launch geometry is host code: it runs in every CUDA build, device or not.
TEST(CudaKernels, GeometryMergesDimsEveryOperandWalksAsOne) {
#if DT_HAVE_CUDA
  // A contiguous [2, 3, 4] with a broadcast [3, 1] operand: the last two dims stay apart for
  // the broadcast operand, the first two cannot merge for it either.
  cuda::Geometry g = cuda::makeGeometry({2, 3, 4}, {{12, 4, 1}, {0, 1, 0}}, "test");
  EXPECT_EQ(g.ndim, 3);
  EXPECT_EQ(g.numel, 24);
  // Two contiguous operands collapse to one dim; size-1 dims vanish.
  g = cuda::makeGeometry({2, 1, 3, 4}, {{12, 12, 4, 1}, {12, 99, 4, 1}}, "test");
  ASSERT_EQ(g.ndim, 1);
  EXPECT_EQ(g.sizes[0], 24);
  EXPECT_EQ(g.strides[1][0], 1);
  // A transposed operand keeps two dims with its own strides.
  g = cuda::makeGeometry({3, 5}, {{5, 1}, {1, 3}}, "test");
  ASSERT_EQ(g.ndim, 2);
  EXPECT_EQ(g.strides[1][0], 1);
  EXPECT_EQ(g.strides[1][1], 3);
  // A 0-dim tensor: one element, no dims.
  g = cuda::makeGeometry({}, {{}, {}}, "test");
  EXPECT_EQ(g.ndim, 0);
  EXPECT_EQ(g.numel, 1);
  // Nine dims that cannot merge exceed the kernels' limit, and the error says what to do.
  std::vector<int64_t> sizes(9, 2), strides(9);
  for (int i = 0; i < 9; ++i)
    strides[static_cast<size_t>(i)] = int64_t{1} << (2 * (8 - i));  // gaps: no merging
  expectThrowsWith<NotSupportedError>([&] { cuda::makeGeometry(sizes, {strides}, "add"); },
                                      {"add", "9 dims", "limit of 8", "contiguous()"});
#else
  GTEST_SKIP() << "needs a CUDA build: " << whyNoCuda();
#endif
}

// Grids are capped and every kernel strides over the rest (finding 8 of issue 24): a count is
// never cast to 32 bits (rows between 2^31 and 2^32 failed to launch, above 2^32 they ran
// rows mod 2^32). Host code: every CUDA build, device or not.
TEST(CudaKernels, GridsAreCappedAndNeverTruncateACount) {
#if DT_HAVE_CUDA
  EXPECT_EQ(cuda::gridForBlocks(0), 1u);
  EXPECT_EQ(cuda::gridForBlocks(1), 1u);
  EXPECT_EQ(cuda::gridForBlocks(1000), 1000u);
  const auto cap = static_cast<unsigned>(cuda::kMaxGridBlocks);
  EXPECT_EQ(cuda::gridForBlocks(cuda::kMaxGridBlocks), cap);
  EXPECT_EQ(cuda::gridForBlocks((int64_t{1} << 31) + 5), cap);
  EXPECT_EQ(cuda::gridForBlocks((int64_t{1} << 32) + 5), cap) << "not (2^32 + 5) mod 2^32 = 5";
  EXPECT_EQ(cuda::gridForBlocks(int64_t{1} << 62), cap);
  EXPECT_EQ(cuda::gridForThreads(0), 1u);
  EXPECT_EQ(cuda::gridForThreads(256), 1u);
  EXPECT_EQ(cuda::gridForThreads(257), 2u);
  EXPECT_EQ(cuda::gridForThreads((int64_t{1} << 40) + 1), cap);
#else
  GTEST_SKIP() << "needs a CUDA build: " << whyNoCuda();
#endif
}

// Finding 7 of issue 24: a reduction over few long rows (a full sum, max(t), a grad norm) must
// not run on one block (or, for the extreme, one thread) per row. Host code: every CUDA build.
TEST(CudaKernels, FewLongRowsAreSpreadOverManyBlocks) {
#if DT_HAVE_CUDA
  // sum(t) / max(t) of 3M elements: one row.
  cuda::RowReduceGeometry g = cuda::rowReduceGeometry(1, 3'000'000);
  EXPECT_FALSE(g.threadPerRow);
  EXPECT_GE(g.chunks, 512) << "a full reduction on " << g.chunks << " block(s)";
  EXPECT_LE(g.chunks, cuda::kMaxChunks);
  EXPECT_GE(g.chunkLen, cuda::kMinChunk);
  EXPECT_GE(int64_t{g.grid}, g.chunks);
  EXPECT_GE(g.chunks * g.chunkLen, 3'000'000);          // the chunks cover the row
  EXPECT_LT((g.chunks - 1) * g.chunkLen, 3'000'000);    // and none is empty
  // Enough rows fill the GPU by themselves: one block each, one pass.
  g = cuda::rowReduceGeometry(4096, 50'000);
  EXPECT_EQ(g.chunks, 1);
  EXPECT_EQ(g.grid, 4096u);
  // A short row is not worth a block: one thread per row.
  g = cuda::rowReduceGeometry(1'000'000, 10);
  EXPECT_TRUE(g.threadPerRow);
  EXPECT_EQ(g.grid, cuda::gridForThreads(1'000'000));
  // A medium row: no chunk shorter than kMinChunk.
  g = cuda::rowReduceGeometry(2, 10'000);
  EXPECT_EQ(g.chunks, 2);
  EXPECT_EQ(g.chunkLen, 5000);
  g = cuda::rowReduceGeometry(3, 4000);
  EXPECT_EQ(g.chunks, 1);
  // Layer norm's parameter gradients of a [8192, 768] input: 3 blocks of columns would each walk
  // all 8192 rows; the rows are split instead.
  cuda::ColumnReduceGeometry c = cuda::columnReduceGeometry(8192, 768);
  EXPECT_EQ(c.gridX, 3u);
  EXPECT_GE(c.rowChunks, 64);
  EXPECT_GE(c.rowsPerChunk, cuda::kMinRowsPerChunk);
  EXPECT_LE(c.rowsPerChunk, 128);
  EXPECT_GE(c.rowChunks * c.rowsPerChunk, 8192);
  // Wide enough: no split.
  c = cuda::columnReduceGeometry(16, 1 << 20);
  EXPECT_EQ(c.rowChunks, 1);
  EXPECT_EQ(c.rowsPerChunk, 16);
#else
  GTEST_SKIP() << "needs a CUDA build: " << whyNoCuda();
#endif
}

// The same reductions on a device: two passes, compared with the CPU, with NaNs and ties placed
// so that the first of them sits in a later chunk than the block that sees a tie first.
TEST(CudaOps, ReductionsOfFewLongRowsMatchTheCpu) {
  REQUIRE_CUDA();
  const Tensor big = randomTensor({3'000'001}, 50);
  checkOp("sum of 3M", [](const TensorList& t) { return sum(t[0]); }, {big});
  checkOp("mean of 3M float64", [](const TensorList& t) { return mean(t[0]); }, {big.to(DType::Float64)});
  checkOp("max of 3M", [](const TensorList& t) { return max(t[0]); }, {big});
  checkOp("min of 3M", [](const TensorList& t) { return min(t[0]); }, {big});
  checkOp("sum of 2 long rows", [](const TensorList& t) { return sum(t[0], {1}); }, {randomTensor({2, 1'000'003}, 51)});
  checkOp(
      "argmax of 3 long rows", [](const TensorList& t) { return argmax(t[0], 1); }, {randomTensor({3, 500'000}, 52)},
      false);
  // Ties: the maximum 7 occurs at 10, 2'000'000 and 2'999'999; min 0 at 5 and at 1'500'000.
  std::vector<float> tied(3'000'000, 3.0f);
  tied[10] = tied[2'000'000] = tied[2'999'999] = 7.0f;
  tied[5] = tied[1'500'000] = 0.0f;
  const Tensor t = fromVector<float>(tied).to(kGpu);
  EXPECT_EQ(argmax(t, 0).item<int64_t>(), 10);
  EXPECT_EQ(argmin(t, 0).item<int64_t>(), 5);
  // NaNs: the first one wins, wherever the chunks split the row.
  tied[2'500'000] = std::nanf("");
  tied[1'000'000] = std::nanf("");
  const Tensor withNan = fromVector<float>(tied).to(kGpu);
  EXPECT_EQ(argmax(withNan, 0).item<int64_t>(), 1'000'000);
  EXPECT_EQ(argmin(withNan, 0).item<int64_t>(), 1'000'000);
  EXPECT_TRUE(std::isnan(max(withNan).item<float>()));
  // int64 sums stay exact.
  const Tensor ints = arange(4'000'000, TensorOptions().dtype(DType::Int64));
  EXPECT_EQ(sum(ints.to(kGpu)).item<int64_t>(), int64_t{4'000'000} * 3'999'999 / 2);
  // Layer norm's parameter gradients over many rows (split along the rows).
  checkOp("layerNorm 8192 x 64", [](const TensorList& in) { return layerNorm(in[0], {64}, in[1], in[2], 1e-5); },
          {randomTensor({8192, 64}, 53), randomTensor({64}, 54), randomTensor({64}, 55)});
}

// More rows than a grid has blocks: the row kernels' grid-stride loops must reach every row.
TEST(CudaOps, RowKernelsReachRowsBeyondTheGridsBlocks) {
  REQUIRE_CUDA();
#if DT_HAVE_CUDA
  const int64_t rows = cuda::kMaxGridBlocks + 1234;
#else
  const int64_t rows = 1;
#endif
  const Tensor a = randomTensor({rows, 3}, 40);
  checkOp("sum over many short rows", [](const TensorList& t) { return sum(t[0], {1}); }, {a});
  checkOp("softmax over many rows", [](const TensorList& t) { return softmax(t[0], -1); }, {a});
  checkOp("logSoftmax over many rows", [](const TensorList& t) { return logSoftmax(t[0], -1); }, {a});
  checkOp("max over many rows", [](const TensorList& t) { return max(t[0], 1).values; }, {a});
  checkOp("layerNorm over many rows", [](const TensorList& t) { return layerNorm(t[0], {3}, t[1], t[2], 1e-5); },
          {a, randomTensor({3}, 41), randomTensor({3}, 42)});
}

TEST(CudaOps, MixedDevicesNameBothDevices) {
  const std::string pytorchWords =
      "Expected all tensors to be on the same device, but found at least two devices, "
      "cuda:0 and cpu!";
  if (cudaDevices() > 0) {
    const Tensor c = ones({2, 2}, DType::Float32, kGpu), h = ones({2, 2});
    expectThrowsWith<InvalidArgument>([&] { add(c, h); },
                                      {"add", pytorchWords, "on cpu", "move one of them"});
    expectThrowsWith<InvalidArgument>([&] { mm(c, h); }, {"mm", pytorchWords});
    expectThrowsWith<InvalidArgument>([&] { linear(c, h); }, {"linear", pytorchWords});
    expectThrowsWith<InvalidArgument>(
        [&] {
          crossEntropy(c, fromVector<int64_t>({0, 1}));
        },
        {"crossEntropy", pytorchWords});
    return;
  }
  // Without a device the check still runs: it happens before any kernel, so a CUDA tensor
  // whose memory is host memory (a stand-in allocator) is enough.
  struct StandInAllocator final : Allocator {
    DataPtr allocate(size_t bytes) override {
      return DataPtr(
          std::malloc(bytes + 1), nullptr, [](void*, void* p) { std::free(p); }, Device::cuda(0));
    }
    DeviceType deviceType() const override { return DeviceType::CUDA; }
  } standIn;
  registerAllocator(DeviceType::CUDA, &standIn);
  {
    const Tensor c = empty({2, 2}, DType::Float32, kGpu), h = ones({2, 2});
    expectThrowsWith<InvalidArgument>([&] { add(c, h); },
                                      {"add", pytorchWords, "on cpu", "move one of them"});
    expectThrowsWith<InvalidArgument>([&] { mm(c, h); }, {"mm", pytorchWords});
    // An op on the stand-in tensor alone says why it cannot run here.
    expectThrowsWith<NotSupportedError>([&] { relu(c); }, {"relu", "cuda:0"});
  }
  registerAllocator(DeviceType::CUDA, nullptr);
}

}  // namespace
}  // namespace dt
