// The NCCL backend's rules without NCCL (process_group/nccl/comm_lifecycle.h), over fakes of
// the event, abort and NCCL state they read: which op counts as done. Runs in every build;
// nccl_backend_test.cpp runs the same paths on GPUs.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "process_group/nccl/comm_lifecycle.h"

namespace dt::nccl {
namespace {

// ---- pollOp --------------------------------------------------------------------------------------

struct FakeOp final : OpProbe {
  bool event = false;
  bool abortFlag = false;
  bool asyncError = false;
  // ncclCommAbort ends the op's kernels, so its event fires: the abort starts
  // on another thread while the watcher looks at the event.
  bool abortFiresTheEvent = false;
  std::vector<std::string> calls;

  bool eventCompleted() override {
    calls.push_back("event");
    if (abortFiresTheEvent) {
      abortFlag = true;
      event = true;
    }
    return event;
  }
  bool aborted() override {
    calls.push_back("aborted");
    return abortFlag;
  }
  void throwIfAsyncError() override {
    calls.push_back("asyncError");
    if (asyncError) throw std::runtime_error("ncclRemoteError");
  }
};

TEST(NcclPollOp, ACompletedEventWithoutAnAbortIsASuccess) {
  FakeOp op;
  EXPECT_EQ(pollOp(op), OpState::Running);
  op.event = true;
  EXPECT_EQ(pollOp(op), OpState::Completed);
}

TEST(NcclPollOp, AnEventThatCompletedBecauseOfAnAbortFailsTheOp) {
  // The abort begins after the watcher last saw the flag clear: the event then
  // completes because the kernels were told to quit. Read before the event,
  // the flag would still be clear and the half-reduced buffer would pass.
  FakeOp op;
  op.abortFiresTheEvent = true;
  EXPECT_EQ(pollOp(op), OpState::Aborted);
  EXPECT_EQ(op.calls, (std::vector<std::string>{"event", "aborted"}));
}

TEST(NcclPollOp, AnAbortFailsTheOpWhetherOrNotItsEventCompleted) {
  FakeOp running;
  running.abortFlag = true;
  EXPECT_EQ(pollOp(running), OpState::Aborted);
  FakeOp fired;
  fired.abortFlag = true;
  fired.event = true;
  EXPECT_EQ(pollOp(fired), OpState::Aborted);
}

TEST(NcclPollOp, AnAsynchronousErrorWinsOverACompletedEvent) {
  FakeOp op;
  op.event = true;
  op.asyncError = true;
  EXPECT_THROW(pollOp(op), std::runtime_error);
  EXPECT_EQ(op.calls, (std::vector<std::string>{"event", "aborted", "asyncError"}));
}

}  // namespace
}  // namespace dt::nccl
