#include "parallel/tensor_parallel.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>

#include "common/check.h"
#include "common/strings.h"
#include "tensor/autograd/function.h"

namespace dt {
namespace {

// ---- counting -----------------------------------------------------------------------------------
// Counts live beside the groups, keyed by address; the weak pointer tells a group that died
// (its address may be reused by a new one, which must start from zero).
struct CountsEntry {
  std::weak_ptr<ProcessGroup> owner;
  TpCollectiveCounts counts;
};
std::mutex countsMutex;
std::map<const ProcessGroup*, CountsEntry> countsByGroup;

enum class Collective { AllReduce, AllGather, ReduceScatter };

void recordCollective(const ProcessGroupPtr& group, Collective kind, int64_t elements) {
  std::lock_guard<std::mutex> lock(countsMutex);
  auto it = countsByGroup.find(group.get());
  if (it == countsByGroup.end() || it->second.owner.lock() != group) {
    std::erase_if(countsByGroup, [](const auto& item) { return item.second.owner.expired(); });
    it = countsByGroup.insert_or_assign(group.get(), CountsEntry{group, {}}).first;
  }
  TpCollectiveCounts& counts = it->second.counts;
  switch (kind) {
    case Collective::AllReduce:
      ++counts.allReduces;
      counts.allReduceElements += elements;
      break;
    case Collective::AllGather:
      ++counts.allGathers;
      counts.allGatherElements += elements;
      break;
    case Collective::ReduceScatter:
      ++counts.reduceScatters;
      counts.reduceScatterElements += elements;
      break;
  }
  counts.elements += elements;
}

// ---- the collectives, synchronous and counted ---------------------------------------------------
void requireGroup(const ProcessGroupPtr& group, std::string_view op) {
  DT_REQUIRE(group != nullptr, op, ": the tensor-parallel group is null");
  DT_REQUIRE(group->isMember(), op, ": this process is not a member of tensor-parallel group ", group->name(),
             " (ranks ", formatRanges(group->parentRanks()), "); pass this rank's group, e.g. mesh[\"tp\"]");
}

std::string groupText(const ProcessGroup& group) {
  return str("rank ", group.rank(), "/", group.size(), " pg=", group.name());
}

}  // namespace

// A layer's shards are this rank's blocks of a degree-t split: only a group where it has the
// same rank out of the same size keeps them right.
static void requireSamePlace(const ProcessGroupPtr& from, const ProcessGroupPtr& to, std::string_view layer) {
  requireGroup(to, layer);
  DT_REQUIRE(to->size() == from->size() && to->rank() == from->rank(), layer, ": cannot move onto tensor-parallel group ",
             groupText(*to), " from ", groupText(*from),
             ": its shards are the blocks of rank ", from->rank(), " of ", from->size(),
             "; the new group must give this process the same rank out of the same size");
}

namespace {

// The size of x's dimension `dim` over the degree; InvalidArgument when the degree does not divide it.
int64_t blockOf(const Tensor& x, int64_t dim, const ProcessGroup& group, std::string_view op) {
  const int64_t whole = x.size(dim);
  DT_REQUIRE(whole % group.size() == 0, op, ": dim ", dim, " of ", x.describe(), " has size ", whole,
             ", which the tensor-parallel degree ", group.size(), " (", groupText(group), ") does not divide");
  return whole / group.size();
}

Tensor allReduced(const Tensor& x, const ProcessGroupPtr& group, ReduceOp op = ReduceOp::Sum) {
  if (group->size() == 1) return x;
  Tensor out = x.clone();
  group->allreduce(out, AllreduceOptions{.reduceOp = op})->wait();
  recordCollective(group, Collective::AllReduce, out.numel());
  return out;
}

// Rank r's block of x along dim (a copy, so that the result owns its memory).
Tensor splitAlong(const Tensor& x, int64_t dim, const ProcessGroupPtr& group) {
  if (group->size() == 1) return x;
  const int64_t block = x.size(dim) / group->size();
  return x.narrow(dim, group->rank() * block, block).clone();
}

// Every rank's x side by side along dim: gathered into [t, *x.shape] (blocks along dim 0, as the
// backends cut them), then the t axis moved in front of dim and merged with it.
Tensor gatherAlong(const Tensor& x, int64_t dim, const ProcessGroupPtr& group) {
  const int t = group->size();
  if (t == 1) return x;
  Shape bufferShape{t};
  bufferShape.insert(bufferShape.end(), x.sizes().begin(), x.sizes().end());
  Tensor buffer = empty(bufferShape, x.options());
  group->allgatherIntoTensor(buffer, x.contiguous())->wait();
  recordCollective(group, Collective::AllGather, buffer.numel());
  Shape order;
  for (int64_t d = 1; d <= dim; ++d) order.push_back(d);
  order.push_back(0);
  for (int64_t d = dim + 1; d <= x.dim(); ++d) order.push_back(d);
  Shape whole = x.sizes();
  whole[dim] *= t;
  return buffer.permute(order).reshape(whole);
}

// The sum over ranks of x, of which this rank keeps block r along dim: x viewed as
// [..., t, block, ...], the t axis moved to the front, reduce-scattered by blocks of dim 0.
Tensor reduceScatterAlong(const Tensor& x, int64_t dim, const ProcessGroupPtr& group) {
  const int64_t t = group->size();
  if (t == 1) return x;
  Shape split = x.sizes();
  const int64_t block = split[dim] / t;
  split[dim] = block;
  split.insert(split.begin() + dim, t);
  Shape order{dim};
  for (int64_t d = 0; d < static_cast<int64_t>(split.size()); ++d) {
    if (d != dim) order.push_back(d);
  }
  Tensor input = x.reshape(split).permute(order).contiguous();
  Shape outShape = x.sizes();
  outShape[dim] = block;
  Tensor out = empty(outShape, x.options());
  group->reduceScatterTensor(out, input)->wait();
  recordCollective(group, Collective::ReduceScatter, input.numel());
  return out;
}

using autograd::FunctionContext;

const ProcessGroupPtr& groupOf(const FunctionContext& ctx) { return ctx.get<ProcessGroupPtr>("group"); }
int64_t dimOf(const FunctionContext& ctx) { return ctx.get<int64_t>("dim"); }

struct CopyToRegion : autograd::Function<CopyToRegion> {
  static constexpr std::string_view name = "CopyToTensorParallelRegion";
  static Tensor forward(FunctionContext& ctx, const Tensor& x, const ProcessGroupPtr& group) {
    ctx.set("group", group);
    return x;
  }
  static Tensor backward(FunctionContext& ctx, const TensorList& grads) { return allReduced(grads[0], groupOf(ctx)); }
};

struct ReduceFromRegion : autograd::Function<ReduceFromRegion> {
  static constexpr std::string_view name = "ReduceFromTensorParallelRegion";
  static Tensor forward(FunctionContext&, const Tensor& x, const ProcessGroupPtr& group) {
    return allReduced(x, group);
  }
  static Tensor backward(FunctionContext&, const TensorList& grads) { return grads[0]; }
};

// A string usable as a template argument: each region function's autograd name.
template <size_t N>
struct FunctionName {
  constexpr FunctionName(const char (&text)[N]) { std::copy_n(text, N, chars); }
  constexpr std::string_view view() const { return {chars, N - 1}; }
  char chars[N];
};

// A region function along one dimension: forward and backward are each one of the helpers
// above, the group and the dimension kept for backward.
template <FunctionName Name, auto Forward, auto Backward>
struct RegionAlong : autograd::Function<RegionAlong<Name, Forward, Backward>> {
  static constexpr std::string_view name = Name.view();
  static Tensor forward(FunctionContext& ctx, const Tensor& x, const ProcessGroupPtr& group, int64_t dim) {
    ctx.set("group", group);
    ctx.set("dim", dim);
    return Forward(x, dim, group);
  }
  static Tensor backward(FunctionContext& ctx, const TensorList& grads) {
    return Backward(grads[0], dimOf(ctx), groupOf(ctx));
  }
};

// Forward keeps this rank's block along dim; backward gathers the blocks' gradients.
using SplitRegion = RegionAlong<"SplitToParallelRegion", splitAlong, gatherAlong>;
// Forward gathers the blocks along dim; backward keeps this rank's block of the gradient.
using GatherRegion = RegionAlong<"GatherFromParallelRegion", gatherAlong, splitAlong>;
// Sequence parallelism's pair. Entering a TP region from a sequence shard, every rank needs the
// whole sequence (all-gather), and the gradient there is a partial sum of the ranks' (their
// heads or columns each contribute), so backward sums and keeps this rank's block.
using GatherSequence = RegionAlong<"GatherFromSequenceParallelRegion", gatherAlong, reduceScatterAlong>;
// Leaving a TP region into a sequence shard: the partial sums are reduced and each rank keeps
// its block of the sequence; the gradient of a block is needed whole on every rank.
using ReduceScatterSequence = RegionAlong<"ReduceScatterToSequenceParallelRegion", reduceScatterAlong, gatherAlong>;

// The checked dimension for a region function: wrapped, and (for a split) divisible by the degree.
int64_t regionDim(const Tensor& x, int64_t dim, const ProcessGroupPtr& group, std::string_view op, bool splits) {
  requireGroup(group, op);
  DT_REQUIRE(x.defined() && x.dim() >= 1, op, ": needs a tensor of at least one dimension, got ",
             x.defined() ? x.describe() : std::string("an undefined tensor"));
  DT_REQUIRE(dim >= -x.dim() && dim < x.dim(), op, ": dim ", dim, " is out of range for ", x.describe());
  const int64_t wrapped = dim < 0 ? dim + x.dim() : dim;
  if (splits) blockOf(x, wrapped, *group, op);
  return wrapped;
}

// ---- vocab-parallel cross-entropy ----------------------------------------------------------------
struct VocabParallelCrossEntropyFunction : autograd::Function<VocabParallelCrossEntropyFunction> {
  static constexpr std::string_view name = "VocabParallelCrossEntropy";

