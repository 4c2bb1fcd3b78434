#include "core/device/cuda.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <torch/cuda.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>

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
  if (l.module && torch::cuda::is_available()) return "";
  std::string why;
  if (!l.module) {
    why = "LibTorch's CUDA libraries could not be loaded: " + l.why;
  } else {
    const std::string runtime = l.module->why_no_device();
    why = "LibTorch finds no usable CUDA device";
    if (!runtime.empty()) why += " (" + runtime + ")";
  }
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"))
    why += fmt::format("; CUDA_VISIBLE_DEVICES='{}'", visible);
  const auto hw = gpu_hardware();
  why += hw.gpus.empty() ? std::string("; the machine shows no NVIDIA GPU")
                         : "; the machine has " + hw.describe();
  return why;
}

std::string gpu_present_but_unusable() {
  if (gpu_hardware().gpus.empty() || cuda_available()) return "";
  return "this machine has NVIDIA GPUs, but CUDA cannot use them: " + cuda_unavailable_reason();
}

std::string GpuHardware::describe() const {
  std::string s = fmt::format("{} NVIDIA GPU{} ({})", gpus.size(), gpus.size() == 1 ? "" : "s",
                              fmt::join(gpus, ", "));
  return s + (driver.empty() ? std::string(", driver version unknown") : ", driver " + driver);
}

GpuHardware gpu_hardware(const std::string& root) {
  GpuHardware hw;
  const fs::path proc = fs::path(root + "/proc/driver/nvidia");
  std::error_code ec;
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu ..." (or "... Open Kernel
  // Module for x86_64  580.159.04  Release Build ..."): the first word shaped like a version.
  std::ifstream version(proc / "version");
  for (std::string word; hw.driver.empty() && version >> word;)
    if (word.find('.') != std::string::npos && std::isdigit(static_cast<unsigned char>(word[0])) &&
        word.find_first_not_of("0123456789.") == std::string::npos)
      hw.driver = word;
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(proc / "gpus", ec)) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end());
  for (const auto& d : dirs) {  // "Model: \t\t NVIDIA H100 80GB HBM3"
    std::ifstream info(d / "information");
    std::string line, model = d.filename().string();
    while (std::getline(info, line))
      if (line.rfind("Model:", 0) == 0) {
        const auto from = line.find_first_not_of(" \t", 6);
        if (from != std::string::npos) model = line.substr(from);
        break;
      }
    hw.gpus.push_back(model);
  }
  if (hw.gpus.empty()) {  // no /proc entries (some containers): the device nodes
    std::vector<std::string> nodes;
    for (const auto& e : fs::directory_iterator(fs::path(root + "/dev"), ec)) {
      const auto n = e.path().filename().string();
      if (n.size() > 6 && n.rfind("nvidia", 0) == 0 &&
          n.find_first_not_of("0123456789", 6) == std::string::npos)
        nodes.push_back("/dev/" + n);
    }
    std::sort(nodes.begin(), nodes.end());
    hw.gpus = nodes;
  }
  return hw;
}

const CudaModule* cuda_module() { return load().module; }

bool cuda_loaded() { return g_loaded; }

void set_tf32(bool on) {
  // LibTorch 2.11 keeps the legacy flags (allowTF32CuBLAS, allowTF32CuDNN) beside the precision
  // settings, and a read of a legacy flag throws ("mix of the legacy and new APIs") when the two
  // disagree: set through the legacy setters (which set the new settings too), then the new.
  auto& ctx = at::globalContext();
  ctx.setAllowTF32CuBLAS(on);
  ctx.setAllowTF32CuDNN(on);
  const auto p = on ? at::Float32Precision::TF32 : at::Float32Precision::IEEE;
  ctx.setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL, p);
  ctx.setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::CONV, p);
}

void set_deterministic(bool on) {
  // Read by cuBLAS when it makes a handle (at the first matmul on a device): set before that.
  if (on) setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  auto& ctx = at::globalContext();
  ctx.setDeterministicAlgorithms(on, /*warn_only=*/false);
  ctx.setDeterministicCuDNN(on);
  if (on) ctx.setBenchmarkCuDNN(false);
}

}  // namespace tessel::device
