#include "collectives/fingerprint.h"

#include <gtest/gtest.h>

#include "common/errors.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

TEST(Fingerprint, DescribesLikeTheErrorMessages) {
  CollectiveFingerprint a;
  a.op = "allreduce";
  a.seq = 41;
  a.tensors = {{DType::Float32, {1048576}}};
  a.reduceOp = ReduceOp::Sum;
  EXPECT_EQ(a.describe(), "allreduce(float32[1048576], sum)");
  CollectiveFingerprint b;
  b.op = "broadcast";
  b.tensors = {{DType::Float32, {4096}}};
  b.root = 0;
  EXPECT_EQ(b.describe(), "broadcast(float32[4096], root 0)");
  CollectiveFingerprint c;
  c.op = "allreduce";
  c.tensors = {{DType::Int64, {2, 3}}, {DType::Int64, {2, 3}}, {DType::BFloat16, {}}};
  c.reduceOp = ReduceOp::Max;
  EXPECT_EQ(c.describe(), "allreduce(int64[2,3] x2, bfloat16[], max)");
  CollectiveFingerprint d;
  d.op = "barrier";
  EXPECT_EQ(d.describe(), "barrier()");
}

TEST(Fingerprint, SerializeRoundTripsAndComparesEveryField) {
  CollectiveFingerprint a;
  a.op = "reduce";
  a.seq = 7;
  a.tensors = {{DType::Float16, {3, 0, 2}}, {DType::Int32, {}}};
  a.reduceOp = ReduceOp::Product;
  a.root = 2;
  const auto parsed = CollectiveFingerprint::parse(a.serialize());
  EXPECT_EQ(parsed, a);
  auto b = a;
  b.root = 1;
  EXPECT_NE(b, a);
  b = a;
  b.seq = 8;
  EXPECT_NE(b, a);
  b = a;
  b.tensors[0].sizes = {3, 0, 3};
  EXPECT_NE(b, a);
  CollectiveFingerprint empty;
  empty.op = "barrier";
  empty.seq = 1;
  EXPECT_EQ(CollectiveFingerprint::parse(empty.serialize()), empty);
}

TEST(Fingerprint, AllToAllAgreesOnDTypesOnly) {
  CollectiveFingerprint a;
  a.op = "allToAllSingle";
  a.seq = 4;
  a.tensors = {{DType::Int64, {3, 2}}};
  CollectiveFingerprint b = a;
  b.tensors[0].sizes = {7, 2};  // another rank's uneven split
  EXPECT_TRUE(a.agreesWith(b));
  b.tensors[0].dtype = DType::Int32;
  EXPECT_FALSE(a.agreesWith(b));
  CollectiveFingerprint c = a;
  c.op = "allreduce";
  CollectiveFingerprint d = c;
  d.tensors[0].sizes = {7, 2};
  EXPECT_TRUE(c.agreesWith(c));
  EXPECT_FALSE(c.agreesWith(d));  // sizes count for every other op
  EXPECT_FALSE(a.agreesWith(c));
}

TEST(Fingerprint, ParseRejectsGarbage) {
  testing::expectThrowsWith<InvalidArgument>([] { CollectiveFingerprint::parse("nonsense"); }, {"5"});
  testing::expectThrowsWith<InvalidArgument>([] { CollectiveFingerprint::parse("1;allreduce;float99[3];sum;"); },
                                             {"float99"});
}

}  // namespace
}  // namespace dt