  static Tensor forward(FunctionContext& ctx, const Tensor& localLogits, const Tensor& targets,
                        const ProcessGroupPtr& group, VocabParallelCrossEntropyOptions options) {
    const int64_t localVocab = localLogits.sizes().back();
    const int64_t rows = localLogits.numel() / localVocab;
    const int64_t vocabStart = group->rank() * localVocab;
    const int64_t vocab = localVocab * group->size();
    // From the targets (the same on every rank): which rows count, and the one-hot of each
    // target on this rank's block of the vocabulary (zero rows where the target is elsewhere).
    const std::vector<int64_t> target = targets.to(DType::Int64).toVector<int64_t>();
    std::vector<double> valid(static_cast<size_t>(rows), 0.0);
    std::vector<double> oneHot(static_cast<size_t>(rows * localVocab), 0.0);
    int64_t counted = 0;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t t = target[static_cast<size_t>(i)];
      if (t == options.ignoreIndex) continue;
      DT_REQUIRE(t >= 0 && t < vocab, "vocabParallelCrossEntropy: target ", t, " at flat index ", i,
                 " is outside the vocabulary [0, ", vocab, ") (", localVocab, " logits per rank x degree ",
                 group->size(), ", ", groupText(*group), ")");
      valid[static_cast<size_t>(i)] = 1.0;
      ++counted;
      if (t >= vocabStart && t < vocabStart + localVocab) {
        oneHot[static_cast<size_t>(i * localVocab + (t - vocabStart))] = 1.0;
      }
    }
    const TensorOptions like = localLogits.options();
    const Tensor validRows = fromVector(valid, {rows}, like);
    const Tensor targetMask = fromVector(oneHot, {rows, localVocab}, like);

