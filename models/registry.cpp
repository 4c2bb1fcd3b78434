#include "models/registry.h"

#include "core/optim/state_names.h"

#include <torch/torch.h>

namespace tessel::models {

extern const Arch kGpt2;
extern const Arch kLlama;

const Arch& arch(plan::ModelArch a) {
  switch (a) {  // a new ModelArch without its case here is a compiler warning (-Wswitch)
    case plan::ModelArch::kGpt2:
      return kGpt2;
    case plan::ModelArch::kLlama:
      return kLlama;
  }
  throw std::logic_error("models::arch: no builder for model.arch value " +
                         std::to_string(static_cast<int>(a)));
}

void check_all_used(const Weights& hf, const std::set<std::string>& used,
                    const std::string& source) {
  auto ignorable = [](const std::string& k) {
    auto ends = [&](const std::string& suf) {
      return k.size() >= suf.size() && k.compare(k.size() - suf.size(), suf.size(), suf) == 0;
    };
    return ends(".attn.bias") || ends(".attn.masked_bias") || ends("rotary_emb.inv_freq") ||
           k == "lm_head.weight";
  };
  std::string extra;
  for (const auto& [k, t] : hf)
    if (!used.count(k) && !ignorable(k)) extra += (extra.empty() ? "" : ", ") + k;
  if (!extra.empty())
    throw plan::UserError(
        source +
        ": tensors the plan's model does not have (more layers, or another architecture?): " +
        extra);
}

Decoder build_model(const ModelShape& m, int64_t seed, parallel::Group* tp, bool sequence_parallel,
                    const StagePart& stages, parallel::Group* cp, plan::CpMethod cp_method,
                    parallel::Group* ep) {
  auto o = arch(m.arch).options(m);
  o.tp = tp;
  o.ep = ep;
  o.sequence_parallel = sequence_parallel && tp && tp->size() > 1;
  o.stages = stages;
  o.cp = cp;
  o.cp_method = cp_method;
  Decoder model(o);
  init_weights(model, seed);
  return model;
}

int64_t block_parameters(const ModelShape& m, int64_t tp, int64_t layer, int64_t ep) {
  const auto o = arch(m.arch).options(m);
  const int64_t h = m.hidden, f = m.ffn_hidden, kv = m.kv_heads * m.head_dim();
  const int64_t bias = o.linear_bias ? 1 : 0;
  const int64_t norm = o.layer_norm ? 2 * h : h;
  // Column-parallel: weight and bias split over tp; row-parallel: weight split, bias whole. Key
  // and value projections are whole on every rank when tp > kv_heads (AttentionImpl).
  const int64_t q = (h * h + bias * h) / tp;
  const int64_t kv_one = m.kv_heads % tp == 0 ? (h * kv + bias * kv) / tp : h * kv + bias * kv;
  const int64_t attn = q + 2 * kv_one + h * h / tp + bias * h;
  const int64_t qk_norm = m.qk_norm ? 2 * m.head_dim() : 0;
  auto dense = [&](int64_t f) {
    return (o.swiglu ? 2 : 1) * (h * f + bias * f) / tp + f / tp * h + bias * h;
  };
  const auto& moe = m.moe;
  const int64_t mlp = !moe.is_moe(layer)
                          ? dense(f)
                          : moe.experts * h + moe.experts / ep * 3 * moe.ffn_hidden * h +
                                (moe.shared > 0 ? dense(moe.shared * moe.ffn_hidden) : 0);
  return 2 * norm + attn + qk_norm + mlp;
}

int64_t expert_parameters_on_rank(const ModelShape& m, const StagePart& stages, int64_t ep) {
  auto chunks = stages.chunks;
  if (chunks.empty()) chunks = {{0, m.layers}};
  int64_t n = 0;
  for (const auto& [b, e] : chunks)
    for (int64_t i = b; i < e; ++i)
      if (m.moe.is_moe(i)) n += m.moe.experts / ep * 3 * m.moe.ffn_hidden * m.hidden;
  return n;
}

int64_t parameters_on_rank(const ModelShape& m, int64_t tp, const StagePart& stages, int64_t ep) {
  const auto o = arch(m.arch).options(m);
  const int64_t table = parallel::tp::padded_vocab(m.vocab_size, tp) / tp * m.hidden;
  int64_t n = 0;
  auto chunks = stages.chunks;
  if (chunks.empty()) chunks = {{0, m.layers}};
  for (const auto& [b, e] : chunks)
    for (int64_t i = b; i < e; ++i) n += block_parameters(m, tp, i, ep);
  if (stages.first) n += table + (o.learned_pos ? m.max_seq_len * m.hidden : 0);
  if (stages.last) {
    n += o.layer_norm ? 2 * m.hidden : m.hidden;
    if (!m.tied() || !stages.first) n += table;  // the head, or the tied table's copy
  }
  return n;
}

Weights model_weights(Decoder& model) {
  Weights w;
  for (const auto& p : model->named_parameters()) w[p.key()] = p.value().detach().to(torch::kCPU);
  return w;
}

void assign_weights(Decoder& model, const Weights& w, const std::string& source) {
  auto params = model->named_parameters();
  // The file holds the global model: every name of it must exist in the global model, and every
  // parameter this rank holds (its pipeline stages) must be in the file.
  const auto global = model->global_names();
  std::string missing, extra;
  for (const auto& p : params)
    if (!w.count(p.key())) missing += (missing.empty() ? "" : ", ") + p.key();
  for (const auto& [name, t] : w)
    if (!global.count(name)) extra += (extra.empty() ? "" : ", ") + name;
  if (!missing.empty())
    throw plan::UserError(source + ": missing tensors for this model: " + missing);
  if (!extra.empty())
    throw plan::UserError(source + ": tensors this model does not have: " + extra);
  torch::NoGradGuard no_grad;
  for (auto& p : params) {
    const auto& t = w.at(p.key());
    const auto& spec = model->specs().at(p.key());
    if (t.sizes() != c10::IntArrayRef(spec.global_shape)) {
      std::ostringstream s;
      s << source << ": tensor '" << p.key() << "' has shape " << t.sizes()
        << " but the plan's model needs " << c10::IntArrayRef(spec.global_shape);
      throw plan::UserError(s.str());
    }
    p.value().copy_(spec.local_of(t));
  }
}

std::vector<optim::NamedParam> named_params(Decoder& model) {
  std::vector<optim::NamedParam> out;
  for (const auto& p : model->named_parameters()) {
    if (!p.value().requires_grad()) continue;  // state that is not trained (MoE balance bias)
    const auto& spec = model->specs().at(p.key());
    out.push_back({p.key(), p.value(), spec.chunk, spec.replicas, spec.expert});
  }
  return out;
}

void load_weights(Decoder& model, const Weights& tensors, const std::string& source) {
  const auto& m = model->options().model;
  // Tessel's own files use Tessel names; anything else is read as Hugging Face names.
  // A checkpoint's rank file also holds optimizer state (optim.*), which is not model weights.
  if (tensors.count("embed.weight") > 0) {
    Weights w;
    for (auto& [name, t] : tensors)
      if (!optim::is_optimizer_state(name)) w[name] = t;
    assign_weights(model, w, source);
  } else {
    std::set<std::string> keep;  // this rank's parameters: nothing else is copied
    for (const auto& p : model->named_parameters()) keep.insert(p.key());
    assign_weights(model, arch(m.arch).from_hf(tensors, m, source, &keep), source);
  }
}

}  // namespace tessel::models
