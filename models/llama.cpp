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
  o.mlp = resolved_mlp(m.mlp, plan::Mlp::kSwiGlu);
  o.linear_bias = false;
  return o;
}

// Attention and norms, the same in every llama-family layer.
const std::pair<const char*, const char*> kBlock[] = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"attn.q.weight", "self_attn.q_proj.weight"},
    {"attn.k.weight", "self_attn.k_proj.weight"},
    {"attn.v.weight", "self_attn.v_proj.weight"},
    {"attn.o.weight", "self_attn.o_proj.weight"},
    {"mlp_norm.weight", "post_attention_layernorm.weight"}};
const std::pair<const char*, const char*> kDense[] = {{"mlp.gate.weight", "mlp.gate_proj.weight"},
                                                      {"mlp.up.weight", "mlp.up_proj.weight"},
                                                      {"mlp.down.weight", "mlp.down_proj.weight"}};

// Mixture of experts: Mixtral's names (block_sparse_moe, w1 gate / w3 up / w2 down) unless the
// model has Qwen3's per-head norms, then Qwen3-MoE's (mlp.gate, gate_proj / up_proj / down_proj).
// Shared experts take DeepSeek's names (mlp.shared_experts.*_proj). Tessel stacks a layer's experts
// in one tensor per projection; Hugging Face holds one tensor per expert.
bool mixtral_names(const ModelShape& m) { return !m.qk_norm; }

struct ExpertNames {
  std::string router;
  std::vector<std::pair<std::string, std::string>> stacked;  // Tessel suffix, HF "...%d..." parts
};

std::string expert_prefix(const ModelShape& m, int64_t layer) {
  return "model.layers." + std::to_string(layer) +
         (mixtral_names(m) ? ".block_sparse_moe." : ".mlp.");
}

std::string expert_name(const ModelShape& m, int64_t layer, int64_t e, const std::string& proj) {
  return expert_prefix(m, layer) + "experts." + std::to_string(e) + "." + proj + ".weight";
}

const std::pair<const char*, const char*> kMixtral[] = {
    {"mlp.experts.gate", "w1"}, {"mlp.experts.up", "w3"}, {"mlp.experts.down", "w2"}};
const std::pair<const char*, const char*> kQwen3[] = {{"mlp.experts.gate", "gate_proj"},
                                                      {"mlp.experts.up", "up_proj"},
                                                      {"mlp.experts.down", "down_proj"}};

// Every one-to-one pair (Tessel, HF); the stacked experts are expert_pairs().
std::vector<std::pair<std::string, std::string>> name_pairs(const ModelShape& m) {
  std::vector<std::pair<std::string, std::string>> p = {
      {"embed.weight", "model.embed_tokens.weight"}, {"norm.weight", "model.norm.weight"}};
  for (int64_t i = 0; i < m.layers; ++i) {
    const std::string t = "layers." + std::to_string(i) + ".",
                      h = "model.layers." + std::to_string(i) + ".";
    for (const auto& [a, b] : kBlock) p.emplace_back(t + a, h + b);
    if (m.qk_norm) {
      p.emplace_back(t + "attn.q_norm.weight", h + "self_attn.q_norm.weight");
      p.emplace_back(t + "attn.k_norm.weight", h + "self_attn.k_norm.weight");
    }
    if (!m.moe.is_moe(i)) {
      for (const auto& [a, b] : kDense) p.emplace_back(t + a, h + b);
      continue;
    }
    p.emplace_back(t + "mlp.router.weight", expert_prefix(m, i) + "gate.weight");
    if (m.moe.shared > 0)
      for (const auto& [a, b] : kDense)
        p.emplace_back(t + "mlp.shared." + std::string(a).substr(4),
                       h + "mlp.shared_experts." + std::string(b).substr(4));
  }
  if (!m.tied()) p.emplace_back("head.weight", "lm_head.weight");
  return p;
}

// (Tessel stacked name, HF name of each expert) for every MoE layer and projection.
std::vector<std::pair<std::string, std::vector<std::string>>> expert_pairs(const ModelShape& m) {
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  for (int64_t i = 0; i < m.layers; ++i) {
    if (!m.moe.is_moe(i)) continue;
    for (const auto& [t, proj] : mixtral_names(m) ? kMixtral : kQwen3) {
      std::vector<std::string> names;
      for (int64_t e = 0; e < m.moe.experts; ++e) names.push_back(expert_name(m, i, e, proj));
      out.emplace_back("layers." + std::to_string(i) + "." + t, std::move(names));
    }
  }
  return out;
}

