#include "core/observe/timing.h"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <vector>

namespace tessel::observe {

struct SpanTimer::Events {
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> pool;  // start, stop, start, stop, ...
  size_t used = 0;
  at::cuda::CUDAEvent& next() {
    if (used == pool.size())  // timing events (the default CUDAEvent disables timing)
      pool.push_back(std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault));
    return *pool[used++];
  }
};

namespace {
// Inside a CUDA graph capture (training.cuda_graph) an event recorded on the stream is a node of
// the graph, not a time the host can read after a replay: spans are not recorded there.
bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}
}  // namespace

SpanTimer::SpanTimer(bool device_side) : device_side_(device_side) {
  if (device_side_) events_ = std::make_unique<Events>();
}
SpanTimer::~SpanTimer() = default;
SpanTimer::SpanTimer(SpanTimer&&) noexcept = default;
SpanTimer& SpanTimer::operator=(SpanTimer&&) noexcept = default;

void SpanTimer::start() {
  if (device_side_) {
    if (!capturing()) events_->next().record();
  } else {
    t0_ = std::chrono::steady_clock::now();
  }
}

void SpanTimer::stop() {
  if (device_side_) {
    if (!capturing()) events_->next().record();
  } else {
    host_ms_ +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
  }
}

double SpanTimer::take_ms() {
  double ms = host_ms_;
  host_ms_ = 0;
  if (device_side_) {
    for (size_t i = 0; i + 1 < events_->used; i += 2) {
      events_->pool[i + 1]->synchronize();
      ms += events_->pool[i]->elapsed_time(*events_->pool[i + 1]);
    }
    events_->used = 0;
  }
  return ms;
}

}  // namespace tessel::observe
