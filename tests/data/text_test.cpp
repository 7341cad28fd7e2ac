// data/text.h: the document split, the fortunes reader, and text windows (the random windows: DistributedSampler's replacement mode, sampler_test.cpp).
#include <set>

#include <gtest/gtest.h>

#include <fstream>

#include "common/errors.h"
#include "data/text.h"
#include "tests/testing/testing.h"

namespace dt::data {
namespace {

TEST(TextSplit, DependsOnlyOnEachDocumentsText) {
  std::vector<std::string> docs;
  for (int i = 0; i < 2000; ++i) docs.push_back("fortune number " + std::to_string(i) + "\n%\n");
  const TextSplit a = splitDocuments(docs, 0.1, "a");
  std::vector<std::string> reversed(docs.rbegin(), docs.rend());
  reversed.push_back(docs[17]);  // a duplicate stays on its side
  const TextSplit b = splitDocuments(reversed, 0.1, "b");
  EXPECT_EQ(a.trainDocuments + a.validationDocuments, 2000);
  EXPECT_NEAR(static_cast<double>(a.validationDocuments) / 2000.0, 0.1, 0.03);
  EXPECT_EQ(a.validation.size() + a.train.size(), b.validation.size() + b.train.size() - docs[17].size());
  EXPECT_EQ(a.validationDocuments + (a.validation.find(docs[17]) != std::string::npos ? 1 : 0), b.validationDocuments);
  for (const std::string& d : docs) {
    EXPECT_EQ(a.validation.find(d) != std::string::npos, b.validation.find(d) != std::string::npos) << d;
  }
  testing::expectThrowsWith<InvalidArgument>([&] { splitDocuments(docs, 1.0, "x"); }, {"(0, 1)", "1"});
}

TEST(Fortunes, ReadsEveryFileInNameOrderAndSkipsIndexesAndLinks) {
  testing::TempDir dir;
  std::ofstream(dir.path() / "b") << "second file\n%\n%\nlast one\n";
  std::ofstream(dir.path() / "a") << "%\nFirst.\n  -- someone\n%\nSecond\n";
  std::ofstream(dir.path() / "a.dat") << "binary index";
  std::filesystem::create_symlink(dir.path() / "a", dir.path() / "a.u8");
  const TextSplit s = loadFortunes(dir.path(), 0.5);
  EXPECT_EQ(s.trainDocuments + s.validationDocuments, 4);
  std::string all = s.train + s.validation;
  for (const char* d : {"First.\n  -- someone\n%\n", "Second\n%\n", "second file\n%\n", "last one\n%\n"}) {
    EXPECT_NE(all.find(d), std::string::npos) << d;
  }
  EXPECT_EQ(all.size(), std::string("First.\n  -- someone\n%\nSecond\n%\nsecond file\n%\nlast one\n%\n").size());
  testing::expectThrowsWith<InvalidArgument>([&] { loadFortunes(dir.path() / "missing"); }, {"missing", "fortunes"});
}

TEST(Fortunes, DebiansPackageIsThere) {
  // scripts/setup.sh installs `fortunes`; examples/gpt and its tests train on it.
  const TextSplit s = loadFortunes(kFortunesDir);
  EXPECT_GT(s.train.size(), 2'000'000u);
  EXPECT_GT(s.validation.size(), 50'000u);
  EXPECT_GT(s.trainDocuments, 10'000);
}

TEST(TextWindows, InputsAreBytesAndTargetsTheNextBytes) {
  TextWindows w("abcdefgh", 3, "t");
  EXPECT_EQ(w.size(), 5);
  const std::vector<int64_t> idx{0, 4};
  const Batch b = w.get(idx);
  EXPECT_EQ(b.inputs.sizes(), (Shape{2, 3}));
  EXPECT_EQ(b.inputs.toVector<int64_t>(), (std::vector<int64_t>{'a', 'b', 'c', 'e', 'f', 'g'}));
  EXPECT_EQ(b.targets.toVector<int64_t>(), (std::vector<int64_t>{'b', 'c', 'd', 'f', 'g', 'h'}));
  const std::vector<int64_t> bad{5};
  testing::expectThrowsWith<InvalidArgument>([&] { w.get(bad); }, {"window 5", "[0, 5)"});
  testing::expectThrowsWith<InvalidArgument>([] { TextWindows("abc", 3, "short"); }, {"short", "3 bytes"});
}

}  // namespace
}  // namespace dt::data
