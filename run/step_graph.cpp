#include "run/step_graph.h"

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <exception>
#include <optional>
#include <utility>

namespace tessel {
namespace {

template <class F>
void quietly(F&& f) noexcept {
  try {
    f();
  } catch (...) {  // cleanup after a failure: what is left is memory, not correctness
  }
}

class CudaGraphBackend : public GraphBackend {
 public:
  void enter_stream() override {
    auto before = c10::cuda::getCurrentCUDAStream();
    auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, before.device_index());
    at::cuda::CUDAEvent queued;
    queued.record(before);
    queued.block(side);  // parameters, state and data queued before are there first
    guard_.emplace(side);
  }
  void leave_stream() override {
    if (!guard_) return;
    auto side = c10::cuda::getCurrentCUDAStream();
    guard_.reset();
    at::cuda::CUDAEvent done;
    done.record(side);
    done.block(c10::cuda::getCurrentCUDAStream());
  }
  void begin() override {
    // The warm-up steps' cached blocks back to the device first: a capture allocates a whole
    // step again in its own pool, and nothing cached is released while it runs.
    c10::cuda::device_synchronize();
    c10::cuda::CUDACachingAllocator::emptyCache();
    graph_ = std::make_unique<at::cuda::CUDAGraph>();
    pool_ = at::cuda::graph_pool_handle();
    capturing_ = true;  // before: capture_begin may fail after routing allocations to the pool
    // Thread-local: the checks apply to the capturing thread (and the autograd thread that
    // queues backward on its stream), not to NCCL's watchdog polling its events elsewhere.
    graph_->capture_begin(pool_, cudaStreamCaptureModeThreadLocal);
  }
  void end() override {
    graph_->capture_end();
    capturing_ = false;  // after: a failing capture_end leaves the pool routing to undo
  }
  void abort() noexcept override {
    // End a capture the failure left open (CUDA invalidates it), hand its memory pool back to
    // the allocator (capture_end would have), then drop what was made. Each step on its own:
    // one failing must not leave the others undone.
    const auto device = c10::cuda::current_device();
    cudaGraph_t partial = nullptr;
    if (cudaStreamEndCapture(c10::cuda::getCurrentCUDAStream(), &partial) == cudaSuccess && partial)
      cudaGraphDestroy(partial);
    (void)cudaGetLastError();  // the failed capture's error is reported by the caller
    if (capturing_) {
      quietly([&] { c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool_); });
      quietly([&] { at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool_); });
      quietly([&] { c10::cuda::CUDACachingAllocator::releasePool(device, pool_); });
      quietly([&] { at::getHostAllocator(at::kCUDA)->release_pool(pool_); });
    }
    capturing_ = false;
    quietly([&] { graph_.reset(); });
  }
  void replay() override { graph_->replay(); }

 private:
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
  c10::MempoolId_t pool_{0, 0};
  bool capturing_ = false;  // from before capture_begin until capture_end returned
};

}  // namespace

std::unique_ptr<GraphBackend> make_cuda_graph_backend() {
  return std::make_unique<CudaGraphBackend>();
}

StepGraph::StepGraph(std::unique_ptr<GraphBackend> backend, int64_t warmup_steps)
    : backend_(std::move(backend)), warmup_left_(warmup_steps) {
  backend_->enter_stream();
}

StepGraph::~StepGraph() { backend_->leave_stream(); }

StepGraph::Ran StepGraph::run(bool eager_only, const std::function<void()>& step,
                              const std::function<void()>& undo) {
  if (captured_ && !eager_only) {
    backend_->replay();
    return Ran::kReplayed;
  }
  if (eager_only || failed() || captured_ || warmup_left_ > 0) {
    if (!eager_only && warmup_left_ > 0) --warmup_left_;
    step();
    return Ran::kEager;
  }
  try {
    backend_->begin();
    step();
    backend_->end();
  } catch (const std::exception& e) {
    backend_->abort();
    failure_ = e.what();
    if (failure_.empty()) failure_ = "capture failed";
    undo();
    step();
    return Ran::kEager;
  }
  captured_ = true;
  backend_->replay();  // the capture only recorded the step: run it
  return Ran::kCaptured;
}

}  // namespace tessel
