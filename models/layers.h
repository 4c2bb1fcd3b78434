// Building blocks of both decoders. Every projection is its own named Linear (q, k, v, o; up,
// gate, down) so tensor parallelism can later replace them with column/row-parallel layers
// without rewriting the blocks, and checkpoints address them by global name.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "engine/config.h"

namespace tessel::models {

/// What differs between the two architectures, derived from the plan by the registry.
struct DecoderOptions {
  ModelConfig model;
  bool layer_norm = true;   // LayerNorm with bias (gpt2) or RMSNorm (llama)
  bool learned_pos = true;  // learned position table (gpt2) or RoPE (llama)
  bool swiglu = false;      // SwiGLU MLP (llama) or GELU-tanh MLP (gpt2)
  bool linear_bias = true;  // biases in projections (gpt2)
};

/// LayerNorm (weight, bias) or RMSNorm (weight), as in Hugging Face.
class NormImpl : public torch::nn::Module {
 public:
  NormImpl(int64_t dim, double eps, bool layer_norm);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;

 private:
  double eps_;
  bool layer_norm_;
};
TORCH_MODULE(Norm);

/// Causal self-attention through at::scaled_dot_product_attention, grouped-query when
/// kv_heads < heads. x: [b, s, h] -> [b, s, h].
class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const DecoderOptions& o);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};

 private:
  int64_t heads_, kv_heads_, head_dim_;
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const DecoderOptions& o);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear up{nullptr}, gate{nullptr}, down{nullptr};
};
TORCH_MODULE(Mlp);

/// Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const DecoderOptions& o);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  Norm attn_norm{nullptr}, mlp_norm{nullptr};
  Attention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

/// The decoder: embed (+ pos_embed) -> layers -> norm -> head (or the tied embedding).
/// forward(tokens [b, s] int64) -> logits [b, s, vocab].
class DecoderImpl : public torch::nn::Module {
 public:
  explicit DecoderImpl(DecoderOptions o);
  torch::Tensor forward(const torch::Tensor& tokens);
  const DecoderOptions& options() const { return o_; }

  torch::nn::Embedding embed{nullptr}, pos_embed{nullptr};
  torch::nn::ModuleList layers;
  Norm norm{nullptr};
  torch::nn::Linear head{nullptr};  // absent when tied

 private:
  std::pair<torch::Tensor, torch::Tensor> rope(int64_t seq, const torch::Tensor& like);
  DecoderOptions o_;
  torch::Tensor inv_freq_;  // [head_dim / 2], fp32, as Hugging Face computes it
};
TORCH_MODULE(Decoder);

}  // namespace tessel::models
