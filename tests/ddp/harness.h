// Shared by the DDP tests: the model every rank builds, each rank's data, a
// single-process reference, and one rank's DDP training loop. Threads and
// forked processes run the same loop, so both check the same equivalence:
// world ranks with batch b each end with the parameters of one process
// training on the concatenated world x b batch.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "ddp/ddp.h"
#include "tensor/nn/module.h"

namespace dt::testing {

struct TrainSpec {
  int world = 2;
  int64_t batchPerRank = 4;
  int steps = 4;
  DdpOptions ddp;
  // A layer that some ranks skip on some steps (and every rank on steps 0, 3, 6, ...).
  bool branchy = false;
  // noSync micro-batches before each synchronised one (gradient accumulation).
  int accumulate = 0;
  // Uneven inputs (join): rank r trains stepsPerRank[r] steps; empty = `steps` each.
  std::vector<int> stepsPerRank;
  // Registers a layer no forward ever uses.
  bool deadLayer = false;
  // Where the model and batches live (cuda: NCCL carries the gradients).
  Device device = Device::cpu();

  int stepsOf(int rank) const { return stepsPerRank.empty() ? steps : stepsPerRank.at(rank); }
  int maxSteps() const;
};

// Linear(6,12) ReLU [skip: x + relu(Linear(12,12)(x))] Linear(12,3), seeded
// with `seed` (DDP makes every rank start from rank 0's values).
class TestNet : public nn::Module {
 public:
  TestNet(uint64_t seed, bool deadLayer);
  Tensor forward(const Tensor& x) override;
  std::string typeName() const override { return "TestNet"; }
  bool useSkip = true;
};

bool usesBranch(int step, int rank);
// Rank r's inputs and labels at (step, micro-batch).
std::pair<Tensor, Tensor> batchFor(const TrainSpec& spec, int step, int micro, int rank);
// Parameters after training one model on every rank's data (single process).
std::vector<Tensor> referenceParameters(const TrainSpec& spec);
// One rank's DDP training over `group`; returns its final parameters.
std::vector<Tensor> trainRank(const TrainSpec& spec, const std::shared_ptr<ProcessGroup>& group);
float maxAbsDifference(const std::vector<Tensor>& a, const std::vector<Tensor>& b);

}  // namespace dt::testing
