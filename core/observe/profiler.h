// --profile STEPS: LibTorch's profiler (Kineto) around a window of training steps. It writes a
// Chrome trace per rank (Perfetto and TensorBoard's profiler plugin open it) and a table of the
// operators where the time went: self time (an operator's time less that of the operators it
// called), calls and share of the profiled wall time; with CUDA, kernels by device time as well.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tessel::observe {

/// One profiled span: an operator on a host thread, or a kernel/copy on the device.
struct ProfiledSpan {
  std::string name;
  uint64_t thread = 0;  // host thread, or device stream for device spans
  uint64_t start_ns = 0, end_ns = 0;
  bool device = false;
};

/// One row of the top-ops table.
struct OpTime {
  std::string name;
  int64_t calls = 0;
  double self_ms = 0;  // host: time less the operators called within; device: kernel time
  bool device = false;
};

/// Self time per operator name, most first: nested spans on one host thread are subtracted from
/// their parent (an aten::linear's own time excludes its aten::addmm). Device spans count whole.
std::vector<OpTime> op_times(std::vector<ProfiledSpan> spans);

/// The table as Markdown: the `top` first host rows and `top` first device rows, each with its
/// share of `wall_ms` (the profiled steps' wall time) and ms per step. `host_threads`: threads
/// whose operators the host rows add up (micro-batch pairs run on two): host shares are of
/// `host_threads` × `wall_ms`.
std::string top_ops_table(const std::vector<OpTime>& ops, double wall_ms, int64_t steps, size_t top,
                          int64_t host_threads = 1);

/// Host threads that ran operators for at least a tenth of the busiest one's time.
int64_t busy_host_threads(const std::vector<ProfiledSpan>& spans);

/// Profiles steps [first, last] of a run (engine/run/train.cpp calls it around every step).
class StepProfiler {
 public:
  /// `dir`: where rank<rank>.pt.trace.json and rank<rank>.top.md go (created when needed).
  StepProfiler(int64_t first, int64_t last, std::string dir, int64_t rank, bool cuda);
  ~StepProfiler();
  void before_step(int64_t step);
  /// At the window's last step: stops, writes the trace and the table, and returns the table
  /// (empty before).
  std::string after_step(int64_t step);
  bool done() const { return done_; }

 private:
  int64_t first_, last_, rank_;
  std::string dir_;
  bool cuda_, on_ = false, done_ = false;
  uint64_t t0_ns_ = 0;
};

}  // namespace tessel::observe
