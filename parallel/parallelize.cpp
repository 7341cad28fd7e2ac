#include "parallel/parallelize.h"

#include <algorithm>
#include <map>
#include <memory>

#include "checkpoint/exchange.h"
#include "common/check.h"
#include "common/errors.h"
#include "common/strings.h"

namespace dt {
namespace {

// ---- the layout of a tensor-parallel Gpt's activations --------------------------------------------
class TensorParallelGptLayout : public nn::GptLayout {
 public:
  TensorParallelGptLayout(ProcessGroupPtr group, bool sequenceParallel, bool vocabParallel)
      : group_(std::move(group)), sequenceParallel_(sequenceParallel), vocabParallel_(vocabParallel) {}

  Tensor enterBlocks(const Tensor& embedded) override {
    if (!sequenceParallel_) return embedded;
    const int64_t tokens = embedded.size(1);
    DT_REQUIRE(tokens % group_->size() == 0, "Gpt (", describe(), "): T = ", tokens,
               " tokens per row do not split over the tensor-parallel degree t = ", group_->size(),
               "; use a sequence length that ", group_->size(), " divides");
    // Splitting a replicated tensor needs no communication; backward all-gathers the blocks'
    // gradients, so wpe and the embedding lookup see the whole gradient on every rank.
    return scatterToSequenceParallelRegion(embedded, group_, 1);
  }

  Tensor enterHead(const Tensor& normalized) override {
    if (!vocabParallel_) return normalized;
    // The head's input gradient is a partial sum (each rank's vocabulary block contributes):
    // the copy's backward all-reduces it, the sequence gather's reduce-scatters it to the block.
    return sequenceParallel_ ? gatherFromSequenceParallelRegion(normalized, group_, 1)
                             : copyToTensorParallelRegion(normalized, group_);
  }

  Tensor loss(const Tensor& logits, const Tensor& targets) override {
    if (!vocabParallel_) return nn::Gpt::loss(logits, targets);
    const bool fits = logits.dim() == 3 && targets.sizes() == Shape{logits.size(0), logits.size(1)};
    DT_REQUIRE(fits,
               "Gpt::nextTokenLoss (", describe(), "): logits ", logits.describe(), " and targets ",
               targets.describe(), " do not match (expected [B, T, V / t] and [B, T])");
    return vocabParallelCrossEntropy(logits, targets, group_);
  }

  int64_t windowLength(int64_t length) const override {
    if (!sequenceParallel_) return length;
    const int64_t t = group_->size();
    return (length + t - 1) / t * t;  // <= contextLength, which t divides (enterBlocks checks)
  }

  Tensor wholeVocabulary(const Tensor& row) override {
    if (!vocabParallel_) return row;
    // Rank r holds the vocabulary's block r: the ranks' rows in rank order are the whole one.
    std::vector<Tensor> blocks;
    for (int r = 0; r < group_->size(); ++r) blocks.push_back(emptyLike(row));
    group_->allgather(blocks, row.contiguous())->wait();
    return cat(blocks, 0);
  }

  const ProcessGroupPtr& group() const { return group_; }
  void rebindGroup(ProcessGroupPtr group) { group_ = std::move(group); }

  std::string describe() const override {
    return str("tensor-parallel over pg=", group_->name(), ", degree ", group_->size(),
               sequenceParallel_ ? ", sequence-parallel" : "", vocabParallel_ ? ", vocab-parallel output" : "");
  }

 private:
  ProcessGroupPtr group_;
  bool sequenceParallel_;
  bool vocabParallel_;
};

// ---- finding modules by path ------------------------------------------------------------------------
struct Site {
  std::string path;
  nn::Module* parent = nullptr;  // null for the root
  std::string name;              // in the parent
  std::shared_ptr<nn::Module> module;
};

void collectSites(nn::Module& parent, const std::string& prefix, std::vector<Site>& out) {
  for (const auto& [name, child] : parent.namedChildren()) {
    const std::string path = prefix.empty() ? name : prefix + "." + name;
    out.push_back({path, &parent, name, child});
    collectSites(*child, path, out);
  }
}

bool pathMatches(const std::string& pattern, const std::string& path) {
  const std::vector<std::string> want = split(pattern, '.'), have = split(path, '.');
  if (want.size() != have.size()) return false;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] != "*" && want[i] != have[i]) return false;
  }
  return true;
}

// A few of the model's module paths, for the message of a pattern that matches none.
std::string examplePaths(const std::vector<Site>& sites) {
  std::vector<std::string> paths;
  for (const Site& site : sites) {
    if (paths.size() == 12) {
      paths.push_back("...");
      break;
    }
    paths.push_back(site.path);
  }
  return join(paths, ", ");
}

bool inside(const std::string& path, const std::string& ancestor) {
  return path.size() > ancestor.size() && path.starts_with(ancestor) && path[ancestor.size()] == '.';
}

