// DeviceSwitch (tensor/cuda/device_switch.h), the rule behind cuda::DeviceGuard, over a fake
// CUDA that behaves as CUDA 12+ does: a thread starts on device 0 without a context, and
// setting a device creates that device's primary context for the whole process. Runs in every
// build; tests/tensor/cuda_test.cpp and nccl_backend_test.cpp check the same on real GPUs.
#include <gtest/gtest.h>

#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "tensor/cuda/device_switch.h"

namespace dt::cuda {
namespace {

// The process's primary contexts and each thread's current device, as CUDA keeps them.
struct FakeCuda {
  std::mutex mutex;
  std::set<int> contexts;
  std::vector<int> sets;  // every cudaSetDevice, in order
};
FakeCuda* fake = nullptr;
thread_local int threadDevice = 0;  // cudaGetDevice on a fresh thread: 0, and no context made

int fakeCurrent() { return threadDevice; }
void fakeSet(int device) {
  std::lock_guard<std::mutex> lock(fake->mutex);
  fake->contexts.insert(device);  // CUDA 12+: cudaSetDevice initialises the primary context
  fake->sets.push_back(device);
  threadDevice = device;
}
void fakeSetBack(int device) noexcept { fakeSet(device); }
bool fakeHasContext(int device) noexcept {
  std::lock_guard<std::mutex> lock(fake->mutex);
  return fake->contexts.count(device) > 0;
}
constexpr DeviceSwitchOps kFake{&fakeCurrent, &fakeSet, &fakeSetBack, &fakeHasContext};

class DeviceSwitchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fake = &state;
    threadDevice = 0;
  }
  void TearDown() override { fake = nullptr; }
  FakeCuda state;
};

TEST_F(DeviceSwitchTest, AThreadThatNeverChoseADeviceStaysOnTheGuardsDeviceAndCuda0GetsNoContext) {
  // A rank that uses cuda:3 only; its watchdog thread queries an event under a guard.
  std::thread watchdog([] {
    for (int i = 0; i < 3; ++i) {
      DeviceSwitch guard(kFake, 3);
      EXPECT_EQ(threadDevice, 3);
    }
    EXPECT_EQ(threadDevice, 3);  // not moved back to the 0 it read
  });
  watchdog.join();
  EXPECT_EQ(state.contexts, std::set<int>{3});
  EXPECT_EQ(state.sets, std::vector<int>{3});  // switched once: later guards find it there
}

TEST_F(DeviceSwitchTest, GoesBackWhenTheProcessHoldsThePreviousDevicesContext) {
  fakeSet(1);  // the trainer's thread chose cuda:1
  {
    DeviceSwitch guard(kFake, 2);  // an op on another GPU of this process
    EXPECT_EQ(threadDevice, 2);
    EXPECT_TRUE(guard.changed());
    EXPECT_EQ(guard.previous(), 1);
  }
  EXPECT_EQ(threadDevice, 1);
  EXPECT_EQ(state.sets, (std::vector<int>{1, 2, 1}));
  EXPECT_EQ(state.contexts, (std::set<int>{1, 2}));
}

TEST_F(DeviceSwitchTest, TheSameDeviceIsNeitherSetNorRestored) {
  fakeSet(2);
  state.sets.clear();
  {
    DeviceSwitch guard(kFake, 2);
    EXPECT_FALSE(guard.changed());
  }
  EXPECT_TRUE(state.sets.empty());
}

TEST_F(DeviceSwitchTest, NestedGuardsUnwindToTheOutermostDeviceThatHasAContext) {
  // A fresh thread (device 0, no context): outer guard to 3, inner to 1.
  std::thread t([] {
    {
      DeviceSwitch outer(kFake, 3);
      {
        DeviceSwitch inner(kFake, 1);
        EXPECT_EQ(threadDevice, 1);
      }
      EXPECT_EQ(threadDevice, 3);  // 3 has a context now: going back is free
    }
    EXPECT_EQ(threadDevice, 3);  // 0 never had one
  });
  t.join();
  EXPECT_EQ(state.contexts, (std::set<int>{1, 3}));
}

TEST_F(DeviceSwitchTest, WhenCuda0IsInUseByThisProcessAGuardRestoresIt) {
  // Rank 0 of a host (or one process driving two GPUs): cuda:0 holds a context already.
  fakeSet(0);
  std::thread t([] {
    {
      DeviceSwitch guard(kFake, 1);
    }
    EXPECT_EQ(threadDevice, 0);
  });
  t.join();
  EXPECT_EQ(state.contexts, (std::set<int>{0, 1}));
}

}  // namespace
}  // namespace dt::cuda
