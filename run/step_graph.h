// training.cuda_graph: the steady-state training step captured once as a CUDA graph and replayed.
// StepGraph owns the policy (warm up eagerly, capture once, replay; eager for good after a failed
// capture, saying why); a GraphBackend owns the CUDA mechanics, so the policy is tested on the CPU
// with a stand-in backend (tests/unit/step_graph_test.cpp) and the CUDA backend on a GPU
// (tests/gpu/gpu_suite.py).
//
// What makes a replay right is the step's contract with its caller (run/train.cpp): every input
// that changes from step to step (the batch, the learning rate, the step number, the stop vote)
// is copied into a fixed device buffer before the step, and the step reads only those; nothing in
// it waits on the host. The same code runs eagerly on every device, so the CPU tests exercise what
// a GPU captures.
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

namespace tessel {

/// Eager steps before the capture (training.cuda_graph's documented 3).
constexpr int64_t kGraphWarmupSteps = 3;

/// The device side of a captured step.
class GraphBackend {
 public:
  virtual ~GraphBackend() = default;
  /// Steps (warm-up, capture, replays) run on a stream of their own from here on: a capture
  /// cannot be taken on the default stream. The stream first waits for the work already queued.
  virtual void enter_stream() = 0;
  /// Back to the stream of before, which waits for the steps' work.
  virtual void leave_stream() = 0;
  virtual void begin() = 0;  // start capturing this thread's stream, into a private memory pool
  virtual void end() = 0;    // end the capture and instantiate the graph; throws if it failed
  virtual void abort() noexcept = 0;  // after a failure inside a capture: end it, drop the graph
  virtual void replay() = 0;          // queue the captured work once more
};

/// The CUDA graph backend (at::cuda::CUDAGraph on a pooled stream of the current device).
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

}  // namespace tessel
