#include "collectives/coalesce.h"

#include <gtest/gtest.h>

#include "common/errors.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

TEST(Coalesce, FlattenAndUnflattenIncludingStridedAndEmpty) {
  Tensor a = fromVector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = fromVector<float>({7, 8, 9, 10}, {2, 2}).t();  // strided: 7 9 8 10
  Tensor c = empty({0}, DType::Float32);
  Tensor d = fromVector<float>({11});
  const std::vector<Tensor> list = {a, b, c, d};
  Tensor flat = flattenTensors(list);
  EXPECT_EQ(flat.sizes(), (Shape{11}));
  EXPECT_EQ(flat.toVector<float>(), (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 9, 8, 10, 11}));

  Tensor changed = fromVector<float>({-1, -2, -3, -4, -5, -6, -7, -8, -9, -10, -11});
  unflattenInto(changed, list);
  EXPECT_EQ(a.toVector<float>(), (std::vector<float>{-1, -2, -3, -4, -5, -6}));
  EXPECT_EQ(b.toVector<float>(), (std::vector<float>{-7, -8, -9, -10}));
  EXPECT_EQ(d.toVector<float>(), (std::vector<float>{-11}));
}

TEST(Coalesce, RejectsMixedDTypesAndWrongSizes) {
  Tensor a = zeros({2});
  Tensor b = zeros({2}, DType::Int64);
  testing::expectThrowsWith<InvalidArgument>([&] { flattenTensors({a, b}); }, {"tensor 1", "int64"});
  testing::expectThrowsWith<InvalidArgument>([&] { unflattenInto(zeros({3}), {a}); }, {"3 vs 2"});
}

}  // namespace
}  // namespace dt
