// Transformer building blocks and a GPT-style language model (GPT-2's architecture).
//
//   dt::nn::GptConfig config{.vocabSize = 256, .contextLength = 128, .layers = 4, .heads = 4, .width = 256};
//   dt::Generator gen(0);
//   auto model = std::make_shared<dt::nn::Gpt>(config, gen);
//   dt::Tensor logits = (*model)(tokens);                       // tokens int64 [B, T] -> [B, T, V]
//   dt::Tensor loss = model->loss(logits, targets);             // mean next-token cross-entropy
//   std::vector<int64_t> text = model->generate(prompt, 200, {.temperature = 0.8, .topK = 40}, gen);
//
// Contract:
//  * Modules and parameter names follow GPT-2 (and nanoGPT): wte, wpe, h.<i>.ln_1,
//    h.<i>.attn.c_attn (the fused q/k/v projection), h.<i>.attn.c_proj, h.<i>.ln_2,
//    h.<i>.mlp.c_fc, h.<i>.mlp.c_proj, ln_f. Every block is its own module (a child of the
//    Sequential "h"), so a wrapper can take blocks one by one.
//  * The output layer is tied to the token embedding: the logits are x wte^T. The weight is
//    one parameter (listed once, as "wte.weight"); autograd sums its two gradients before its
//    accumulator runs, so DDP's hook sees it once per backward and reduces it once.
//  * Initialisation as GPT-2: every Linear weight and both embeddings N(0, 0.02), biases 0,
//    LayerNorm 1 and 0, and the two residual projections of each block (attn.c_proj,
//    mlp.c_proj) N(0, 0.02 / sqrt(2 layers)). Drawn from the generator given, in
//    registration order: the same seed gives the same model on every machine.
//  * Dropout (embeddings, attention probabilities, both residual branches) draws from the
//    dropout generator passed to the constructor (the init generator if none) while training;
//    eval() turns it off. The embeddings' dropout is the child "drop" and the MLP's the child
//    "h.<i>.mlp.dropout" (nn::Dropout, no parameters), so a parallelization can put a dropout
//    that draws another way in their place (sequence parallelism: this rank's block of the mask).
//  * forward takes int64 (or int32) tokens [B, T] with T <= contextLength, each below
//    vocabSize; otherwise InvalidArgument names the shape or token. CPU tensors: attention has
//    no CUDA kernel yet (a CUDA model throws NotSupportedError from selfAttention).
//  * generate() runs under NoGradGuard and does not change train/eval; the caller chooses.
//  * Children are called through Module (their call operator), so replaceChild() can put any
//    module with the same forward in a child's place (parallel/'s parallelize() puts tensor-
//    parallel layers there); the typed members (wte, attn, c_fc, ...) follow a replacement
//    and are null once the child is of another type: reach it through child(name) then.
//    The output layer uses whatever parameter "weight" the child "wte" holds.
//  * A GptLayout (setLayout) changes where the activations are split: the plain model has
//    none. With one, forward's logits may be a block of the vocabulary: take the loss with
//    nextTokenLoss(), which uses the layout's (Gpt::loss expects the whole vocabulary).
//    generate() asks the layout for each window's length (sequence parallelism pads it, on the
//    right, where causal attention leaves the real positions alone) and for the whole
//    vocabulary's logits of the last position (a collective over the layout's group): every
//    rank of that group calls generate with the same prompt and an equally seeded generator,
//    and all of them get the same tokens.
//  * Not thread-safe (as Module).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tensor/nn/module.h"

namespace dt::nn {

struct GptConfig {
  int64_t vocabSize = 256;
  int64_t contextLength = 128;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 256;  // embedding width; a multiple of heads
  double dropout = 0.0;
  double layerNormEps = 1e-5;
  // Each block's activations are recomputed in backward instead of kept (autograd::checkpoint;
  // dropout draws the same masks both times): less memory, one more forward of every block.
  bool activationCheckpointing = false;
  // Throws InvalidArgument naming the first impossible value.
  void validate() const;
  // Parameters of the model this config makes (the tied output layer counted once).
  int64_t parameterCount() const;
};

// Causal multi-head self-attention: one fused Linear(C, 3C) for q, k and v, the fused
// selfAttention op (causal mask, dropout on the probabilities), Linear(C, C) back, dropout.
class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(const GptConfig& config, Generator& init, Generator& dropout);
  Tensor forward(const Tensor& x) override;  // [B, T, C] -> [B, T, C]
  std::string typeName() const override { return "CausalSelfAttention"; }
  int64_t heads() const { return heads_; }
  // What the attention probabilities and the output draw their dropout with (for a tensor-
  // parallel replacement, which must draw the replicated output's mask as this one does).
  double dropoutProbability() const { return dropout_; }
  Generator& dropoutGenerator() const { return *dropoutGenerator_; }
  std::shared_ptr<Linear> c_attn;
  std::shared_ptr<Linear> c_proj;

 protected:
  void childReplaced(const std::string& name, const std::shared_ptr<Module>& module) override;

 private:
  int64_t heads_;
  double dropout_;
  Generator* dropoutGenerator_;
};

