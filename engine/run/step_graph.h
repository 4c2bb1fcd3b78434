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

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/device/cuda.h"

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

 private:
  std::unique_ptr<GraphBackend> backend_;
  int64_t warmup_left_;
  bool captured_ = false;
  std::string failure_;
};

}  // namespace tessel::run
