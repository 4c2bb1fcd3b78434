// ZeRO's weight all-gather, shared by stages 1-2 (gather_weights, after the optimizer step) and
// stage 3 (UnitGatherer, around each unit's forward and backward): every rank's piece of a flat
// bucket into the whole bucket, in rank order.
#pragma once

#include <torch/types.h>

#include <vector>

#include "parallel/comm.h"

namespace tessel::parallel::dp {

/// All-gathers of flat buckets started and not yet waited for.
class BucketGather {
 public:
  /// Starts gathering every rank's `piece` of a bucket into `whole`. A piece that lies in `whole`
  /// itself (stages 1-2: a slice of the flat weights) is gathered in place on NCCL (input = output
  /// + rank·count) and from a copy otherwise; a piece of a separate shard (stage 3) is read as it
  /// is. The input is kept until wait().
  void start(Group& dp_cp, torch::Tensor whole, const torch::Tensor& piece) {
    const bool copy = piece.is_alias_of(whole) && !dp_cp.is_nccl();
    inputs_.push_back(copy ? piece.clone() : piece);
    works_.push_back(dp_cp.all_gather(whole, inputs_.back()));
  }
  /// Waits for every gather started (orders the current stream on NCCL) and drops their inputs.
  void wait() {
    for (auto& w : works_) w.wait();
    works_.clear();
    inputs_.clear();
  }

 private:
  std::vector<Work> works_;
  std::vector<torch::Tensor> inputs_;  // alive until their all-gather completes
};

}  // namespace tessel::parallel::dp