    const Tensor logits = localLogits.reshape({rows, localVocab});
    const Tensor rowMax = allReduced(amax(logits, {1}), group, ReduceOp::Max);
    const Tensor shifted = logits - rowMax.unsqueeze(1);
    const Tensor expShifted = exp(shifted);
    const Tensor sumExp = allReduced(sum(expShifted, {1}), group);
    // Adding zeros is exact: each row's target logit comes from the one rank that holds it.
    const Tensor targetLogit = allReduced(sum(shifted * targetMask, {1}), group);
    const Tensor perRow = (log(sumExp) - targetLogit) * validRows;

    ctx.saveForBackward(expShifted / sumExp.unsqueeze(1), targetMask, validRows);
    ctx.set("shape", localLogits.sizes());
    ctx.set("reduction", options.reduction);
    ctx.set("counted", counted);
    switch (options.reduction) {
      case Reduction::None:
        return perRow.reshape(targets.sizes());
      case Reduction::Sum:
        return sum(perRow);
      case Reduction::Mean:
        break;
    }
    return sum(perRow) / static_cast<double>(counted);
  }

  static TensorList backward(FunctionContext& ctx, const TensorList& grads) {
    const TensorList saved = ctx.savedTensors();
    const Tensor& softmax = saved[0];
    const Tensor& targetMask = saved[1];
    const Tensor& validRows = saved[2];
    Tensor rowScale;
    switch (ctx.get<Reduction>("reduction")) {
      case Reduction::None:
        rowScale = grads[0].reshape({-1}) * validRows;
        break;
      case Reduction::Sum:
        rowScale = validRows * grads[0];
        break;
      case Reduction::Mean:
        rowScale = validRows * grads[0] / static_cast<double>(ctx.get<int64_t>("counted"));
        break;
    }
    const Tensor gradLogits = (softmax - targetMask) * rowScale.unsqueeze(1);
    return {gradLogits.reshape(ctx.get<Shape>("shape")), Tensor()};
  }
};

}  // namespace

