// Applying tensor (and sequence) parallelism to a model as it is: a plan names modules by path
// and says how each one is split (torchtitan's parallelize plan, PyTorch's ColwiseParallel /
// RowwiseParallel / SequenceParallel), and parallelize() puts the tensor-parallel layers of
// tensor_parallel.h in those modules' places (nn::Module::replaceChild), so parameter names
// and order stay those of the plain model.
//
//   dt::Generator init(seed);                                   // the same seed on every rank
//   auto model = std::make_shared<dt::nn::Gpt>(config, init);
//   dt::parallelize(*model, mesh["tp"], dt::gptParallelPlan({.sequenceParallel = true}));
//   dt::Tensor logits = (*model)(tokens);                       // [B, T, V / t]: this rank's vocabulary
//   dt::Tensor loss = model->nextTokenLoss(logits, targets);    // vocab-parallel: never gathered
//
// The styles (collectives per use, forward / backward; t the degree):
//   Column    nn::Linear -> ColumnParallelLinear: output features / t. Copy in (backward: all-
//             reduce); sequence-parallel: all-gather the sequence in (backward: reduce-scatter).
//   Row       nn::Linear -> RowParallelLinear: input features / t. All-reduce out; sequence-
//             parallel: reduce-scatter the sequence out (backward: all-gather), and the bias's
//             gradient summed over the group (one small all-reduce in backward).
//   Heads     nn::CausalSelfAttention -> ParallelSelfAttention: heads / t (c_attn column by head,
//             c_proj row): as a Column then a Row.
//   Vocab     nn::Embedding -> VocabParallelEmbedding: rows / t, all-reduce out. At a Gpt's
//             "wte" the tied output layer becomes vocab-parallel too: its logits are this rank's
//             block of the vocabulary (x copied into the region, or the sequence gathered), and
//             Gpt::nextTokenLoss takes vocabParallelCrossEntropy (3 small all-reduces).
//   Sequence  nn::LayerNorm -> SequenceParallelLayerNorm: whole parameters on this rank's block
//             of the sequence, their gradients summed over the group (one small all-reduce per
//             norm in backward). Only with sequenceParallel.
// With sequenceParallel the residual stream between the blocks is a block of T on each rank:
// the embeddings' sum is split after the embedding (no communication; backward all-gathers),
// and ln_f's output is gathered before the output layer (backward reduce-scatters).
//
// Contract:
//  * Collective: every rank of the group calls parallelize with the same plan on a model built
//    from the same seed. First, before any check or change, the ranks agree on what the plan
//    does to each module, on sequenceParallel and (with dropout) on the dropout stream's seed
//    and position (one allgather of a count and a hash; on a difference every rank throws one
//    InvalidArgument line naming the first differing module and the ranks on each side). The
//    weights are not compared (the layers keep their blocks of the whole weights, so different
//    weights go unnoticed).
//    The model then runs under tensor_parallel.h's contract: every rank runs the same steps.
//  * Validation before any change: a pattern that matches no module, a module matched twice
//    or inside another matched module, a style on a module of the wrong type, a size the
//    degree does not divide (the layer's message, prefixed by the module path), and, with
//    sequenceParallel, a module on the residual stream left out of the plan: InvalidArgument
//    in one line naming the module path, and the model is left as it was. A sequence length
//    the degree does not divide is refused by forward, naming T and t.
//  * Dropout (GptConfig::dropout > 0) draws as tensor_parallel.h's "dropout under tensor
//    parallelism" says: the heads' probabilities per rank, the replicated stream's masks the
//    single process's; with sequenceParallel, "drop" and each "h.<i>.mlp.dropout" become
//    SequenceParallelDropout (this rank's block of the single process's mask).
//  * Patterns: module paths as namedParameters() spells their prefixes ("h.0.mlp.c_fc");
//    "*" stands for exactly one name ("h.*.attn").
//  * Ownership: the model owns its new layers; each keeps the group alive. The old children
//    are dropped. Not thread-safe (as nn::Module).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "parallel/mesh.h"
#include "parallel/tensor_parallel.h"
#include "tensor/nn/gpt.h"

namespace dt {

enum class ParallelStyle { Column, Row, Heads, Vocab, Sequence };
const char* parallelStyleName(ParallelStyle style);  // "column", "row", "heads", "vocab", "sequence"

struct ParallelPlan {
  // (module path pattern, style), applied in this order.
  std::vector<std::pair<std::string, ParallelStyle>> styles;
  bool sequenceParallel = false;
};

struct GptPlanOptions {
  bool sequenceParallel = false;
};

// The plan for nn::Gpt: "wte" vocab, "h.*.attn" heads, "h.*.mlp.c_fc" column,
// "h.*.mlp.c_proj" row; with sequenceParallel also "h.*.ln_1", "h.*.ln_2" and "ln_f" sequence.
// wpe stays whole on every rank (it is small and added before the sequence is split).
ParallelPlan gptParallelPlan(GptPlanOptions options = {});

// Applies `plan` to `model` over the tensor-parallel group (see the contract). At degree 1 the
// layers are the plain ones' equivalents and communicate nothing.
void parallelize(nn::Gpt& model, const ProcessGroupPtr& tensorParallel, const ParallelPlan& plan);
// The same over mesh[dimension].
void parallelize(nn::Gpt& model, const DeviceMesh& mesh, const ParallelPlan& plan, const std::string& dimension = "tp");

// Moves every tensor-parallel layer of `model` (and a Gpt's tensor-parallel layout) onto
// `group`, which must give this process the same rank out of the same size as the group they
// were built on (an elastic job's next epoch, whose mesh keeps each rank's tp coordinate): the
// shards stay what they are and nothing is communicated. Returns how many it moved.
// InvalidArgument naming both groups when the rank or size differs (the model is then left on
// its old group when the layout caught it, which it does first for a parallelized Gpt).
int rebindTensorParallel(nn::Module& model, const ProcessGroupPtr& group);

// Where every parameter of `model` sits in the whole model, named as namedParameters() names
// them: the tensor-parallel layers' shards, and every other parameter replicated (dim -1).
std::vector<ParameterShard> parameterShardsOf(const nn::Module& model);

}  // namespace dt
