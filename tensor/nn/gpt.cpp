#include "tensor/nn/gpt.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/errors.h"
#include "common/strings.h"
#include "tensor/autograd/checkpoint.h"

namespace dt::nn {

namespace {
// The typed handle to a replaced child: the new module when it is of that type, else null.
template <typename M>
void follow(std::shared_ptr<M>& handle, const std::shared_ptr<Module>& module) {
  handle = std::dynamic_pointer_cast<M>(module);
}
}  // namespace

void GptConfig::validate() const {
  auto positive = [](int64_t v, const char* name) {
    if (v < 1) throw InvalidArgument(str("GptConfig: ", name, " must be at least 1, got ", v));
  };
  positive(vocabSize, "vocabSize");
  positive(contextLength, "contextLength");
  positive(layers, "layers");
  positive(heads, "heads");
  positive(width, "width");
  if (width % heads != 0) {
    throw InvalidArgument(str("GptConfig: width ", width, " is not a multiple of heads ", heads));
  }
  if (dropout < 0 || dropout >= 1) throw InvalidArgument(str("GptConfig: dropout must be in [0, 1), got ", dropout));
  if (!(layerNormEps > 0)) throw InvalidArgument(str("GptConfig: layerNormEps must be positive, got ", layerNormEps));
}

int64_t GptConfig::parameterCount() const {
  const int64_t c = width;
  const int64_t block = 2 * 2 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c);
  return vocabSize * c + contextLength * c + layers * block + 2 * c;
}

CausalSelfAttention::CausalSelfAttention(const GptConfig& config, Generator& init, Generator& dropout)
    : heads_(config.heads), dropout_(config.dropout), dropoutGenerator_(&dropout) {
  c_attn = registerModule("c_attn", std::make_shared<Linear>(config.width, 3 * config.width, true, init));
  c_proj = registerModule("c_proj", std::make_shared<Linear>(config.width, config.width, true, init));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  const Tensor qkv = (*child("c_attn"))(x);
  const Tensor y = selfAttention(qkv, heads_, {.causal = true, .dropoutP = dropout_, .training = isTraining()},
                                 *dropoutGenerator_);
  return dropout((*child("c_proj"))(y), dropout_, isTraining(), *dropoutGenerator_);
}

void CausalSelfAttention::childReplaced(const std::string& name, const std::shared_ptr<Module>& module) {
  follow(name == "c_attn" ? c_attn : c_proj, module);
}

Mlp::Mlp(const GptConfig& config, Generator& init, Generator& dropout) {
  c_fc = registerModule("c_fc", std::make_shared<Linear>(config.width, 4 * config.width, true, init));
  c_proj = registerModule("c_proj", std::make_shared<Linear>(4 * config.width, config.width, true, init));
  registerModule("dropout", std::make_shared<Dropout>(config.dropout, dropout));
}

Tensor Mlp::forward(const Tensor& x) {
  return (*child("dropout"))((*child("c_proj"))(gelu((*child("c_fc"))(x))));
}

void Mlp::childReplaced(const std::string& name, const std::shared_ptr<Module>& module) {
  if (name == "c_fc") follow(c_fc, module);
  if (name == "c_proj") follow(c_proj, module);
}

TransformerBlock::TransformerBlock(const GptConfig& config, Generator& init, Generator& dropout)
    : checkpointActivations(config.activationCheckpointing), dropout_(config.dropout), dropoutGenerator_(&dropout) {
  ln_1 = registerModule("ln_1", std::make_shared<LayerNorm>(std::vector<int64_t>{config.width}, config.layerNormEps));
  attn = registerModule("attn", std::make_shared<CausalSelfAttention>(config, init, dropout));
  ln_2 = registerModule("ln_2", std::make_shared<LayerNorm>(std::vector<int64_t>{config.width}, config.layerNormEps));
  mlp = registerModule("mlp", std::make_shared<Mlp>(config, init, dropout));
}

Tensor TransformerBlock::forward(const Tensor& x) {
  if (!checkpointActivations) return body(x);
  // Without dropout the recomputation draws nothing: no generator to rewind.
  autograd::CheckpointOptions options;
  if (dropout_ > 0 && isTraining()) options.preserveGenerators = {dropoutGenerator_};
  return autograd::checkpoint([this](const Tensor& in) { return body(in); }, x, options);
}

Tensor TransformerBlock::body(const Tensor& x) {
  const Tensor h1 = add(x, (*child("attn"))((*child("ln_1"))(x)));
  return add(h1, (*child("mlp"))((*child("ln_2"))(h1)));
}

void TransformerBlock::childReplaced(const std::string& name, const std::shared_ptr<Module>& module) {
  if (name == "ln_1") follow(ln_1, module);
  if (name == "attn") follow(attn, module);
  if (name == "ln_2") follow(ln_2, module);
  if (name == "mlp") follow(mlp, module);
}

Gpt::Gpt(const GptConfig& config, Generator& init, Generator* dropout)
    : config_(config), dropoutGenerator_(dropout != nullptr ? dropout : &init) {
  config.validate();
  wte = registerModule("wte", std::make_shared<Embedding>(config.vocabSize, config.width, init));
  wpe = registerModule("wpe", std::make_shared<Embedding>(config.contextLength, config.width, init));
  h = registerModule("h", std::make_shared<Sequential>());
  for (int64_t i = 0; i < config.layers; ++i) {
    h->pushBack(std::make_shared<TransformerBlock>(config, init, *dropoutGenerator_));
  }
  ln_f = registerModule("ln_f", std::make_shared<LayerNorm>(std::vector<int64_t>{config.width}, config.layerNormEps));
  // Registered last so the children before it keep their places (no parameters).
  registerModule("drop", std::make_shared<Dropout>(config.dropout, *dropoutGenerator_));
  tiedWeight_ = wte->weight;
  // GPT-2's initialisation, in registration order.
  const double residualStd = 0.02 / std::sqrt(2.0 * static_cast<double>(config.layers));
  NoGradGuard ng;
  for (auto& [name, p] : namedParameters()) {
    const bool isNorm = name.starts_with("ln_f.") || name.find(".ln_") != std::string::npos;
    if (isNorm) continue;  // LayerNorm: weight 1, bias 0 as constructed
    Tensor t = p;
    if (name.ends_with(".bias")) {
      t.zero_();
    } else if (name.ends_with("c_proj.weight")) {
      normal_(t, 0.0, residualStd, init);
    } else {
      normal_(t, 0.0, 0.02, init);
    }
  }
}

