// DistributedDataParallel: data-parallel training of one nn::Module over a
// process group, with gradient reduction overlapped with backward.
//
//   auto ddp = std::make_shared<dt::DistributedDataParallel>(model, group);
//   dt::optim::SGD sgd(ddp->parameters(), {.lr = 0.1});
//   for (auto& [x, y] : batches) {
//     sgd.zeroGrad();
//     dt::crossEntropy((*ddp)(x), y).backward();  // returns with averaged gradients
//     sgd.step();
//   }
//
// Contract:
//  * Construction is collective over the group: every rank checks that all
//    ranks hold the same parameters (count, module paths, shapes, dtypes,
//    devices, requiresGrad). A mismatch throws InvalidArgument on every rank,
//    naming the first differing parameter, what each rank has and which ranks
//    differ. Then rank 0's parameters and buffers are copied to every rank.
//  * The wrapped module is registered as child "module" (so parameters() and
//    stateDict() list "module.<path>", as in PyTorch); module() returns it.
//    Errors name parameters by their path in the wrapped module ("0.weight").
//  * A forward in grad mode prepares one iteration: the next backward pass
//    over its outputs reduces every gradient across ranks (average) and
//    returns only when they are final. Overlap and buckets: reducer.h and
//    docs/ddp.md. Under NoGradGuard forward issues no collectives at all, so
//    one rank may evaluate alone.
//  * Collectives per training forward: the buffer broadcast from rank 0
//    (broadcastBuffers, when the module has buffers), and inside join() one
//    small allreduce. Every rank must run the same sequence of DDP forwards
//    and backwards, except inside join().
//  * noSync(): forwards inside the scope are not reduced (gradients accumulate
//    locally); the first forward after the scope reduces the total.
//  * Errors surface where they happen: parameters without a gradient (when
//    findUnusedParameters is off) make that backward() throw, naming them; a
//    rank that never reaches its backward is named by the other ranks'
//    process-group timeout, thrown from their backward().
//  * Not thread-safe: use one DDP module from one thread. Destroying it
//    removes its hooks from the parameters.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddp/comm_hooks.h"
#include "ddp/reducer.h"
#include "process_group/process_group.h"
#include "tensor/nn/module.h"

namespace dt {

struct DdpOptions {
  size_t bucketCapBytes = size_t{25} << 20;
  size_t firstBucketCapBytes = size_t{1} << 20;
  // .grad of each parameter is a view into its bucket: no copy back, no
  // second copy of gradient memory.
  bool gradientAsBucketView = true;
  // Parameters the forward's outputs cannot reach are reduced as zeros
  // right away; parameters no rank used keep their .grad untouched.
  bool findUnusedParameters = false;
  // The set of used parameters and how many gradients each gets per backward
  // are the same every iteration (learned in the first one): allows
  // re-entrant backward (activation checkpointing) and unused parameters
  // without the per-iteration graph walk and used-map allreduce.
  bool staticGraph = false;
  bool broadcastBuffers = true;
  // Empty: allreduceHook().
  CommHook commHook;
  // The bucket layout of an earlier run (bucketOrder() saved with its
  // checkpoint): the buckets are planned from it at once and never rebuilt,
  // so a resumed job needs no first iteration to settle them. Parameter paths
  // as bucketOrder() gives them; the same on every rank.
  std::vector<std::string> bucketOrder;
  // Construction verifies that every rank has the same model and broadcasts rank 0's
  // parameters and buffers: collectives over the group. false skips both, for a process
  // that joins a running elastic job: it received the state from the members
  // (checkpoint/transfer.h) and they, already past their construction, run no such ops.
  bool syncAtConstruction = true;
};

class DistributedDataParallel : public nn::Module {
 public:
  DistributedDataParallel(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> group,
                          DdpOptions options = {});
  ~DistributedDataParallel() override;

  Tensor forward(const Tensor& input) override;
  // For modules whose forward takes other arguments: runs body (which calls
  // the wrapped module) as this DDP's forward and prepares backward from the
  // tensors it returns.
  std::vector<Tensor> forwardWith(const std::function<std::vector<Tensor>()>& body);
  std::string typeName() const override { return "DistributedDataParallel"; }

  nn::Module& module() { return *module_; }
  const std::shared_ptr<nn::Module>& modulePtr() const { return module_; }
  ProcessGroup& processGroup() { return *group_; }

  // Between iterations; every rank must register the same hook.
  void registerCommHook(CommHook hook);

  class NoSyncGuard {
   public:
    ~NoSyncGuard();
    NoSyncGuard(NoSyncGuard&& other) noexcept;
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;

   private:
    friend class DistributedDataParallel;
    explicit NoSyncGuard(DistributedDataParallel* ddp);
    DistributedDataParallel* ddp_;
    bool previous_;
  };
  // Gradient accumulation: while the guard lives, forwards are not reduced.
  [[nodiscard]] NoSyncGuard noSync();

  // Uneven inputs: runs body (this rank's training loop). A rank whose body
  // returns early keeps answering the other ranks' collectives with zeros
  // until every rank's body has returned; then all ranks copy the model of
  // one of the last ranks to finish, so they leave with identical
  // parameters. Gradients are still divided by the full world size. Every
  // rank must call join; not with staticGraph (NotSupportedError).
  void join(const std::function<void()>& body);

  std::vector<DdpBucketInfo> buckets() const { return reducer_->buckets(); }
  bool bucketsRebuilt() const { return reducer_->rebuilt(); }
  // Parameter paths in bucket order, for DdpOptions::bucketOrder.
  std::vector<std::string> bucketOrder() const;
  // Continues on `group`, a group rebuilt with other members (elastic jobs:
  // elastic/elastic_group.h), keeping the buckets as they are; the parameters
  // must already be equal on every member of it. Not collective; between
  // iterations or after one that threw (its buckets are dropped).
  void rebind(std::shared_ptr<ProcessGroup> group);
  const DdpIterationStats& lastIteration() const { return reducer_->lastIteration(); }
  const DdpIterationStats& totals() const { return reducer_->totals(); }

 private:
  void beforeForward();
  void afterForward(const std::vector<Tensor>& outputs, double forwardMs);
  std::string who() const;

  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  DdpOptions options_;
  std::unique_ptr<Reducer> reducer_;
  bool requireSync_ = true;
  bool inJoin_ = false;
};

}  // namespace dt
