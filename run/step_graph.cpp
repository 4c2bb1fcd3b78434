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
    graph_ = std::make_unique<at::cuda::CUDAGraph>();
    pool_ = at::cuda::graph_pool_handle();
    // Thread-local: the checks apply to the capturing thread (and the autograd thread that
    // queues backward on its stream), not to NCCL's watchdog polling its events elsewhere.
    graph_->capture_begin(pool_, cudaStreamCaptureModeThreadLocal);
    capturing_ = true;
  }
  void end() override {
    capturing_ = false;
    graph_->capture_end();
  }
  void abort() noexcept override {
    // End a capture the failure left open (CUDA invalidates it), hand its memory pool back to
    // the allocator (capture_end would have), then drop what was made.
    const auto device = c10::cuda::current_device();
    cudaGraph_t partial = nullptr;
    if (cudaStreamEndCapture(c10::cuda::getCurrentCUDAStream(), &partial) == cudaSuccess && partial)
      cudaGraphDestroy(partial);
    (void)cudaGetLastError();  // the failed capture's error is reported by the caller
    if (capturing_) {
      try {
        c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool_);
        at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool_);
        c10::cuda::CUDACachingAllocator::releasePool(device, pool_);
        at::getHostAllocator(at::kCUDA)->release_pool(pool_);
      } catch (...) {  // the pool stays reserved: memory, not correctness
      }
    }
    capturing_ = false;
    graph_.reset();
  }
  void replay() override { graph_->replay(); }

 private:
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
  c10::MempoolId_t pool_{0, 0};
  bool capturing_ = false;  // capture_begin done, capture_end not
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
