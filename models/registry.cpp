#include "models/registry.h"

#include <torch/torch.h>

#include "engine/safetensors.h"

namespace tessel::models {

extern const Arch kGpt2;
extern const Arch kLlama;

const Arch& arch(const std::string& name) {
  if (name == kGpt2.name) return kGpt2;
  if (name == kLlama.name) return kLlama;
  throw UserError("model.arch: unknown architecture '" + name + "' (known: gpt2, llama)");
}

Decoder build_model(const ModelConfig& m, int64_t seed) {
  Decoder model(arch(m.arch).options(m));
  init_weights(model, seed);
  return model;
}

Weights model_weights(Decoder& model) {
  Weights w;
  for (const auto& p : model->named_parameters()) w[p.key()] = p.value().detach().to(torch::kCPU);
  return w;
}

void assign_weights(Decoder& model, const Weights& w, const std::string& source) {
  auto params = model->named_parameters();
  std::string missing, extra;
  for (const auto& p : params)
    if (!w.count(p.key())) missing += (missing.empty() ? "" : ", ") + p.key();
  for (const auto& [name, t] : w)
    if (!params.contains(name)) extra += (extra.empty() ? "" : ", ") + name;
  if (!missing.empty()) throw UserError(source + ": missing tensors for this model: " + missing);
  if (!extra.empty()) throw UserError(source + ": tensors this model does not have: " + extra);
  torch::NoGradGuard no_grad;
  for (auto& p : params) {
    const auto& t = w.at(p.key());
    if (t.sizes() != p.value().sizes()) {
      std::ostringstream s;
      s << source << ": tensor '" << p.key() << "' has shape " << t.sizes() << " but the plan's model needs "
        << p.value().sizes();
      throw UserError(s.str());
    }
    p.value().copy_(t);
  }
}

void load_weights(Decoder& model, const std::string& path) {
  auto file = read_safetensors(path);
  const auto& m = model->options().model;
  // Tessel's own files use Tessel names; anything else is read as Hugging Face names.
  bool tessel_names = file.tensors.count("embed.weight") > 0;
  assign_weights(model, tessel_names ? file.tensors : arch(m.arch).from_hf(file.tensors, m, path), path);
}

}  // namespace tessel::models