TpCollectiveCounts operator-(const TpCollectiveCounts& a, const TpCollectiveCounts& b) {
  return {a.allReduces - b.allReduces,
          a.allGathers - b.allGathers,
          a.reduceScatters - b.reduceScatters,
          a.elements - b.elements,
          a.allReduceElements - b.allReduceElements,
          a.allGatherElements - b.allGatherElements,
          a.reduceScatterElements - b.reduceScatterElements};
}

double TpCollectiveCounts::ringElementsPerRank(int degree) const {
  const double share = static_cast<double>(degree - 1) / degree;
  return share * (2.0 * static_cast<double>(allReduceElements) +
                  static_cast<double>(allGatherElements + reduceScatterElements));
}

TpCollectiveCounts tpCollectiveCounts(const ProcessGroup& group) {
  std::lock_guard<std::mutex> lock(countsMutex);
  const auto it = countsByGroup.find(&group);
  if (it == countsByGroup.end() || it->second.owner.lock().get() != &group) return {};
  return it->second.counts;
}

// ---- region functions ---------------------------------------------------------------------------
Tensor copyToTensorParallelRegion(const Tensor& x, const ProcessGroupPtr& group) {
  requireGroup(group, "copyToTensorParallelRegion");
  return CopyToRegion::apply(x, group);
}

Tensor reduceFromTensorParallelRegion(const Tensor& x, const ProcessGroupPtr& group) {
  requireGroup(group, "reduceFromTensorParallelRegion");
  return ReduceFromRegion::apply(x, group);
}

Tensor scatterToTensorParallelRegion(const Tensor& x, const ProcessGroupPtr& group) {
  return SplitRegion::apply(x, group, regionDim(x, -1, group, "scatterToTensorParallelRegion", true));
}

Tensor gatherFromTensorParallelRegion(const Tensor& x, const ProcessGroupPtr& group) {
  return GatherRegion::apply(x, group, regionDim(x, -1, group, "gatherFromTensorParallelRegion", false));
}

Tensor scatterToSequenceParallelRegion(const Tensor& x, const ProcessGroupPtr& group, int64_t seqDim) {
  return SplitRegion::apply(x, group, regionDim(x, seqDim, group, "scatterToSequenceParallelRegion", true));
}

Tensor gatherFromSequenceParallelRegion(const Tensor& x, const ProcessGroupPtr& group, int64_t seqDim) {
  return GatherSequence::apply(x, group, regionDim(x, seqDim, group, "gatherFromSequenceParallelRegion", false));
}

Tensor reduceScatterToSequenceParallelRegion(const Tensor& x, const ProcessGroupPtr& group, int64_t seqDim) {
  return ReduceScatterSequence::apply(
      x, group, regionDim(x, seqDim, group, "reduceScatterToSequenceParallelRegion", true));
}

// ---- layers -------------------------------------------------------------------------------------
void TensorParallelModule::rebindGroup(ProcessGroupPtr group) {
  requireSamePlace(group_, group, typeName());
  group_ = std::move(group);
}

void ParallelSelfAttention::rebindGroup(ProcessGroupPtr group) {
  requireSamePlace(group_, group, typeName());
  group_ = std::move(group);
}

void SequenceParallelDropout::rebindGroup(ProcessGroupPtr group) {
  requireSamePlace(group_, group, typeName());
  group_ = std::move(group);
}

TensorParallelModule::TensorParallelModule(ProcessGroupPtr group) : group_(std::move(group)) {
  requireGroup(group_, "TensorParallelModule");
}

Tensor TensorParallelModule::shardOf(const Tensor& whole, int64_t dim, const char* module, const char* what,
                                     int64_t parts) const {
  const int64_t size = whole.size(dim);
  const int degree = group_->size();
  DT_REQUIRE(size % (parts * degree) == 0, module, ": ", size, " ", what,
             parts > 1 ? str(" (", parts, " parts)") : std::string(), " do not split over the tensor-parallel degree ",
             degree, " (", groupText(*group_), "); choose a size that ", parts * degree, " divides");
  const int64_t part = size / parts;
  const int64_t block = part / degree;
  NoGradGuard noGrad;
  std::vector<Tensor> blocks;
  for (int64_t p = 0; p < parts; ++p) blocks.push_back(whole.detach().narrow(dim, p * part + group_->rank() * block, block));
  return blocks.size() == 1 ? blocks[0].clone() : cat(blocks, dim);
}

