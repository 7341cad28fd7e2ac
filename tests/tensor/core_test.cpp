// Core tensor tests: dtypes and 16-bit rounding, devices, storage, views,
// strided copies with conversion and broadcasting, factories.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/config.h"
#include "common/strings.h"
#include "common/errors.h"
#include "tensor/dtype.h"
#include "tensor/ops.h"
#include "tensor/storage.h"
#include "tensor/tensor.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using testing::expectThrowsWith;

TEST(DType, NamesAndSizes) {
  EXPECT_EQ(itemSize(DType::Float32), 4u);
  EXPECT_EQ(itemSize(DType::Float64), 8u);
  EXPECT_EQ(itemSize(DType::Float16), 2u);
  EXPECT_EQ(itemSize(DType::BFloat16), 2u);
  EXPECT_EQ(itemSize(DType::Int32), 4u);
  EXPECT_EQ(itemSize(DType::Int64), 8u);
  EXPECT_EQ(itemSize(DType::Bool), 1u);
  EXPECT_EQ(toString(DType::BFloat16), "bfloat16");
  std::ostringstream out;
  out << DType::Float16 << " " << DType::Bool;
  EXPECT_EQ(out.str(), "float16 bool");
  EXPECT_EQ(DTypeOf<int64_t>::value, DType::Int64);
  EXPECT_TRUE((std::is_same_v<CppType<DType::BFloat16>, BFloat16>));
  EXPECT_EQ(promoteTypes(DType::Int64, DType::Float32), DType::Float32);
  EXPECT_EQ(promoteTypes(DType::Float16, DType::BFloat16), DType::Float32);
  const size_t s = dispatchDType(DType::Float64, []<typename T>() { return sizeof(T); });
  EXPECT_EQ(s, 8u);
}

TEST(DType, HalfRoundTripsEveryValue) {
  // Every non-NaN half converts to float and back to the same bits.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    Half h = Half::fromBits(static_cast<uint16_t>(b));
    float f = toFloat(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(toFloat(toHalf(f))));
      continue;
    }
    ASSERT_EQ(toHalf(f).bits, b) << "bits " << b << " value " << f;
  }
}

TEST(DType, HalfRoundingEdgeCases) {
  EXPECT_EQ(toHalf(1.0f).bits, 0x3c00);
  EXPECT_EQ(toHalf(65504.0f).bits, 0x7bff);      // max finite
  EXPECT_EQ(toHalf(65519.0f).bits, 0x7bff);      // below the rounding midpoint
  EXPECT_EQ(toHalf(65520.0f).bits, 0x7c00);      // midpoint rounds (to even) to inf
  EXPECT_EQ(toHalf(INFINITY).bits, 0x7c00);
  EXPECT_EQ(toHalf(-INFINITY).bits, 0xfc00);
  EXPECT_TRUE(std::isnan(toFloat(toHalf(NAN))));
  EXPECT_EQ(toHalf(-0.0f).bits, 0x8000);
  // 1 + 2^-11 is exactly between 1 and 1 + 2^-10: ties to even (1.0).
  EXPECT_EQ(toHalf(1.0f + std::ldexp(1.0f, -11)).bits, 0x3c00);
  // 1 + 3*2^-11 is between 1+2^-10 (odd) and 1+2^-9: ties to even (up).
  EXPECT_EQ(toHalf(1.0f + 3 * std::ldexp(1.0f, -11)).bits, 0x3c02);
  // Subnormals: smallest 2^-24, ties at 2^-25 go to zero (even), above go up.
  EXPECT_EQ(toHalf(std::ldexp(1.0f, -24)).bits, 0x0001);
  EXPECT_EQ(toHalf(std::ldexp(1.0f, -25)).bits, 0x0000);
  EXPECT_EQ(toHalf(std::ldexp(1.5f, -25)).bits, 0x0001);
  EXPECT_EQ(toHalf(std::ldexp(3.0f, -25)).bits, 0x0002);  // 1.5 units: tie -> even 2
  EXPECT_FLOAT_EQ(toFloat(Half::fromBits(0x0001)), std::ldexp(1.0f, -24));
  EXPECT_FLOAT_EQ(toFloat(Half::fromBits(0x03ff)), std::ldexp(1023.0f, -24));
  // Largest subnormal rounding up into the smallest normal.
  EXPECT_EQ(toHalf(std::ldexp(1023.5f, -24)).bits, 0x0400);
}

