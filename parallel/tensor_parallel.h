// Tensor parallelism (Megatron-LM's layers; PyTorch's ColwiseParallel / RowwiseParallel /
// SequenceParallel / loss_parallel): one layer's weights split over a tensor-parallel (TP)
// group, the conjugate collectives in forward and backward that keep the result equal to the
// unsplit layer's.
//
//   auto mesh = dt::DeviceMesh::create(world, {{"dp", 2}, {"tp", 2}});
//   dt::nn::Linear fc(h, 4 * h, true, gen), proj(4 * h, h, true, gen);   // same seed on every rank
//   dt::ColumnParallelLinear up(fc, mesh["tp"]);      // rows of fc.weight: out features / t
//   dt::RowParallelLinear down(proj, mesh["tp"]);     // columns of proj.weight: in features / t
//   dt::Tensor y = down(dt::gelu(up(x)));              // = proj(gelu(fc(x))), one all-reduce each way
//
// The region functions (the autograd functions underneath), as Megatron names them; "region"
// is the stretch of the model whose activations are split over the group:
//                                        forward                 backward
//   copyToTensorParallelRegion           identity                all-reduce (sum)
//   reduceFromTensorParallelRegion       all-reduce (sum)        identity
//   scatterToTensorParallelRegion        split the last dim      all-gather the last dim
//   gatherFromTensorParallelRegion       all-gather the last dim split the last dim
//   scatterToSequenceParallelRegion      split seqDim            all-gather seqDim
//   gatherFromSequenceParallelRegion     all-gather seqDim       reduce-scatter seqDim (sum)
//   reduceScatterToSequenceParallelRegion reduce-scatter seqDim  all-gather seqDim
// Rank r of the group holds block r of a split dimension (equal blocks, in group rank order).
// seqDim defaults to 1, the T of dtrain's [B, T, C] activations (Megatron's [s, b, h] uses 0).
//
// Contract:
//  * Collective: every rank of the TP group runs the same layers on tensors of the same shapes
//    in the same order, forward and backward (the collectives run inside them, synchronously:
//    a call returns once its collective has completed, and a failed or timed-out collective
//    throws the group's error from forward or from backward()). Inputs of a replicated region
//    must be equal on every rank of the group (the same batch); nothing checks it.
//  * Gradients: a split parameter's .grad is this rank's block of the full gradient; a
//    replicated one (RowParallelLinear's bias) gets the same full gradient on every rank.
//    Data-parallel reduction over other mesh dimensions is the caller's (DDP, the sharded
//    wrapper), never these layers'.
//  * Counting: every collective these functions and layers issue is counted per group
//    (tpCollectiveCounts), so tests pin how many ran rather than time them.
//  * Errors: InvalidArgument in one line at the call, naming the module or function, the size
//    and the TP degree: a width, vocabulary or split dimension the degree does not divide (no
//    uneven shards yet), shapes that do not fit the layer; a null or non-member group.
//  * Ownership and threads: modules own their shards (plain leaf tensors registered as
//    parameters "weight" / "bias", so optimizers, DDP and state dicts see them as any module's;
//    ParallelSelfAttention's are its children's, named as nn::CausalSelfAttention's); they keep
//    the group alive. Not thread-safe (as nn::Module); the functions may run on any
//    thread but one group's collectives must be issued from one thread at a time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "process_group/process_group.h"
#include "tensor/nn/gpt.h"
#include "tensor/nn/module.h"
#include "tensor/ops.h"

