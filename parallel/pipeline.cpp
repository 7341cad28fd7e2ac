#include "parallel/pipeline.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "common/errors.h"
#include "common/logging.h"
#include "common/strings.h"
#include "parallel/parallelize.h"
#include "tensor/autograd/function.h"
#include "tensor/ops.h"

namespace dt::pipeline {
namespace {

// Registers the blocks under their indices in the unsplit model's "h", so that a chunk's
// parameters carry the unsplit names ("h.5.ln_1.weight").
class BlockRange : public nn::Module {
 public:
  BlockRange(const nn::Sequential& h, int begin, int end) {
    const auto& all = h.namedChildren();
    for (int i = begin; i < end; ++i) blocks_.push_back(registerModule(all[static_cast<size_t>(i)].first, all[static_cast<size_t>(i)].second));
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = x;
    for (const auto& block : blocks_) y = (*block)(y);
    return y;
  }
  std::string typeName() const override { return "BlockRange"; }

 private:
  std::vector<std::shared_ptr<nn::Module>> blocks_;
};

// The last stage's copy of the tied weight, named as the unsplit model's ("wte.weight").
class TiedHead : public nn::Module {
 public:
  explicit TiedHead(const Tensor& weight) { this->weight = registerParameter("weight", weight.detach().clone()); }
  std::string typeName() const override { return "TiedHead"; }
  Tensor weight;
};

class GptChunk : public nn::Module {
 public:
  GptChunk(nn::Gpt& model, int stage, int numStages, int begin, int end, const std::shared_ptr<nn::Module>& sharedWte)
      : first_(stage == 0), last_(stage == numStages - 1), layout_(model.layout()) {
    if (first_) {
      wte_ = registerModule("wte", model.child("wte"));
      wpe_ = registerModule("wpe", model.child("wpe"));
    } else if (last_) {
      // Elsewhere than stage 0 the head needs the weight as a module of its own: a shared one when
      // stage 0 is on this rank (V placement), a copy otherwise.
      wte_ = registerModule("wte", sharedWte ? sharedWte : std::make_shared<TiedHead>(tiedOf(*model.child("wte"))));
    }
    blocks_ = registerModule("h", std::make_shared<BlockRange>(*model.h, begin, end));
    if (last_) ln_f_ = registerModule("ln_f", model.child("ln_f"));
    if (first_) drop_ = registerModule("drop", model.child("drop"));
  }

  static Tensor tiedOf(const nn::Module& wte) {
    for (const auto& [name, tensor] : wte.namedParameters(false)) {
      if (name == "weight") return tensor;
    }
    throw InvalidArgument(str("pipeline: splitGpt: the model's wte (", wte.typeName(), ") has no parameter \"weight\""));
  }

  Tensor forward(const Tensor& input) override {
    Tensor x = input;
    if (first_) {
      const Tensor positions = arange(input.size(1), TensorOptions().dtype(DType::Int64).device(input.device()));
      x = add((*wte_)(input), (*wpe_)(positions));
      if (layout_) x = layout_->enterBlocks(x);  // as Gpt::forward: sequence parallelism's block of T
      x = (*drop_)(x);
    }
    x = (*blocks_)(x);
    if (last_) {
      x = (*ln_f_)(x);
      if (layout_) x = layout_->enterHead(x);
      x = linear(x, tiedOf(*wte_));
    }
    return x;
  }
  std::string typeName() const override { return "GptChunk"; }
  const std::shared_ptr<nn::Module>& wte() const { return wte_; }

