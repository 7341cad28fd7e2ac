// The Backend conformance suite: written once against process_group/backend.h
// and instantiated per backend (gloo_conformance_test.cpp; the NCCL backend
// adds its own instantiation with device cuda).
//
//   INSTANTIATE_TEST_SUITE_P(Gloo, BackendConformance, ::testing::Values(myFactory()),
//                            [](const auto& info) { return info.param.name; });
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>

#include <gtest/gtest.h>

#include "process_group/backend.h"
#include "store/store.h"
#include "tensor/device.h"

namespace dt::testing {

struct BackendTestOptions {
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  std::chrono::milliseconds progressInterval = std::chrono::milliseconds(100);
  bool checkFingerprints = false;
  std::string groupName = "test";
};

// What a backend lacks; each non-empty entry is the reason the tests that
// need the feature skip (NCCL: no tags, contiguous tensors only).
struct UnsupportedFeatures {
  std::string tags;     // send/recv tags other than 0
  std::string strided;  // non-contiguous tensors
};

struct BackendFactory {
  std::string name;
  // Where the suite makes its tensors: the CPU, or cuda:<rank> for every
  // rank (a world size above the number of GPUs is skipped with the reason,
  // as is every test on a machine without one).
  Device device = Device::cpu();
  UnsupportedFeatures unsupported;
  // Called concurrently on every rank's thread with a store scoped to the group.
  std::function<BackendPtr(StorePtr store, int rank, int size, const BackendTestOptions& options)> make;
};

// So test names read "... # GetParam() = gloo" instead of a byte dump.
inline void PrintTo(const BackendFactory& factory, std::ostream* out) { *out << factory.name; }

class BackendConformance : public ::testing::TestWithParam<BackendFactory> {};

}  // namespace dt::testing