// Linear(C, 4C), GELU, Linear(4C, C), dropout (the child "dropout").
class Mlp : public Module {
 public:
  Mlp(const GptConfig& config, Generator& init, Generator& dropout);
  Tensor forward(const Tensor& x) override;
  std::string typeName() const override { return "Mlp"; }
  std::shared_ptr<Linear> c_fc;
  std::shared_ptr<Linear> c_proj;

 protected:
  void childReplaced(const std::string& name, const std::shared_ptr<Module>& module) override;
};

// Pre-norm block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). With checkpointActivations
// (GptConfig::activationCheckpointing) the block runs under autograd::checkpoint.
class TransformerBlock : public Module {
 public:
  TransformerBlock(const GptConfig& config, Generator& init, Generator& dropout);
  Tensor forward(const Tensor& x) override;
  std::string typeName() const override { return "TransformerBlock"; }
  std::shared_ptr<LayerNorm> ln_1;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<LayerNorm> ln_2;
  std::shared_ptr<Mlp> mlp;
  bool checkpointActivations = false;

 protected:
  void childReplaced(const std::string& name, const std::shared_ptr<Module>& module) override;

 private:
  Tensor body(const Tensor& x);
  double dropout_;
  Generator* dropoutGenerator_;
};

struct SamplingOptions {
  double temperature = 1.0;  // 0: always the most likely token (greedy)
  int64_t topK = 0;          // 0: all tokens; else only the k most likely
};

// Draws a token from one row of logits [V]: logits / temperature, only the topK largest kept
// (ties broken towards the lower token), softmax, then one uniform number from `generator`.
int64_t sampleToken(const Tensor& logits, const SamplingOptions& options, Generator& generator);

// Where a parallelization changes the layout of Gpt's activations; parallel/ implements it for
// tensor and sequence parallelism. Each method runs inside Gpt::forward (or nextTokenLoss) on
// the caller's thread and may issue collectives; it is called the same number of times, in
// the same order, on every rank that runs the model.
class GptLayout {
 public:
  virtual ~GptLayout() = default;
  // The embeddings' sum [B, T, C] (before the embedding dropout) -> what the blocks take
  // (sequence parallelism: this rank's block of T).
  virtual Tensor enterBlocks(const Tensor& embedded) = 0;
  // ln_f's output -> the tied output layer's input (tensor parallelism: copied into the
  // tensor-parallel region; sequence parallelism: the whole sequence gathered).
  virtual Tensor enterHead(const Tensor& normalized) = 0;
  // The mean next-token loss of forward's logits (a block of the vocabulary when the output
  // layer is split) against targets [B, T].
  virtual Tensor loss(const Tensor& logits, const Tensor& targets) = 0;
  // For messages: "tensor-parallel over pg=tp0 (degree 2, sequence-parallel)".
  virtual std::string describe() const = 0;
  // Generation: the tokens forward takes for a window of `length` (at most contextLength), and
  // the whole vocabulary's logits [V] of one position from forward's row (a block of it when the
  // output layer is split; then a collective). The plain model's: length and the row as they are.
  virtual int64_t windowLength(int64_t length) const { return length; }
  virtual Tensor wholeVocabulary(const Tensor& row) { return row; }
};

class Gpt : public Module {
 public:
  // dropout: the generator dropout draws from (init's when null); it must outlive the model.
  Gpt(const GptConfig& config, Generator& init, Generator* dropout = nullptr);
  Tensor forward(const Tensor& tokens) override;  // int64 [B, T] -> logits [B, T, V]
  std::string typeName() const override { return "Gpt"; }
  // Mean next-token cross-entropy of logits [B, T, V] against targets int64 [B, T].
  static Tensor loss(const Tensor& logits, const Tensor& targets);
  // The same loss of this model's own logits: loss() for the plain model, the layout's (which
  // takes a block of the vocabulary) when one is set.
  Tensor nextTokenLoss(const Tensor& logits, const Tensor& targets) const;
  // Installs (or with null removes) the layout forward and nextTokenLoss go through.
  void setLayout(std::shared_ptr<GptLayout> layout) { layout_ = std::move(layout); }
  const std::shared_ptr<GptLayout>& layout() const { return layout_; }
  // Continues `prompt` (at least one token) by maxNewTokens sampled tokens, feeding the model
  // at most contextLength tokens at a time; returns prompt + the new tokens.
  std::vector<int64_t> generate(const std::vector<int64_t>& prompt, int64_t maxNewTokens,
                                const SamplingOptions& options, Generator& generator);
  const GptConfig& config() const { return config_; }
  // The generator every dropout of the model draws from.
  Generator& dropoutGenerator() const { return *dropoutGenerator_; }

  std::shared_ptr<Embedding> wte;
  std::shared_ptr<Embedding> wpe;
  std::shared_ptr<Sequential> h;
  std::shared_ptr<LayerNorm> ln_f;

 protected:
  void childReplaced(const std::string& name, const std::shared_ptr<Module>& module) override;

 private:
  GptConfig config_;
  Generator* dropoutGenerator_;
  Tensor tiedWeight_;  // the output layer's weight: wte's "weight", whatever module wte is
  std::shared_ptr<GptLayout> layout_;
};

}  // namespace dt::nn