namespace {

void requireLinear(const Tensor& weight, const Tensor& bias, const char* module) {
  DT_REQUIRE(weight.defined() && weight.dim() == 2, module, ": the whole weight must be [out, in], got ",
             weight.defined() ? weight.describe() : std::string("an undefined tensor"));
  DT_REQUIRE(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), module, ": the bias ",
             bias.defined() ? bias.describe() : std::string(), " does not fit the weight ", weight.describe(),
             " (want [", weight.size(0), "])");
}

void requireFeatures(const Tensor& x, int64_t features, const char* module, const char* what) {
  DT_REQUIRE(x.defined() && x.dim() >= 1 && x.sizes().back() == features, module, ": input ",
             x.defined() ? x.describe() : std::string("(undefined)"), " must end in ", features, " ", what);
}

}  // namespace

ColumnParallelLinear::ColumnParallelLinear(const Tensor& fullWeight, const Tensor& fullBias, ProcessGroupPtr group,
                                           ColumnParallelOptions options)
    : TensorParallelModule(std::move(group)), options_(options) {
  requireLinear(fullWeight, fullBias, "ColumnParallelLinear");
  outFeatures_ = fullWeight.size(0);
  inFeatures_ = fullWeight.size(1);
  DT_REQUIRE(options_.parts >= 1, "ColumnParallelLinear: parts must be at least 1, got ", options_.parts);
  weight = registerParameter("weight", shardOf(fullWeight, 0, "ColumnParallelLinear", "output features", options_.parts));
  if (fullBias.defined()) {
    bias = registerParameter("bias", shardOf(fullBias, 0, "ColumnParallelLinear", "output features", options_.parts));
  }
}

ColumnParallelLinear::ColumnParallelLinear(const nn::Linear& full, ProcessGroupPtr group, ColumnParallelOptions options)
    : ColumnParallelLinear(full.weight, full.bias, std::move(group), options) {}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  requireFeatures(x, inFeatures_, "ColumnParallelLinear", "input features");
  const Tensor input = options_.sequenceParallel ? gatherFromSequenceParallelRegion(x, group_)
                                                 : copyToTensorParallelRegion(x, group_);
  const Tensor local = linear(input, weight, bias);
  return options_.gatherOutput ? gatherFromTensorParallelRegion(local, group_) : local;
}

std::vector<ParameterShard> ColumnParallelLinear::parameterShards() const {
  // From the layer's own sizes, not the weight tensor's: a sharded wrapper around the layer
  // resizes that tensor to its rows of it between uses.
  const int64_t offset = group_->rank() * (outFeatures_ / options_.parts / group_->size());
  std::vector<ParameterShard> shards{{"weight", {outFeatures_, inFeatures_}, 0, offset, options_.parts}};
  if (bias.defined()) shards.push_back({"bias", {outFeatures_}, 0, offset, options_.parts});
  return shards;
}

RowParallelLinear::RowParallelLinear(const Tensor& fullWeight, const Tensor& fullBias, ProcessGroupPtr group,
                                     RowParallelOptions options)
    : TensorParallelModule(std::move(group)), options_(options) {
  requireLinear(fullWeight, fullBias, "RowParallelLinear");
  outFeatures_ = fullWeight.size(0);
  inFeatures_ = fullWeight.size(1);
  weight = registerParameter("weight", shardOf(fullWeight, 1, "RowParallelLinear", "input features"));
  if (fullBias.defined()) {
    NoGradGuard noGrad;
    bias = registerParameter("bias", fullBias.detach().clone());
  }
}

RowParallelLinear::RowParallelLinear(const nn::Linear& full, ProcessGroupPtr group, RowParallelOptions options)
    : RowParallelLinear(full.weight, full.bias, std::move(group), options) {}