 private:
  bool first_, last_;
  std::shared_ptr<nn::GptLayout> layout_;
  std::shared_ptr<nn::Module> wte_, wpe_, drop_, ln_f_, blocks_;
};

int64_t countOf(const nn::Module& module) {
  int64_t n = 0;
  for (const auto& [name, t] : module.namedParameters()) n += t.numel();
  return n;
}

// Per-block parameter count of a GPT block from its config (every block is the same).
int64_t blockParameters(const nn::GptConfig& c) {
  const int64_t w = c.width;
  return 2 * 2 * w + (w * 3 * w + 3 * w) + (w * w + w) + (w * 4 * w + 4 * w) + (4 * w * w + w);
}

// Tags: one range per message kind, each kind's range indexed by (edge, micro-batch).
enum Message : std::uint32_t { kDataF, kDataB, kMetaF, kMetaB, kAckF, kAckB, kTied };
constexpr int kMetaDims = 8;  // dtype, rank, up to 6 sizes

std::string shapeText(DType dtype, const Shape& shape) { return str(toString(dtype), describeShape(shape)); }

Tensor metaOf(DType dtype, const Shape& shape) {
  std::vector<int64_t> v(kMetaDims + 1, -1);
  v[0] = static_cast<int64_t>(dtype);
  v[1] = static_cast<int64_t>(shape.size());
  for (size_t i = 0; i < shape.size() && i + 2 < v.size(); ++i) v[i + 2] = shape[i];
  return fromVector(v);
}

std::pair<DType, Shape> readMeta(const Tensor& meta) {
  const int64_t* v = meta.data<int64_t>();
  Shape shape;
  for (int64_t i = 0; i < v[1] && i + 2 < kMetaDims + 1; ++i) shape.push_back(v[i + 2]);
  return {static_cast<DType>(v[0]), shape};
}

}  // namespace

std::vector<int> splitLayers(const nn::GptConfig& config, int numStages, SplitRule rule) {
  const int layers = static_cast<int>(config.layers);
  if (numStages < 1 || layers < numStages) {
    throw InvalidArgument(str("pipeline: splitLayers: ", layers, " blocks cannot fill ", numStages,
                              " stages (every stage needs at least one block); hint: fewer stages (p*v) or more layers"));
  }
  std::vector<int> begin(static_cast<size_t>(numStages) + 1, 0);
  if (rule == SplitRule::Layers) {
    const int base = layers / numStages, extra = layers % numStages;
    for (int s = 0; s < numStages; ++s) begin[static_cast<size_t>(s) + 1] = begin[static_cast<size_t>(s)] + base + (s < extra ? 1 : 0);
    return begin;
  }
  // Parameters: minimise the largest stage's count over contiguous cuts (dynamic programming over
  // (stages, blocks): layers^2 * stages steps, nothing for any real depth). Stage 0 carries the embeddings, the last stage ln_f and the
  // head's weight (its compute is the model's largest matmul, tied or not).
  const int64_t block = blockParameters(config);
  const int64_t embed = config.vocabSize * config.width + config.contextLength * config.width;
  const int64_t head = 2 * config.width + config.vocabSize * config.width;
  auto cost = [&](int s, int a, int b) {
    int64_t c = static_cast<int64_t>(b - a) * block;
    if (s == 0) c += embed;
    if (s == numStages - 1) c += head;
    return c;
  };
  // best[s][i]: over stages 0..s-1 covering blocks 0..i-1, the smallest largest stage, ties broken
  // by the smaller sum of squares (the more even cut: GPT-2 small on 4 stages is 1 5 5 1, not 1 4 6 1).
  using Score = std::pair<int64_t, double>;
  const Score inf{std::numeric_limits<int64_t>::max(), 0.0};
  std::vector<std::vector<Score>> best(static_cast<size_t>(numStages) + 1, std::vector<Score>(static_cast<size_t>(layers) + 1, inf));
  std::vector<std::vector<int>> cut(best.size(), std::vector<int>(static_cast<size_t>(layers) + 1, 0));
  best[0][0] = {0, 0.0};
  for (int s = 1; s <= numStages; ++s) {
    for (int i = s; i <= layers; ++i) {
      for (int j = s - 1; j < i; ++j) {
        const Score& before = best[static_cast<size_t>(s) - 1][static_cast<size_t>(j)];
        if (before == inf) continue;
        const int64_t c = cost(s - 1, j, i);
        const Score score{std::max(before.first, c), before.second + static_cast<double>(c) * static_cast<double>(c)};
        if (score < best[static_cast<size_t>(s)][static_cast<size_t>(i)]) {
          best[static_cast<size_t>(s)][static_cast<size_t>(i)] = score;
          cut[static_cast<size_t>(s)][static_cast<size_t>(i)] = j;
        }
      }
    }
  }
  begin[static_cast<size_t>(numStages)] = layers;
  for (int s = numStages, i = layers; s > 0; --s) {
    i = cut[static_cast<size_t>(s)][static_cast<size_t>(i)];
    begin[static_cast<size_t>(s) - 1] = i;
  }
  return begin;
}

RunnerStages GptStages::runnerStages() const {
  RunnerStages r;
  r.chunks = chunks;
  if (layout) {
    r.loss = [layout = layout](const Tensor& logits, const Tensor& targets) { return layout->loss(logits, targets); };
  } else {
    r.loss = [](const Tensor& logits, const Tensor& targets) { return nn::Gpt::loss(logits, targets); };
  }
  r.tiedCopy = tiedCopy;
  r.tiedPeer = tiedPeer;
  r.tiedIsLast = tiedIsLast;
  return r;
}

std::vector<Tensor> GptStages::parameters() const {
  std::vector<Tensor> out;
  std::set<const void*> seen;
  for (const auto& chunk : chunks) {
    for (const auto& [name, t] : chunk->namedParameters()) {
      if (seen.insert(t.dataPtr()).second) out.push_back(t);
    }
  }
  return out;
}

NamedTensors GptStages::namedParameters() const {
  NamedTensors out;
  for (const auto& chunk : chunks) {
    for (auto& named : chunk->namedParameters()) out.push_back(named);
  }
  return out;
}

std::string GptStages::summary() const {
  std::string out;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int s = stages[c];
    const int b = stageBegin[static_cast<size_t>(s)], e = stageBegin[static_cast<size_t>(s) + 1];
    const int last = static_cast<int>(stageBegin.size()) - 2;
    out += str(out.empty() ? "" : "\n", "pipeline stage ", s, " (chunk ", c, "): blocks ", b, "-", e - 1,
               s == 0 ? " + embeddings" : "", s == last ? " + ln_f and the tied head" : "", ", ",
               countOf(*chunks[c]), " parameters");
  }
  return out;
}