namespace dt {

// ---- counting ---------------------------------------------------------------------------------
struct TpCollectiveCounts {
  int64_t allReduces = 0;
  int64_t allGathers = 0;
  int64_t reduceScatters = 0;
  // Elements of the whole tensor of each collective (the all-reduced tensor, the gathered
  // output, the reduce-scattered input), summed, in all and per kind: the traffic formulas
  // are in these.
  int64_t elements = 0;
  int64_t allReduceElements = 0;
  int64_t allGatherElements = 0;
  int64_t reduceScatterElements = 0;
  int64_t total() const { return allReduces + allGathers + reduceScatters; }
  // The elements each rank sends when a ring runs these collectives over `degree` ranks: an
  // all-reduce of N sends 2 N (t-1)/t, an all-gather or reduce-scatter of N sends N (t-1)/t.
  double ringElementsPerRank(int degree) const;
};
TpCollectiveCounts operator-(const TpCollectiveCounts& a, const TpCollectiveCounts& b);
// What the functions of this header issued on `group` since it was created (zeros for a group
// they never used). Thread-safe; a group's counts go when the group does.
TpCollectiveCounts tpCollectiveCounts(const ProcessGroup& group);

// ---- region functions (see the table above) ---------------------------------------------------
Tensor copyToTensorParallelRegion(const Tensor& x, const ProcessGroupPtr& group);
Tensor reduceFromTensorParallelRegion(const Tensor& x, const ProcessGroupPtr& group);
Tensor scatterToTensorParallelRegion(const Tensor& x, const ProcessGroupPtr& group);
Tensor gatherFromTensorParallelRegion(const Tensor& x, const ProcessGroupPtr& group);
Tensor scatterToSequenceParallelRegion(const Tensor& x, const ProcessGroupPtr& group, int64_t seqDim = 1);
Tensor gatherFromSequenceParallelRegion(const Tensor& x, const ProcessGroupPtr& group, int64_t seqDim = 1);
Tensor reduceScatterToSequenceParallelRegion(const Tensor& x, const ProcessGroupPtr& group, int64_t seqDim = 1);

// ---- layers -------------------------------------------------------------------------------------
// Where one parameter of a TP layer sits in the whole (unsplit) parameter: what a checkpoint
// needs to save a shard under the global name and shape and load it at another degree.
struct ParameterShard {
  std::string name;  // as the module's namedParameters() spells it
  Shape globalShape;
  int64_t dim = -1;     // the dimension split over the group; -1: replicated (the whole tensor here)
  int64_t offset = 0;   // where this rank's block starts along dim (within each part)
  // dim is made of `parts` equal parts split alike (a fused q/k/v projection: 3): this rank holds
  // [offset, offset + its size / parts) of every part, the parts one after another.
  int64_t parts = 1;
};

class TensorParallelModule : public nn::Module {
 public:
  explicit TensorParallelModule(ProcessGroupPtr group);
  const ProcessGroupPtr& group() const { return group_; }
  // Moves the layer onto another group of the same size in which this process has the same
  // rank (an elastic job's next epoch: its shards stay valid, nothing moves). InvalidArgument
  // naming both groups otherwise.
  void rebindGroup(ProcessGroupPtr group);
  // One entry per parameter of this module (not of its children), in registration order.
  virtual std::vector<ParameterShard> parameterShards() const = 0;

