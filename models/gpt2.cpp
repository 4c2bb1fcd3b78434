// GPT-2: learned positions, LayerNorm, GELU (tanh approximation), tied embeddings by default.
// Hugging Face's GPT2 uses Conv1D ([in, out] weights) and a fused c_attn: we split and transpose.
#include <torch/torch.h>

#include "models/registry.h"

namespace tessel::models {
namespace {

DecoderOptions gpt2_options(const ModelShape& m) {
  DecoderOptions o;
  o.model = m;
  o.layer_norm = true;
  o.learned_pos = true;
  o.mlp = resolved_mlp(m.mlp, plan::Mlp::kGeluTanh);
  o.linear_bias = true;
  return o;
}

// Tessel name suffix <-> Hugging Face name suffix, per block; Conv1D weights need a transpose.
struct Pair {
  const char* tessel;
  const char* hf;
  bool transpose;
};
const Pair kBlock[] = {
    {"attn_norm.weight", "ln_1.weight", false},     {"attn_norm.bias", "ln_1.bias", false},
    {"attn.o.weight", "attn.c_proj.weight", true},  {"attn.o.bias", "attn.c_proj.bias", false},
    {"mlp_norm.weight", "ln_2.weight", false},      {"mlp_norm.bias", "ln_2.bias", false},
    {"mlp.up.weight", "mlp.c_fc.weight", true},     {"mlp.up.bias", "mlp.c_fc.bias", false},
    {"mlp.down.weight", "mlp.c_proj.weight", true}, {"mlp.down.bias", "mlp.c_proj.bias", false}};
const Pair kTop[] = {{"embed.weight", "wte.weight", false},
                     {"pos_embed.weight", "wpe.weight", false},
                     {"norm.weight", "ln_f.weight", false},
                     {"norm.bias", "ln_f.bias", false}};

// Every tensor a view of its file (`keep` unread: nothing here copies).
Weights gpt2_from_hf(const Weights& hf_in, const ModelShape& m, const std::string& source,
                     const std::set<std::string>* /*keep*/) {
  hf_activation(m, source);  // the file's MLP must be one GPT2LMHeadModel holds
  // save_pretrained of GPT2LMHeadModel prefixes "transformer."; the hub's gpt2 files do not.
  Weights hf;
  for (const auto& [k, v] : hf_in) hf[k.rfind("transformer.", 0) == 0 ? k.substr(12) : k] = v;
  std::set<std::string> used;
  auto get = [&](const std::string& k) -> torch::Tensor {
    auto it = hf.find(k);
    if (it == hf.end())
      throw plan::UserError(source + ": missing Hugging Face tensor '" + k + "' (gpt2)");
    used.insert(k);
    return it->second;
  };
  Weights w;
  for (const auto& p : kTop) w[p.tessel] = get(p.hf);
  for (int64_t i = 0; i < m.layers; ++i) {
    std::string t = "layers." + std::to_string(i) + ".", h = "h." + std::to_string(i) + ".";
    for (const auto& p : kBlock) w[t + p.tessel] = p.transpose ? get(h + p.hf).t() : get(h + p.hf);
    auto qkv_w = get(h + "attn.c_attn.weight").t().chunk(3, 0);  // [3h, h] -> q, k, v
    auto qkv_b = get(h + "attn.c_attn.bias").chunk(3, 0);
    const char* names[] = {"q", "k", "v"};
    for (int j = 0; j < 3; ++j) {
      w[t + "attn." + names[j] + ".weight"] = qkv_w[j];  // views: copied where a rank keeps them
      w[t + "attn." + names[j] + ".bias"] = qkv_b[j];
    }
  }
  if (!m.tied()) w["head.weight"] = get("lm_head.weight");
  check_all_used(hf, used, source);
  return w;
}

std::vector<std::pair<std::string, torch::Tensor>> gpt2_to_hf(const Weights& w,
                                                              const ModelShape& m) {
  hf_activation(m, "export to Hugging Face");
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : kTop) out.emplace_back("transformer." + std::string(p.hf), w.at(p.tessel));
  for (int64_t i = 0; i < m.layers; ++i) {
    std::string t = "layers." + std::to_string(i) + ".",
                h = "transformer.h." + std::to_string(i) + ".";
    for (const auto& p : kBlock)
      out.emplace_back(h + p.hf,
                       p.transpose ? w.at(t + p.tessel).t().contiguous() : w.at(t + p.tessel));
    out.emplace_back(
        h + "attn.c_attn.weight",
        torch::cat(
            {w.at(t + "attn.q.weight"), w.at(t + "attn.k.weight"), w.at(t + "attn.v.weight")}, 0)
            .t()
            .contiguous());
    out.emplace_back(
        h + "attn.c_attn.bias",
        torch::cat({w.at(t + "attn.q.bias"), w.at(t + "attn.k.bias"), w.at(t + "attn.v.bias")}, 0));
  }
  if (!m.tied()) out.emplace_back("lm_head.weight", w.at("head.weight"));
  return out;
}

nlohmann::json gpt2_hf_config(const ModelShape& m) {
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", m.vocab_size},
          {"n_positions", m.max_seq_len},
          {"n_embd", m.hidden},
          {"n_layer", m.layers},
          {"n_head", m.heads},
          {"n_inner", m.ffn_hidden},
          {"activation_function", hf_activation(m, "config.json of gpt2")},
          {"layer_norm_epsilon", m.norm_eps},
          {"initializer_range", m.init_std},
          {"tie_word_embeddings", m.tied()},
          {"resid_pdrop", 0.0},
          {"embd_pdrop", 0.0},
          {"attn_pdrop", 0.0},
          {"torch_dtype", "float32"}};
}

// GPT2MLP: down(act(up x)), not gated.
const char* gpt2_activation(plan::Mlp form) {
  switch (form) {
    case plan::Mlp::kGeluTanh:
      return "gelu_new";
    case plan::Mlp::kRelu2:
      return "relu2";
    case plan::Mlp::kSwiGlu:
    case plan::Mlp::kAuto:
      break;
  }
  return nullptr;
}

}  // namespace

extern const Arch kGpt2{"gpt2",     gpt2_options,   gpt2_from_hf,
                        gpt2_to_hf, gpt2_hf_config, gpt2_activation};

}  // namespace tessel::models
