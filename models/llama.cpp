// Llama: RMSNorm, rotate-half RoPE (rope_theta), SwiGLU, grouped-query attention (kv_heads), no
// biases, untied head by default. Names map one to one onto LlamaForCausalLM's.
#include <torch/torch.h>

#include "models/registry.h"

namespace tessel::models {
namespace {

DecoderOptions llama_options(const ModelShape& m) {
  DecoderOptions o;
  o.model = m;
  o.layer_norm = false;
  o.learned_pos = false;
  o.swiglu = true;
  o.linear_bias = false;
  return o;
}

const std::pair<const char*, const char*> kBlock[] = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"attn.q.weight", "self_attn.q_proj.weight"},
    {"attn.k.weight", "self_attn.k_proj.weight"},
    {"attn.v.weight", "self_attn.v_proj.weight"},
    {"attn.o.weight", "self_attn.o_proj.weight"},
    {"mlp_norm.weight", "post_attention_layernorm.weight"},
    {"mlp.gate.weight", "mlp.gate_proj.weight"},
    {"mlp.up.weight", "mlp.up_proj.weight"},
    {"mlp.down.weight", "mlp.down_proj.weight"}};

std::vector<std::pair<std::string, std::string>> name_pairs(const ModelShape& m) {
  std::vector<std::pair<std::string, std::string>> p = {
      {"embed.weight", "model.embed_tokens.weight"}, {"norm.weight", "model.norm.weight"}};
  for (int64_t i = 0; i < m.layers; ++i)
    for (const auto& [t, h] : kBlock)
      p.emplace_back("layers." + std::to_string(i) + "." + t,
                     "model.layers." + std::to_string(i) + "." + h);
  if (!m.tied()) p.emplace_back("head.weight", "lm_head.weight");
  return p;
}

Weights llama_from_hf(const Weights& hf, const ModelShape& m, const std::string& source) {
  Weights w;
  std::set<std::string> used;
  for (const auto& [t, h] : name_pairs(m)) {
    auto it = hf.find(h);
    if (it == hf.end())
      throw UserError(source + ": missing Hugging Face tensor '" + h + "' (llama)");
    w[t] = it->second;
    used.insert(h);
  }
  check_all_used(hf, used, source);
  return w;
}

std::vector<std::pair<std::string, torch::Tensor>> llama_to_hf(const Weights& w,
                                                               const ModelShape& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& [t, h] : name_pairs(m)) out.emplace_back(h, w.at(t));
  return out;
}

nlohmann::json llama_hf_config(const ModelShape& m) {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"vocab_size", m.vocab_size},
          {"hidden_size", m.hidden},
          {"intermediate_size", m.ffn_hidden},
          {"num_hidden_layers", m.layers},
          {"num_attention_heads", m.heads},
          {"num_key_value_heads", m.kv_heads},
          {"max_position_embeddings", m.max_seq_len},
          {"rms_norm_eps", m.norm_eps},
          {"rope_theta", m.rope_theta},
          {"tie_word_embeddings", m.tied()},
          {"hidden_act", "silu"},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"initializer_range", m.init_std},
          {"torch_dtype", "float32"}};
}

}  // namespace

extern const Arch kLlama{"llama", llama_options, llama_from_hf, llama_to_hf, llama_hf_config};

}  // namespace tessel::models