TEST(DType, BFloat16Rounding) {
  EXPECT_EQ(toBFloat16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even -> 1.
  EXPECT_EQ(toBFloat16(1.0f + std::ldexp(1.0f, -8)).bits, 0x3f80);
  EXPECT_EQ(toBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)).bits, 0x3f82);
  EXPECT_EQ(toBFloat16(INFINITY).bits, 0x7f80);
  EXPECT_TRUE(std::isnan(toFloat(toBFloat16(NAN))));
  EXPECT_TRUE(std::isnan(toFloat(toBFloat16(-NAN))));
  // Max float rounds to inf.
  EXPECT_EQ(toBFloat16(std::numeric_limits<float>::max()).bits, 0x7f80);
  // Subnormal floats survive.
  const float sub = std::ldexp(1.0f, -130);
  EXPECT_EQ(toFloat(toBFloat16(sub)), sub);
}

TEST(Device, NamesAndEquality) {
  EXPECT_EQ(Device::cpu().str(), "cpu");
  EXPECT_EQ(Device::cuda(1).str(), "cuda:1");
  EXPECT_TRUE(Device::cuda().isCuda());
  EXPECT_EQ(Device::cuda(0), Device::cuda());
  EXPECT_NE(Device::cuda(0), Device::cpu());
  std::ostringstream out;
  out << Device::cuda(3);
  EXPECT_EQ(out.str(), "cuda:3");
}

TEST(Device, ParseAndAvailability) {
  EXPECT_EQ(Device::parse("cpu"), Device::cpu());
  EXPECT_EQ(Device::parse("cuda"), Device::cuda(0));
  EXPECT_EQ(Device::parse("cuda:2"), Device::cuda(2));
  for (const char* bad : {"", "gpu", "cuda:", "cuda:-1", "cuda:1x", "CPU"}) {
    testing::expectThrowsWith<InvalidArgument>([&] { Device::parse(bad); }, {str("\"", bad, "\""), "cpu, cuda, cuda:N"});
  }
  EXPECT_TRUE(deviceAvailable(Device::cpu()));
  EXPECT_EQ(deviceUnavailableReason(Device::cpu()), "");
  // Far past any machine's device count: unavailable, with a reason either way.
  EXPECT_FALSE(deviceAvailable(Device::cuda(4096)));
  EXPECT_FALSE(deviceUnavailableReason(Device::cuda(4096)).empty());
  EXPECT_EQ(deviceCount(DeviceType::CPU), 1);
  const int gpus = deviceCount(DeviceType::CUDA);
  EXPECT_EQ(deviceAvailable(Device::cuda(0)), gpus > 0);
  EXPECT_FALSE(deviceAvailable(Device::cuda(gpus)));
  setCurrentDevice(Device::cpu());  // nothing to do
  testing::expectThrowsWith<NotSupportedError>([&] { setCurrentDevice(Device::cuda(gpus)); },
                                               {"cannot make cuda:", "the current device"});
}

TEST(Storage, CpuAlignedAndCudaUnsupported) {
  Storage s(100, Device::cpu());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(s.data()) % 64, 0u);
  EXPECT_EQ(s.nbytes(), 100u);
  Storage copy = s;
  EXPECT_TRUE(copy.isSameAs(s));
  EXPECT_EQ(s.useCount(), 2);
  expectThrowsWith<NotSupportedError>([] { Storage(16, Device::cuda(0)); }, {"cuda:0"});
  expectThrowsWith<NotSupportedError>([] { empty({2}, DType::Float32, Device::cuda(1)); }, {"cuda:1"});
}