 protected:
  // The block of `whole` along `dim` that this rank keeps, as a fresh leaf (a copy: the whole
  // tensor may go away); with parts > 1, its block of each of the dim's equal parts, concatenated.
  // InvalidArgument naming `module`, `what`, the size and the degree when they do not divide it.
  Tensor shardOf(const Tensor& whole, int64_t dim, const char* module, const char* what, int64_t parts = 1) const;
  ProcessGroupPtr group_;
};

struct ColumnParallelOptions {
  // All-gather the output's last dim so that the caller gets the whole [*, out] (the layer is
  // then a drop-in Linear); off, the output is this rank's [*, out / t] block.
  bool gatherOutput = false;
  // Sequence parallelism: the input is this rank's block of the sequence (dim 1 of [B, T, C]),
  // all-gathered whole before the product (gatherFromSequenceParallelRegion: its backward
  // reduce-scatters the input gradient) instead of copied in.
  bool sequenceParallel = false;
  // The output features are `parts` equal parts split alike (a fused q/k/v projection: 3, so
  // that each rank holds the q, k and v features of its own heads, [q_r; k_r; v_r]).
  int64_t parts = 1;
};

// y = x W^T + b with W's rows (the output features) and b split over the group. Forward:
// copyToTensorParallelRegion(x) (the input is replicated; backward all-reduces its gradient)
// or, sequence-parallel, gatherFromSequenceParallelRegion(x), then the local linear, then
// gatherFromTensorParallelRegion when gatherOutput.
class ColumnParallelLinear : public TensorParallelModule {
 public:
  // fullWeight [out, in], fullBias [out] or undefined: the whole layer, the same on every rank.
  ColumnParallelLinear(const Tensor& fullWeight, const Tensor& fullBias, ProcessGroupPtr group,
                       ColumnParallelOptions options = {});
  ColumnParallelLinear(const nn::Linear& full, ProcessGroupPtr group, ColumnParallelOptions options = {});
  Tensor forward(const Tensor& x) override;
  std::string typeName() const override { return "ColumnParallelLinear"; }
  std::vector<ParameterShard> parameterShards() const override;
  int64_t inFeatures() const { return inFeatures_; }
  int64_t outFeatures() const { return outFeatures_; }  // the whole layer's
  Tensor weight;  // [out / t, in]
  Tensor bias;    // [out / t] or undefined

 private:
  int64_t inFeatures_;
  int64_t outFeatures_;
  ColumnParallelOptions options_;
};

struct RowParallelOptions {
  // The input is already split on its last dim (a ColumnParallelLinear's output); off, the
  // whole input comes in and is split here (scatterToTensorParallelRegion).
  bool inputIsParallel = true;
  // Sequence parallelism: the partial products are reduce-scattered to this rank's block of
  // the sequence (dim 1 of [B, T, C]) instead of all-reduced, and the bias is added to that
  // block. The bias then sees only this rank's rows, so its gradient is summed over the group
  // inside backward (one all-reduce of [out] per backward, as the sequence-parallel norms').
  bool sequenceParallel = false;
};

// y = x W^T + b with W's columns (the input features) split over the group: each rank computes
// its partial product, reduceFromTensorParallelRegion sums them (one all-reduce; sequence-
// parallel: reduceScatterToSequenceParallelRegion), and the bias, whole on every rank, is added
// once after the sum.
class RowParallelLinear : public TensorParallelModule {
 public:
  RowParallelLinear(const Tensor& fullWeight, const Tensor& fullBias, ProcessGroupPtr group,
                    RowParallelOptions options = {});
  RowParallelLinear(const nn::Linear& full, ProcessGroupPtr group, RowParallelOptions options = {});
  Tensor forward(const Tensor& x) override;
  std::string typeName() const override { return "RowParallelLinear"; }
  std::vector<ParameterShard> parameterShards() const override;
  int64_t inFeatures() const { return inFeatures_; }  // the whole layer's
  int64_t outFeatures() const { return outFeatures_; }
  Tensor weight;  // [out, in / t]
  Tensor bias;    // [out] (replicated) or undefined

 private:
  int64_t inFeatures_;
  int64_t outFeatures_;
  RowParallelOptions options_;
};

// An embedding table whose rows (the vocabulary) are split over the group: rank r holds tokens
// [r V/t, (r+1) V/t). A token outside this rank's rows looks up zeros here; the all-reduce of
// reduceFromTensorParallelRegion then gives every rank the whole [*, dim] lookup.
class VocabParallelEmbedding : public TensorParallelModule {
 public:
  VocabParallelEmbedding(const Tensor& fullWeight, ProcessGroupPtr group);
  VocabParallelEmbedding(const nn::Embedding& full, ProcessGroupPtr group);
  // tokens int32/int64 of any shape, each in [0, V) -> [*tokens.shape, dim].
  Tensor forward(const Tensor& tokens) override;
  std::string typeName() const override { return "VocabParallelEmbedding"; }
  std::vector<ParameterShard> parameterShards() const override;
  int64_t vocabSize() const { return vocabSize_; }  // the whole vocabulary
  int64_t vocabStart() const { return vocabStart_; }  // this rank's first token
  Tensor weight;  // [V / t, dim]

