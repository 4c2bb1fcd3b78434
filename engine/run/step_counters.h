// Measured per-step figures that --dry-run's planner predicts (tests compare the two): bytes each
// process group carried during training steps, and the memory a step allocates beyond the state
// held between steps (activations, their gradients, temporaries). On CPU the allocations are
// counted by core/observe/counters.h's allocator; on CUDA they come from the caching allocator.
#pragma once

#include <torch/types.h>

#include <map>
#include <string>
#include <utility>

#include "core/observe/counters.h"
#include "parallel/mesh.h"

namespace tessel::run {

class StepCounters {
 public:
  StepCounters(const parallel::Mesh& mesh, const torch::Device& device);
  void begin_step();
  /// `host_ran`: false for a replayed CUDA graph (training.cuda_graph), whose collectives no
  /// host code counted: the step then counts for memory, not for payload bytes.
  void end_step(bool host_ran = true);
  /// Steps whose payload bytes were counted.
  int64_t host_steps() const { return host_steps_; }
  /// Mean payload bytes per counted step of each group (collectives + point-to-point sent).
  std::map<std::string, double> comm_bytes_per_step() const;
  /// Largest memory a step allocated above what was allocated when it began (steps after the
  /// first, which also allocates lasting buffers; the first when it is the only one).
  int64_t step_peak_bytes() const { return peak_extra_; }
  /// Memory allocated when the last step began (weights, gradients, optimizer state, buffers).
  int64_t step_base_bytes() const { return base_; }
  /// The most host reads (core/observe/host_reads.h) one step made: steps after the first, which
  /// also reads once what lives on; the first when it is the only one. Counted in full only with
  /// TESSEL_COUNT_HOST_READS=1 (else Tessel's own reads alone).
  int64_t host_reads_per_step() const { return reads_; }
  /// CUDA: the highest allocated bytes since the last call (metrics' mem_bytes).
  int64_t take_peak_since_log() { return std::exchange(peak_abs_, 0); }

 private:
  int64_t allocated() const;
  int64_t reset_peak();
  const parallel::Mesh& mesh_;
  torch::Device device_;
  std::map<parallel::GroupKind, int64_t> at_begin_, total_;
  int64_t steps_ = 0, host_steps_ = 0, base_ = 0, peak_extra_ = 0, peak_abs_ = 0;
  int64_t reads_at_begin_ = 0, reads_ = 0;
};

}  // namespace tessel::run
