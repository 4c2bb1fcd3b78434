#include "engine/data/blend.h"

#include "engine/data/gpt_index.h"

#include <algorithm>
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
  if (pos < pos_) {
    pos_ = 0;
    std::fill(taken_.begin(), taken_.end(), 0);
  }
  for (; pos_ < pos; ++pos_) ++taken_[next()];
}

std::pair<int64_t, int64_t> Blend::at(int64_t pos) {
  if (weights_.size() == 1) return {0, pos};  // one dataset: no walk, whatever the position
  advance_to(pos);
  const size_t d = next();
  return {static_cast<int64_t>(d), taken_[d]};
}

std::vector<int64_t> Blend::taken(int64_t pos) {
  if (weights_.size() == 1) return {pos};
  advance_to(pos);
  return taken_;
}

}  // namespace tessel::data
