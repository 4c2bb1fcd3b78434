// Inference on one process: `tessel-train score` (mean loss and perplexity of given sequences,
// a Megatron dataset or text) and `tessel-train generate` (sampling from a prompt).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/plan/config.h"
#include "engine/data/dataset.h"
#include "models/layers.h"

namespace tessel::run {

struct ScoreResult {
  double loss;     // mean next-token loss over all B·T targets
  int64_t tokens;  // B·T
  int64_t rows;    // B
};

/// --token-dtype: the element type of score's tokens file.
enum class ScoreTokens { kInt32, kUint16, kUint32 };
/// Its names, in the enum's order (the command line's values).
inline const std::vector<std::string>& score_token_names() {
  static const std::vector<std::string> n{"int32", "uint16", "uint32"};
  return n;
}

/// `tessel-train score`: the plan's model with `weights` (Hugging Face or Tessel names) on the
/// sequences of `tokens_path` (raw little-endian rows of training.seq_len+1 tokens, each
/// `token_dtype`: int32, uint16 or uint32 — data.format tokens files are uint16 or uint32).
/// `logits_out` (optional): also writes the logits of every row, {"logits": [B, T, vocab]} fp32,
/// to that safetensors file (parity checks against other implementations).
ScoreResult score(const plan::Config& c, const std::string& weights, const std::string& tokens_path,
                  ScoreTokens token_dtype = ScoreTokens::kInt32,
                  const std::string& logits_out = "");

/// Scores a token stream (a Megatron prefix or text files, as `data` describes them; text is
/// tokenized with `tokenizer` when given, else byte tokens) cut into windows of seq_len+1 tokens
/// (stride seq_len, as training reads it); at most `max_rows` windows (0: all).
ScoreResult score_data(const plan::Config& c, const std::string& weights, const std::string& data,
                       const std::string& tokenizer, int64_t max_rows);

/// The plan's test (or validation) split scored: every sample of each of its datasets (at most
/// `max_rows` of each; 0: all), in stream order; the overall loss weighs the datasets by their
/// weights, as evaluation does. UserError when the plan holds no such split.
struct SplitScore {
  ScoreResult all;
  std::vector<std::pair<std::string, ScoreResult>> by_dataset;  // by plan key
};
SplitScore score_split(const plan::Config& c, const std::string& weights, data::SampleSplit split,
                       int64_t max_rows);

/// A plan for inference from a Hugging Face config.json (gpt2 or llama model_type), for
/// `generate` and `score` when no plan is given: the model keys from the file, the rest defaults.
/// UserError names the file and the key that is missing or of another architecture.
plan::Config plan_from_hf_config(const std::string& config_json,
                                 const std::vector<std::string>& sets);

/// The plan's model on its device with `weights` loaded, in eval mode (one process, no groups).
models::Decoder load_for_inference(const plan::Config& c, const std::string& weights);

struct SampleOptions {
  int64_t max_new_tokens = 32;
  double temperature = 0;  // 0: greedy (argmax)
  int64_t top_k = 0;       // 0: the whole vocabulary
  uint64_t seed = 0;
  std::optional<int64_t> stop;  // end-of-sequence id: generation stops after producing it
};

/// Continues `prompt` (token ids); returns only the new tokens. The prompt runs once, then each
/// new token attends over cached keys and values (DecoderImpl::decode).
std::vector<int64_t> generate(models::Decoder& model, const plan::Config& c,
                              const std::vector<int64_t>& prompt, const SampleOptions& o);

}  // namespace tessel::run