Tensor Gpt::forward(const Tensor& tokens) {
  if (tokens.dim() != 2 || (tokens.dtype() != DType::Int64 && tokens.dtype() != DType::Int32)) {
    throw InvalidArgument(str("Gpt: tokens must be int64 [B, T], got ", tokens.describe()));
  }
  const int64_t len = tokens.sizes()[1];
  if (len < 1 || len > config_.contextLength) {
    throw InvalidArgument(str("Gpt: ", len, " tokens per row (", tokens.describe(), ") but the context length is ",
                              config_.contextLength));
  }
  const Tensor positions = arange(len, TensorOptions().dtype(DType::Int64).device(tokens.device()));
  Tensor x = add((*child("wte"))(tokens), (*child("wpe"))(positions));
  if (layout_) x = layout_->enterBlocks(x);
  x = (*child("drop"))(x);
  x = (*child("ln_f"))((*child("h"))(x));
  if (layout_) x = layout_->enterHead(x);
  return linear(x, tiedWeight_);  // the output layer is the token embedding (tied)
}

Tensor Gpt::nextTokenLoss(const Tensor& logits, const Tensor& targets) const {
  return layout_ ? layout_->loss(logits, targets) : loss(logits, targets);
}

void Gpt::childReplaced(const std::string& name, const std::shared_ptr<Module>& module) {
  if (name == "wte") {
    // The output layer is tied to whatever table the embedding holds now (a vocabulary block
    // under tensor parallelism).
    const NamedTensors own = module->namedParameters(false);
    const auto weight = std::find_if(own.begin(), own.end(), [](const auto& entry) { return entry.first == "weight"; });
    if (weight == own.end()) {
      throw InvalidArgument(str("Gpt: the replacement for wte (", module->typeName(),
                                ") has no parameter \"weight\", which the tied output layer uses"));
    }
    tiedWeight_ = weight->second;
    follow(wte, module);
  }
  if (name == "wpe") follow(wpe, module);
  if (name == "h") follow(h, module);
  if (name == "ln_f") follow(ln_f, module);
}

Tensor Gpt::loss(const Tensor& logits, const Tensor& targets) {
  if (logits.dim() != 3 || targets.sizes() != Shape{logits.sizes()[0], logits.sizes()[1]}) {
    throw InvalidArgument(str("Gpt::loss: logits ", logits.describe(), " and targets ", targets.describe(),
                              " do not match (expected [B, T, V] and [B, T])"));
  }
  const int64_t rows = logits.sizes()[0] * logits.sizes()[1];
  return crossEntropy(logits.reshape({rows, logits.sizes()[2]}), targets.reshape({rows}));
}

int64_t sampleToken(const Tensor& logits, const SamplingOptions& options, Generator& generator) {
  if (logits.dim() != 1 || logits.numel() < 1) {
    throw InvalidArgument(str("sampleToken: logits must be one non-empty row [V], got ", logits.describe()));
  }
  if (options.temperature < 0 || options.topK < 0) {
    throw InvalidArgument(str("sampleToken: temperature ", options.temperature, " and topK ", options.topK,
                              " must be non-negative"));
  }
  const std::vector<double> row = logits.toVector<double>();
  const int64_t v = static_cast<int64_t>(row.size());
  std::vector<int64_t> order(row.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  // Most likely first; equal logits keep the lower token first.
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
  if (options.temperature == 0.0) return order[0];
  const int64_t keep = options.topK > 0 ? std::min(options.topK, v) : v;
  std::vector<double> weights(static_cast<size_t>(keep));
  double total = 0;
  for (int64_t i = 0; i < keep; ++i) {
    weights[i] = std::exp((row[order[i]] - row[order[0]]) / options.temperature);
    total += weights[i];
  }
  double u = generator.nextDouble() * total;
  for (int64_t i = 0; i < keep; ++i) {
    u -= weights[i];
    if (u < 0) return order[i];
  }
  return order[keep - 1];
}

std::vector<int64_t> Gpt::generate(const std::vector<int64_t>& prompt, int64_t maxNewTokens,
                                   const SamplingOptions& options, Generator& generator) {
  if (prompt.empty()) throw InvalidArgument("Gpt::generate: the prompt needs at least one token");
  NoGradGuard ng;
  std::vector<int64_t> tokens = prompt;
  for (int64_t n = 0; n < maxNewTokens; ++n) {
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(tokens.size()), config_.contextLength);
    std::vector<int64_t> window(tokens.end() - len, tokens.end());
    // Padding after the last real token: under causal attention no real position sees it.
    if (layout_) window.resize(static_cast<size_t>(layout_->windowLength(len)), window.back());
    const Tensor logits = forward(fromVector<int64_t>(window, {1, static_cast<int64_t>(window.size())}));
    Tensor row = logits.select(0, 0).select(0, len - 1);
    if (layout_) row = layout_->wholeVocabulary(row);
    tokens.push_back(sampleToken(row, options, generator));
  }
  return tokens;
}

}  // namespace dt::nn