Weights llama_from_hf(const Weights& hf, const ModelShape& m, const std::string& source,
                      const std::set<std::string>* keep) {
  hf_activation(m, source);  // the file's MLP must be one LlamaForCausalLM holds
  auto kept = [keep](const std::string& t) { return !keep || keep->count(t) > 0; };
  Weights w;
  std::set<std::string> used;
  auto take = [&](const std::string& h) {
    auto it = hf.find(h);
    if (it == hf.end())
      throw plan::UserError(source + ": missing Hugging Face tensor '" + h + "' (" +
                            (m.moe.experts == 0 ? "llama"
                             : mixtral_names(m) ? "Mixtral-style MoE"
                                                : "Qwen3-MoE-style MoE") +
                            ")");
    used.insert(h);
    return it->second;
  };
  for (const auto& [t, h] : name_pairs(m)) w[t] = take(h);  // views of the files
  for (const auto& [t, names] : expert_pairs(m)) {
    std::vector<torch::Tensor> experts;
    for (const auto& h : names) experts.push_back(take(h));
    if (kept(t)) w[t] = torch::stack(experts);  // a copy: only for a layer this rank holds
  }
  // Auxiliary-loss-free balancing starts from no bias (Mixtral and Qwen3-MoE have none).
  if (m.moe.bias_update_rate > 0)
    for (int64_t i = 0; i < m.layers; ++i)
      if (m.moe.is_moe(i) && kept("layers." + std::to_string(i) + ".mlp.router.bias"))
        w["layers." + std::to_string(i) + ".mlp.router.bias"] = torch::zeros({m.moe.experts});
  check_all_used(hf, used, source);
  return w;
}

std::vector<std::pair<std::string, torch::Tensor>> llama_to_hf(const Weights& w,
                                                               const ModelShape& m) {
  hf_activation(m, "export to Hugging Face");
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& [t, h] : name_pairs(m)) out.emplace_back(h, w.at(t));
  for (const auto& [t, names] : expert_pairs(m)) {
    const auto& stacked = w.at(t);
    for (size_t e = 0; e < names.size(); ++e)
      out.emplace_back(names[e], stacked[static_cast<int64_t>(e)].contiguous());
  }
  return out;
}

nlohmann::json moe_hf_config(const ModelShape& m, nlohmann::json c) {
  const auto& e = m.moe;
  c["router_aux_loss_coef"] = e.aux_loss_coef;
  c["num_experts_per_tok"] = e.top_k;
  c["output_router_logits"] = false;
  if (mixtral_names(m)) {
    c["architectures"] = {"MixtralForCausalLM"};
    c["model_type"] = "mixtral";
    c["num_local_experts"] = e.experts;
    c["intermediate_size"] = e.ffn_hidden;
    c["sliding_window"] = nullptr;
  } else {
    c["architectures"] = {"Qwen3MoeForCausalLM"};
    c["model_type"] = "qwen3_moe";
    c["num_experts"] = e.experts;
    c["moe_intermediate_size"] = e.ffn_hidden;
    c["decoder_sparse_step"] = e.every;
    c["mlp_only_layers"] = nlohmann::json::array();
    c["norm_topk_prob"] = e.norm_topk;
    c["head_dim"] = m.head_dim();
    c["use_sliding_window"] = false;
  }
  return c;
}

nlohmann::json llama_hf_config(const ModelShape& m) {
  nlohmann::json c = {{"architectures", {"LlamaForCausalLM"}},
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
                      {"hidden_act", hf_activation(m, "config.json of llama")},
                      {"attention_bias", false},
                      {"mlp_bias", false},
                      {"initializer_range", m.init_std},
                      {"torch_dtype", "float32"}};
  return m.moe.experts > 0 ? moe_hf_config(m, c) : c;
}

// LlamaMLP: down(act(gate x) * up x), always gated.
const char* llama_activation(plan::Mlp form) {
  switch (form) {
    case plan::Mlp::kSwiGlu:
      return "silu";
    case plan::Mlp::kGeluTanh:
    case plan::Mlp::kRelu2:
    case plan::Mlp::kAuto:
      break;
  }
  return nullptr;
}

}  // namespace

extern const Arch kLlama{"llama",     llama_options,   llama_from_hf,
                         llama_to_hf, llama_hf_config, llama_activation};

}  // namespace tessel::models