TEST(Storage, LargeCpuBlocksStartOnAHugePageBoundary) {
  // Blocks of 2 MiB and more are aligned (and advised) for transparent huge pages.
  for (size_t bytes : {size_t{2} << 20, (size_t{3} << 20) + 5, size_t{64} << 20}) {
    Storage s(bytes, Device::cpu());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(s.data()) % (size_t{2} << 20), 0u) << bytes << " bytes";
    std::memset(s.data(), 0x5a, bytes);  // all of it is usable
    EXPECT_EQ(static_cast<unsigned char*>(s.data())[bytes - 1], 0x5a);
  }
}

TEST(Tensor, FactoriesAndAccessors) {
  Tensor t = zeros({4, 1024});
  EXPECT_EQ(t.describe(), "float32[4, 1024]");
  EXPECT_EQ(t.numel(), 4096);
  EXPECT_EQ(t.nbytes(), 4096u * 4);
  EXPECT_EQ(t.size(-1), 1024);
  EXPECT_EQ(t.dim(), 2);
  EXPECT_TRUE(t.isContiguous());
  EXPECT_EQ(t.strides(), (Shape{1024, 1}));
  EXPECT_EQ(full({2, 2}, 2.5, DType::Float64).toVector<double>(), (std::vector<double>{2.5, 2.5, 2.5, 2.5}));
  EXPECT_EQ(ones({3}, DType::Int32).toVector<int32_t>(), (std::vector<int32_t>{1, 1, 1}));
  EXPECT_EQ(arange(4, DType::Int64).toVector<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3}));
  Tensor v = fromVector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(v.sizes(), (Shape{2, 3}));
  EXPECT_EQ(v.data<float>()[4], 5.0f);
  expectThrowsWith<InvalidArgument>([&] { v.data<double>(); }, {"float32[2, 3]", "float64"});
  expectThrowsWith<InvalidArgument>([&] { fromVector<float>({1, 2, 3}, {2, 2}); }, {"3 values", "[2, 2]"});
  EXPECT_EQ(scalarTensor(7.0).item<float>(), 7.0f);
  expectThrowsWith<InvalidArgument>([&] { v.item<float>(); }, {"6 elements"});
  Tensor b = fromVector<bool>({true, false, true});
  EXPECT_EQ(b.dtype(), DType::Bool);
  EXPECT_EQ(b.toVector<bool>(), (std::vector<bool>{true, false, true}));
  Tensor h = fromVector<float>({1.5f, -2.0f}, {2}, DType::Float16);
  EXPECT_EQ(h.dtype(), DType::Float16);
  EXPECT_EQ(h.toVector<float>(), (std::vector<float>{1.5f, -2.0f}));
}

TEST(Tensor, EmptyShapeMeansZeroDimEverywhere) {
  Tensor oneDim = fromVector<float>({1, 2, 3});
  EXPECT_EQ(oneDim.sizes(), (Shape{3}));
  EXPECT_EQ(fromVector<float>({}).sizes(), (Shape{0}));

  Tensor zeroDim = fromVector<float>({5}, {});
  EXPECT_EQ(zeroDim.dim(), 0);
  EXPECT_EQ(zeroDim.item<float>(), 5.0f);
  EXPECT_EQ(zeroDim.sizes(), scalarTensor(5.0).sizes());
  EXPECT_EQ(zeros({}).sizes(), zeroDim.sizes());
  Tensor converted = fromVector<float>({2.5f}, {}, DType::Float64);
  EXPECT_EQ(converted.describe(), "float64[]");

  expectThrowsWith<InvalidArgument>([] { fromVector<float>({1, 2, 3}, {}); },
                                    {"shape []", "exactly 1 value", "got 3", "fromVector(values)"});
  expectThrowsWith<InvalidArgument>([] { fromVector<int64_t>({}, Shape{}); }, {"shape []", "got 0"});
}

