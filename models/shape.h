// What the models need to know about the model to build: shapes and constants, nothing about
// files, YAML or the run. The layer above fills it from the plan (models/from_plan.h).
#pragma once

#include <cstdint>
#include <string>

#include "core/plan/choices.h"

namespace tessel::models {

/// Mixture of experts (models/moe.h): none when experts is 0.
struct MoeShape {
  int64_t experts = 0, top_k = 2;
  int64_t shared = 0;          // shared experts: one MLP of shared·ffn_hidden every token passes
  int64_t ffn_hidden = 0;      // each expert's inner width
  int64_t every = 1;           // layer i is an MoE layer when (i + 1) % every == 0
  double capacity_factor = 0;  // 0: dropless; else choices kept per sequence and expert
  plan::RouterScore score = plan::RouterScore::kSoftmax;  // model.moe.router.score
  bool norm_topk = true;        // gate weights renormalised over the k chosen
  double aux_loss_coef = 0;     // the sequence-wise balance loss's weight
  double bias_update_rate = 0;  // auxiliary-loss-free balancing (DeepSeek-V3): 0 = off

  bool is_moe(int64_t layer) const { return experts > 0 && (layer + 1) % every == 0; }
  /// MoE layers among the first `layers`.
  int64_t layers_in(int64_t layers) const { return experts > 0 ? layers / every : 0; }
};

struct ModelShape {
  plan::ModelArch arch{};  // what it builds: models::features (models/registry.h)
  int64_t layers = 0, hidden = 0, heads = 0;
  int64_t kv_heads = 0;    // key/value heads (grouped-query attention when < heads)
  int64_t ffn_hidden = 0;  // the MLP's inner width
  int64_t vocab_size = 0, max_seq_len = 0;
  bool tie_embeddings = false;  // the head reuses the token table
  double norm_eps = 1e-5, rope_theta = 10000, init_std = 0.02;
  bool qk_norm = false;              // RMSNorm of each query and key head before RoPE (Qwen3)
  plan::Mlp mlp = plan::Mlp::kAuto;  // the MLP's form (models/mlp.h); auto: the architecture's
  MoeShape moe;

  bool tied() const { return tie_embeddings; }
  int64_t head_dim() const { return hidden / heads; }
};

}  // namespace tessel::models