// ---- building each style's layer --------------------------------------------------------------------
struct Assignment {
  const Site* site;
  ParallelStyle style;
  std::shared_ptr<nn::Module> replacement;
};

template <typename Full>
const Full& requireType(const Site& site, ParallelStyle style, const char* wanted) {
  const auto* full = dynamic_cast<const Full*>(site.module.get());
  DT_REQUIRE(full != nullptr, "parallelize: ", site.path, " is a ", site.module->typeName(), "; style ",
             parallelStyleName(style), " applies to a ", wanted);
  return *full;
}

std::shared_ptr<nn::Module> buildLayer(const Site& site, ParallelStyle style, const ProcessGroupPtr& group,
                                       bool sequenceParallel) {
  try {
    switch (style) {
      case ParallelStyle::Column:
        return std::make_shared<ColumnParallelLinear>(requireType<nn::Linear>(site, style, "Linear"), group,
                                                      ColumnParallelOptions{.sequenceParallel = sequenceParallel});
      case ParallelStyle::Row:
        return std::make_shared<RowParallelLinear>(requireType<nn::Linear>(site, style, "Linear"), group,
                                                   RowParallelOptions{.sequenceParallel = sequenceParallel});
      case ParallelStyle::Heads: {
        const auto& full = requireType<nn::CausalSelfAttention>(site, style, "CausalSelfAttention");
        return std::make_shared<ParallelSelfAttention>(full, full.heads(), group,
                                                       ParallelAttentionOptions{.sequenceParallel = sequenceParallel});
      }
      case ParallelStyle::Vocab:
        return std::make_shared<VocabParallelEmbedding>(requireType<nn::Embedding>(site, style, "Embedding"), group);
      case ParallelStyle::Sequence:
        DT_REQUIRE(sequenceParallel, "parallelize: ", site.path,
                   " has style sequence but the plan's sequenceParallel is off; turn it on or leave the norm whole");
        return std::make_shared<SequenceParallelLayerNorm>(requireType<nn::LayerNorm>(site, style, "LayerNorm"), group);
    }
  } catch (const InvalidArgument& error) {
    const std::string message = error.what();
    if (message.starts_with("parallelize: ")) throw;
    // The layer names the size and the degree; the path says which of the model's layers it is.
    throw InvalidArgument(str("parallelize: ", site.path, " (", parallelStyleName(style), "): ", message));
  }
  throw InvalidArgument(str("parallelize: ", site.path, ": unknown style ", static_cast<int>(style)));
}

const Assignment* assignmentAt(const std::vector<Assignment>& assignments, const std::string& path) {
  for (const Assignment& a : assignments) {
    if (a.site->path == path) return &a;
  }
  return nullptr;
}

// The checks that need the whole plan: split layers that must come in pairs, and with sequence
// parallelism every module on the residual stream.
void checkGptPlan(const nn::Gpt& model, const std::vector<Assignment>& assignments, bool sequenceParallel) {
  for (const Assignment& a : assignments) {
    const bool linear = a.style == ParallelStyle::Column || a.style == ParallelStyle::Row;
    DT_REQUIRE(!linear || dynamic_cast<const nn::CausalSelfAttention*>(a.site->parent) == nullptr,
               "parallelize: ", a.site->path, " is a projection inside an attention, whose columns are not its "
               "heads; split the attention itself by head (\"h.*.attn\" -> heads)");
    if (dynamic_cast<const nn::Mlp*>(a.site->parent) == nullptr || !linear) continue;
    // A column-split c_fc hands c_proj a block of the hidden features: only a row-split c_proj takes it.
    const std::string mlp = a.site->path.substr(0, a.site->path.rfind('.'));
    const Assignment* fc = assignmentAt(assignments, mlp + ".c_fc");
    const Assignment* proj = assignmentAt(assignments, mlp + ".c_proj");
    DT_REQUIRE(fc != nullptr && fc->style == ParallelStyle::Column && proj != nullptr &&
                   proj->style == ParallelStyle::Row,
               "parallelize: ", mlp, " needs c_fc column and c_proj row together (the hidden features stay split "
               "between them); the plan gives c_fc ", fc ? parallelStyleName(fc->style) : "nothing", " and c_proj ",
               proj ? parallelStyleName(proj->style) : "nothing");
  }
  if (!sequenceParallel) return;
  // On a sequence shard every module that touches the residual stream must expect one.
  std::vector<std::pair<std::string, ParallelStyle>> needed{{"wte", ParallelStyle::Vocab}};
  for (int64_t i = 0; i < model.config().layers; ++i) {
    const std::string block = str("h.", i, ".");
    needed.insert(needed.end(), {{block + "ln_1", ParallelStyle::Sequence},
                                 {block + "attn", ParallelStyle::Heads},
                                 {block + "ln_2", ParallelStyle::Sequence},
                                 {block + "mlp.c_fc", ParallelStyle::Column},
                                 {block + "mlp.c_proj", ParallelStyle::Row}});
  }
  needed.emplace_back("ln_f", ParallelStyle::Sequence);
  for (const auto& [path, style] : needed) {
    const Assignment* a = assignmentAt(assignments, path);
    DT_REQUIRE(a != nullptr && a->style == style, "parallelize: with sequenceParallel the residual stream is a block "
               "of the sequence on each rank, so ", path, " must be split too (style ", parallelStyleName(style),
               "; the plan gives ", a ? parallelStyleName(a->style) : "nothing", "); start from gptParallelPlan()");
  }
}

