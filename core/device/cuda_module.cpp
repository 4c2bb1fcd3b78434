// libtessel_cuda.so: Tessel's code that needs LibTorch's CUDA half (core/device/cuda.h), loaded
// only by a process that may compute on a GPU. It holds no state of its own and includes nothing of
// Tessel's but core/device/cuda.h.
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "core/device/cuda.h"

namespace tessel::device {
namespace {

// NCCL, configured rather than left to defaults and environment variables:
//  - bound to this rank's device and connected now (eagerConnectSingleDevice): NCCL otherwise
//    creates a communicator at its group's first collective, in the middle of a step, in
//    whatever order the ranks reach it. Point-to-point transfers go through Group::send_recv's
//    coalesced batch, which uses this same communicator (no lazy per-pair ones).
//  - parallel.timeout_s as the collective timeout, and asynchronous error handling on: NCCL
//    collectives return before they finish, so a failure surfaces in the watchdog, not in
//    wait(); with TearDown it aborts the communicators and ends the process, printing the
//    group's description (our group name), the operation, its sequence number and the rank.
c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                            int size, const std::string& name,
                                            const std::vector<int64_t>& ranks,
                                            std::chrono::milliseconds timeout,
                                            const c10::Device& device) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  opts->group_name = name;
  opts->group_desc = name;
  opts->global_ranks_in_group.assign(ranks.begin(), ranks.end());
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
  pg->setGroupDesc(name);
  pg->setBoundDeviceId(device);
  pg->eagerConnectSingleDevice(device);
  return pg;
}

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

std::unique_ptr<GraphBackend> make_graph() { return std::make_unique<CudaGraphBackend>(); }

std::string device_name(int index) { return at::cuda::getDeviceProperties(index)->name; }

int compute_capability(int index) {
  const auto* p = at::cuda::getDeviceProperties(index);
  return 10 * p->major + p->minor;
}

std::string version_text(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

// Asked of the CUDA runtime itself, not of LibTorch (whose answer is a bare false): the error,
// the CUDA version the driver supports and the one this runtime is.
std::string why_no_device() {
  int count = 0, runtime = 0, driver = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  (void)cudaGetLastError();
  if (e == cudaSuccess && count > 0) return "";
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  std::string why = e == cudaSuccess ? std::string("the CUDA runtime counts 0 devices")
                                     : fmt::format("cudaGetDeviceCount: {} ({})",
                                                   cudaGetErrorString(e), cudaGetErrorName(e));
  why += fmt::format("; LibTorch's CUDA runtime is {}, ", version_text(runtime));
  why += driver > 0 ? fmt::format("the installed NVIDIA driver supports CUDA up to {}",
                                  version_text(driver))
                    : std::string("no NVIDIA driver answers (libcuda.so.1 not found)");
  if (driver > 0 && driver < runtime)
    why += fmt::format(": CUDA {} needs {}", version_text(runtime), driver_needed(runtime));
  return why;
}

HostCopy copy_to_host(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
  const auto current = c10::cuda::getCurrentCUDAStream();
  const auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, current.device_index());
  at::cuda::CUDAEvent ready;
  ready.record(current);
  ready.block(side);
  {
    c10::cuda::CUDAStreamGuard guard(side);
    for (size_t i = 0; i < dst.size(); ++i) {
      dst[i].copy_(src[i], /*non_blocking=*/true);
      // A source freed meanwhile (a view's storage) is not reused before the side stream read it.
      c10::cuda::CUDACachingAllocator::recordStream(src[i].storage().data_ptr(), side);
    }
  }
  auto done = std::make_shared<at::cuda::CUDAEvent>();
  done->record(side);
  return {[done] { done->synchronize(); },
          [done] { done->block(c10::cuda::getCurrentCUDAStream(done->device_index())); }};
}

at::Tensor pinned_bytes(int64_t bytes) {
  void* p = nullptr;
  C10_CUDA_CHECK(
      cudaHostAlloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1)), cudaHostAllocDefault));
  return at::from_blob(
      p, {bytes}, [](void* q) { cudaFreeHost(q); }, at::TensorOptions().dtype(at::kByte));
}

const CudaModule kModule{kCudaModuleVersion, &make_nccl,          &make_graph,   &device_name,
                         &why_no_device,     &compute_capability, &copy_to_host, &pinned_bytes};

}  // namespace
}  // namespace tessel::device

extern "C" const tessel::device::CudaModule* tessel_cuda_module() {
  return &tessel::device::kModule;
}
