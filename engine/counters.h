// Measured per-step figures that --dry-run's planner predicts (tests compare the two): bytes each
// process group carried during training steps, and the memory a step allocates beyond the state
// held between steps (activations, their gradients, temporaries). On CPU the allocations are
// counted by an allocator installed at start; on CUDA they come from the caching allocator.
#pragma once

#include <torch/types.h>

#include <map>
#include <string>
#include <utility>

#include "parallel/mesh.h"

namespace tessel {

/// What a lasting CPU allocation holds, so that each part of the training state is measured by
/// the allocator on its own (memory.json; the planner test compares each with its prediction).
enum class Held : int { kOther = 0, kWeights, kGrads, kOptimizer, kCount };

/// Bytes the CPU allocator has handed out (now and at peak), counted by a wrapper installed over
/// the default CPU allocator on first use and never removed (tensors it allocated must find it
/// at release). StepCounters and the memory unit tests read it.
class CpuAllocationCounter {
 public:
  static CpuAllocationCounter& get();
  int64_t now() const;
  /// The highest count since the last call (or since installation); the peak restarts at now().
  int64_t take_peak();
  /// Bytes allocated under HeldAs(what) and not released yet.
  int64_t live(Held what) const;
};

/// While alive, the CPU allocations of this thread are counted as `what` (until released).
class HeldAs {
 public:
  explicit HeldAs(Held what);
  ~HeldAs();
  HeldAs(const HeldAs&) = delete;
  HeldAs& operator=(const HeldAs&) = delete;

 private:
  Held before_;
};

class StepCounters {
 public:
  StepCounters(const parallel::Mesh& mesh, const torch::Device& device);
  void begin_step();
  void end_step();
  /// Mean payload bytes per step of each group (collectives + point-to-point sent), by name.
  std::map<std::string, double> comm_bytes_per_step() const;
  /// Largest memory a step allocated above what was allocated when it began (steps after the
  /// first, which also allocates lasting buffers; the first when it is the only one).
  int64_t step_peak_bytes() const { return peak_extra_; }
  /// Memory allocated when the last step began (weights, gradients, optimizer state, buffers).
  int64_t step_base_bytes() const { return base_; }
  /// CUDA: the highest allocated bytes since the last call (metrics' mem_bytes).
  int64_t take_peak_since_log() { return std::exchange(peak_abs_, 0); }

 private:
  int64_t allocated() const;
  int64_t reset_peak();
  const parallel::Mesh& mesh_;
  torch::Device device_;
  std::map<parallel::GroupKind, int64_t> at_begin_, total_;
  int64_t steps_ = 0, base_ = 0, peak_extra_ = 0, peak_abs_ = 0;
};

}  // namespace tessel