TEST(TensorOptions, SettersReturnChangedCopies) {
  const TensorOptions defaults;
  EXPECT_EQ(defaults.dtype(), DType::Float32);
  EXPECT_EQ(defaults.device(), Device::cpu());
  EXPECT_FALSE(defaults.requiresGrad());
  const TensorOptions chained = defaults.dtype(DType::Float64).device(Device::cuda(1)).requiresGrad(true);
  EXPECT_EQ(chained.dtype(), DType::Float64);
  EXPECT_EQ(chained.device(), Device::cuda(1));
  EXPECT_TRUE(chained.requiresGrad());
  EXPECT_EQ(defaults, TensorOptions());  // untouched by the chain
  std::ostringstream out;
  out << chained;
  EXPECT_EQ(out.str(), "TensorOptions(dtype=float64, device=cuda:1, requiresGrad=true)");
}

TEST(TensorOptions, FactoriesHonourDTypeAndRequiresGrad) {
  const TensorOptions f64Param = TensorOptions().dtype(DType::Float64).requiresGrad(true);
  Tensor z = zeros({2, 3}, f64Param);
  EXPECT_EQ(z.describe(), "float64[2, 3]");
  EXPECT_TRUE(z.requiresGrad());
  EXPECT_TRUE(z.isLeaf());
  EXPECT_EQ(z.toVector<double>(), std::vector<double>(6, 0.0));
  EXPECT_EQ(ones({2}, f64Param).toVector<double>(), (std::vector<double>{1, 1}));
  EXPECT_EQ(full({2}, 2.5, f64Param).toVector<double>(), (std::vector<double>{2.5, 2.5}));
  EXPECT_EQ(empty({4}, f64Param).sizes(), (Shape{4}));
  Tensor s = scalarTensor(3.0, f64Param);
  EXPECT_EQ(s.dim(), 0);
  EXPECT_TRUE(s.requiresGrad());
  EXPECT_EQ(arange(3, TensorOptions()).describe(), "float32[3]");  // the options' dtype, as given
  EXPECT_EQ(arange(0.0, 1.0, 0.25, f64Param).toVector<double>(), (std::vector<double>{0, 0.25, 0.5, 0.75}));
  Tensor v = fromVector<float>({1.5f, 2.5f}, {2, 1}, f64Param);
  EXPECT_EQ(v.describe(), "float64[2, 1]");
  EXPECT_TRUE(v.requiresGrad());
  EXPECT_TRUE(v.isLeaf());
  EXPECT_EQ(v.toVector<double>(), (std::vector<double>{1.5, 2.5}));

  const TensorOptions plainInts = TensorOptions().dtype(DType::Int64);
  EXPECT_FALSE(ones({2}, plainInts).requiresGrad());
  expectThrowsWith<InvalidArgument>([&] { zeros({2}, plainInts.requiresGrad(true)); },
                                    {"floating point", "int64[2]"});
#if !DT_HAVE_CUDA
  expectThrowsWith<NotSupportedError>([] { zeros({2}, TensorOptions().device(Device::cuda())); }, {"cuda:0"});
#endif
}

TEST(TensorOptions, OptionsOfATensorCarryDTypeAndDeviceOnly) {
  Tensor param = zeros({2}, TensorOptions().dtype(DType::Float64).requiresGrad(true));
  EXPECT_EQ(param.options(), TensorOptions().dtype(DType::Float64));
  Tensor like = ones({3}, param.options());
  EXPECT_EQ(like.dtype(), DType::Float64);
  EXPECT_FALSE(like.requiresGrad());
}

// A float buffer from new[] whose deleter counts its calls, for the ownership tests.
struct OwnedFloats {
  explicit OwnedFloats(std::vector<float> values) : data(new float[values.size()]) {
    std::copy(values.begin(), values.end(), data);
  }
  BlobDeleter deleter() {
    return [this](void* p) {
      ++calls;
      seen = p;
      delete[] static_cast<float*>(p);
    };
  }
  float* data;
  int calls = 0;
  void* seen = nullptr;
};

