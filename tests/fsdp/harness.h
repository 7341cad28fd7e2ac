// Shared by the sharded-training tests: a small GPT whose shapes cut unevenly at world 3 and
// 4, the global batches of every step, one rank's training loop under DDP, ZeRO or the
// sharded wrapper (with the same AdamW, decay groups, clipping and schedule as
// examples/gpt), and the training state each wrapper checkpoints.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_dir.h"
#include "ddp/ddp.h"
#include "ddp/zero.h"
#include "fsdp/fully_shard.h"
#include "process_group/process_group.h"
#include "tensor/nn/gpt.h"
#include "tensor/optim/optim.h"

namespace dt::testing {

// 61 tokens (61 rows of wte: 21/21/19 at world 3, 16/16/16/13 at 4), 2 blocks of width 16.
nn::GptConfig smallGpt(int64_t layers = 2);

enum class Wrapper { Ddp, Zero1, Zero2, Sharded };
const char* wrapperName(Wrapper wrapper);

struct RunSpec {
  Wrapper wrapper = Wrapper::Sharded;
  nn::GptConfig model = smallGpt();
  FullyShardOptions sharded;  // units are filled in: every block
  DdpOptions ddp;             // DDP and ZeRO
  int microBatches = 1;       // noSync accumulation over the first micro-batches
  // The sharded wrapper: the micro-batches run the model itself inside gatherFullParameters()
  // and reduceGradients() reduces once (what a pipeline does), instead of noSync.
  bool wholeAcrossMicroBatches = false;
  int64_t globalBatch = 12;
  // DDP and ZeRO: one thrown-away iteration first (DDP's bucket rebuild happens there).
  bool settle = true;
};

// One rank of a training job: the model, its wrapper and optimizer, and the training state.
class TrainingRank {
 public:
  TrainingRank(const RunSpec& spec, std::shared_ptr<ProcessGroup> group);
  ~TrainingRank();
  // Trains steps [from, to); returns the last step's loss (mean over ranks).
  double train(int64_t from, int64_t to);
  // The whole parameters (a collective for the sharded wrapper), cpu copies in model order.
  std::vector<Tensor> fullParameters();
  // The state as checkpoints hold it.
  TrainingState state();
  FullyShardedDataParallel* sharded() { return fsdp_.get(); }
  ZeroRedundancy* zero() { return zero_.get(); }
  nn::Gpt& model() { return *model_; }
  optim::AdamW& optimizer() { return *optimizer_; }
  // Rebinds the wrapper to another group (the sharded wrapper only).
  void rebind(std::shared_ptr<ProcessGroup> group);

 private:
  RunSpec spec_;
  std::shared_ptr<ProcessGroup> group_;
  Generator init_{7};  // the model keeps a pointer to it (its dropout generator): it lives as long
  std::shared_ptr<nn::Gpt> model_;
  std::shared_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<ZeroRedundancy> zero_;
  std::unique_ptr<FullyShardedDataParallel> fsdp_;
  std::unique_ptr<optim::AdamW> optimizer_;
};

// The whole tensors from every rank's dim-0 shards (pick(shard): the shard, or its .grad).
std::vector<Tensor> gatherShards(ProcessGroup& group, const std::vector<Tensor>& shards, const ParameterMap& map,
                                 const std::function<Tensor(const Tensor&)>& pick);

// Runs fn(rank, group) on `world` threads, each with its group (30 s timeout).
void withRanks(int world, const std::function<void(int rank, const std::shared_ptr<ProcessGroup>& group)>& fn);
// The same with the job's store at hand and a chosen backend ("" lets the group pick).
void withRanksAndStore(int world,
                       const std::function<void(int rank, const std::shared_ptr<ProcessGroup>& group, const StorePtr& store)>& fn,
                       const std::string& backend = "");

// The largest |a - b| over all elements, relative to the largest |a|.
double relativeDifference(const std::vector<Tensor>& a, const std::vector<Tensor>& b);
bool bitwiseEqual(const std::vector<Tensor>& a, const std::vector<Tensor>& b);

// Full parameters of rank 0 after training steps [0, steps) with `spec` at `world`.
std::vector<Tensor> trainedParameters(const RunSpec& spec, int world, int64_t steps);

}  // namespace dt::testing
