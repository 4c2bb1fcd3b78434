#include "engine/run/init_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/run/score.h"
#include "models/from_plan.h"
#include "models/registry.h"

namespace tessel::run {
namespace {

namespace fs = std::filesystem;

// The config.json beside model.init_from's weights, or "".
std::string config_json_of(const std::string& init_from) {
  if (init_from.empty()) return "";
  const fs::path folder =
      fs::is_directory(init_from) ? fs::path(init_from) : fs::path(init_from).parent_path();
  const fs::path json = folder / "config.json";
  return fs::is_regular_file(json) ? json.string() : "";
}

// The model keys config.json decides, as plan_from_hf_config reads them: the architecture's
// shape. max_seq_len is left out for rotary models (a shorter context trains the same weights).
std::vector<std::string> decided_keys(const plan::Config& hf) {
  std::vector<std::string> keys = {"model.arch",       "model.layers",   "model.hidden",
                                   "model.heads",      "model.kv_heads", "model.ffn_hidden",
                                   "model.vocab_size", "model.norm_eps", "model.tie_embeddings",
                                   "model.qk_norm",    "model.mlp"};
  if (models::features(models::model_shape(hf.model)).learned_pos)
    keys.push_back("model.max_seq_len");
  else
    keys.push_back("model.rope_theta");
  if (hf.model.moe.experts > 0)
    for (const char* k : {"model.moe.experts", "model.moe.top_k", "model.moe.ffn_hidden",
                          "model.moe.shared_experts", "model.moe.every", "model.moe.router.score",
                          "model.moe.router.norm_topk"})
      keys.push_back(k);
  return keys;
}

// A key's value as the model is built: kv_heads and ffn_hidden resolved from their "auto" 0.
std::string resolved(plan::Config c, const std::string& key) {
  const auto shape = models::model_shape(c.model);
  if (key == "model.kv_heads") return std::to_string(shape.kv_heads);
  if (key == "model.ffn_hidden") return std::to_string(shape.ffn_hidden);
  if (key == "model.tie_embeddings") return shape.tie_embeddings ? "true" : "false";
  if (key == "model.mlp") return plan::name_of(models::features(shape).mlp);
  for (const auto& f : plan::bind_fields(c))
    if (f.key == key) return f.value_text();
  return "";
}

}  // namespace

plan::Config load_plan(const std::string& path, const std::vector<std::string>& sets) {
  return plan::load_config(path, sets, [&path](const plan::Config& c) {
    std::vector<std::string> taken, wrong;
    const std::string json = config_json_of(c.model.init_from);
    if (json.empty()) return taken;
    const plan::Config hf = plan_from_hf_config(json, {});
    const auto& accept = c.model.init_from_accept;
    for (const auto& key : decided_keys(hf)) {
      const std::string want = resolved(hf, key), have = resolved(c, key);
      if (want == have) continue;
      const auto given = c.given.find(key);
      if (given == c.given.end())
        taken.push_back(key + "=" + want);
      else if (std::find(accept.begin(), accept.end(), key) == accept.end())
        wrong.push_back(fmt::format(
            "{} is {} ({}), config.json's is {}", key, have,
            given->second > 0 ? fmt::format("{}:{}", path, given->second) : std::string("--set"),
            want));
    }
    if (!wrong.empty())
      throw plan::UserError(fmt::format(
          "model.init_from {}: the weights were made for the model {} describes, and the plan "
          "contradicts it: {}; remove the plan's value to take config.json's, or list the key "
          "in model.init_from_accept to train with the plan's",
          c.model.init_from, json, fmt::join(wrong, "; ")));
    if (!taken.empty()) spdlog::info("model: from {}: {}", json, fmt::join(taken, ", "));
    return taken;
  });
}

}  // namespace tessel::run
