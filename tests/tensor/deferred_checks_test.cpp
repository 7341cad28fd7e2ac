// The deferred index checks' bookkeeping (tensor/deferred_checks.h) without a GPU: fake checks
// whose "device" finishes when the test says, on a private DeferredChecks. What the CUDA ops
// do with it (queue the kernel, raise at item() and the optimizer step) is in cuda_ops_test.
#include "tensor/deferred_checks.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "common/errors.h"
#include "tensor/ops.h"
#include "tests/testing/testing.h"

namespace dt::detail {
namespace {

using dt::testing::expectThrowsWith;

const Device kGpu0 = Device::cuda(0);
const Device kGpu1 = Device::cuda(1);

// A check the test finishes by hand; `waits` counts finished(true) calls.
struct FakeCheck {
  bool done = false;
  IndexCheckResult result;
  int waits = 0;
};

DeferredChecks::Check makeCheck(Device device, const std::shared_ptr<FakeCheck>& fake, std::string what) {
  DeferredChecks::Check c;
  c.device = device;
  c.finished = [fake](bool wait) {
    if (wait) {
      ++fake->waits;
      fake->done = true;  // a wait returns once the device got there
    }
    return fake->done;
  };
  c.result = [fake] { return fake->result; };
  c.error = [what](const IndexCheckResult& r) {
    return crossEntropyTargetError(r.value, r.position, 10, -100) + " [" + what + "]";
  };
  return c;
}

TEST(DeferredChecks, AFailureIsRaisedOnlyOnceTheDeviceHasWrittenIt) {
  DeferredChecks checks;
  auto bad = std::make_shared<FakeCheck>();
  bad->result = {2, 10};
  checks.add(makeCheck(kGpu0, bad, "first"));
  EXPECT_NO_THROW(checks.poll(kGpu0, false, "a read"));  // still in flight: nothing known yet
  EXPECT_EQ(checks.pending(kGpu0), 1u);
  bad->done = true;
  expectThrowsWith<InvalidArgument>(
      [&] { checks.poll(kGpu0, false, "the next copy between the host and this device"); },
      {"crossEntropy: target 10 at position 2 is out of range for 10 classes", "found on cuda:0",
       "raised at the next copy between the host and this device"});
  // Raised once: the failed check is gone.
  EXPECT_EQ(checks.pending(kGpu0), 0u);
  EXPECT_NO_THROW(checks.poll(kGpu0, false, "a read"));
}

TEST(DeferredChecks, PassedChecksAreDroppedSilently) {
  DeferredChecks checks;
  auto good = std::make_shared<FakeCheck>();
  checks.add(makeCheck(kGpu0, good, "good"));
  good->done = true;
  EXPECT_NO_THROW(checks.poll(kGpu0, false, "a read"));
  EXPECT_EQ(checks.pending(kGpu0), 0u);
  EXPECT_EQ(checks.pendingTotal(), 0u);
}

TEST(DeferredChecks, WaitingPollsRaiseWhatIsInFlight) {
  // The optimizer step's rule: wait for the device's checks, so a bad batch never reaches the weights.
  DeferredChecks checks;
  auto bad = std::make_shared<FakeCheck>();
  bad->result = {0, -7};
  checks.add(makeCheck(kGpu0, bad, "in flight"));
  expectThrowsWith<InvalidArgument>([&] { checks.poll(kGpu0, true, "the optimizer step"); },
                                    {"target -7 at position 0", "raised at the optimizer step"});
  EXPECT_EQ(bad->waits, 1);
}

TEST(DeferredChecks, TheFirstFailureInLaunchOrderIsRaisedAndTheOtherFinishedOnesDropped) {
  DeferredChecks checks;
  auto a = std::make_shared<FakeCheck>(), b = std::make_shared<FakeCheck>(),
       c = std::make_shared<FakeCheck>();
  a->result = {-1, 0};
  b->result = {5, 11};
  c->result = {1, 12};
  checks.add(makeCheck(kGpu0, a, "a"));
  checks.add(makeCheck(kGpu0, b, "b"));
  checks.add(makeCheck(kGpu0, c, "c"));
  a->done = b->done = c->done = true;
  expectThrowsWith<InvalidArgument>([&] { checks.poll(kGpu0, false, "a read"); },
                                    {"target 11 at position 5", "[b]"});
  EXPECT_EQ(checks.pending(kGpu0), 0u);
}

TEST(DeferredChecks, AnUnfinishedCheckStaysWhileFinishedOnesAreRaised) {
  DeferredChecks checks;
  auto slow = std::make_shared<FakeCheck>(), bad = std::make_shared<FakeCheck>();
  slow->result = {3, 99};
  bad->result = {4, 10};
  checks.add(makeCheck(kGpu0, slow, "slow"));
  checks.add(makeCheck(kGpu0, bad, "bad"));
  bad->done = true;
  expectThrowsWith<InvalidArgument>([&] { checks.poll(kGpu0, false, "a read"); }, {"[bad]"});
  EXPECT_EQ(checks.pending(kGpu0), 1u);
  slow->done = true;
  expectThrowsWith<InvalidArgument>([&] { checks.poll(kGpu0, false, "a read"); }, {"[slow]", "target 99"});
}

TEST(DeferredChecks, DevicesAreIndependent) {
  DeferredChecks checks;
  auto bad = std::make_shared<FakeCheck>();
  bad->result = {0, 10};
  checks.add(makeCheck(kGpu1, bad, "gpu1"));
  bad->done = true;
  EXPECT_NO_THROW(checks.poll(kGpu0, true, "a read"));  // cuda:0's read does not raise cuda:1's check
  EXPECT_EQ(bad->waits, 0);
  expectThrowsWith<InvalidArgument>([&] { checks.poll(kGpu1, false, "a read"); }, {"found on cuda:1"});
}

TEST(DeferredChecks, AddingRaisesAFinishedFailureAndBoundsThePendingOnes) {
  DeferredChecks checks;
  auto bad = std::make_shared<FakeCheck>();
  bad->result = {1, 10};
  checks.add(makeCheck(kGpu0, bad, "old"));
  bad->done = true;
  auto next = std::make_shared<FakeCheck>();
  // A loop that never reads still hears of it at its next check; the new check stays registered.
  expectThrowsWith<InvalidArgument>([&] { checks.add(makeCheck(kGpu0, next, "new")); },
                                    {"[old]", "raised at a later check on the same device"});
  EXPECT_EQ(checks.pending(kGpu0), 1u);
  // More than kMaxPendingChecks in flight: the next add waits for them.
  std::vector<std::shared_ptr<FakeCheck>> many;
  for (size_t i = 0; i < kMaxPendingChecks; ++i) {
    many.push_back(std::make_shared<FakeCheck>());
    checks.add(makeCheck(kGpu0, many.back(), "many"));
  }
  EXPECT_EQ(next->waits, 1);
  EXPECT_EQ(checks.pending(kGpu0), 0u);
}

TEST(DeferredChecks, MessagesMatchTheCpuChecks) {
  // The CPU raises at once with the same text (no "found on" part).
  const Tensor logits = zeros({3, 10});
  expectThrowsWith<InvalidArgument>(
      [&] {
        crossEntropy(logits, fromVector<int64_t>({0, 10, 1}));
      },
      {crossEntropyTargetError(10, 1, 10, -100)});
  const Tensor table = zeros({4, 2});
  expectThrowsWith<InvalidArgument>(
      [&] {
        embedding(table, fromVector<int64_t>({1, -1}));
      },
      {embeddingIndexError(-1, -1, table.describe(), 4)});
  EXPECT_EQ(embeddingIndexError(9, 3, "w", 4),
            "embedding: index 9 at position 3 out of range for weight w (4 rows)");
  const std::string deferred = deferredCheckError("E", kGpu0, "the optimizer step");
  EXPECT_EQ(deferred.find("E; found on cuda:0"), 0u) << deferred;
}

}  // namespace
}  // namespace dt::detail
