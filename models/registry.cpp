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

DecoderOptions features(const ModelShape& m) { return arch(m.arch).options(m); }

std::vector<std::pair<plan::Mlp, std::string>> hf_forms(const Arch& a) {
  std::vector<std::pair<plan::Mlp, std::string>> forms;
  for (size_t i = 1; i < plan::choice_names(plan::Mlp{}).size(); ++i)  // every form but auto
    if (const char* name = a.hf_activation(static_cast<plan::Mlp>(i)))
      forms.emplace_back(static_cast<plan::Mlp>(i), name);
  return forms;
}

std::string hf_activation(const ModelShape& m, const std::string& use) {
  const auto& a = arch(m.arch);
  const plan::Mlp form = features(m).mlp;
  if (const char* name = a.hf_activation(form)) return name;
  std::string held;
  for (const auto& [f, name] : hf_forms(a)) held += (held.empty() ? "" : ", ") + plan::name_of(f);
  throw plan::UserError(use + ": model.mlp " + plan::name_of(form) + " has no Hugging Face " +
                        a.name + " form (its MLP is " + held + " only)");
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

namespace {

// param_entries' writer: the parameters of each module kind as the modules register them.
struct EntryWriter {
  const ModelShape& m;
  DecoderOptions o;
  int64_t tp, ep;
  std::vector<optim::ParamEntry> out;

  void add(const std::string& name, int64_t numel, int64_t chunk, bool expert = false) {
    out.push_back({name, numel, chunk, expert});
  }
  void norm(const std::string& name, int64_t dim, int64_t chunk, bool layer_norm) {
    add(name + ".weight", dim, chunk);
    if (layer_norm) add(name + ".bias", dim, chunk);
  }
  // Column-parallel: weight and bias split over tp; row-parallel: weight split, bias whole
  // (parallel/tp/layers.h).
  void column(const std::string& name, int64_t in, int64_t out_features, int64_t chunk) {
    add(name + ".weight", out_features / tp * in, chunk);
    if (o.linear_bias) add(name + ".bias", out_features / tp, chunk);
  }
  void row(const std::string& name, int64_t in, int64_t out_features, int64_t chunk) {
    add(name + ".weight", out_features * (in / tp), chunk);
    if (o.linear_bias) add(name + ".bias", out_features, chunk);
  }
  void mlp(const std::string& name, int64_t f, int64_t chunk) {
    column(name + ".up", m.hidden, f, chunk);
    if (mlp_form(o.mlp).gated()) column(name + ".gate", m.hidden, f, chunk);
    row(name + ".down", f, m.hidden, chunk);
  }
  void block(int64_t i, int64_t c) {
    const int64_t h = m.hidden, kv = m.kv_heads * m.head_dim();
    const std::string l = "layers." + std::to_string(i) + ".";
    norm(l + "attn_norm", h, c, o.layer_norm);
    column(l + "attn.q", h, h, c);
    if (m.kv_heads % tp == 0) {
      column(l + "attn.k", h, kv, c);
      column(l + "attn.v", h, kv, c);
    } else {  // tp > kv_heads: every rank holds every key/value projection (AttentionImpl)
      for (const char* kv_name : {"attn.k", "attn.v"}) {
        add(l + kv_name + ".weight", kv * h, c);
        if (o.linear_bias) add(l + kv_name + ".bias", kv, c);
      }
    }
    row(l + "attn.o", h, h, c);
    if (m.qk_norm) {
      norm(l + "attn.q_norm", m.head_dim(), c, false);
      norm(l + "attn.k_norm", m.head_dim(), c, false);
    }
    norm(l + "mlp_norm", h, c, o.layer_norm);
    if (!m.moe.is_moe(i)) return mlp(l + "mlp", m.ffn_hidden, c);
    // The router's balance bias is state, not trained (MoeImpl): not among them.
    add(l + "mlp.router.weight", m.moe.experts * h, c);
    const int64_t experts = m.moe.experts / ep * m.moe.ffn_hidden * h;
    for (const char* e : {"gate", "up", "down"})
      add(l + "mlp.experts." + e, experts, c, /*expert=*/true);
    if (m.moe.shared > 0) mlp(l + "mlp.shared", m.moe.shared * m.moe.ffn_hidden, c);
  }
};

}  // namespace

std::vector<optim::ParamEntry> param_entries(const ModelShape& m, int64_t tp,
                                             const StagePart& stages, int64_t ep) {
  EntryWriter w{m, arch(m.arch).options(m), tp, ep, {}};
  StagePart part = stages;
  if (part.chunks.empty()) part.chunks = {{0, m.layers}};
  const int64_t last = static_cast<int64_t>(part.chunks.size()) - 1;
  const int64_t table = parallel::tp::padded_vocab(m.vocab_size, tp) / tp * m.hidden;
  if (part.first) {
    w.add("embed.weight", table, 0);
    if (w.o.learned_pos) w.add("pos_embed.weight", m.max_seq_len * m.hidden, 0);
  }
  for (int64_t c = 0; c <= last; ++c)
    for (int64_t i = part.chunks[c].first; i < part.chunks[c].second; ++i) w.block(i, c);
  if (part.last) {
    w.norm("norm", m.hidden, last, w.o.layer_norm);
    if (!m.tied())
      w.add("head.weight", table, last);
    else if (!part.first)  // the last stage's copy of a tied token table
      w.add("embed.weight", table, last);
  }
  return w.out;
}

namespace {
int64_t sum(const std::vector<optim::ParamEntry>& entries, bool experts_only = false) {
  int64_t n = 0;
  for (const auto& e : entries)
    if (!experts_only || e.expert) n += e.numel;
  return n;
}
}  // namespace

int64_t block_parameters(const ModelShape& m, int64_t tp, int64_t layer, int64_t ep) {
  return sum(param_entries(m, tp, {{{layer, layer + 1}}, false, false}, ep));
}

int64_t expert_parameters_on_rank(const ModelShape& m, const StagePart& stages, int64_t ep) {
  return sum(param_entries(m, 1, stages, ep), /*experts_only=*/true);
}

int64_t parameters_on_rank(const ModelShape& m, int64_t tp, const StagePart& stages, int64_t ep) {
  return sum(param_entries(m, tp, stages, ep));
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
