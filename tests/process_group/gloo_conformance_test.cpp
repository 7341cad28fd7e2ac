#include "common/config.h"
#include "tests/process_group/backend_conformance.h"

#if DT_HAVE_GLOO
#include "process_group/gloo/gloo_backend.h"

namespace dt::testing {
namespace {

BackendFactory glooFactory() {
  BackendFactory f;
  f.name = "gloo";
  f.device = Device::cpu();
  f.make = [](StorePtr store, int rank, int size, const BackendTestOptions& o) -> BackendPtr {
    GlooBackendOptions g;
    g.groupName = o.groupName;
    g.timeout = o.timeout;
    g.progressInterval = o.progressInterval;
    g.checkFingerprints = o.checkFingerprints;
    g.failureReportWindow = std::chrono::milliseconds(1500);
    return std::make_shared<GlooBackend>(std::move(store), rank, size, g);
  };
  return f;
}

INSTANTIATE_TEST_SUITE_P(Gloo, BackendConformance, ::testing::Values(glooFactory()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace dt::testing
#endif