GptStages splitGpt(nn::Gpt& model, const Schedule& schedule, int rank, const SplitOptions& options) {
  if (rank < 0 || rank >= schedule.p) {
    throw InvalidArgument(str("pipeline: splitGpt: rank ", rank, " is not in [0, ", schedule.p, ")"));
  }
  const int stages = schedule.numStages();
  GptStages out;
  out.layout = model.layout();
  out.stageBegin = splitLayers(model.config(), stages, options.rule);
  const int firstRank = schedule.rankOfStage(0), lastRank = schedule.rankOfStage(stages - 1);
  std::shared_ptr<nn::Module> sharedWte;
  // Chunks in local order; on V rank 0 the first stage (chunk 0) comes before the last (chunk 1),
  // so the last stage can share the first's module.
  for (int c = 0; c < schedule.v; ++c) {
    const int s = schedule.stageOf(rank, c);
    auto chunk = std::make_shared<GptChunk>(model, s, stages, out.stageBegin[static_cast<size_t>(s)],
                                            out.stageBegin[static_cast<size_t>(s) + 1],
                                            firstRank == lastRank ? sharedWte : nullptr);
    if (s == 0) sharedWte = chunk->wte();
    if (s == stages - 1 && firstRank != lastRank) out.tiedCopy = GptChunk::tiedOf(*chunk->wte());
    if (s == 0 && firstRank != lastRank) out.tiedCopy = GptChunk::tiedOf(*chunk->wte());
    out.chunks.push_back(chunk);
    out.stages.push_back(s);
  }
  if (firstRank != lastRank && (rank == firstRank || rank == lastRank)) {
    out.tiedPeer = rank == firstRank ? lastRank : firstRank;
    out.tiedIsLast = rank == lastRank;
  }
  logger("parallel")->info("{}", out.summary());
  return out;
}

// ---- the runner ------------------------------------------------------------------------------

PipelineRunner::PipelineRunner(Schedule schedule, RunnerStages stages, ProcessGroupPtr pp, PipelineOptions options)
    : schedule_(std::move(schedule)), stages_(std::move(stages)), pp_(std::move(pp)), options_(std::move(options)) {
  if (!pp_ || !pp_->isMember()) throw InvalidArgument("pipeline: PipelineRunner needs a pp group this rank is a member of");
  rank_ = pp_->rank();
  validate(schedule_);
  if (schedule_.p != pp_->size()) {
    throw InvalidArgument(str("pipeline: schedule ", schedule_.name, " is for p=", schedule_.p, " ranks but pg=",
                              pp_->name(), " has ", pp_->size(), "; hint: generate it with p = mesh[\"pp\"]->size()"));
  }
  if (static_cast<int>(stages_.chunks.size()) != schedule_.v) {
    throw InvalidArgument(str("pipeline: rank ", rank_, " holds ", stages_.chunks.size(), " chunks but schedule ",
                              schedule_.name, " has v=", schedule_.v, " per rank"));
  }
  if (options_.activationShape.empty()) throw InvalidArgument("pipeline: PipelineOptions::activationShape is required");
  if (options_.activationShape.size() > kMetaDims - 2) {
    throw InvalidArgument(str("pipeline: activations of ", options_.activationShape.size(), " dimensions (at most ",
                              kMetaDims - 2, ")"));
  }
  const uint64_t tags = 7ull * static_cast<uint64_t>(schedule_.numStages()) * static_cast<uint64_t>(schedule_.m) + 1;
  if (tags > std::numeric_limits<std::uint32_t>::max() - options_.tagBase) {
    throw InvalidArgument(str("pipeline: ", tags, " tags from ", options_.tagBase, " do not fit 32 bits"));
  }
}

void PipelineRunner::setActivation(Shape shape, DType dtype) {
  options_.activationShape = std::move(shape);
  options_.activationDType = dtype;
  checkShapes_ = true;
}

