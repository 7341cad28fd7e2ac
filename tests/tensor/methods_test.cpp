// Tensor's member forms of the ops (x.sum({1}), x.matmul(w), ...) against the free functions
// they forward to: same shape, dtype and values, and the same gradients.
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "tensor/ops.h"

namespace dt {
namespace {

std::vector<double> vals(const Tensor& t) { return t.toVector<double>(); }

struct MemberCase {
  std::string name;
  std::function<Tensor()> member;
  std::function<Tensor()> freeForm;
};

void expectSameTensor(const Tensor& member, const Tensor& freeForm) {
  EXPECT_EQ(member.describe(), freeForm.describe());
  EXPECT_EQ(vals(member), vals(freeForm));
}

TEST(TensorMethods, OutOfPlaceMembersEqualFreeFunctions) {
  const Tensor a = fromVector<double>({0.5, -1.25, 2, 3.5, -0.75, 1}, {2, 3});
  const Tensor b = fromVector<double>({1.5, 2, -0.5}, {3});  // broadcasts against a's rows
  const Tensor positive = fromVector<double>({0.25, 1, 2, 4, 9, 0.5}, {2, 3});
  const Tensor w = fromVector<double>({1, 2, -1, 0.5, 3, -2}, {3, 2});
  const Tensor batchA = fromVector<double>({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {2, 2, 3});
  const Tensor batchW = fromVector<double>({1, 0, 0, 1, 1, 1, 2, 0, 0, 2, -1, -1}, {2, 3, 2});
  const Tensor index = fromVector<int64_t>({2, 0});

  const std::vector<MemberCase> cases = {
      {"add", [&] { return a.add(b, 0.5); }, [&] { return add(a, b, 0.5); }},
      {"add scalar", [&] { return a.add(2.0); }, [&] { return add(a, 2.0); }},
      {"sub", [&] { return a.sub(b, 2.0); }, [&] { return sub(a, b, 2.0); }},
      {"sub scalar", [&] { return a.sub(1.5); }, [&] { return sub(a, 1.5); }},
      {"mul", [&] { return a.mul(b); }, [&] { return mul(a, b); }},
      {"mul scalar", [&] { return a.mul(3.0); }, [&] { return mul(a, 3.0); }},
      {"div", [&] { return a.div(b); }, [&] { return div(a, b); }},
      {"div scalar", [&] { return a.div(4.0); }, [&] { return div(a, 4.0); }},
      {"pow tensor", [&] { return positive.pow(b); }, [&] { return pow(positive, b); }},
      {"pow scalar", [&] { return a.pow(3.0); }, [&] { return pow(a, 3.0); }},
      {"maximum", [&] { return a.maximum(b); }, [&] { return maximum(a, b); }},
      {"minimum", [&] { return a.minimum(b); }, [&] { return minimum(a, b); }},
      {"neg", [&] { return a.neg(); }, [&] { return neg(a); }},
      {"exp", [&] { return a.exp(); }, [&] { return exp(a); }},
      {"log", [&] { return positive.log(); }, [&] { return log(positive); }},
      {"sqrt", [&] { return positive.sqrt(); }, [&] { return sqrt(positive); }},
      {"abs", [&] { return a.abs(); }, [&] { return abs(a); }},
      {"clamp", [&] { return a.clamp(-1.0, 1.0); }, [&] { return clamp(a, -1.0, 1.0); }},
      {"clamp low only", [&] { return a.clamp(0.0, std::nullopt); }, [&] { return clamp(a, 0.0, std::nullopt); }},
      {"relu", [&] { return a.relu(); }, [&] { return relu(a); }},
      {"gelu", [&] { return a.gelu(); }, [&] { return gelu(a); }},
      {"tanh", [&] { return a.tanh(); }, [&] { return tanh(a); }},
      {"sigmoid", [&] { return a.sigmoid(); }, [&] { return sigmoid(a); }},
      {"eq", [&] { return a.eq(b); }, [&] { return eq(a, b); }},
      {"ne", [&] { return a.ne(b); }, [&] { return ne(a, b); }},
      {"lt", [&] { return a.lt(b); }, [&] { return lt(a, b); }},
      {"le", [&] { return a.le(b); }, [&] { return le(a, b); }},
      {"gt", [&] { return a.gt(b); }, [&] { return gt(a, b); }},
      {"ge", [&] { return a.ge(b); }, [&] { return ge(a, b); }},
      {"gt scalar", [&] { return a.gt(0.75); }, [&] { return gt(a, 0.75); }},
      {"lt scalar", [&] { return a.lt(0.75); }, [&] { return lt(a, 0.75); }},
      {"sum", [&] { return a.sum(); }, [&] { return sum(a); }},
      {"sum dims", [&] { return a.sum({1}); }, [&] { return sum(a, {1}); }},
      {"sum keepdim", [&] { return a.sum({0}, true); }, [&] { return sum(a, {0}, true); }},
      {"mean", [&] { return a.mean(); }, [&] { return mean(a); }},
      {"mean dims keepdim", [&] { return a.mean({-1}, true); }, [&] { return mean(a, {-1}, true); }},
      {"max", [&] { return a.max(); }, [&] { return max(a); }},
      {"min", [&] { return a.min(); }, [&] { return min(a); }},
      {"max dim values", [&] { return a.max(1).values; }, [&] { return max(a, 1).values; }},
      {"max dim indices", [&] { return a.max(1, true).indices; }, [&] { return max(a, 1, true).indices; }},
      {"min dim values", [&] { return a.min(0).values; }, [&] { return min(a, 0).values; }},
      {"min dim indices", [&] { return a.min(0).indices; }, [&] { return min(a, 0).indices; }},
      {"amax", [&] { return a.amax({0, 1}); }, [&] { return amax(a, {0, 1}); }},
      {"argmax", [&] { return a.argmax(); }, [&] { return argmax(a); }},
      {"argmax dim", [&] { return a.argmax(1, true); }, [&] { return argmax(a, 1, true); }},
      {"argmin dim", [&] { return a.argmin(0); }, [&] { return argmin(a, 0); }},
      {"mm", [&] { return a.mm(w); }, [&] { return mm(a, w); }},
      {"bmm", [&] { return batchA.bmm(batchW); }, [&] { return bmm(batchA, batchW); }},
      {"matmul", [&] { return a.matmul(w); }, [&] { return matmul(a, w); }},
      {"matmul batched", [&] { return batchA.matmul(w); }, [&] { return matmul(batchA, w); }},
      {"softmax", [&] { return a.softmax(1); }, [&] { return softmax(a, 1); }},
      {"logSoftmax", [&] { return a.logSoftmax(0); }, [&] { return logSoftmax(a, 0); }},
      {"indexSelect", [&] { return a.indexSelect(1, index); }, [&] { return indexSelect(a, 1, index); }},
  };
  for (const MemberCase& c : cases) {
    SCOPED_TRACE(c.name);
    expectSameTensor(c.member(), c.freeForm());
  }
  EXPECT_TRUE(a.allclose(a.add(1e-9)));
  EXPECT_EQ(a.allclose(positive), allclose(a, positive));
  EXPECT_FALSE(a.allclose(positive));
}

TEST(TensorMethods, InPlaceMembersEqualFreeFunctionsAndReturnThis) {
  const Tensor start = fromVector<double>({0.5, -1.25, 2, 3.5, -0.75, 1}, {2, 3});
  const Tensor other = fromVector<double>({1.5, 2, -0.5}, {3});
  using InPlace = std::function<Tensor&(Tensor&)>;
  const std::vector<std::pair<InPlace, InPlace>> cases = {
      {[&](Tensor& x) -> Tensor& { return x.add_(other, 2.0); }, [&](Tensor& x) -> Tensor& { return add_(x, other, 2.0); }},
      {[](Tensor& x) -> Tensor& { return x.add_(0.5); }, [](Tensor& x) -> Tensor& { return add_(x, 0.5); }},
      {[&](Tensor& x) -> Tensor& { return x.sub_(other, 0.5); }, [&](Tensor& x) -> Tensor& { return sub_(x, other, 0.5); }},
      {[&](Tensor& x) -> Tensor& { return x.mul_(other); }, [&](Tensor& x) -> Tensor& { return mul_(x, other); }},
      {[](Tensor& x) -> Tensor& { return x.mul_(-2.0); }, [](Tensor& x) -> Tensor& { return mul_(x, -2.0); }},
      {[&](Tensor& x) -> Tensor& { return x.div_(other); }, [&](Tensor& x) -> Tensor& { return div_(x, other); }},
      {[](Tensor& x) -> Tensor& { return x.relu_(); }, [](Tensor& x) -> Tensor& { return relu_(x); }},
      {[](Tensor& x) -> Tensor& { return x.clamp_(-1.0, 0.75); }, [](Tensor& x) -> Tensor& { return clamp_(x, -1.0, 0.75); }},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("in-place case " + std::to_string(i));
    Tensor viaMember = start.clone();
    Tensor viaFree = start.clone();
    const uint32_t before = viaMember.version();
    Tensor& returned = cases[i].first(viaMember);
    cases[i].second(viaFree);
    EXPECT_EQ(&returned, &viaMember);
    EXPECT_GT(viaMember.version(), before);
    expectSameTensor(viaMember, viaFree);
  }
  // sqrt_ on its own: start has negatives, whose NaNs would never compare equal.
  Tensor viaMember = start.abs();
  Tensor viaFree = start.abs();
  EXPECT_EQ(&viaMember.sqrt_(), &viaMember);
  sqrt_(viaFree);
  expectSameTensor(viaMember, viaFree);
}

// Builds the same small network loss twice, once in each spelling, and compares gradients.
TEST(TensorMethods, GradientsMatchFreeFunctions) {
  const TensorOptions param = TensorOptions().dtype(DType::Float64).requiresGrad(true);
  const std::vector<double> xValues = {0.5, -1.25, 2, 3.5, -0.75, 1};
  const std::vector<double> wValues = {1, 2, -1, 0.5, 3, -2};
  const Tensor target = fromVector<double>({0, 1, 1, 0}, {2, 2});

  Tensor x1 = fromVector(xValues, {2, 3}, param);
  Tensor w1 = fromVector(wValues, {3, 2}, param);
  Tensor h1 = x1.matmul(w1).tanh();
  Tensor loss1 = h1.logSoftmax(1).mul(target).sum().neg().add(x1.pow(2.0).sum({1}).mean().mul(0.1));
  loss1.backward();

  Tensor x2 = fromVector(xValues, {2, 3}, param);
  Tensor w2 = fromVector(wValues, {3, 2}, param);
  Tensor h2 = tanh(matmul(x2, w2));
  Tensor loss2 = add(neg(sum(mul(logSoftmax(h2, 1), target))), mul(mean(sum(pow(x2, 2.0), {1})), 0.1));
  loss2.backward();

  expectSameTensor(loss1, loss2);
  expectSameTensor(x1.grad(), x2.grad());
  expectSameTensor(w1.grad(), w2.grad());
  EXPECT_EQ(x1.grad().sizes(), (Shape{2, 3}));
}

}  // namespace
}  // namespace dt
