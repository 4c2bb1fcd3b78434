// ZeRO-3: parameters sharded over the data group. Each rank keeps its piece of every bucket (the
// weight shard); a unit's full weights (a block, or "root": embeddings, final norm, head) live
// in per-bucket gather buffers whose storage exists only while the unit is gathered. The model's
// parameters are permanent views of those buffers, so autograd's saved tensors see the weights
// again once a unit is re-gathered for backward (the storage-resize technique of PyTorch FSDP).
//   forward:  gather block i (waiting for its prefetch), prefetch block i+1, run, free block i
//   backward: when the gradient of block i's output arrives, gather block i (prefetched), prefetch
//             block i-1; once backward has produced all of its gradients (GradReducer), free it.
// The root unit stays gathered from the first forward until its gradients are in. The last block
// is kept after forward, since its backward comes next (under a pipeline it may not be: then the
// block's output gradient gathers it again). With several micro-batches per step (pipelines,
// accumulation) a unit may instead be kept from its first use to the step's end. The gathers go
// over the data group's side channel (Group::side, a communicator of its own), so that in backward
// they run beside the gradient reduce-scatters on the group itself instead of queueing behind them.
#pragma once

#include "core/observe/timing.h"

#include <map>
#include <string>
#include <vector>

#include "core/optim/optim.h"
#include "parallel/block_hooks.h"
#include "parallel/comm.h"
#include "parallel/dp/bucket_gather.h"

namespace tessel::parallel::dp {

class UnitGatherer : public BlockHooks {
 public:
  /// Frees every unit's storage (the shards hold the weights from now on). `dp_cp`: the data
  /// group's side channel (or the group, where it has none). `keep`: a unit stays gathered from
  /// its first use to release_all() (parallel.zero3.keep_gathered), else it is freed after each
  /// forward and backward.
  /// `experts`: the group the MoE experts' buckets are split over (the data group when ep is 1).
  UnitGatherer(Group& dp_cp, Group& experts, optim::FlatAdamW& opt, bool keep = false);
  void before_stage() override;
  torch::Tensor before_block(int64_t layer, const torch::Tensor& x) override;
  torch::Tensor after_block(int64_t layer, const torch::Tensor& y) override;
  /// Backward has produced every gradient of bucket `b`.
  void bucket_done(size_t b);
  /// After the optimizer step: every unit freed (the next forward gathers the new weights).
  void release_all();
  /// Milliseconds spent waiting for gathers since the last call (communication compute did not
  /// hide), and resets the count.
  double take_wait_ms() { return wait_.take_ms(); }
  /// Bytes of gathered weights held at once, at most, so far.
  int64_t peak_gathered_bytes() const { return peak_bytes_; }
  /// Bytes of the largest unit.
  int64_t largest_unit_bytes() const;

 private:
  struct Unit {
    std::vector<size_t> buckets;
    bool resident = false;
    BucketGather pending;  // a gather in flight
    size_t done = 0;       // buckets whose gradients are in, this backward
    int64_t bytes = 0;
  };
  Unit* find(const std::string& name);
  Unit* layer(int64_t i) { return find("layers." + std::to_string(i)); }
  void start(Unit& u);  // begin gathering (no-op when resident or in flight)
  void ready(Unit& u);  // gathered and waited for
  void release(Unit& u);

  Group& dp_cp_;
  Group& experts_;
  optim::FlatAdamW& opt_;
  std::map<std::string, Unit> units_;
  std::vector<std::string> unit_of_bucket_;
  int64_t last_layer_ = -1;
  bool keep_;
  int64_t live_bytes_ = 0, peak_bytes_ = 0;
  observe::SpanTimer wait_;
};

}  // namespace tessel::parallel::dp
