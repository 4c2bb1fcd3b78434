#include "engine/data/blend.h"

#include "core/observe/interrupt.h"
#include "core/plan/user_error.h"
#include "engine/data/gpt_index.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace tessel::data {

Blend::Blend(std::vector<double> weights, bool numpy_sum) : weights_(std::move(weights)) {
  if (weights_.empty()) throw std::invalid_argument("blend: no datasets");
  if (numpy_sum) {
    weights_ = numpy_normalize(std::move(weights_));
  } else {
    const double sum = std::accumulate(weights_.begin(), weights_.end(), 0.0);
    for (auto& w : weights_) w /= sum;
  }
  taken_.assign(weights_.size(), 0);
}

size_t Blend::next() const {
  // Megatron-Core's build_blending_indices: the largest error, the first on ties.
  const double at = static_cast<double>(std::max<int64_t>(pos_, 1));
  size_t best = 0;
  double best_error = weights_[0] * at - static_cast<double>(taken_[0]);
  for (size_t d = 1; d < weights_.size(); ++d) {
    const double error = weights_[d] * at - static_cast<double>(taken_[d]);
    if (error > best_error) best = d, best_error = error;
  }
  return best;
}

void Blend::advance_to(int64_t pos) {
  if (pos > kFurthest)
    throw plan::UserError(fmt::format(
        "sample {} of a blend of {} datasets: Megatron's blending rule has no closed form, so a "
        "position is found by walking it from sample 0, and Tessel walks at most 2^36 = {} "
        "samples (about 11 minutes here; 2.8e14 tokens at 4096 a sample, beyond any run): "
        "training.steps x training.global_batch, a checkpoint's consumed_samples or a samples "
        "--skip this far is not a run's",
        pos, weights_.size(), kFurthest));
  if (pos < pos_) {  // back to the nearest kept state at or before pos
    const auto k = static_cast<size_t>(pos / kStride);
    pos_ = static_cast<int64_t>(k) * kStride;
    taken_ = kept_[k];
  }
  const bool long_walk = pos - pos_ > (int64_t{1} << 27);
  if (long_walk)
    spdlog::info(
        "finding sample {} of the blend: Megatron's rule is walked from sample {} "
        "(about a second per 10^8 samples)",
        pos, pos_);
  for (; pos_ < pos; ++pos_) {
    if (pos_ % kStride == 0) {
      if (static_cast<size_t>(pos_ / kStride) == kept_.size()) kept_.push_back(taken_);
      if (pos_ % (kStride << 6) == 0) observe::stop_if_signalled("finding the blend's position");
    }
    ++taken_[next()];
    ++walked_;
  }
}

std::pair<int64_t, int64_t> Blend::at(int64_t pos) {
  if (weights_.size() == 1) return {0, pos};  // one dataset: no walk, whatever the position
  advance_to(pos);
  const size_t d = next();
  return {static_cast<int64_t>(d), taken_[d]};
}

std::vector<int64_t> Blend::shares(int64_t pos, bool* exact) {
  *exact = pos <= kFurthest;
  if (*exact) return taken(pos);
  std::vector<int64_t> out;
  for (double w : weights_) out.push_back(std::llround(w * static_cast<double>(pos)));
  return out;
}

std::vector<int64_t> Blend::taken(int64_t pos) {
  if (weights_.size() == 1) return {pos};
  advance_to(pos);
  return taken_;
}

}  // namespace tessel::data
