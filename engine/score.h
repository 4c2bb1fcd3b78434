#pragma once

#include <string>

#include "engine/config.h"

namespace tessel {

struct ScoreResult {
  double loss;     // mean next-token loss over all B·T targets
  int64_t tokens;  // B·T
};

/// `tessel-train score`: the plan's model with `weights` (Hugging Face or Tessel names) on the
/// sequences of `tokens_path` (raw little-endian int32, rows of training.seq_len+1 tokens).
ScoreResult score(const Config& c, const std::string& weights, const std::string& tokens_path);

}  // namespace tessel
