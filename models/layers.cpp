#include "models/layers.h"

#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/normalization.h>

namespace tessel::models {
namespace F = torch::nn::functional;

NormImpl::NormImpl(int64_t dim, double eps, bool layer_norm) : eps_(eps), layer_norm_(layer_norm) {
  weight = register_parameter("weight", torch::ones({dim}));
  if (layer_norm) bias = register_parameter("bias", torch::zeros({dim}));
}

torch::Tensor NormImpl::forward(const torch::Tensor& x) {
  if (layer_norm_) return at::layer_norm(x, {x.size(-1)}, weight, bias, eps_);
  // RMSNorm as Hugging Face's LlamaRMSNorm: statistics in fp32, scale in the weight's dtype.
  auto x32 = x.to(torch::kFloat32);
  auto y = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight * y.to(x.scalar_type());
}

AttentionImpl::AttentionImpl(const DecoderOptions& opt)
    : heads_(opt.model.heads), kv_heads_(opt.model.kv_heads), head_dim_(opt.model.head_dim()) {
  const int64_t h = opt.model.hidden, kv = kv_heads_ * head_dim_;
  auto lin = [&](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(opt.linear_bias));
  };
  q = register_module("q", lin(h, h));
  k = register_module("k", lin(h, kv));
  v = register_module("v", lin(h, kv));
  o = register_module("o", lin(h, h));
}

namespace {
// Rotate-half RoPE (GPT-NeoX / Hugging Face Llama convention). x: [b, heads, s, d].
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos,
                         const torch::Tensor& sin) {
  auto halves = x.chunk(2, -1);
  auto rotated = torch::cat({-halves[1], halves[0]}, -1);
  return x * cos + rotated * sin;
}
}  // namespace

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                     const torch::Tensor& sin) {
  const int64_t b = x.size(0), s = x.size(1);
  // [b, s, heads·d] -> [b, heads, s, d]
  auto qh = q(x).view({b, s, heads_, head_dim_}).transpose(1, 2);
  auto kh = k(x).view({b, s, kv_heads_, head_dim_}).transpose(1, 2);
  auto vh = v(x).view({b, s, kv_heads_, head_dim_}).transpose(1, 2);
  if (cos.defined()) {
    qh = apply_rope(qh, cos, sin);
    kh = apply_rope(kh, cos, sin);
  }
  auto y = at::scaled_dot_product_attention(qh, kh, vh, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                            /*is_causal=*/true, /*scale=*/std::nullopt,
                                            /*enable_gqa=*/kv_heads_ != heads_);
  return o(y.transpose(1, 2).reshape({b, s, heads_ * head_dim_}));
}

MlpImpl::MlpImpl(const DecoderOptions& o) {
  const int64_t h = o.model.hidden, f = o.model.ffn_hidden;
  auto opts = [&](int64_t in, int64_t out) {
    return torch::nn::LinearOptions(in, out).bias(o.linear_bias);
  };
  up = register_module("up", torch::nn::Linear(opts(h, f)));
  if (o.swiglu) gate = register_module("gate", torch::nn::Linear(opts(h, f)));
  down = register_module("down", torch::nn::Linear(opts(f, h)));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  if (gate) return down(torch::silu(gate(x)) * up(x));
  return down(torch::gelu(up(x), "tanh"));
}

BlockImpl::BlockImpl(const DecoderOptions& o) {
  attn_norm = register_module("attn_norm", Norm(o.model.hidden, o.model.norm_eps, o.layer_norm));
  attn = register_module("attn", Attention(o));
  mlp_norm = register_module("mlp_norm", Norm(o.model.hidden, o.model.norm_eps, o.layer_norm));
  mlp = register_module("mlp", Mlp(o));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                 const torch::Tensor& sin) {
  auto h = x + attn(attn_norm(x), cos, sin);
  return h + mlp(mlp_norm(h));
}

DecoderImpl::DecoderImpl(DecoderOptions o) : o_(std::move(o)) {
  const auto& m = o_.model;
  embed = register_module("embed", torch::nn::Embedding(m.vocab_size, m.hidden));
  if (o_.learned_pos) {
    pos_embed = register_module("pos_embed", torch::nn::Embedding(m.max_seq_len, m.hidden));
  } else {
    const int64_t d = m.head_dim();
    inv_freq_ = 1.0 / torch::pow(m.rope_theta,
                                 torch::arange(0, d, 2, torch::kInt64).to(torch::kFloat32) / d);
  }
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < m.layers; ++i) layers->push_back(Block(o_));
  norm = register_module("norm", Norm(m.hidden, m.norm_eps, o_.layer_norm));
  if (!m.tied())
    head = register_module(
        "head", torch::nn::Linear(torch::nn::LinearOptions(m.hidden, m.vocab_size).bias(false)));
}

std::pair<torch::Tensor, torch::Tensor> DecoderImpl::rope(int64_t seq, const torch::Tensor& like) {
  // Angles in fp32 on the device, then cast to the activation dtype (as Hugging Face does).
  auto pos =
      torch::arange(seq, torch::TensorOptions().dtype(torch::kFloat32).device(like.device()));
  auto freqs = torch::outer(pos, inv_freq_.to(like.device()));  // [s, d/2]
  auto emb = torch::cat({freqs, freqs}, -1);                    // [s, d]
  return {emb.cos().to(like.scalar_type()), emb.sin().to(like.scalar_type())};
}

torch::Tensor DecoderImpl::forward(const torch::Tensor& tokens) {
  const int64_t s = tokens.size(1);
  auto x = embed(tokens);  // [b, s, h]
  torch::Tensor cos, sin;
  if (pos_embed) {
    x = x + pos_embed(torch::arange(s, tokens.options()));
  } else {
    std::tie(cos, sin) = rope(s, x);
  }
  for (const auto& layer : *layers) x = layer->as<Block>()->forward(x, cos, sin);
  x = norm(x);
  return head ? head(x) : torch::matmul(x, embed->weight.t());  // [b, s, vocab]
}

}  // namespace tessel::models