Tensor RowParallelLinear::forward(const Tensor& x) {
  Tensor input = x;
  if (options_.inputIsParallel) {
    requireFeatures(x, weight.size(1), "RowParallelLinear", "input features (this rank's block)");
  } else {
    requireFeatures(x, inFeatures_, "RowParallelLinear", "input features");
    input = scatterToTensorParallelRegion(x, group_);
  }
  // The partial products are summed first and the bias added once: added before the
  // all-reduce it would count t times.
  const Tensor partial = linear(input, weight);
  if (!options_.sequenceParallel) {
    const Tensor summed = reduceFromTensorParallelRegion(partial, group_);
    return bias.defined() ? summed + bias : summed;
  }
  const Tensor block = reduceScatterToSequenceParallelRegion(partial, group_);
  // On a block of the sequence the bias's gradient covers this rank's rows only.
  return bias.defined() ? block + sumGradientsOverGroup({bias}, group_)[0] : block;
}

std::vector<ParameterShard> RowParallelLinear::parameterShards() const {
  std::vector<ParameterShard> shards{{"weight", {outFeatures_, inFeatures_}, 1, group_->rank() * weight.size(1)}};
  if (bias.defined()) shards.push_back({"bias", {outFeatures_}, -1, 0});
  return shards;
}

VocabParallelEmbedding::VocabParallelEmbedding(const Tensor& fullWeight, ProcessGroupPtr group)
    : TensorParallelModule(std::move(group)) {
  DT_REQUIRE(fullWeight.defined() && fullWeight.dim() == 2,
             "VocabParallelEmbedding: the whole table must be [vocabulary, dim], got ",
             fullWeight.defined() ? fullWeight.describe() : std::string("an undefined tensor"));
  vocabSize_ = fullWeight.size(0);
  weight = registerParameter("weight", shardOf(fullWeight, 0, "VocabParallelEmbedding", "vocabulary rows"));
  vocabStart_ = group_->rank() * weight.size(0);
}

VocabParallelEmbedding::VocabParallelEmbedding(const nn::Embedding& full, ProcessGroupPtr group)
    : VocabParallelEmbedding(full.weight, std::move(group)) {}

Tensor VocabParallelEmbedding::forward(const Tensor& tokens) {
  DT_REQUIRE(tokens.defined() && (tokens.dtype() == DType::Int64 || tokens.dtype() == DType::Int32),
             "VocabParallelEmbedding: tokens must be int32 or int64, got ",
             tokens.defined() ? tokens.describe() : std::string("an undefined tensor"));
  const std::vector<int64_t> ids = tokens.to(DType::Int64).toVector<int64_t>();
  const int64_t rows = weight.size(0);
  std::vector<int64_t> local(ids.size(), 0);
  std::vector<double> here(ids.size(), 0.0);
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t token = ids[i];
    DT_REQUIRE(token >= 0 && token < vocabSize_, "VocabParallelEmbedding: token ", token, " at flat index ", i,
               " is outside the vocabulary [0, ", vocabSize_, ")");
    if (token < vocabStart_ || token >= vocabStart_ + rows) continue;
    local[i] = token - vocabStart_;
    here[i] = 1.0;
  }
  // Tokens of other ranks look up row 0 and are zeroed by the mask (so their gradient is too).
  const Tensor lookedUp = embedding(weight, fromVector(local, tokens.sizes()));
  const Tensor mask = fromVector(here, tokens.sizes(), weight.options()).unsqueeze(-1);
  return reduceFromTensorParallelRegion(lookedUp * mask, group_);
}

std::vector<ParameterShard> VocabParallelEmbedding::parameterShards() const {
  return {{"weight", {vocabSize_, weight.size(1)}, 0, vocabStart_}};
}

ParallelSelfAttention::ParallelSelfAttention(const Tensor& qkvWeight, const Tensor& qkvBias, const Tensor& projWeight,
                                             const Tensor& projBias, int64_t heads, ProcessGroupPtr group,
                                             ParallelAttentionOptions options) {
  requireGroup(group, "ParallelSelfAttention");
  DT_REQUIRE(heads >= 1 && heads % group->size() == 0, "ParallelSelfAttention: ", heads,
             " heads do not split over the tensor-parallel degree ", group->size(), " (", groupText(*group),
             "); choose a head count that ", group->size(), " divides");
  DT_REQUIRE(qkvWeight.defined() && qkvWeight.dim() == 2 && qkvWeight.size(0) == 3 * qkvWeight.size(1),
             "ParallelSelfAttention: the fused projection must be [3C, C], got ",
             qkvWeight.defined() ? qkvWeight.describe() : std::string("an undefined tensor"));
  DT_REQUIRE(options.dropout == 0.0 || options.dropoutGenerator != nullptr, "ParallelSelfAttention: dropout ",
             options.dropout, " needs ParallelAttentionOptions::dropoutGenerator (the replicated stream, e.g. "
             "the model's dropout generator)");
  heads_ = heads;
  localHeads_ = heads / group->size();
  group_ = group;
  options_ = options;
  c_attn = registerModule(
      "c_attn", std::make_shared<ColumnParallelLinear>(
                    qkvWeight, qkvBias, group,
                    ColumnParallelOptions{.sequenceParallel = options.sequenceParallel, .parts = 3}));
  c_proj = registerModule("c_proj", std::make_shared<RowParallelLinear>(
                                        projWeight, projBias, std::move(group),
                                        RowParallelOptions{.sequenceParallel = options.sequenceParallel}));
}