TEST(FromBlob, DeleterRunsOnceWhenTheLastViewDies) {
  OwnedFloats blob({1, 2, 3, 4, 5, 6});
  float* const address = blob.data;
  Tensor t = fromBlob(blob.data, {2, 3}, DType::Float32, blob.deleter());
  EXPECT_EQ(t.dataPtr(), address);
  Tensor transposed = t.transpose(0, 1);
  Tensor row = t.select(0, 1);
  t = Tensor();
  transposed = Tensor();
  EXPECT_EQ(blob.calls, 0);
  EXPECT_EQ(row.toVector<float>(), (std::vector<float>{4, 5, 6}));
  Tensor copy = row.clone();  // its own memory: does not keep the blob
  row = Tensor();
  EXPECT_EQ(blob.calls, 1);
  EXPECT_EQ(blob.seen, address);
  EXPECT_EQ(copy.toVector<float>(), (std::vector<float>{4, 5, 6}));
}

TEST(FromBlob, AGraphThatSavedTheTensorKeepsTheMemory) {
  OwnedFloats blob({1, 2, 3});
  Tensor x = fromBlob(blob.data, {3}, TensorOptions().requiresGrad(true), blob.deleter());
  Tensor loss = mul(x, x).sum();  // MulBackward saves x
  x = Tensor();
  EXPECT_EQ(blob.calls, 0);
  loss = Tensor();
  EXPECT_EQ(blob.calls, 1);

  std::vector<float> borrowed = {1, 2, 3};
  Tensor y = fromBlob(borrowed.data(), {3}, TensorOptions().requiresGrad(true));
  mul(y, y).sum().backward();
  EXPECT_EQ(y.grad().toVector<float>(), (std::vector<float>{2, 4, 6}));
}

TEST(FromBlob, BorrowedMemorySeesWritesBothWays) {
  alignas(64) float buffer[6] = {1, 2, 3, 4, 5, 6};
  Tensor t = fromBlob(buffer, {2, 3});
  t.select(0, 1).fill_(9);
  EXPECT_EQ((std::vector<float>(buffer, buffer + 6)), (std::vector<float>{1, 2, 3, 9, 9, 9}));
  t.mul_(2.0);
  EXPECT_EQ(buffer[0], 2.0f);
  buffer[1] = 42;
  EXPECT_EQ(t.toVector<float>()[1], 42.0f);
  const uint32_t before = t.version();
  t.add_(1.0);
  EXPECT_GT(t.version(), before);
  t = Tensor();
  EXPECT_EQ(buffer[2], 7.0f);  // never freed by dtrain; still the caller's
}

TEST(FromBlob, StridesDescribeTheCallersLayout) {
  alignas(64) double columnMajor[6] = {1, 4, 2, 5, 3, 6};  // [[1, 2, 3], [4, 5, 6]] stored by column
  Tensor t = fromBlob(columnMajor, {2, 3}, {1, 2}, DType::Float64);
  EXPECT_FALSE(t.isContiguous());
  EXPECT_EQ(t.storage().nbytes(), 6 * sizeof(double));
  EXPECT_EQ(t.toVector<double>(), (std::vector<double>{1, 2, 3, 4, 5, 6}));
  Tensor dense = t.contiguous();
  EXPECT_FALSE(dense.storage().isSameAs(t.storage()));
  expectThrowsWith<InvalidArgument>([&] { t.asStrided({2, 4}, {1, 2}, 0); }, {"holds 6 elements"});
}

