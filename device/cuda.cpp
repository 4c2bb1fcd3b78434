#include "device/cuda.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <torch/cuda.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>

namespace tessel::device {
namespace {

namespace fs = std::filesystem;

std::atomic<bool> g_loaded{false};

struct Loaded {
  const CudaModule* module = nullptr;
  std::string why;  // why there is no module
};

// libtessel_cuda.so lies beside the binary that loads it (build/bin, an install's libexec/tessel).
fs::path module_path() {
  std::error_code ec;
  const auto exe = fs::read_symlink("/proc/self/exe", ec);
  return (ec ? fs::path() : exe.parent_path()) / "libtessel_cuda.so";
}

Loaded load_once() {
  Loaded l;
  const auto path = module_path();
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!handle) {
    const char* e = dlerror();
    l.why = e ? e : path.string() + ": cannot be loaded";
    return l;
  }
  using Entry = const CudaModule* (*)();
  auto entry = reinterpret_cast<Entry>(dlsym(handle, "tessel_cuda_module"));
  const CudaModule* m = entry ? entry() : nullptr;
  if (!m || m->version != kCudaModuleVersion) {
    l.why = fmt::format("{} is not this build's CUDA module (version {}, this binary's {})",
                        path.string(), m ? m->version : 0, kCudaModuleVersion);
    return l;
  }
  // LibTorch asks its CUDA hooks registry once, at the first question about CUDA, and keeps the
  // answer for the process's life. tessel-train's first question is this one (the plan's
  // validation asks before any tensor exists); a process that made LibTorch ask first (a
  // torch::manual_seed, say) has no CUDA, and a plan on training.device cuda is refused saying so.
  if (!at::detail::getCUDAHooks().isBuilt()) {
    l.why =
        "LibTorch was asked about CUDA (by a call such as torch::manual_seed) before Tessel loaded "
        "its CUDA half, and LibTorch answers that question once per process";
    return l;
  }
  g_loaded = true;
  l.module = m;
  return l;
}

const Loaded& load() {
  static const Loaded loaded = load_once();
  return loaded;
}

}  // namespace

bool cuda_available() { return load().module && torch::cuda::is_available(); }

int64_t cuda_device_count() {
  return cuda_available() ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
}

std::string cuda_unavailable_reason() {
  const auto& l = load();
  if (!l.module) return "LibTorch's CUDA libraries could not be loaded: " + l.why;
  if (torch::cuda::is_available()) return "";
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  return fmt::format(
      "LibTorch finds no usable CUDA device (no GPU, a driver older than this LibTorch's CUDA "
      "needs, or CUDA_VISIBLE_DEVICES={})",
      visible ? fmt::format("'{}'", visible) : std::string("unset"));
}

const CudaModule* cuda_module() { return load().module; }

bool cuda_loaded() { return g_loaded; }

}  // namespace tessel::device
