// Elapsed time of spans of work, read when the host waits anyway (at a log line), never inside a
// step. On the CPU, and for waits that block the host (Gloo), a span is host time. On CUDA a span
// is a pair of CUDA events recorded on the current stream around it: what the stream did between
// them (kernels, or a stall behind a communication stream), not how long launching took.
#pragma once

#include <torch/types.h>

#include <chrono>
#include <memory>

namespace tessel::observe {

class SpanTimer {
 public:
  /// `device_side`: time the current CUDA stream (device must be CUDA); else the host clock.
  /// No default: a host clock around NCCL waits reads about 0 (they return at once), so every
  /// timer says which it is, normally through time_on_device().
  explicit SpanTimer(bool device_side);
  ~SpanTimer();
  SpanTimer(SpanTimer&&) noexcept;
  SpanTimer& operator=(SpanTimer&&) noexcept;

  void start();
  void stop();
  /// Milliseconds of every span stopped since the last take. On CUDA this waits for the spans'
  /// events: call it where the host synchronizes anyway.
  double take_ms();

 private:
  struct Events;  // CUDA events, reused from step to step
  bool device_side_;
  std::chrono::steady_clock::time_point t0_;
  double host_ms_ = 0;
  std::unique_ptr<Events> events_;
};

/// Device-side timing for work on `device` whose waits order a stream (NCCL); host time otherwise.
inline bool time_on_device(const torch::Device& device, bool nccl) {
  return device.is_cuda() && nccl;
}

}  // namespace tessel::observe