TEST(FromBlob, BadArgumentsNameTheValueAndLeaveOwnershipWithTheCaller) {
  int deleterCalls = 0;
  const BlobDeleter counting = [&](void*) { ++deleterCalls; };
  expectThrowsWith<InvalidArgument>([&] { fromBlob(nullptr, {2, 3}, DType::Float32, counting); },
                                    {"null", "[2, 3]", "6 elements"});
  alignas(8) unsigned char bytes[32] = {};
  const std::string message = expectThrowsWith<InvalidArgument>(
      [&] { fromBlob(bytes + 1, {2}, DType::Float32, counting); }, {"not aligned", "float32", "4-byte", "= 1"});
  std::ostringstream address;
  address << static_cast<void*>(bytes + 1);
  EXPECT_NE(message.find(address.str()), std::string::npos) << message;
  expectThrowsWith<InvalidArgument>([&] { fromBlob(bytes + 4, {2}, DType::Float64, counting); }, {"8-byte"});
  expectThrowsWith<InvalidArgument>([&] { fromBlob(bytes, {2, 2}, {2}, DType::Float32, counting); },
                                    {"strides [2]", "sizes [2, 2]"});
  expectThrowsWith<InvalidArgument>([&] { fromBlob(bytes, {2}, {-1}, DType::Float32, counting); },
                                    {"negative stride", "[-1]"});
  expectThrowsWith<InvalidArgument>([&] { fromBlob(bytes, {-2}, DType::Float32, counting); }, {"[-2]"});
  expectThrowsWith<InvalidArgument>(
      [&] { fromBlob(bytes, {2}, TensorOptions().dtype(DType::Int64).requiresGrad(true), counting); },
      {"requiresGrad", "int64"});
  expectThrowsWith<NotSupportedError>(
      [&] { fromBlob(bytes, {2}, TensorOptions().device(Device::cuda()), counting); },
      {"cuda:0", "not supported yet"});
  EXPECT_EQ(deleterCalls, 0);

  // Alignment is per dtype: 16-bit types need 2 bytes, bool none.
  EXPECT_EQ(fromBlob(bytes + 2, {3}, DType::Float16).numel(), 3);
  EXPECT_EQ(fromBlob(bytes + 3, {3}, DType::Bool).numel(), 3);
  // Null is fine for an empty tensor; an owning deleter still runs exactly once.
  Tensor none = fromBlob(nullptr, {0, 4}, DType::Float32, counting);
  EXPECT_EQ(none.numel(), 0);
  none = Tensor();
  EXPECT_EQ(deleterCalls, 1);
}

TEST(FromBlob, AThrowingDeleterIsLoggedNotPropagated) {
  alignas(64) float buffer[2] = {1, 2};
  int calls = 0;
  Tensor t = fromBlob(buffer, {2}, DType::Float32, [&](void*) {
    ++calls;
    throw std::runtime_error("deleter failed on purpose");
  });
  EXPECT_NO_THROW(t = Tensor());
  EXPECT_EQ(calls, 1);
}