// What this rank's plan does to each module of the model (every module, so one left out on one
// rank shows too), whether it is sequence-parallel, and where the dropout stream stands: the
// lines every rank of the group must agree on before any layer is built.
std::vector<std::string> planLines(const nn::Gpt& model, const std::vector<Site>& sites, const ParallelPlan& plan) {
  std::vector<std::string> lines;
  for (const Site& site : sites) {
    std::string styles;
    for (const auto& [pattern, style] : plan.styles) {
      if (pathMatches(pattern, site.path)) styles += str(styles.empty() ? "" : "+", parallelStyleName(style));
    }
    lines.push_back(str(site.path, " -> ", styles.empty() ? "whole" : styles));
  }
  lines.push_back(str("sequenceParallel ", plan.sequenceParallel ? "on" : "off"));
  if (model.config().dropout > 0) {
    // Replicated regions draw from this stream: it must stand at one place on every rank.
    const GeneratorState stream = model.dropoutGenerator().state();
    lines.push_back(str("dropout ", model.config().dropout, " stream seed ", stream.seed, " position ", stream.counter));
  }
  return lines;
}

void collectShards(const nn::Module& module, const std::string& prefix, std::vector<ParameterShard>& out) {
  if (const auto* parallel = dynamic_cast<const TensorParallelModule*>(&module)) {
    for (ParameterShard shard : parallel->parameterShards()) {
      shard.name = prefix + shard.name;
      out.push_back(std::move(shard));
    }
  } else {
    for (const auto& [name, parameter] : module.namedParameters(false)) {
      out.push_back({prefix + name, parameter.sizes(), -1, 0});
    }
  }
  for (const auto& [name, child] : module.namedChildren()) collectShards(*child, prefix + name + ".", out);
}

}  // namespace

const char* parallelStyleName(ParallelStyle style) {
  switch (style) {
    case ParallelStyle::Column:
      return "column";
    case ParallelStyle::Row:
      return "row";
    case ParallelStyle::Heads:
      return "heads";
    case ParallelStyle::Vocab:
      return "vocab";
    case ParallelStyle::Sequence:
      return "sequence";
  }
  return "unknown";
}

ParallelPlan gptParallelPlan(GptPlanOptions options) {
  ParallelPlan plan{.styles = {{"wte", ParallelStyle::Vocab},
                               {"h.*.attn", ParallelStyle::Heads},
                               {"h.*.mlp.c_fc", ParallelStyle::Column},
                               {"h.*.mlp.c_proj", ParallelStyle::Row}},
                    .sequenceParallel = options.sequenceParallel};
  if (options.sequenceParallel) {
    plan.styles.insert(plan.styles.end(), {{"h.*.ln_1", ParallelStyle::Sequence},
                                           {"h.*.ln_2", ParallelStyle::Sequence},
                                           {"ln_f", ParallelStyle::Sequence}});
  }
  return plan;
}