 private:
  int64_t vocabSize_;
  int64_t vocabStart_;
};

struct ParallelAttentionOptions {
  // Sequence parallelism: the input and the output are this rank's block of the sequence;
  // c_attn all-gathers the input and c_proj reduce-scatters the output (see the linears').
  bool sequenceParallel = false;
  // Dropout on the attention probabilities and on the output, while training; the generator is
  // the replicated stream (the same seed and position on every rank of the group), required
  // when dropout > 0. See "Dropout under tensor parallelism" below.
  double dropout = 0.0;
  Generator* dropoutGenerator = nullptr;
};

// Multi-head self-attention (nn::CausalSelfAttention's: fused q/k/v projection c_attn, the
// fused causal selfAttention op, output projection c_proj) with its heads split over the group:
// rank r runs heads [r H/t, (r+1) H/t). c_attn is a ColumnParallelLinear of 3 parts (each rank
// takes the q, k and v features of its heads, not a raw range of c_attn's rows), c_proj a
// RowParallelLinear (the heads' outputs are contiguous columns): one all-reduce forward (c_proj's)
// and one backward (c_attn's copy); sequence-parallel, an all-gather and a reduce-scatter each
// way instead. Children and parameter names as CausalSelfAttention's. Dropout: this rank's heads'
// probabilities draw from shardDropoutStream (a sharded region), then the replicated stream
// skips what the whole layer would have drawn there; the output draws from the replicated
// stream (sequence-parallel: sequenceBlockDropout), as nn::CausalSelfAttention's does.
class ParallelSelfAttention : public nn::Module {
 public:
  // The whole projections: qkvWeight [3C, C] (q rows, then k, then v), projWeight [C, C].
  // The constructor from `full` takes its dropout probability and generator.
  ParallelSelfAttention(const Tensor& qkvWeight, const Tensor& qkvBias, const Tensor& projWeight,
                        const Tensor& projBias, int64_t heads, ProcessGroupPtr group,
                        ParallelAttentionOptions options = {});
  ParallelSelfAttention(const nn::CausalSelfAttention& full, int64_t heads, ProcessGroupPtr group,
                        ParallelAttentionOptions options = {});
  // [B, T, C] -> [B, T, C], replicated in and out ([B, T/t, C] sequence-parallel)
  Tensor forward(const Tensor& x) override;
  std::string typeName() const override { return "ParallelSelfAttention"; }
  int64_t localHeads() const { return localHeads_; }
  // As TensorParallelModule::rebindGroup; c_attn and c_proj are rebound on their own.
  void rebindGroup(ProcessGroupPtr group);
  std::shared_ptr<ColumnParallelLinear> c_attn;
  std::shared_ptr<RowParallelLinear> c_proj;