ParallelSelfAttention::ParallelSelfAttention(const nn::CausalSelfAttention& full, int64_t heads, ProcessGroupPtr group,
                                             ParallelAttentionOptions options)
    : ParallelSelfAttention(full.c_attn->weight, full.c_attn->bias, full.c_proj->weight, full.c_proj->bias, heads,
                            std::move(group),
                            ParallelAttentionOptions{.sequenceParallel = options.sequenceParallel,
                                                     .dropout = full.dropoutProbability(),
                                                     .dropoutGenerator = &full.dropoutGenerator()}) {}

Tensor ParallelSelfAttention::forward(const Tensor& x) {
  // c_attn gathers a sequence block whole (sequence-parallel) and c_proj scatters it back.
  const Tensor qkv = (*c_attn)(x);
  const AttentionOptions attention{.causal = true, .dropoutP = options_.dropout, .training = isTraining()};
  if (!isTraining() || options_.dropout == 0.0) return (*c_proj)(selfAttention(qkv, localHeads_, attention));
  Generator& replicated = *options_.dropoutGenerator;
  // This rank's heads are a sharded region: their own stream; the replicated stream then moves
  // past the whole layer's draws there (one per visible score: T (T + 1) / 2 per head and row).
  Generator shardStream = shardDropoutStream(replicated, *group_);
  const Tensor attended = selfAttention(qkv, localHeads_, attention, shardStream);
  const int64_t rows = qkv.size(0), len = qkv.size(1);
  skipDraws(replicated, rows * heads_ * len * (len + 1) / 2);
  const Tensor out = (*c_proj)(attended);
  return options_.sequenceParallel ? sequenceBlockDropout(out, options_.dropout, true, replicated, *group_)
                                   : dropout(out, options_.dropout, true, replicated);
}

Generator shardDropoutStream(const Generator& replicated, const ProcessGroup& group) {
  const GeneratorState at = replicated.state();
  // Distinct odd multipliers keep (position, rank) pairs apart; Generator hashes the seed again.
  return Generator(at.seed ^ (at.counter * 0x9e3779b97f4a7c15ull) ^
                   (static_cast<uint64_t>(group.rank() + 1) * 0xd1b54a32d192ed03ull));
}

void skipDraws(Generator& generator, int64_t draws) {
  DT_REQUIRE(draws >= 0, "skipDraws: cannot move a generator back by ", -draws, " draws");
  GeneratorState state = generator.state();
  state.counter += static_cast<uint64_t>(draws);
  generator.setState(state);
}

Tensor sequenceBlockDropout(const Tensor& x, double p, bool training, Generator& generator, const ProcessGroup& group,
                            int64_t seqDim) {
  // Nothing drawn, or nothing random (p = 1), or a bad p: dropout()'s own answer or message.
  if (!training || p <= 0.0 || p >= 1.0) return dropout(x, p, training, generator);
  DT_REQUIRE(x.defined() && seqDim >= 0 && seqDim < x.dim(), "sequenceBlockDropout: sequence dim ", seqDim,
             " is outside ", x.defined() ? x.describe() : std::string("an undefined tensor"), " (rank ", group.rank(),
             " of ", groupText(group), ")");
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < seqDim; ++d) outer *= x.size(d);
  for (int64_t d = seqDim + 1; d < x.dim(); ++d) inner *= x.size(d);
  const int64_t run = x.size(seqDim) * inner;  // this rank's elements per outer index
  const int64_t wholeRun = run * group.size();
  const GeneratorState start = generator.state();
  Tensor mask = empty(x.sizes(), x.dtype(), x.device());
  {
    NoGradGuard noGrad;
    // The same arithmetic as dropout(), so each kept element is scaled bitwise alike.
    Tensor drawn = empty(x.sizes(), DType::Float32);
    float* out = drawn.data<float>();
    const float scale = static_cast<float>(1.0 / (1.0 - p));
    for (int64_t o = 0; o < outer; ++o) {
      GeneratorState at = start;
      at.counter += static_cast<uint64_t>(o * wholeRun + group.rank() * run);
      generator.setState(at);
      for (int64_t k = 0; k < run; ++k) out[o * run + k] = generator.nextDouble() >= p ? scale : 0.0f;
    }
    mask.copy_(drawn);
  }
  GeneratorState end = start;
  end.counter += static_cast<uint64_t>(outer * wholeRun);
  generator.setState(end);
  return mul(x, mask);
}