std::string PipelineRunner::where(int stage) const {
  return str("pipeline rank ", rank_, "/", schedule_.p, " (pg=", pp_->name(), ") stage ", stage);
}

struct PipelineRunner::Slot {
  Tensor input;        // the chunk's input (a leaf that requires grad past stage 0)
  Tensor output;       // its output (the last stage: the loss)
  Tensor outputGrad;   // the gradient of the output, received or handed over
  Tensor inputGrad;    // after backward: what goes to the previous stage
  WeightGradients weights;  // after I: the weight gradients its W computes
  bool backwardDone = false;
};

double PipelineRunner::step(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets) {
  return execute(inputs, targets, false);
}

double PipelineRunner::evaluate(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets) {
  NoGradGuard noGrad;
  return execute(inputs, targets, true);
}

double PipelineRunner::execute(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets, bool forwardOnly) {
  std::vector<double> losses;
  int current = -1;
  const auto start = std::chrono::steady_clock::now();
  // An evaluation keeps step's timing and numbering: its own, and "evaluation k" in its errors.
  StepTiming evaluationTiming;
  StepTiming& timing = forwardOnly ? evaluationTiming : lastStep_;
  timing = StepTiming{};
  int64_t& count = forwardOnly ? evaluations_ : steps_;
  const char* what = forwardOnly ? "evaluation" : "step";
  struct Wall {
    StepTiming& timing;
    std::chrono::steady_clock::time_point start;
    ~Wall() { timing.wallSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); }
  } wall{timing, start};
  try {
    run(inputs, targets, losses, current, forwardOnly, timing);
  } catch (...) {
    const Action* action =
        current >= 0 ? &schedule_.ranks[static_cast<size_t>(rank_)][static_cast<size_t>(current)] : nullptr;
    const std::string at = action ? str(" action #", current, " ", toString(*action, schedule_.v > 1))
                                  : std::string(" (after its actions)");
    const int stage = schedule_.stageOf(rank_, action ? action->chunk : 0);
    // Not broken: this rank's own failure started it. Broken: a peer failed first and aborted the
    // group (the transport says "aborted the group's transfers"), or this rank found the cause
    // itself: a transfer that timed out (it names the peer that never came) or a peer that died
    // (the transport names it). Those break the group too.
    bool origin = !pp_->isBroken();
    std::string cause;
    if (options_.store) {
      const std::string key = str("pipeline/", pp_->name(), "/", options_.tagBase, "/", what, count, "/cause");
      std::string what = "unknown exception";
      try {
        throw;
      } catch (const TimeoutError& e) {
        what = describe(e);
        origin = true;
      } catch (const std::exception& e) {
        what = describe(e);
        origin = origin || what.find("aborted the group's transfers") == std::string::npos;
      } catch (...) {
      }
      try {
        // The first to write wins (a rank that saw the abort of one that wrote first reads its
        // cause: that rank wrote before it aborted); an origin that lost (two ranks timing out together) reads the
        // winner's, the others wait for it.
        const std::string first = origin
            ? options_.store->compareSet(key, "", str("rank ", rank_, " stage ", stage, at, ": ", what))
            : options_.store->get(key, options_.causeWait);
        // Its own error, or both ends of a shape mismatch throwing the same words: say them once.
        if (first.find(what) == std::string::npos) cause = str("; the failure that started it: ", first);
      } catch (const std::exception&) {
        // No cause to add (none was left, or the store is gone): the transport's words stand.
      }
    }
    std::exception_ptr error =
        withPrefix(std::current_exception(), str(where(stage), " ", what, " ", count, ",", at, " failed: "),
                   cause + (action ? "\n" + actionGrid(schedule_, {{rank_, current}}) : std::string()));
    // The others are (or will be) waiting on this rank: break the group so they fail now.
    pp_->abort(error);
    ++count;
    std::rethrow_exception(error);
  }
  ++count;
  return losses.empty() ? 0.0 : losses.front();
}

