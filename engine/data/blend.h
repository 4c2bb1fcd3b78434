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
  /// Global sample `pos`: {dataset, that dataset's sample index}. Megatron's rule has no closed
  /// form, so a position is found by walking the rule (as BlendedDataset builds its whole index):
  /// sequential positions cost O(1) each; the walk keeps its state every kStride samples, so any
  /// position it has passed is found again from the nearest kept state in under kStride steps.
  /// A run's start-up walks the run's length once (about a second per 10^8 samples here).
  std::pair<int64_t, int64_t> at(int64_t pos);
  /// Samples each dataset gave to positions [0, pos).
  std::vector<int64_t> taken(int64_t pos);
  /// taken(pos) for a report, without a walk past kFurthest: beyond it each dataset's weight x
  /// pos, rounded (the rule keeps every dataset within one sample of that). `exact`: walked.
  std::vector<int64_t> shares(int64_t pos, bool* exact);
  /// Steps walked so far (a test's figure: a position passed before costs under kStride).
  int64_t walked() const { return walked_; }
  static constexpr int64_t kStride = int64_t{1} << 16;
  /// The furthest position walked to (2^36 samples, about 11 minutes here): a position beyond
  /// it is refused as a UserError naming it.
  static constexpr int64_t kFurthest = int64_t{1} << 36;

 private:
  size_t next() const;  // the dataset position pos_ takes
  void advance_to(int64_t pos);
  std::vector<double> weights_;
  int64_t pos_ = 0;                         // the walk's position
  std::vector<int64_t> taken_;              // samples each dataset gave to [0, pos_)
  std::vector<std::vector<int64_t>> kept_;  // taken_ at 0, kStride, 2·kStride, ... passed
  int64_t walked_ = 0;
};

}  // namespace tessel::data