 private:
  int64_t heads_;
  int64_t localHeads_;
  ProcessGroupPtr group_;
  ParallelAttentionOptions options_;
};

// ---- dropout under tensor parallelism --------------------------------------------------------
// Where an activation is replicated over the TP group (the residual stream and the embeddings
// without SP), every rank must drop the same elements; where each rank holds a different block
// (its heads' attention probabilities; under SP its block of the sequence) the ranks must draw
// differently. Megatron keeps a second, tp-rank-seeded generator for the sharded regions; here
// there is one stream, the model's dropout generator (replicated: the same seed and position
// on every rank), and everything else is derived from its position, so one seed reproduces a
// run, autograd::checkpoint's rewinding of that generator replays every draw, and a checkpoint
// of its state resumes them:
//  * replicated regions draw from it as the single process does;
//  * a sequence block draws exactly the single process's mask for its block (the generator is
//    counter-based: it jumps to the block's draws, then past the whole tensor's);
//  * a head-sharded region draws from shardDropoutStream, then the replicated stream skips the
//    draws the whole layer makes there (skipDraws), so the later replicated masks still equal
//    the single process's. The sharded masks themselves are not the single process's.

// A generator for this rank's draws of a tensor-parallel-sharded region: seeded from the
// replicated stream's seed and position and the rank, so the ranks' streams differ, repeat with
// the seed, and never depend on how many sharded regions ran before.
Generator shardDropoutStream(const Generator& replicated, const ProcessGroup& group);

// Moves `generator` past `draws` uniform draws, as if it had made them (its spare normal kept).
void skipDraws(Generator& generator, int64_t draws);

// dropout() of this rank's block of the sequence (dim `seqDim` of x, block r of t equal blocks in
// group rank order): the mask is the rank's block of the mask dropout() would draw for the
// whole tensor from `generator`'s position, bitwise, and the generator ends where that whole
// draw would leave it. Draws nothing when !training or p == 0 (as dropout()).
Tensor sequenceBlockDropout(const Tensor& x, double p, bool training, Generator& generator,
                            const ProcessGroup& group, int64_t seqDim = 1);

// nn::Dropout for a sequence-parallel region (sequenceBlockDropout); no parameters.
class SequenceParallelDropout : public nn::Module {
 public:
  SequenceParallelDropout(double p, Generator& generator, ProcessGroupPtr group);
  Tensor forward(const Tensor& x) override;  // [B, T/t, ...] -> the same
  std::string typeName() const override { return "SequenceParallelDropout"; }
  void rebindGroup(ProcessGroupPtr group);  // as TensorParallelModule::rebindGroup

 private:
  double p_;
  Generator* generator_;
  ProcessGroupPtr group_;
};

// LayerNorm on this rank's block of the sequence (sequence parallelism): the whole weight and
// bias on every rank, but each rank normalises only its rows, so each one's gradients are a
// partial sum. They enter the norm through sumGradientsOverGroup, whose backward all-reduces
// them (one all-reduce of weight and bias together), so every rank's .grad is the whole
// gradient when backward returns (what Megatron-LM#1446 was about: without it the ranks'
// norms drift apart silently). Parameter names as nn::LayerNorm's.
class SequenceParallelLayerNorm : public TensorParallelModule {
 public:
  SequenceParallelLayerNorm(const nn::LayerNorm& full, ProcessGroupPtr group);
  Tensor forward(const Tensor& x) override;  // [B, T/t, C] -> [B, T/t, C]
  std::string typeName() const override { return "SequenceParallelLayerNorm"; }
  std::vector<ParameterShard> parameterShards() const override;  // replicated (dim -1)
  Tensor weight;  // whole, or undefined without an affine part
  Tensor bias;

 private:
  std::vector<int64_t> shape_;
  double eps_;
};

// Identity forward; backward all-reduces (sums) the gradients of `tensors` over the group, in
// one collective. For replicated parameters used on a sequence shard (the norms, a row-parallel
// bias under sequence parallelism). Returns new handles in the same order.
std::vector<Tensor> sumGradientsOverGroup(const std::vector<Tensor>& tensors, const ProcessGroupPtr& group);

struct VocabParallelCrossEntropyOptions {
  int64_t ignoreIndex = -100;  // targets equal to it add no loss and no gradient
  Reduction reduction = Reduction::Mean;  // mean over the targets not ignored (NaN if none)
};

// Cross-entropy of logits whose last dim (the vocabulary) is split over the group, as a
// ColumnParallelLinear without gatherOutput or a tied VocabParallelEmbedding makes them: rank r
// holds the logits of tokens [r V/t, (r+1) V/t). localLogits [*, V/t] (float32 or float64),
// targets int64 [*] of the whole vocabulary. The full logits are never gathered: exactly three
// all-reduces of one value per row (the row max, the sum of exp(logit - max), the target's
// logit); the backward, softmax minus the one-hot target on this rank's block, needs none.
// Every rank gets the same loss.
Tensor vocabParallelCrossEntropy(const Tensor& localLogits, const Tensor& targets, const ProcessGroupPtr& group,
                                 const VocabParallelCrossEntropyOptions& options = {});

}  // namespace dt