void parallelize(nn::Gpt& model, const ProcessGroupPtr& tensorParallel, const ParallelPlan& plan) {
  DT_REQUIRE(tensorParallel != nullptr && tensorParallel->isMember(),
             "parallelize: pass this rank's tensor-parallel group (e.g. mesh[\"tp\"]); got ",
             tensorParallel ? str("group ", tensorParallel->name(), ", of which this process is not a member")
                            : std::string("a null group"));
  DT_REQUIRE(model.layout() == nullptr, "parallelize: the model is already laid out (", model.layout()->describe(),
             "); parallelize a plain model once");

  std::vector<Site> sites;
  collectSites(model, "", sites);
  // Before anything is checked or built: ranks with different plans would otherwise run
  // different collectives from the first step on (a hang, or numbers mixed silently).
  requireSameOnAllRanks(*tensorParallel, planLines(model, sites, plan),
                        str("parallelize: the ranks of tensor-parallel group ", tensorParallel->name(),
                            " apply different plans:"),
                        "module", "give every rank of the group the same plan, model and sequenceParallel, and "
                        "(with dropout) the same dropout seed: vary it over data-parallel replicas only");
  std::vector<Assignment> assignments;
  std::map<std::string, std::string> claimedBy;  // path -> the pattern that matched it
  for (const auto& [pattern, style] : plan.styles) {
    bool matched = false;
    for (const Site& site : sites) {
      if (!pathMatches(pattern, site.path)) continue;
      matched = true;
      const auto [it, fresh] = claimedBy.emplace(site.path, pattern);
      DT_REQUIRE(fresh, "parallelize: ", site.path, " is matched by \"", it->second, "\" and again by \"", pattern,
                 "\"; give each module one style");
      assignments.push_back({&site, style, nullptr});
    }
    DT_REQUIRE(matched, "parallelize: the plan's \"", pattern, "\" (", parallelStyleName(style),
               ") matches no module of ", model.typeName(), "; its module paths are ", examplePaths(sites));
  }
  for (const Assignment& a : assignments) {
    for (const Assignment& b : assignments) {
      DT_REQUIRE(!inside(a.site->path, b.site->path), "parallelize: ", a.site->path, " (", parallelStyleName(a.style),
                 ") lies inside ", b.site->path, " (", parallelStyleName(b.style),
                 "), which the plan replaces whole; split one or the other");
    }
  }
  checkGptPlan(model, assignments, plan.sequenceParallel);
  // Every layer is built before the first is put in place, so a refusal leaves the model whole.
  for (Assignment& a : assignments) a.replacement = buildLayer(*a.site, a.style, tensorParallel, plan.sequenceParallel);

  bool vocabParallel = false;
  for (const Assignment& a : assignments) {
    a.site->parent->replaceChild(a.site->name, a.replacement);
    vocabParallel = vocabParallel || (a.site->path == "wte" && a.style == ParallelStyle::Vocab);
  }
  if (plan.sequenceParallel) {
    // The residual stream is a block of the sequence: its dropouts draw that block of the mask.
    const double p = model.config().dropout;
    Generator& replicated = model.dropoutGenerator();
    model.replaceChild("drop", std::make_shared<SequenceParallelDropout>(p, replicated, tensorParallel));
    for (const auto& [index, block] : model.h->namedChildren()) {
      nn::Module& mlp = *block->child("mlp");
      mlp.replaceChild("dropout", std::make_shared<SequenceParallelDropout>(p, replicated, tensorParallel));
    }
  }
  if (vocabParallel || plan.sequenceParallel) {
    model.setLayout(std::make_shared<TensorParallelGptLayout>(tensorParallel, plan.sequenceParallel, vocabParallel));
  }
}

void parallelize(nn::Gpt& model, const DeviceMesh& mesh, const ParallelPlan& plan, const std::string& dimension) {
  parallelize(model, mesh[dimension], plan);
}

namespace {
void rebindModules(nn::Module& module, const ProcessGroupPtr& group, int& rebound) {
  if (auto* layer = dynamic_cast<TensorParallelModule*>(&module)) {
    layer->rebindGroup(group);
    ++rebound;
  } else if (auto* attention = dynamic_cast<ParallelSelfAttention*>(&module)) {
    attention->rebindGroup(group);
    ++rebound;
  } else if (auto* dropout = dynamic_cast<SequenceParallelDropout*>(&module)) {
    dropout->rebindGroup(group);
    ++rebound;
  }
  for (const auto& [name, child] : module.namedChildren()) rebindModules(*child, group, rebound);
}
}  // namespace

int rebindTensorParallel(nn::Module& model, const ProcessGroupPtr& group) {
  DT_REQUIRE(group != nullptr && group->isMember(), "rebindTensorParallel: the new tensor-parallel group is null or "
             "this process is not a member of it; pass this rank's group, e.g. mesh[\"tp\"]");
  int rebound = 0;
  // The layout first: it checks the place once, before any layer moves.
  if (auto* gpt = dynamic_cast<nn::Gpt*>(&model)) {
    if (auto layout = std::dynamic_pointer_cast<TensorParallelGptLayout>(gpt->layout())) {
      const ProcessGroupPtr& old = layout->group();
      DT_REQUIRE(old->size() == group->size() && old->rank() == group->rank(), "rebindTensorParallel: cannot move the "
                 "model from tensor-parallel rank ", old->rank(), "/", old->size(), " (pg=", old->name(), ") to rank ",
                 group->rank(), "/", group->size(), " (pg=", group->name(), "): its shards are rank ", old->rank(),
                 "'s blocks; the new group must give this process the same rank out of the same size");
      layout->rebindGroup(group);
      ++rebound;
    }
  }
  rebindModules(model, group, rebound);
  return rebound;
}

std::vector<ParameterShard> parameterShardsOf(const nn::Module& model) {
  std::vector<ParameterShard> shards;
  collectShards(model, "", shards);
  return shards;
}

}  // namespace dt
