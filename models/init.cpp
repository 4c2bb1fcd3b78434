// Initial weights from a generator keyed by (seed, global parameter name): any layout that
// builds the same global parameter draws the same numbers, whatever rank or shard holds it.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "models/registry.h"

namespace tessel::models {
namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

void init_weights(Decoder& model, int64_t seed) {
  const auto& m = model->options().model;
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters()) {
    const std::string& name = p.key();
    // Drawn at the global shape, then sliced: every layout holds the same global numbers.
    const auto& spec = model->specs().at(name);
    const auto shape = spec.global_shape;
    torch::Tensor t;
    if (ends_with(name, ".bias")) {
      t = torch::zeros(shape);
    } else if (name.find("norm.") != std::string::npos) {
      t = torch::ones(shape);
    } else {
      // Output projections of residual branches get std/sqrt(2·layers) (GPT-2 paper, sec. 2.3).
      double std = m.init_std;
      if (ends_with(name, "attn.o.weight") || ends_with(name, "mlp.down.weight") ||
          ends_with(name, "mlp.shared.down.weight") || ends_with(name, "mlp.experts.down"))
        std /= std::sqrt(2.0 * static_cast<double>(m.layers));
      auto gen =
          at::make_generator<at::CPUGeneratorImpl>(splitmix64(fnv1a(name) ^ splitmix64(seed)));
      t = torch::empty(shape).normal_(0.0, std, gen);
    }
    p.value().copy_(spec.local_of(t));
  }
}

}  // namespace tessel::models