void PipelineRunner::run(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets,
                         std::vector<double>& losses, int& current, bool forwardOnly, StepTiming& timing) {
  const Schedule& s = schedule_;
  const int stages = s.numStages(), m = s.m;
  const bool holdsFirst = s.rankOfStage(0) == rank_, holdsLast = s.rankOfStage(stages - 1) == rank_;
  if (holdsFirst && static_cast<int>(inputs.size()) != m) {
    throw InvalidArgument(str(where(0), ": ", inputs.size(), " input micro-batches for a schedule of m=", m));
  }
  if (holdsLast && static_cast<int>(targets.size()) != m) {
    throw InvalidArgument(str(where(stages - 1), ": ", targets.size(), " target micro-batches for a schedule of m=", m));
  }
  const Shape& expectShape = options_.activationShape;
  const DType expectDType = options_.activationDType;
  const bool check = checkShapes_;
  auto tag = [&](Message kind, int edge, int mb) {
    return options_.tagBase + 1 + static_cast<std::uint32_t>((static_cast<int>(kind) * stages + edge) * m + mb);
  };
  SendOptions sendOptions;
  sendOptions.timeout = options_.timeout;
  RecvOptions recvOptions;
  recvOptions.timeout = options_.timeout;
  auto waitFor = [&](const WorkPtr& work) { work->wait(); };

  std::map<std::pair<int, int>, Slot> slots;  // (micro-batch, stage)
  struct Pending {
    WorkPtr work;
    Tensor keep;
  };
  std::vector<Pending> sends;
  Tensor lossSum = scalarTensor(0.0, DType::Float64);
  double lossTotal = 0;

  // The first step's check: the sender says what it sends, the receiver answers with its verdict
  // (0 ok, else its expected dtype and shape); a mismatch throws on both ends with one message.
  auto mismatch = [&](bool forward, int toStage, int mb, DType gotType, const Shape& got) {
    return InvalidArgument(str("pipeline: stage ", toStage, " expected the ", forward ? "activation" : "gradient",
                               " of micro-batch ", mb, forward ? " from stage " : " from stage ",
                               forward ? toStage - 1 : toStage + 1, " as ", shapeText(expectDType, expectShape),
                               " but received ", shapeText(gotType, got),
                               "; hint: every stage boundary carries PipelineOptions::activationShape (micro-batch, T, width)"));
  };
  auto sendChecked = [&](const Tensor& data, int peer, bool forward, int edge, int mb, int toStage) {
    const Tensor contiguous = data.contiguous();
    if (check) {
      const Tensor meta = metaOf(contiguous.dtype(), contiguous.sizes());
      Tensor ack = zeros({kMetaDims + 1}, DType::Int64);
      try {
        waitFor(pp_->send({meta}, peer, {tag(forward ? kMetaF : kMetaB, edge, mb), options_.timeout, 0}));
        waitFor(pp_->recv({ack}, peer, {tag(forward ? kAckF : kAckB, edge, mb), options_.timeout, 0}));
      } catch (...) {
        // The transport names its own op (a recv of the verdict): say that this is the send's
        // first-step handshake, so a SEND that found no receiver does not read as a recv.
        std::rethrow_exception(withPrefix(std::current_exception(),
                                          str("sending the ", forward ? "activation" : "gradient", " of micro-batch ", mb,
                                              " to stage ", toStage, " (rank ", peer,
                                              "; the first step's shape check waits for its verdict): "),
                                          ""));
      }
      if (ack.data<int64_t>()[0] != 0) {
        waitFor(pp_->send({zeros({1}, DType::Int64)}, peer, {tag(forward ? kMetaF : kMetaB, edge, mb), options_.timeout, 0}));
        // The receiver's expected shape is the one this rank is configured with too, unless the
        // two were configured differently: report the receiver's.
        std::vector<int64_t> v(ack.data<int64_t>(), ack.data<int64_t>() + kMetaDims + 1);
        v[0] = v[kMetaDims];
        const auto [theirType, theirShape] = readMeta(fromVector(v));
        throw InvalidArgument(str("pipeline: stage ", toStage, " expected the ", forward ? "activation" : "gradient",
                                  " of micro-batch ", mb, " from stage ", forward ? toStage - 1 : toStage + 1, " as ",
                                  shapeText(theirType, theirShape), " but received ",
                                  shapeText(contiguous.dtype(), contiguous.sizes()),
                                  "; hint: every stage boundary carries PipelineOptions::activationShape (micro-batch, T, width)"));
      }
    }
    sends.push_back({pp_->send({contiguous}, peer, {tag(forward ? kDataF : kDataB, edge, mb), options_.timeout, 0}), contiguous});
  };
  auto recvChecked = [&](int peer, bool forward, int edge, int mb, int toStage) {
    if (check) {
      Tensor meta = zeros({kMetaDims + 1}, DType::Int64);
      waitFor(pp_->recv({meta}, peer, {tag(forward ? kMetaF : kMetaB, edge, mb), options_.timeout, 0}));
      const auto [gotType, got] = readMeta(meta);
      const bool ok = gotType == expectDType && got == expectShape;
      // The verdict: 0, or 1 with our expectation (dtype moved to the last slot, as readMeta's
      // layout shifted by one).
      std::vector<int64_t> verdict(kMetaDims + 1, 0);
      if (!ok) {
        const Tensor mine = metaOf(expectDType, expectShape);
        const int64_t* e = mine.data<int64_t>();
        verdict[0] = 1;
        for (int i = 1; i < kMetaDims; ++i) verdict[static_cast<size_t>(i)] = e[i];
        verdict[kMetaDims] = e[0];
      }
      waitFor(pp_->send({fromVector(verdict)}, peer, {tag(forward ? kAckF : kAckB, edge, mb), options_.timeout, 0}));
      if (!ok) {
        // Abort only once the sender has read the verdict (it answers before it throws and aborts
        // itself): an abort racing ahead of the verdict would leave the sender without the reason.
        try {
          Tensor seen = zeros({1}, DType::Int64);
          waitFor(pp_->recv({seen}, peer, {tag(forward ? kMetaF : kMetaB, edge, mb), options_.timeout, 0}));
        } catch (const std::exception&) {
          // The sender aborted first: it has the verdict either way.
        }
        throw mismatch(forward, toStage, mb, gotType, got);
      }
    }
    Tensor buffer = zeros(expectShape, expectDType);
    waitFor(pp_->recv({buffer}, peer, {tag(forward ? kDataF : kDataB, edge, mb), options_.timeout, 0}));
    return buffer;
  };

  std::vector<TensorList> chunkParameters(stages_.chunks.size());  // filled at a chunk's first I
  const std::vector<Action>& actions = s.ranks[static_cast<size_t>(rank_)];
  for (current = 0; current < static_cast<int>(actions.size()); ++current) {
    const Action& a = actions[static_cast<size_t>(current)];
    // Forward only: the list's F, SEND_F and RECV_F in their order. Dropping the backward actions
    // only removes what a RECV_F could wait behind, so the order stays deadlock-free.
    if (forwardOnly && a.kind != ActionKind::F && a.kind != ActionKind::SendF && a.kind != ActionKind::RecvF) continue;
    const int stage = s.stageOf(rank_, a.chunk);
    const FlightContext flightContext("pipeline %s mb %d stage %d", toString(a.kind), a.microBatch, stage);
    const bool computes = a.kind == ActionKind::F || a.kind == ActionKind::B || a.kind == ActionKind::I ||
                          a.kind == ActionKind::W;
    const auto actionStart = std::chrono::steady_clock::now();
    struct ComputeTime {
      bool computes;
      std::chrono::steady_clock::time_point start;
      double& total;
      ~ComputeTime() {
        if (computes) total += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
    } computeTime{computes, actionStart, timing.computeSeconds};
    Slot& slot = slots[{a.microBatch, stage}];
    const auto& chunk = stages_.chunks[static_cast<size_t>(a.chunk)];
    switch (a.kind) {
      case ActionKind::F: {
        if (stage == 0) {
          slot.input = inputs[static_cast<size_t>(a.microBatch)];
        } else if (s.rankOfStage(stage - 1) == rank_) {
          // Handed over on this rank (V's middle): cut the graph so each stage's B runs its own part.
          Slot& previous = slots[{a.microBatch, stage - 1}];
          slot.input = previous.output.detach();
          slot.input.setRequiresGrad(!forwardOnly);
        } else if (!slot.input.defined()) {
          throw InvalidArgument(str("F", a.microBatch, " of stage ", stage, " before its input arrived"));
        }
        Tensor out = (*chunk)(slot.input);
        if (stage == stages - 1) {
          out = stages_.loss(out, targets[static_cast<size_t>(a.microBatch)]);
          NoGradGuard ng;
          lossTotal += out.detach().to(DType::Float64).item<double>();
        }
        slot.output = out;
        break;
      }
      case ActionKind::RecvF: {
        Tensor received = recvChecked(peerRank(s, rank_, a), true, stage - 1, a.microBatch, stage);
        received.setRequiresGrad(!forwardOnly);
        slot.input = received;
        break;
      }
      case ActionKind::SendF:
        sendChecked(slot.output.detach(), peerRank(s, rank_, a), true, stage, a.microBatch, stage + 1);
        break;
      case ActionKind::RecvB:
        slot.outputGrad = recvChecked(peerRank(s, rank_, a), false, stage, a.microBatch, stage);
        break;
      case ActionKind::B:
      case ActionKind::I: {
        Tensor root = slot.output, rootGrad;
        if (stage == stages - 1) {
          root = slot.output * (1.0 / m);
        } else {
          if (s.rankOfStage(stage + 1) == rank_) slot.outputGrad = slots[{a.microBatch, stage + 1}].inputGrad;
          if (!slot.outputGrad.defined()) {
            throw InvalidArgument(str(a.kind == ActionKind::B ? "B" : "I", a.microBatch, " of stage ", stage,
                                      " before its output's gradient arrived"));
          }
          rootGrad = slot.outputGrad;
        }
        const TensorList rootGrads = rootGrad.defined() ? TensorList{rootGrad} : TensorList{};
        if (a.kind == ActionKind::B) {
          backward({root}, rootGrads);
        } else {
          // Input gradients now (what the previous stage waits for); the weight products at W.
          TensorList& weights = chunkParameters[static_cast<size_t>(a.chunk)];
          if (weights.empty()) weights = chunk->parameters();
          slot.weights = backwardDeferringWeights({root}, rootGrads, weights);
        }
        if (stage > 0) slot.inputGrad = slot.input.grad();
        // The graph and activations go now; the input gradient stays until it is sent or handed over.
        slot.output = Tensor();
        slot.outputGrad = Tensor();
        slot.input = Tensor();
        slot.backwardDone = true;
        break;
      }
      case ActionKind::W:
        if (!slot.backwardDone) {
          throw InvalidArgument(str("W", a.microBatch, " of stage ", stage, " before its I"));
        }
        slot.weights.run();
        break;
      case ActionKind::SendB:
        sendChecked(slot.inputGrad, peerRank(s, rank_, a), false, stage - 1, a.microBatch, stage - 1);
        slot.inputGrad = Tensor();
        break;
    }
  }
  current = -1;
  for (Pending& p : sends) waitFor(p.work);
  sends.clear();
  if (!forwardOnly) {
    // A forward-only pass checked the activations only: the gradients' shapes are still unseen.
    checkShapes_ = false;
    syncTied();
  }
  // The mean loss, from the last stage to every rank.
  lossSum.data<double>()[0] = holdsLast ? lossTotal / m : 0.0;
  BroadcastOptions b;
  b.root = s.rankOfStage(stages - 1);
  b.timeout = options_.timeout;
  waitFor(pp_->broadcast(lossSum, b));
  losses.push_back(lossSum.data<double>()[0]);
}

void PipelineRunner::syncTied() {
  if (!stages_.tiedCopy.defined() || stages_.tiedPeer < 0) return;
  Tensor grad = stages_.tiedCopy.grad();
  if (!grad.defined()) {
    throw InvalidArgument(str(where(stages_.tiedIsLast ? schedule_.numStages() - 1 : 0),
                              ": the tied weight has no gradient after the step's backward"));
  }
  NoGradGuard ng;
  const Tensor mine = grad.contiguous().clone();
  Tensor theirs = zerosLike(mine);
  const int m = schedule_.m, stages = schedule_.numStages();
  const std::uint32_t tag = options_.tagBase + 1 + static_cast<std::uint32_t>(kTied * stages * m);
  P2POp send = P2POp::send({mine}, stages_.tiedPeer, tag);
  P2POp recv = send;
  recv.isSend = false;
  recv.tensors = {theirs};
  send.timeout = options_.timeout;
  recv.timeout = options_.timeout;
  pp_->batchIsendIrecv({send, recv})->wait();
  // first + last on both ranks: the same sum, bit for bit.
  grad.copy_(stages_.tiedIsLast ? add(theirs, mine) : add(mine, theirs));
}

namespace {

void sleepMicros(int64_t us) {
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

// y = x * weight, with the costs slept: forward f, the input's gradient i, the weight's w.
struct FixedCost : autograd::Function<FixedCost> {
  static constexpr std::string_view name = "FixedCost";
  static Tensor forward(autograd::FunctionContext& ctx, const Tensor& x, const Tensor& weight, int64_t f, int64_t i,
                        int64_t w) {
    ctx.saveForBackward(x, weight);
    ctx.set("i", i);
    ctx.set("w", w);
    sleepMicros(f);
    return mul(x, weight);
  }
  static TensorList backward(autograd::FunctionContext& ctx, const TensorList& grads) {
    const TensorList saved = ctx.savedTensors();
    Tensor gx, gw;
    if (ctx.needsInputGrad(0)) {
      sleepMicros(ctx.get<int64_t>("i"));
      gx = mul(grads[0], saved[1]);
    }
    if (ctx.needsInputGrad(1)) {
      sleepMicros(ctx.get<int64_t>("w"));
      gw = sum(mul(grads[0], saved[0])).reshape({1});
    }
    return {gx, gw};
  }
};

class FixedCostChunk final : public nn::Module {
 public:
  FixedCostChunk(int64_t f, int64_t i, int64_t w) : f_(f), i_(i), w_(w) {
    weight = registerParameter("weight", ones({1}));
  }
  Tensor forward(const Tensor& x) override { return FixedCost::apply(x, weight, f_, i_, w_); }
  std::string typeName() const override { return "FixedCostChunk"; }
  Tensor weight;

 private:
  int64_t f_, i_, w_;
};

}  // namespace

RunnerStages fixedCostStages(const Schedule& schedule, int rank, const Costs& costs, std::chrono::microseconds unit) {
  if (rank < 0 || rank >= schedule.p) {
    throw InvalidArgument(str("fixedCostStages: rank ", rank, " is outside the schedule's p=", schedule.p));
  }
  const auto micros = [&](double c) {
    if (c < 0) throw InvalidArgument(str("fixedCostStages: a negative cost ", c));
    return static_cast<int64_t>(std::llround(c * static_cast<double>(unit.count())));
  };
  RunnerStages out;
  for (int c = 0; c < schedule.v; ++c) {
    out.chunks.push_back(std::make_shared<FixedCostChunk>(micros(costs.f), micros(costs.i), micros(costs.w)));
  }
  out.loss = [](const Tensor& output, const Tensor& target) { return mean(mul(output, target)); };
  return out;
}

namespace {

// Every clipGradNorm of a pipeline: `holderOf` (optional) gives the tensor holding a parameter's
// gradient, `tensorParallel` (optional) the group a split parameter's squares are summed over.
double clipStages(const PipelineRunner& runner, double maxNorm, const ProcessGroupPtr& tensorParallel,
                  const std::function<Tensor(const Tensor&)>& holderOf, nn::ClipGradNormOptions options) {
  const RunnerStages& st = runner.stages();
  const auto held = [&holderOf](const Tensor& t) { return holderOf ? holderOf(t) : t; };
  std::vector<Tensor> parameters;
  std::vector<bool> split;  // per parameter: a tensor-parallel block (its squares summed over tp)
  std::set<const void*> seen;
  const bool skipCopy = st.tiedCopy.defined() && st.tiedIsLast;
  for (const auto& chunk : st.chunks) {
    std::map<std::string, bool> splitByName;
    if (tensorParallel) {
      for (const ParameterShard& shard : parameterShardsOf(*chunk)) splitByName[shard.name] = shard.dim >= 0;
    }
    for (const auto& [name, t] : chunk->namedParameters()) {
      if (skipCopy && t.dataPtr() == st.tiedCopy.dataPtr()) continue;
      if (!seen.insert(t.dataPtr()).second) continue;
      parameters.push_back(held(t));
      split.push_back(splitByName[name]);
    }
  }
  if (tensorParallel) {
    if (options.isSplit || options.reduceSplitPartial) {
      throw InvalidArgument(str("pipeline: clipGradNorm over tp group ", tensorParallel->name(),
                                ": options carry isSplit / reduceSplitPartial; it sets them from the stages"));
    }
    options.isSplit = [&split](size_t index) { return split[index]; };
    options.reduceSplitPartial = [&tensorParallel](Tensor& partial, bool max) {
      tensorParallel->allreduce(partial, {.reduceOp = max ? ReduceOp::Max : ReduceOp::Sum})->wait();
    };
  }
  const ProcessGroupPtr& pp = runner.group();
  // A holder's partial covers this rank's piece: over the holders' group first, then over pp.
  options.reducePartial = [&pp, outer = holderOf ? options.reducePartial : nullptr](Tensor& partial, bool max) {
    if (outer) outer(partial, max);
    AllreduceOptions o;
    o.reduceOp = max ? ReduceOp::Max : ReduceOp::Sum;
    pp->allreduce(partial, o)->wait();
  };
  const double norm = nn::clipGradNorm(parameters, maxNorm, options);
  // The copy left out of the norm is scaled as clipGradNorm scaled the rest.
  const Tensor copy = skipCopy ? held(st.tiedCopy) : Tensor();
  if (copy.defined() && copy.grad().defined()) {
    const double coefficient = maxNorm / (norm + 1e-6);
    if (coefficient < 1.0 || std::isnan(coefficient)) {
      NoGradGuard ng;
      Tensor g = copy.grad();
      mul_(g, coefficient);
    }
  }
  return norm;
}

}  // namespace

double clipGradNorm(const PipelineRunner& runner, double maxNorm, nn::ClipGradNormOptions options) {
  return clipStages(runner, maxNorm, nullptr, nullptr, std::move(options));
}

double clipGradNorm(const PipelineRunner& runner, double maxNorm, const ProcessGroupPtr& tensorParallel,
                    nn::ClipGradNormOptions options) {
  return clipStages(runner, maxNorm, tensorParallel, nullptr, std::move(options));
}

double clipGradNorm(const PipelineRunner& runner, double maxNorm, const std::function<Tensor(const Tensor&)>& holderOf,
                    nn::ClipGradNormOptions options, const ProcessGroupPtr& tensorParallel) {
  if (!holderOf) throw InvalidArgument("pipeline: clipGradNorm with holders: holderOf is empty");
  return clipStages(runner, maxNorm, tensorParallel, holderOf, std::move(options));
}

}  // namespace dt::pipeline