TEST(Tensor, ViewsShareStorage) {
  Tensor a = arange(12, DType::Float32);
  Tensor m = a.view({3, 4});
  EXPECT_TRUE(m.storage().isSameAs(a.storage()));
  Tensor tr = m.transpose(0, 1);
  EXPECT_EQ(tr.sizes(), (Shape{4, 3}));
  EXPECT_EQ(tr.strides(), (Shape{1, 4}));
  EXPECT_FALSE(tr.isContiguous());
  EXPECT_EQ(tr.contiguous().toVector<float>(),
            (std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  EXPECT_EQ(m.narrow(1, 1, 2).toVector<float>(), (std::vector<float>{1, 2, 5, 6, 9, 10}));
  EXPECT_EQ(m.select(0, -1).toVector<float>(), (std::vector<float>{8, 9, 10, 11}));
  EXPECT_EQ(m.slice(1, 0, 4, 2).toVector<float>(), (std::vector<float>{0, 2, 4, 6, 8, 10}));
  EXPECT_EQ(m.permute({1, 0}).sizes(), (Shape{4, 3}));
  EXPECT_EQ(m.unsqueeze(1).sizes(), (Shape{3, 1, 4}));
  EXPECT_EQ(m.unsqueeze(1).squeeze().sizes(), (Shape{3, 4}));
  EXPECT_EQ(m.unsqueeze(0).squeeze(0).sizes(), (Shape{3, 4}));
  Tensor e = fromVector<float>({1, 2, 3}, {3, 1}).expand({3, 4});
  EXPECT_EQ(e.strides(), (Shape{1, 0}));
  EXPECT_EQ(e.toVector<float>(), (std::vector<float>{1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}));
  Tensor s = a.asStrided({2, 2}, {6, 1}, 1);
  EXPECT_EQ(s.toVector<float>(), (std::vector<float>{1, 2, 7, 8}));
  EXPECT_EQ(m.view({-1, 6}).sizes(), (Shape{2, 6}));
  expectThrowsWith<InvalidArgument>([&] { m.view({5, 3}); }, {"[5, 3]", "float32[3, 4]"});
  expectThrowsWith<InvalidArgument>([&] { tr.view({12}); }, {"reshape"});
  Tensor r = tr.reshape({12});  // must copy
  EXPECT_FALSE(r.storage().isSameAs(a.storage()));
  EXPECT_EQ(r.toVector<float>()[1], 4.0f);
  expectThrowsWith<InvalidArgument>([&] { m.select(0, 3); }, {"index 3", "size 3"});
  expectThrowsWith<InvalidArgument>([&] { m.transpose(0, 2); }, {"dimension 2"});
  expectThrowsWith<InvalidArgument>([&] { a.asStrided({4, 4}, {4, 1}, 0); }, {"storage"});
  expectThrowsWith<InvalidArgument>([&] { e.expand({2, 4}); }, {"[2, 4]"});
}

TEST(Tensor, StridedCopyConvertsAndBroadcasts) {
  Tensor src = fromVector<double>({1.5, 2.5, -3.25}, {3});
  Tensor dst = zeros({2, 3}, DType::Float32);
  dst.copy_(src);
  EXPECT_EQ(dst.toVector<float>(), (std::vector<float>{1.5f, 2.5f, -3.25f, 1.5f, 2.5f, -3.25f}));
  // Into a transposed destination from a non-contiguous source.
  Tensor big = arange(6, DType::Int64).view({2, 3});
  Tensor outT = zeros({3, 2}, DType::Float64).t();  // [2, 3] view with strides {1, 2}
  outT.copy_(big);
  EXPECT_EQ(outT.contiguous().toVector<double>(), (std::vector<double>{0, 1, 2, 3, 4, 5}));
  // Int -> bool -> half.
  Tensor flags = fromVector<int32_t>({0, 3, -1}).to(DType::Bool);
  EXPECT_EQ(flags.toVector<bool>(), (std::vector<bool>{false, true, true}));
  EXPECT_EQ(flags.to(DType::BFloat16).toVector<float>(), (std::vector<float>{0, 1, 1}));
  expectThrowsWith<InvalidArgument>([&] { dst.copy_(zeros({4})); }, {"float32[4]", "[2, 3]"});
  uint32_t before = dst.version();
  dst.fill_(1.0);
  EXPECT_GT(dst.version(), before);
  Tensor view = dst.view({6});
  EXPECT_EQ(view.version(), dst.version());
  view.zero_();
  EXPECT_EQ(dst.toVector<float>(), std::vector<float>(6, 0.0f));
  EXPECT_EQ(view.version(), dst.version());
}

TEST(Tensor, LargeCopyIsCorrectAcrossChunks) {
  // Big enough to be split over threads; a transposed source exercises the carry logic.
  Tensor a = arange(512 * 300, DType::Float32).view({512, 300});
  Tensor b = a.t().contiguous();
  const float* pb = b.data<float>();
  for (int64_t i = 0; i < 300; i += 37) {
    for (int64_t j = 0; j < 512; j += 41) ASSERT_EQ(pb[i * 512 + j], static_cast<float>(j * 300 + i));
  }
}

TEST(Tensor, ToStringShowsValues) {
  Tensor t = fromVector<float>({1, 2, 3, 4}, {2, 2});
  EXPECT_EQ(t.toString(), "tensor(float32[2, 2]) [[1, 2], [3, 4]]");
  std::ostringstream out;
  out << fromVector<int64_t>({5});
  EXPECT_EQ(out.str(), "tensor(int64[1]) [5]");
}

}  // namespace
}  // namespace dt
