#include "models/from_plan.h"

#include "parallel/pp/schedule.h"

namespace tessel::models {

models::ModelShape model_shape(const plan::ModelConfig& m) {
  models::ModelShape s;
  s.arch = m.arch;
  s.layers = m.layers;
  s.hidden = m.hidden;
  s.heads = m.heads;
  s.kv_heads = m.kv_heads;
  s.ffn_hidden = m.ffn_hidden;
  s.vocab_size = m.vocab_size;
  s.max_seq_len = m.max_seq_len;
  s.tie_embeddings = m.tied();
  s.norm_eps = m.norm_eps;
  s.rope_theta = m.rope_theta;
  s.init_std = m.init_std;
  s.qk_norm = m.qk_norm;
  s.mlp = m.mlp;
  s.moe.experts = m.moe.experts;
  s.moe.top_k = m.moe.top_k;
  s.moe.shared = m.moe.shared_experts;
  s.moe.ffn_hidden = m.moe.ffn_hidden > 0 ? m.moe.ffn_hidden : m.ffn_hidden;
  s.moe.every = m.moe.every;
  s.moe.capacity_factor = m.moe.capacity_factor;
  s.moe.score = m.moe.router_score;
  s.moe.norm_topk = m.moe.norm_topk;
  s.moe.aux_loss_coef = m.moe.aux_loss_coef;
  s.moe.bias_update_rate = m.moe.bias_update_rate;
  return s;
}

c10::ScalarType resolve_dtype(plan::Dtype dtype) {
  if (dtype == plan::Dtype::kBf16) return c10::kBFloat16;
  return dtype == plan::Dtype::kFp16 ? c10::kHalf : c10::kFloat;
}

models::StagePart stage_part(const plan::Config& c, int64_t pp, int64_t rank) {
  const int64_t v = c.parallel.virtual_stages;
  const auto layers =
      parallel::pp::stage_layers(c.model.layers, pp * v, c.parallel.layers_per_stage);
  const plan::PipelineSchedule name = c.parallel.pipeline_schedule;
  const int64_t last = pp * v - 1;
  models::StagePart part{{}, rank == 0, parallel::pp::stage_of(name, pp, rank, v - 1) == last};
  for (int64_t chunk = 0; chunk < v; ++chunk)
    part.chunks.push_back(
        layers[static_cast<size_t>(parallel::pp::stage_of(name, pp, rank, chunk))]);
  return part;
}

}  // namespace tessel::models
