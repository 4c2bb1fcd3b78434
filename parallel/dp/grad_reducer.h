// Gradient reduction over the data group (dp×cp; an MoE layer's experts over the expert data group,
// the ranks that hold the same experts) for every ZeRO stage, driven by
// post-accumulate-grad hooks while backward runs. The buckets are the flat layout's. With bf16/fp16
// weights at stages 0-1 the same hooks fold each parameter's 16-bit gradient into the fp32
// gradient the moment backward produces it and drop it (Megatron's main_grad): a gradient is held
// once, in fp32, with or without data parallelism.
//   stage 0: on the final micro-batch of a step, each bucket is all-reduced the moment backward
//            completes it; earlier micro-batches only accumulate (DDP's no_sync).
//   stage 1: the same, but reduce-scattered: each rank receives the sum of its piece only.
//   stages 2-3: no full gradient buffer exists. Every micro-batch, each parameter's gradient is
//            copied (in fp32) into its bucket's transient buffer and dropped; a complete bucket is
//            reduce-scattered; with more than two buckets reducing, the oldest is waited for,
//            its piece added into this rank's gradient shard and its buffer freed (the rest at
//            the end of the micro-batch's backward), so at most three buffers are ever alive.
// Hybrid sharding (parallel.zero_shard): the reduce-scatters above run inside this rank's shard
// group, which then holds the sum of its own ranks' gradients; each bucket's piece is then
// all-reduced over the replicas (the ranks holding the same piece in the other shard groups):
// once per step, 1/shards of the gradient, whatever the micro-batches. Stages 2-3 start it as
// soon as the bucket's last reduce-scatter of the step is drained, during backward (but for a
// bucket holding the token table, which a zbv rank fills from two chunks: after backward);
// stage 1 as each bucket's reduce-scatter is waited for, after backward.
// Under pipeline parallelism "final" is per model chunk (each chunk's last backward of the step).
// ZeRO-2 inside a pipeline with fp32 weights reduce-scatters once per step: the micro-batches'
// gradients accumulate in the parameters, and the chunk's last backward moves the sum into its
// buckets (in bf16/fp16 every micro-batch is reduce-scattered, so that the sum is fp32). So does
// fp32 ZeRO-3 with its units kept gathered for the step.
// The loss rule (sum over the global batch / global target tokens) makes the sum the exact
// gradient, so no averaging happens here.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "core/observe/timing.h"
#include "core/optim/optim.h"
#include "parallel/mesh.h"

namespace tessel::parallel::dp {

using optim::FlatBucket;
using optim::Slot;

struct BucketState {
  int64_t ready = 0;     // parameters counted in during this backward (stages 2-3: this fill)
  bool reduced = false;  // stages 2-3: reduced during this backward
  Work work;             // its all-reduce or reduce-scatter
  torch::Tensor buffer;  // stages 2-3: the bucket's gradients [end - begin], fp32, transient
  torch::Tensor piece;   // the reduce-scatter's output when not in place
  // Hybrid sharding: the piece's all-reduce over the replicas, once a step (started: `summed`).
  bool summed = false;
  Work replica;
  torch::Tensor replica_piece;
};

/// Whether a chunk's gradients accumulate in its parameters over the step's micro-batches and
/// are reduce-scattered once, at its last backward: ZeRO-2 inside a pipeline (`pp` > 1), or
/// ZeRO-3 with its units kept gathered, with fp32 weights (not `low_precision`, whose gradients
/// are folded into the fp32 shard as they come). The planner reads the same rule.
inline bool reduces_once(const plan::Sharding& s, int64_t pp, bool keep_gathered,
                         bool low_precision) {
  return ((s.grads && !s.weights && pp > 1) || (s.weights && keep_gathered)) && !low_precision;
}

class GradReducer {
 public:
  /// Hooks `params` (those FlatAdamW took over) to reduce their gradients as backward produces
  /// them. `keep_gathered`: ZeRO-3's units stay gathered for the whole step
  /// (parallel.zero3.keep_gathered), so with fp32 weights the gradients accumulate in the
  /// parameters and are reduce-scattered once per step, as ZeRO-2 does inside a pipeline.
  GradReducer(const Mesh& mesh, const std::vector<optim::NamedParam>& params, optim::FlatAdamW& opt,
              bool keep_gathered = false);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  /// Before each backward of this rank's pipeline chunk `chunk` (0 without pipelining): whether
  /// it is that chunk's last backward of the step (the one that reduces at stages 0-1).
  void begin_backward(int64_t chunk, bool final);
  /// After it: stages 0-1 in bf16/fp16 fold what reached a parameter without its hook;
  /// stages 2-3 add this micro-batch's reduced pieces into the gradient shard.
  void end_backward(int64_t chunk, bool final);
  /// After the step's last backward: waits for every bucket (orders the stream on NCCL).
  void finish();
  /// Forgets a step left half-run by a failed CUDA graph capture (engine/run/step_graph.h): its
  /// collectives were recorded, never queued, so nothing is waited for; every bucket is empty
  /// again and the next step starts as the first did.
  void abandon_step();
  /// Milliseconds spent waiting on reductions since the last call (the communication backward
  /// did not hide); on CUDA read from events, so call it where the host waits anyway.
  double take_wait_ms() { return wait_.take_ms(); }
  /// Stage 3: called when backward has produced every gradient of bucket `b` (its unit's
  /// parameters are no longer needed this micro-batch).
  std::function<void(size_t b)> on_bucket_done;

  const std::vector<FlatBucket>& buckets() const { return opt_.layout().buckets(); }
  /// Peak bytes of stage 2-3 bucket buffers alive at once (transient gradient memory).
  int64_t peak_bucket_bytes() const { return peak_bucket_bytes_; }

 private:
  void on_grad_ready(size_t bucket, const Slot& slot, const torch::autograd::Variable& p);
  void check_complete(size_t b) const;    // every gradient of bucket b counted in (or throws)
  void drain(size_t b);                   // waits for its reduction and stores the result
  void sum_over_replicas(size_t b);       // hybrid sharding: starts bucket b's (once a step)
  static constexpr size_t kInFlight = 2;  // stages 2-3: bucket buffers reducing at once, at most

  const Mesh& mesh_;
  optim::FlatAdamW& opt_;
  std::vector<torch::Tensor> hooked_;  // parameters carrying our hook (removed on destruction)
  std::vector<BucketState> state_;
  std::deque<size_t> in_flight_;  // stages 2-3: buckets reducing, oldest first
  std::vector<std::pair<int64_t, int64_t>> chunk_range_;  // flat range of each chunk's slots
  std::vector<bool> final_;                               // per chunk, during its last backward
  std::vector<bool> table_;  // per bucket: holds the token table (summed over replicas last)
  bool reduce_ = false;      // anything to do: dp×cp > 1, or gradients sharded
  bool fold_ = false;        // stages 0-1 in bf16/fp16: each gradient folded into fp32 as it comes
  std::vector<std::pair<torch::Tensor, const Slot*>> folded_;  // the parameters fold_ hooks
  bool once_ = false;  // fp32 ZeRO-2 with pp > 1 or ZeRO-3 kept gathered: reduce-scatter at each
                       // chunk's last backward
  observe::SpanTimer wait_;
  int64_t live_bucket_bytes_ = 0, peak_bucket_bytes_ = 0;
};

}  // namespace tessel::parallel::dp
