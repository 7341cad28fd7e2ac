// Reducer: the gradient buckets of one DDP model and their reduction.
//
// Contract:
//  * Owns one flat buffer per bucket (see bucket_plan.h) and installs one
//    post-accumulate-grad hook per parameter; the destructor removes the
//    hooks and releases the gradient buffers, so a destroyed Reducer leaves
//    plain parameters behind. It holds each parameter's AccumulateGrad node so
//    it can recognise the parameter in every graph.
//  * One iteration: prepareForBackward(outputs, sync) at the end of a forward,
//    then one backward pass over those outputs. With sync, each hook copies
//    its gradient into its bucket (dividing by the world size); a full bucket
//    whose predecessors have been launched is handed to the comm hook at once,
//    so communication overlaps the rest of backward. A callback queued on the
//    outermost backward pass waits for every bucket, writes the averages back
//    (nothing to write when gradients are bucket views) and checks that every
//    parameter got a gradient. Errors surface from that backward() call.
//  * Without sync (noSync), hooks leave .grad accumulating locally.
//  * All ranks issue the same collectives in the same order: buckets in bucket
//    order, then (find-unused) the used-parameter map, then (once) the
//    rebuild broadcast. shadowBackward() issues exactly those with zeros, for
//    a rank that has joined (run out of data).
//  * While a profiler records (tensor/profiler.h), each bucket is an event of
//    category "ddp" from launch to done, with its bytes, on a track of its own
//    ("ddp bucket <i>") since buckets in flight overlap.
//  * Not thread-safe: forward, backward and every call here on one thread
//    (Work completion callbacks only record times).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ddp/bucket_plan.h"
#include "ddp/comm_hooks.h"
#include "process_group/process_group.h"
#include "tensor/tensor.h"

namespace dt {

class Node;

struct ReducerOptions {
  BucketCaps caps;
  bool gradientAsBucketView = true;
  bool findUnusedParameters = false;
  bool staticGraph = false;
  // Rank 0 prints the bucket table once and a summary line every logEvery
  // synchronised iterations to stderr (DT_DDP_LOG); 0: silent.
  int logEvery = 0;
  // Plan the buckets from this order of parameter indices (a permutation,
  // the same on every rank; what bucketOrder() returned in an earlier run)
  // and never rebuild them. Empty: reverse registration order, rebuilt once
  // from rank 0's observed gradient order after the first iteration.
  std::vector<size_t> bucketOrder;
};

struct DdpBucketInfo {
  size_t index = 0;
  size_t bytes = 0;
  DType dtype = DType::Float32;
  Device device = Device::cpu();
  std::vector<std::string> parameters;  // module paths, in order within the buffer
};

struct DdpIterationStats {
  uint64_t iteration = 0;     // synchronised backward passes so far (this one included)
  double forwardMs = 0;       // DDP forward: buffer broadcast, the module, graph walk
  double backwardMs = 0;      // from backward reaching the model's output to the end of the pass
  double commMs = 0;          // first bucket launched -> last bucket reduced
  double exposedCommMs = 0;   // after the pass: waiting for buckets and writing back
  size_t bucketsLaunchedInBackward = 0;  // launched before the autograd pass ended
  size_t unusedParameters = 0;           // parameters no rank used (find-unused / static graph)
};

class Reducer {
 public:
  Reducer(std::vector<Tensor> params, std::vector<std::string> names, std::shared_ptr<ProcessGroup> group,
          ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Replaces the comm hook (default: allreduceHook()). Between iterations only.
  void setCommHook(CommHook hook);
  // Called by DDP at the end of a forward whose outputs backward will start
  // from. sync=false: a no-sync iteration. forwardMs goes into the stats.
  void prepareForBackward(const std::vector<Tensor>& outputs, bool sync, double forwardMs);
  // Whether a hook firing outside a prepared iteration is an error (it is,
  // unless a noSync scope is open: then gradients accumulate locally).
  void setInNoSyncScope(bool inScope) { inNoSyncScope_ = inScope; }
  // Joined rank: the collectives of one synchronised backward, contributing zeros.
  void shadowBackward();

  std::vector<DdpBucketInfo> buckets() const;
  bool rebuilt() const { return rebuilt_; }
  // The parameter indices in bucket order: what ReducerOptions::bucketOrder
  // takes to plan the same buckets again (save it with a checkpoint).
  std::vector<size_t> bucketOrder() const;
  // Moves the reducer to `group` (the same model on every member: a group
  // rebuilt after a member left or joined) keeping its bucket layout, and
  // forgets the iteration in progress: the buckets of a backward that failed
  // with the old group are released, every gradient stays as it is. Between
  // iterations or after one that threw; the next forward starts afresh.
  void rebind(std::shared_ptr<ProcessGroup> group);
  const DdpIterationStats& lastIteration() const { return last_; }
  // Sums over all synchronised iterations (iteration = their count).
  const DdpIterationStats& totals() const { return totals_; }

 private:
  struct Bucket;
  struct Timing;
  enum class Phase { Idle, NoSync, Sync };

  void buildBuckets(const std::vector<size_t>& order);
  void onGradReady(size_t param);
  void beginBackward();
  void markReady(size_t param, bool unusedHere);
  void launchReadyBuckets();
  void profileBucket(size_t index, Bucket& bucket, int64_t launchNs) const;
  void finalize();
  void finishIteration(const DdpIterationStats& stats);
  void maybeRebuild(bool contribute);
  std::vector<std::vector<size_t>> currentPlan() const;
  std::string formatBucketTable() const;
  std::string who() const;
  std::string namesOf(const std::vector<size_t>& params) const;

  std::vector<Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<ProcessGroup> group_;
  ReducerOptions options_;
  CommHook hook_;
  // Hooks left in a graph that outlives this Reducer check it before use.
  std::shared_ptr<char> alive_;
  std::vector<std::shared_ptr<Node>> accumulators_;
  std::vector<int> hookHandles_;
  std::vector<BucketParam> paramInfo_;

  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<size_t> bucketOf_;   // param -> bucket
  std::vector<Tensor> views_;      // param -> its slice of its bucket, shaped like the param

  // Per iteration.
  Phase phase_ = Phase::Idle;
  bool inNoSyncScope_ = false;
  bool backwardStarted_ = false;
  size_t nextToLaunch_ = 0;
  std::vector<uint8_t> ready_;
  std::vector<int> hookCalls_;
  std::vector<size_t> unusedHere_;       // found by the graph walk (or known from the static graph)
  std::vector<std::pair<size_t, Tensor>> savedGrads_;  // defined .grad of params nobody may have used
  std::vector<size_t> readyOrder_;
  std::shared_ptr<Timing> timing_;
  double pendingForwardMs_ = 0;
  std::vector<WorkPtr> abandoned_;       // in flight when an iteration failed

  // Across iterations.
  bool rebuilt_ = false;
  bool staticGraphKnown_ = false;
  std::vector<int> expectedCalls_;       // static graph: hook firings per backward
  std::vector<uint8_t> globallyUnused_;  // static graph
  uint64_t iterations_ = 0;
  DdpIterationStats last_;
  DdpIterationStats totals_;
  bool loggedLayout_ = false;
};

}  // namespace dt
