// training.cuda_graph: the steady-state training step captured once as a CUDA graph and replayed.
// StepGraph owns the policy (warm up eagerly, capture once, replay; eager for good after a failed
// capture, saying why); a GraphBackend owns the CUDA mechanics, so the policy is tested on the CPU
// with a stand-in backend (tests/unit/step_graph_test.cpp) and the CUDA backend on a GPU
// (tests/gpu/gpu_suite.py).
//
// What makes a replay right is the step's contract with its caller (engine/run/train.cpp): every
// input that changes from step to step (the batch, the learning rate, the step number, the stop
// vote) is copied into a fixed device buffer before the step, and the step reads only those;
// nothing in it waits on the host. The same code runs eagerly on every device, so the CPU tests
// exercise what a GPU captures.
//
// After a failed capture LibTorch offers no way to take its default CUDA generator out of capture
// mode: the eager steps that follow must draw no CUDA random numbers (Tessel's training steps draw
// none: no dropout, and recomputation, which saves the generator's state, is refused with
// training.cuda_graph).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/device/cuda.h"
#include "core/kernels/document_attention.h"

namespace tessel::run {

/// Eager steps before the capture (training.cuda_graph's documented 3).
constexpr int64_t kGraphWarmupSteps = 3;

/// The device side of a captured step (core/device/cuda.h: its CUDA implementation lives in
/// libtessel_cuda.so; tests stand in for it on the CPU).
using GraphBackend = device::GraphBackend;

/// The CUDA graph backend (at::cuda::CUDAGraph on a pooled stream of the current device), from
/// libtessel_cuda.so.
std::unique_ptr<GraphBackend> make_cuda_graph_backend();

class StepGraph {
 public:
  enum class Ran { kEager, kCaptured, kReplayed };
  /// `warmup_steps` eager steps before the capture (NCCL communicators, cuBLAS workspaces and
  /// the allocator's blocks exist by then, none of which may be created inside a capture).
  StepGraph(std::unique_ptr<GraphBackend> backend, int64_t warmup_steps);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  /// One step. `step` runs the step's device work (eagerly, or captured: then it is replayed at
  /// once, since a capture only records). `eager_only`: this step must run eagerly (a host
  /// decision differs for it); it neither counts as warm-up nor drops the graph. After a failed
  /// capture, `undo` resets the host bookkeeping of the half-captured step, the step then runs
  /// eagerly, and so do all later ones (failure() says why; the caller logs it).
  Ran run(bool eager_only, const std::function<void()>& step, const std::function<void()>& undo);

  bool captured() const { return captured_; }
  bool failed() const { return !failure_.empty(); }
  const std::string& failure() const { return failure_; }
  /// The log's line for step `step` that ran as `ran`: the capture, or (once) the failure.
  void log(int64_t step, Ran ran);

 private:
  std::unique_ptr<GraphBackend> backend_;
  int64_t warmup_left_;
  bool captured_ = false;
  bool failure_logged_ = false;
  std::string failure_;
};

/// training.cuda_graph around a trainer's step, whose device outputs are `Out`: off, every step
/// runs as it is; on, a StepGraph's, and each replay answers the captured step's outputs (which
/// the replay rewrites in place).
template <class Out>
class GraphedStep {
 public:
  void start(bool on) { start(on ? make_cuda_graph_backend() : nullptr); }
  /// On with `backend` (null: off); tests stand a CPU backend in for CUDA's.
  void start(std::unique_ptr<GraphBackend> backend, int64_t warmup_steps = kGraphWarmupSteps) {
    graph_ = backend ? std::make_unique<StepGraph>(std::move(backend), warmup_steps) : nullptr;
    captured_ = Out{};
    replayed_ = false;
  }
  void stop() {  // back on the stream of before, the graph's memory freed
    graph_.reset();
    captured_ = Out{};
  }
  bool on() const { return graph_ != nullptr; }
  bool captured() const { return graph_ && graph_->captured(); }
  bool replayed() const { return replayed_; }  // the last step was a replay: no host code ran
  /// Step `step`: `device_step` queues its device work; `eager_only` and `undo` as
  /// StepGraph::run's.
  Out run(int64_t step, bool eager_only, const std::function<Out()>& device_step,
          const std::function<void()>& undo) {
    if (!graph_) return device_step();
    Out out;
    const auto ran = graph_->run(
        eager_only, [&] { out = device_step(); }, undo);
    if (ran == StepGraph::Ran::kCaptured) captured_ = out;
    replayed_ = ran == StepGraph::Ran::kReplayed;
    graph_->log(step, ran);
    return ran == StepGraph::Ran::kEager ? out : captured_;
  }

 private:
  std::unique_ptr<StepGraph> graph_;
  Out captured_{};
  bool replayed_ = false;
};

/// A step's inputs, which the step reads and nothing else that changes between steps: this data
/// rank's rows [rows, seq + 1], the learning rate, the step number and this rank's stop vote (the
/// rate a float64 on the CPU, the others device scalars), each micro-batch's documents
/// (data.document_mask) and the global batch's scored targets (data.eod_mask_loss).
struct StepInputs {
  torch::Tensor batch, lr, step, vote;
  std::vector<kernels::Documents> docs;
  int64_t scored = 0;
  /// The next step's, on `device`. `fixed` (a captured step, which reads the same addresses on
  /// each replay): every tensor is a buffer kept across steps and copied into, the rate a float32
  /// device scalar; otherwise the batch is taken as it is.
  void put(torch::Tensor rows, double rate, int64_t number, const torch::Tensor& stop_vote,
           bool fixed, const torch::Device& device);
  /// After an eager step: the batch and documents are not held into the next step's figures.
  void release();
};

}  // namespace tessel::run
