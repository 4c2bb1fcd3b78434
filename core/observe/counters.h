// CPU memory as the allocator sees it: bytes handed out now and at peak, and by what they hold
// (weights, gradients, optimizer state), counted by a wrapper over the default CPU allocator.
// engine/run/step_counters.h turns them (or CUDA's caching allocator) into per-step figures.
#pragma once

#include <torch/types.h>

#include <functional>
#include <map>
#include <string>
#include <utility>

namespace tessel::observe {

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
  /// The most `fn` allocates at once, above the count it starts at, on any thread while it runs
  /// (what take_peak() reports is left as if `fn` had not run). Not for use inside a step.
  int64_t peak_during(const std::function<void()>& fn);
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

}  // namespace tessel::observe
