// Weighted blends of datasets (data.blend), with Megatron-Core's BlendedDataset rule: global
// sample i comes from the dataset whose share of samples so far lags its weight the most,
// argmax_d(weight_d · max(i, 1) − taken_d), the first on ties; that dataset's next sample in its
// own order. A pure function of the weights and i, so a run resumed at any sample, under any
// layout, continues every dataset where it stopped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace tessel::data {

class Blend {
 public:
  /// `weights`: positive, normalised here (by their running sum; by numpy's pairwise sum, as
  /// Megatron-Core's BlendedDataset, when `numpy_sum`).
  explicit Blend(std::vector<double> weights, bool numpy_sum = false);
  size_t size() const { return weights_.size(); }
  const std::vector<double>& weights() const { return weights_; }
  /// Global sample `pos`: {dataset, that dataset's sample index}. Sequential positions cost O(1)
  /// each (the state moves forward); an earlier one restarts the walk from 0, so a run resumed at
  /// sample N walks N·datasets steps once (about a second per 10^8 samples here).
  std::pair<int64_t, int64_t> at(int64_t pos);
  /// Samples each dataset gave to positions [0, pos).
  std::vector<int64_t> taken(int64_t pos);

 private:
  size_t next() const;  // the dataset position pos_ takes
  void advance_to(int64_t pos);
  std::vector<double> weights_;
  int64_t pos_ = 0;             // the walk's position
  std::vector<int64_t> taken_;  // samples each dataset gave to [0, pos_)
};

}  // namespace tessel::data
