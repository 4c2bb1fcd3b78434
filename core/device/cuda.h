// Where CUDA comes from. LibTorch's CUDA half (libtorch_cuda, with cuBLAS, cuDNN, NCCL and the
// rest: about a third of a second of one core and a gigabyte mapped at every start) is loaded
// only by a process that may compute on a GPU, together with Tessel's own code that needs it:
// libtessel_cuda.so, beside the binaries (build/bin, an install's libexec/tessel). Every question
// "is there a GPU?" goes through cuda_available() here, which loads it first: LibTorch decides
// once, at its first such question, whether CUDA exists in the process, so nothing may ask it
// before the load (a process where something did has no CUDA, and cuda_unavailable_reason() says
// so). A run on training.device cpu never loads it.
#pragma once

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace tessel::device {

/// The device side of a captured training step (engine/run/step_graph.h owns the policy).
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

/// Device-to-host copies in flight (CudaModule::copy_to_host).
struct HostCopy {
  /// Blocks the host until the copies are done: call it before reading a destination.
  std::function<void()> wait_host;
  /// The current stream waits on the device for the copies (the host is not held): call it
  /// before queueing anything that writes a source.
  std::function<void()> wait_on_device;
};

/// What libtessel_cuda.so provides: Tessel's code that needs LibTorch's CUDA half.
struct CudaModule {
  int version = 0;  // kCudaModuleVersion of the build that made it
  /// NCCL for one group, bound to `device` and connected now (cuda_module.cpp says why).
  c10::intrusive_ptr<c10d::Backend> (*make_nccl)(const c10::intrusive_ptr<c10d::Store>& store,
                                                 int rank, int size, const std::string& name,
                                                 const std::vector<int64_t>& ranks,
                                                 std::chrono::milliseconds timeout,
                                                 const c10::Device& device) = nullptr;
  /// The CUDA graph backend (at::cuda::CUDAGraph on a pooled stream of the current device).
  std::unique_ptr<GraphBackend> (*make_graph)() = nullptr;
  /// The name of CUDA device `index` ("NVIDIA H100 80GB HBM3").
  std::string (*device_name)(int index) = nullptr;
  /// Why the CUDA runtime itself sees no device ("" when it sees one): its error, the CUDA
  /// version the installed driver supports and the runtime's own.
  std::string (*why_no_device)() = nullptr;
  /// CUDA device `index`'s compute capability, 10·major + minor (90 on an H100).
  int (*compute_capability)(int index) = nullptr;
  /// dst[i] (host, pinned) <- src[i] (this device) on a side stream that first waits for the
  /// current stream's work. Nothing waits for the copies yet: the sources may be read meanwhile,
  /// and whatever writes one first calls wait_on_device.
  HostCopy (*copy_to_host)(const std::vector<at::Tensor>& dst,
                           const std::vector<at::Tensor>& src) = nullptr;
  /// `bytes` of page-locked host memory, exactly (cudaHostAlloc: the caching host allocator
  /// rounds each request up to a power of two), as a uint8 tensor that frees it.
  at::Tensor (*pinned_bytes)(int64_t bytes) = nullptr;
};
/// Bumped whenever CudaModule changes: a module of another build is refused.
constexpr int kCudaModuleVersion = 5;

/// NVIDIA GPUs the operating system shows, whether or not CUDA can use them.
struct GpuHardware {
  std::vector<std::string> gpus;  // one entry per GPU: its model, else its /dev node
  std::string driver;             // the kernel driver's version ("580.159.04"), or ""
  std::string describe() const;   // "1 NVIDIA GPU (NVIDIA H100 80GB HBM3), driver 580.159.04"
};
/// Read from `root`/proc/driver/nvidia (the driver's version, each GPU's model), else from the
/// `root`/dev/nvidia<N> nodes. `root`: "" for this machine; tests pass a folder.
GpuHardware gpu_hardware(const std::string& root = "");
/// The NVIDIA driver CUDA `version` (1000 * major + 10 * minor, as cudaRuntimeGetVersion) needs.
/// Inline: libtessel_cuda.so uses it too, and links nothing of Tessel's.
inline std::string driver_needed(int version) {
  const int major = version / 1000;
  if (major >= 13) return "an NVIDIA driver of release 580 or newer";
  if (major == 12) return "an NVIDIA driver of release 525 or newer";
  if (major == 11) return "an NVIDIA driver of release 450 or newer";
  return "a newer NVIDIA driver";
}

/// Whether a CUDA device can be used here. Loads libtessel_cuda.so first (once); where it cannot
/// be loaded there is no usable CUDA, and cuda_unavailable_reason() says why.
bool cuda_available();
/// CUDA devices visible to this process (0 without CUDA).
int64_t cuda_device_count();
/// Why cuda_available() is false ("" when it is true): the cause as far as it can be found (the
/// libraries, the driver's CUDA version against the runtime's, CUDA_VISIBLE_DEVICES) and the
/// GPUs the machine has all the same.
std::string cuda_unavailable_reason();
/// For checks that must not pass without a GPU: the machine has NVIDIA GPUs (gpu_hardware()) and
/// CUDA cannot use them. The message names both; "" otherwise (CUDA works, or there is no GPU).
std::string gpu_present_but_unusable();
/// The module, loaded; nullptr where it cannot be (cuda_unavailable_reason() says why).
const CudaModule* cuda_module();
/// Whether this process has loaded LibTorch's CUDA half, usable (for tests).
bool cuda_loaded();
/// TF32 tensor cores for CUDA's fp32 matmuls and convolutions, on or off (training.tf32), set
/// through both of LibTorch's APIs so that neither reads the other as a contradiction.
void set_tf32(bool on);
/// training.deterministic: PyTorch's deterministic algorithms on (strict: an operator without a
/// deterministic kernel throws, naming itself), cuDNN deterministic and not benchmarking, and
/// CUBLAS_WORKSPACE_CONFIG=:4096:8 unless the environment sets it (before the first cuBLAS
/// handle). Off: PyTorch's defaults.
void set_deterministic(bool on);

}  // namespace tessel::device

/// The module's one entry point, looked up by name after loading it.
extern "C" const tessel::device::CudaModule* tessel_cuda_module();