SequenceParallelDropout::SequenceParallelDropout(double p, Generator& generator, ProcessGroupPtr group)
    : p_(p), generator_(&generator), group_(std::move(group)) {
  requireGroup(group_, "SequenceParallelDropout");
}

Tensor SequenceParallelDropout::forward(const Tensor& x) {
  return sequenceBlockDropout(x, p_, isTraining(), *generator_, *group_);
}

std::vector<Tensor> sumGradientsOverGroup(const std::vector<Tensor>& tensors, const ProcessGroupPtr& group) {
  requireGroup(group, "sumGradientsOverGroup");
  if (tensors.empty() || group->size() == 1) return tensors;
  // Packed into one vector so that one all-reduce sums them all: cat's backward hands each
  // tensor its slice of the summed gradient.
  std::vector<Tensor> flat;
  for (const Tensor& t : tensors) flat.push_back(t.reshape({-1}));
  const Tensor summed = copyToTensorParallelRegion(cat(flat, 0), group);
  std::vector<Tensor> out;
  int64_t offset = 0;
  for (const Tensor& t : tensors) {
    out.push_back(summed.narrow(0, offset, t.numel()).reshape(t.sizes()));
    offset += t.numel();
  }
  return out;
}

SequenceParallelLayerNorm::SequenceParallelLayerNorm(const nn::LayerNorm& full, ProcessGroupPtr group)
    : TensorParallelModule(std::move(group)), shape_(full.normalizedShape()), eps_(full.eps()) {
  NoGradGuard noGrad;
  if (full.weight.defined()) weight = registerParameter("weight", full.weight.detach().clone());
  if (full.bias.defined()) bias = registerParameter("bias", full.bias.detach().clone());
}

Tensor SequenceParallelLayerNorm::forward(const Tensor& x) {
  std::vector<Tensor> affine;
  for (const Tensor& p : {weight, bias}) {
    if (p.defined()) affine.push_back(p);
  }
  affine = sumGradientsOverGroup(affine, group_);
  const Tensor w = weight.defined() ? affine.front() : Tensor();
  const Tensor b = bias.defined() ? affine.back() : Tensor();
  return layerNorm(x, shape_, w, b, eps_);
}

std::vector<ParameterShard> SequenceParallelLayerNorm::parameterShards() const {
  std::vector<ParameterShard> shards;
  if (weight.defined()) shards.push_back({"weight", weight.sizes(), -1, 0});
  if (bias.defined()) shards.push_back({"bias", bias.sizes(), -1, 0});
  return shards;
}

Tensor vocabParallelCrossEntropy(const Tensor& localLogits, const Tensor& targets, const ProcessGroupPtr& group,
                                 const VocabParallelCrossEntropyOptions& options) {
  requireGroup(group, "vocabParallelCrossEntropy");
  DT_REQUIRE(localLogits.defined() && localLogits.dim() >= 1 &&
                 (localLogits.dtype() == DType::Float32 || localLogits.dtype() == DType::Float64),
             "vocabParallelCrossEntropy: logits must be float32 or float64 [*, vocabulary / t], got ",
             localLogits.defined() ? localLogits.describe() : std::string("an undefined tensor"));
  DT_REQUIRE(targets.defined() && (targets.dtype() == DType::Int64 || targets.dtype() == DType::Int32),
             "vocabParallelCrossEntropy: targets must be int32 or int64, got ",
             targets.defined() ? targets.describe() : std::string("an undefined tensor"));
  Shape rowShape = localLogits.sizes();
  rowShape.pop_back();
  DT_REQUIRE(targets.sizes() == rowShape, "vocabParallelCrossEntropy: targets ", targets.describe(),
             " must have the logits' shape without the last dim ", describeShape(rowShape), " (logits ",
             localLogits.describe(), ")");
  return VocabParallelCrossEntropyFunction::apply(localLogits, targets, group, options);
}

}  // namespace dt
