// The Backend conformance suite on NCCL: every rank's tensors live on
// cuda:<rank>. Without a GPU every test skips ("needs a CUDA device: ...");
// with N GPUs the world sizes above N skip (NCCL 2.28 rejects two ranks on
// one GPU), so a one-GPU machine runs the world-size-1 cases.
#include "process_group/nccl/nccl_backend.h"
#include "tests/process_group/backend_conformance.h"

namespace dt::testing {
namespace {

BackendFactory ncclFactory() {
  BackendFactory f;
  f.name = "nccl";
  f.device = Device::cuda(0);
  f.unsupported.tags =
      "NCCL has no tags: sends and recvs between two ranks match in issue order, and each is launched on its own "
      "(a batch that receives before it sends would deadlock)";
  f.unsupported.strided = "NCCL works in place on contiguous memory; the nccl backend rejects strided tensors";
  f.make = [](StorePtr store, int rank, int size, const BackendTestOptions& o) -> BackendPtr {
    NcclBackendOptions n;
    n.groupName = o.groupName;
    n.timeout = o.timeout;
    n.progressInterval = o.progressInterval;
    n.checkFingerprints = o.checkFingerprints;
    n.failureReportWindow = std::chrono::milliseconds(1500);
    return std::make_shared<NcclBackend>(std::move(store), rank, size, n);
  };
  return f;
}

INSTANTIATE_TEST_SUITE_P(Nccl, BackendConformance, ::testing::Values(ncclFactory()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace dt::testing
