// What the models need to know about the model to build: shapes and constants, nothing about
// files, YAML or the run. The layer above fills it from the plan (planner/model_plan.h).
#pragma once

#include <cstdint>
#include <string>

namespace tessel::models {

struct ModelShape {
  std::string arch;  // gpt2 | llama (models/registry.h)
  int64_t layers = 0, hidden = 0, heads = 0;
  int64_t kv_heads = 0;    // key/value heads (grouped-query attention when < heads)
  int64_t ffn_hidden = 0;  // the MLP's inner width
  int64_t vocab_size = 0, max_seq_len = 0;
  bool tie_embeddings = false;  // the head reuses the token table
  double norm_eps = 1e-5, rope_theta = 10000, init_std = 0.02;

  bool tied() const { return tie_embeddings; }
  int64_t head_dim() const { return hidden / heads; }
};

}  // namespace tessel::models
