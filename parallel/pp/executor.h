// Pipeline parallelism's one entry point: the executor runs this rank's action list of any
// schedule (schedule.h) for one step. Sends and receives go over the pipeline group's
// point-to-point channels (Group::add_channel: one communicator per direction between neighbours,
// messages matched in order, on Gloo as on NCCL), each with a work of its own: a compute action
// waits only for the receive it needs, never for a send, which is waited for at the step's end.
// Once an activation is sent this rank keeps only its autograd edge (what backward needs), and
// backward starts from that edge with the received gradient, as Megatron-Core's deallocated outputs
// do.
#pragma once

#include <torch/types.h>

#include <functional>
#include <memory>
#include <vector>

#include "core/observe/timing.h"
#include "parallel/comm.h"
#include "parallel/pp/schedule.h"

namespace c10 {
class ThreadPool;
}

namespace tessel::parallel::pp {

/// What the executor calls; the model and the loss rule stay outside it.
struct StageFns {
  /// Forward of micro-batch `mb` on this rank's chunk `chunk`. `input`: the previous stage's
  /// activation (a leaf that requires grad while training), undefined on the first stage. Returns
  /// the activation for the next stage or, on the last stage, the micro-batch's (scaled) loss.
  std::function<torch::Tensor(int64_t mb, int64_t chunk, const torch::Tensor& input)> forward;
  /// Around each backward; `final`: the chunk's last backward of the step.
  std::function<void(int64_t chunk, bool final)> before_backward;
  std::function<void(int64_t chunk, bool final)> after_backward;
};

/// One step as this rank saw it.
struct StepStats {
  int64_t peak_activations = 0;  // micro-batch chunks forwarded and not yet backwarded, at most
};

/// Time of the steps since the last take: whole steps, forward/backward compute, and waits for
/// transfers (host clock on CPU and Gloo; CUDA events on the compute stream with NCCL).
struct StepTimes {
  double step_ms = 0, compute_ms = 0, wait_ms = 0;
  double bubble() const { return step_ms > 0 ? (step_ms - compute_ms) / step_ms : 0.0; }
};

class Executor {
 public:
  /// `pp`: the pipeline group (its rank i is pipeline rank i); `activation_shape` and `options`:
  /// one micro-batch's activation between stages ([b, s, h]; sequence parallel [b, s/t, h]).
  Executor(Group& pp, Schedule schedule, std::vector<int64_t> activation_shape,
           torch::TensorOptions options);

  ~Executor();

  /// CPU, one stage, nothing hooked to gradient accumulation (one process): training steps run
  /// the micro-batches two at a time, each pair's first on the calling thread and its second on
  /// a lane thread, each lane on half of the intra-op threads. The first lane's gradients
  /// accumulate into `weights` as usual; the second's are added into `weights`' gradients just
  /// after the pair, so they are summed in one at a time's order and steps repeat bit for bit.
  /// The hooks of StageFns run on the calling thread around each micro-batch's gradients reaching
  /// the weights (the second of a pair's: around that addition); forward must be safe to run on
  /// two threads at once.
  void pair_microbatches(std::vector<torch::Tensor> weights);
  bool pairs() const { return lane_ != nullptr; }

  /// Runs this rank's list once. With grad mode off (evaluation) forwards keep no graph.
  StepStats run(const StageFns& fns);
  /// The time of every step run since the last call (reads CUDA events: call it where the host
  /// waits anyway).
  StepTimes take_times();
  const Schedule& schedule() const { return schedule_; }

 private:
  StepStats run_pairs(const StageFns& fns);  // pairs.cpp

  Group& pp_;
  Schedule schedule_;
  std::vector<int64_t> shape_;
  torch::TensorOptions options_;
  std::vector<bool> last_backward_;  // per action of this rank: the chunk's last backward
  observe::SpanTimer step_, compute_, wait_;
  std::vector<torch::Tensor> weights_;     // pair_microbatches: those that require grad
  std::unique_ptr<c10::ThreadPool> lane_;  // pair_microbatches: the second lane's thread
};

}  // namespace tessel::parallel::pp
