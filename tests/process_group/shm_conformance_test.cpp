#include "process_group/shm/shm_backend.h"
#include "tests/process_group/backend_conformance.h"

namespace dt::testing {
namespace {

// Small slots, so that the suite's sizes take many rounds and every path of
// the round logic (small, reduce-scatter + allgather, partial last round) runs.
BackendFactory shmFactory(const std::string& name, size_t slotBytes) {
  BackendFactory f;
  f.name = name;
  f.device = Device::cpu();
  f.make = [slotBytes](StorePtr store, int rank, int size, const BackendTestOptions& o) -> BackendPtr {
    ShmBackendOptions s;
    s.groupName = o.groupName;
    s.timeout = o.timeout;
    s.progressInterval = o.progressInterval;
    s.checkFingerprints = o.checkFingerprints;
    s.failureReportWindow = std::chrono::milliseconds(1500);
    s.slotBytes = slotBytes;
    return std::make_shared<ShmBackend>(std::move(store), rank, size, s);
  };
  return f;
}

INSTANTIATE_TEST_SUITE_P(Shm, BackendConformance,
                         ::testing::Values(shmFactory("shm", size_t{1} << 20), shmFactory("shm_small_slots", size_t{64} << 10)),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace dt::testing
