// IDX files and datasets: round trips, every kind of bad file (each error names the file), the
// byte-to-float conversion, and the real Fashion-MNIST files from Debian's package.
#include <array>
#include <fstream>
#include <numeric>

#include <gtest/gtest.h>
#include <zlib.h>

#include "common/errors.h"
#include "data/dataset.h"
#include "data/idx.h"
#include "tests/testing/testing.h"

namespace dt::data {
namespace {

using testing::expectThrowsWith;
using testing::TempDir;

std::vector<uint8_t> ramp(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((i * 7) & 0xff);
  return v;
}

std::string readBytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void writeBytes(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// gzip-compresses bytes the way the data sets are shipped.
std::string gzipBytes(const std::string& raw) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&z, raw.size()) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(raw.data()));
  z.avail_in = static_cast<uInt>(raw.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

TEST(Idx, RoundTripGzippedAndPlain) {
  TempDir dir;
  const auto data = ramp(5 * 3 * 4);
  for (bool gzip : {true, false}) {
    const auto path = dir.path() / (gzip ? "a.gz" : "a.idx");
    writeIdx(path, {5, 3, 4}, data, gzip);
    const std::string bytes = readBytes(path);
    if (gzip) {
      EXPECT_EQ(static_cast<uint8_t>(bytes[0]), 0x1f) << "gzip magic";
    } else {
      EXPECT_EQ(bytes.substr(0, 4), std::string("\0\0\x08\x03", 4)) << "IDX magic: unsigned byte, 3 dims";
      EXPECT_EQ(bytes.size(), 4 + 3 * 4 + data.size());
    }
    const IdxArray a = readIdx(path);
    EXPECT_EQ(a.dims, (std::vector<int64_t>{5, 3, 4}));
    EXPECT_EQ(a.count(), 5);
    EXPECT_EQ(a.itemBytes(), 12);
    EXPECT_EQ(a.data, data);
    EXPECT_EQ(a.path, path.string());
  }
}

TEST(Idx, MissingFileIsNamed) {
  TempDir dir;
  const auto path = dir.path() / "nope-idx1-ubyte.gz";
  expectThrowsWith<InvalidArgument>([&] { readIdx(path); }, {path.string(), "does not exist"});
}

TEST(Idx, WrongMagicIsNamedWithTheBytesFound) {
  TempDir dir;
  const auto path = dir.path() / "text.gz";
  writeBytes(path, gzipBytes("hello, this is not an IDX file"));
  expectThrowsWith<InvalidArgument>([&] { readIdx(path); }, {path.string(), "is not an IDX file", "0x68656c6c"});
}

TEST(Idx, OtherElementTypesAreNotSupported) {
  TempDir dir;
  const auto path = dir.path() / "floats.idx";
  writeBytes(path, std::string("\0\0\x0d\x01\0\0\0\x01\0\0\x80\x3f", 12));
  expectThrowsWith<NotSupportedError>([&] { readIdx(path); }, {path.string(), "0x0d", "float32", "type 0x08"});
}

TEST(Idx, BadDimensionCount) {
  TempDir dir;
  const auto path = dir.path() / "dims.idx";
  writeBytes(path, std::string("\0\0\x08\x07", 4));
  expectThrowsWith<InvalidArgument>([&] { readIdx(path); }, {path.string(), "declares 7 dimensions"});
}

TEST(Idx, TruncatedHeaderAndDataAreNamed) {
  TempDir dir;
  const auto path = dir.path() / "images.idx";
  writeIdx(path, {10, 28, 28}, ramp(10 * 28 * 28), false);
  const std::string full = readBytes(path);

  writeBytes(path, full.substr(0, 2));
  expectThrowsWith<InvalidArgument>([&] { readIdx(path); }, {path.string(), "truncated", "2 of the 4 header bytes"});
  writeBytes(path, full.substr(0, 9));
  expectThrowsWith<InvalidArgument>([&] { readIdx(path); }, {path.string(), "truncated", "after 9 of 16 bytes"});
  writeBytes(path, full.substr(0, 16 + 1000));
  expectThrowsWith<InvalidArgument>([&] { readIdx(path); },
                                    {path.string(), "truncated", "1000 of the 7840 data bytes", "[10, 28, 28]"});
}

TEST(Idx, TruncatedGzipStreamIsNamed) {
  TempDir dir;
  const auto path = dir.path() / "images.gz";
  writeIdx(path, {100, 28, 28}, ramp(100 * 28 * 28), true);
  const std::string full = readBytes(path);
  writeBytes(path, full.substr(0, full.size() / 2));
  expectThrowsWith<InvalidArgument>([&] { readIdx(path); }, {path.string(), "truncated"});
}

TEST(Idx, CorruptGzipStreamIsNamed) {
  TempDir dir;
  const auto path = dir.path() / "images.gz";
  std::vector<uint8_t> data(100 * 28 * 28);
  std::iota(data.begin(), data.end(), uint8_t{0});
  writeIdx(path, {100, 28, 28}, data, true);
  std::string bytes = readBytes(path);
  for (size_t i = 20; i < bytes.size() - 20; i += 7) bytes[i] = static_cast<char>(bytes[i] ^ 0x5a);
  writeBytes(path, bytes);
  expectThrowsWith<InvalidArgument>([&] { readIdx(path); }, {path.string(), "zlib"});
}

TEST(Idx, BytesAfterTheDataAreAnError) {
  TempDir dir;
  const auto path = dir.path() / "labels.idx";
  writeIdx(path, {4}, ramp(4), false);
  writeBytes(path, readBytes(path) + "xyz");
  expectThrowsWith<InvalidArgument>([&] { readIdx(path); }, {path.string(), "bytes after the 4 data bytes"});
}

TEST(Idx, WriteChecksItsArguments) {
  TempDir dir;
  const auto data = ramp(6);
  expectThrowsWith<InvalidArgument>([&] { writeIdx(dir.path() / "x", {2, 4}, data); }, {"need 8 bytes but 6"});
  expectThrowsWith<InvalidArgument>([&] { writeIdx(dir.path() / "x", {}, data); }, {"0 dimensions"});
}

IdxArray makeArray(std::vector<int64_t> dims, std::vector<uint8_t> data, const std::string& path) {
  IdxArray a;
  a.dims = std::move(dims);
  a.data = std::move(data);
  a.path = path;
  return a;
}

TEST(ImageDataset, BatchesAreNormalisedFloatsAndInt64Labels) {
  const ImageClassificationDataset ds(makeArray({3, 2, 2}, {0, 255, 51, 102, 1, 2, 3, 4, 10, 20, 30, 40}, "img"),
                                      makeArray({3}, {7, 0, 9}, "lab"), 10, {0.5, 0.25}, "tiny");
  EXPECT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.features(), 4);
  const std::array<int64_t, 2> idx{2, 0};
  const Batch b = ds.get(idx);
  EXPECT_EQ(b.inputs.sizes(), (Shape{2, 4}));
  EXPECT_EQ(b.inputs.dtype(), DType::Float32);
  EXPECT_EQ(b.targets.dtype(), DType::Int64);
  EXPECT_EQ(b.targets.toVector<int64_t>(), (std::vector<int64_t>{9, 7}));
  const auto x = b.inputs.toVector<float>();
  EXPECT_FLOAT_EQ(x[4], (0 / 255.0 - 0.5) / 0.25);
  EXPECT_FLOAT_EQ(x[5], (255 / 255.0 - 0.5) / 0.25);
  EXPECT_FLOAT_EQ(x[6], (51 / 255.0 - 0.5) / 0.25);
  EXPECT_FLOAT_EQ(x[0], (10 / 255.0 - 0.5) / 0.25);
  const std::array<int64_t, 1> bad{3};
  expectThrowsWith<InvalidArgument>([&] { ds.get(bad); }, {"tiny", "index 3 outside [0, 3)"});
}

TEST(ImageDataset, MismatchedFilesAreNamed) {
  expectThrowsWith<InvalidArgument>(
      [] { ImageClassificationDataset(makeArray({3, 2, 2}, std::vector<uint8_t>(12), "a/img.gz"), makeArray({2}, {1, 2}, "a/lab.gz"), 10, {}, "x"); },
      {"a/img.gz holds 3 images", "a/lab.gz holds 2 labels"});
  expectThrowsWith<InvalidArgument>(
      [] { ImageClassificationDataset(makeArray({2, 2, 2}, std::vector<uint8_t>(8), "a/img.gz"), makeArray({2}, {1, 12}, "a/lab.gz"), 10, {}, "x"); },
      {"label #1 in a/lab.gz is 12", "below 10"});
  expectThrowsWith<InvalidArgument>(
      [] { ImageClassificationDataset(makeArray({2, 2, 2}, std::vector<uint8_t>(8), "a/img.gz"), makeArray({2, 1}, {1, 2}, "a/lab.gz"), 10, {}, "x"); },
      {"a/lab.gz have dimensions [2, 1]"});
}

TEST(FashionMnist, MissingFolderSaysWhereTheFilesComeFrom) {
  TempDir dir;
  expectThrowsWith<InvalidArgument>([&] { loadFashionMnist(dir.path() / "absent", Split::Train); },
                                    {"absent", "does not exist", "dataset-fashion-mnist"});
  expectThrowsWith<InvalidArgument>([&] { loadFashionMnist(dir.path(), Split::Test); },
                                    {"t10k-images-idx3-ubyte.gz", "does not exist"});
}

// The real files, as Debian's dataset-fashion-mnist installs them (scripts/setup.sh).
TEST(FashionMnist, DebianPackageFilesLoad) {
  ASSERT_TRUE(std::filesystem::exists(std::filesystem::path(kFashionMnistDir) / "train-images-idx3-ubyte.gz"))
      << "Fashion-MNIST is not installed in " << kFashionMnistDir << ": run scripts/setup.sh (package dataset-fashion-mnist)";
  const auto train = loadFashionMnist(kFashionMnistDir, Split::Train);
  const auto test = loadFashionMnist(kFashionMnistDir, Split::Test);
  EXPECT_EQ(train->size(), 60000);
  EXPECT_EQ(test->size(), 10000);
  EXPECT_EQ(train->features(), 784);
  // The set is balanced: 6000 training and 1000 test images per class.
  std::array<int, 10> trainCounts{}, testCounts{};
  for (int64_t i = 0; i < train->size(); ++i) ++trainCounts[train->label(i)];
  for (int64_t i = 0; i < test->size(); ++i) ++testCounts[test->label(i)];
  for (int c = 0; c < 10; ++c) {
    EXPECT_EQ(trainCounts[c], 6000) << "class " << c;
    EXPECT_EQ(testCounts[c], 1000) << "class " << c;
  }
  // Normalised pixels average about 0 over a large batch.
  std::vector<int64_t> idx(1000);
  std::iota(idx.begin(), idx.end(), int64_t{0});
  const Batch b = train->get(idx);
  const auto x = b.inputs.toVector<float>();
  const double mean = std::accumulate(x.begin(), x.end(), 0.0) / static_cast<double>(x.size());
  EXPECT_NEAR(mean, 0.0, 0.05);
}

}  // namespace
}  // namespace dt::data
