// ZeRO-1/2: after the optimizer step every rank holds only its piece of each bucket updated; the
// whole weights come back by one all-gather per bucket. They are started together as the next step
// begins and waited for unit by unit as its forward reaches each unit (the embeddings and head
// before the stage, a block just before it runs), so the gathers of later blocks run while earlier
// blocks compute. Everything else that reads the weights (evaluation, a checkpoint, the next
// optimizer step, the end of the run) calls wait_all() first.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/observe/timing.h"
#include "core/optim/optim.h"
#include "parallel/block_hooks.h"
#include "parallel/comm.h"
#include "parallel/dp/bucket_gather.h"

namespace tessel::parallel::dp {

class WeightGather : public BlockHooks {
 public:
  /// `timer` times the waits (the gathers' time that compute did not hide).
  /// `experts`: the group the MoE experts' buckets are split over (the data group when ep is 1).
  WeightGather(Group& dp_cp, Group& experts, optim::FlatAdamW& opt, observe::SpanTimer& timer);
  /// After each optimizer step: the pieces changed, the whole weights are due a gather.
  void updated() { due_ = true; }
  /// At the start of a step: every bucket's all-gather started, when the weights are due one
  /// (after an update, and once at the start, which keeps every step's traffic the same).
  void start_all();
  /// The weights are whole: every gather due started and landed.
  void wait_all();
  void before_stage() override;
  torch::Tensor before_block(int64_t layer, const torch::Tensor& x) override;
  torch::Tensor after_block(int64_t, const torch::Tensor& y) override { return y; }

 private:
  void wait(const std::string& unit);
  void wait_in_flight();
  bool due_ = true;

  Group& dp_cp_;
  Group& experts_;
  optim::FlatAdamW& opt_;
  observe::SpanTimer& timer_;
  // A unit ("root", "layers.<i>") waits for every bucket holding any of its parameters (under
  // ZeRO-1/2 a bucket may hold several units' parameters).
  std::map<std::string, std::vector<size_t>> buckets_of_;
  std::vector<BucketGather> pending_;  // per bucket
  std::vector<bool> in_flight_;
};

}  // namespace tessel::parallel::dp
