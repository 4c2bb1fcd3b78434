// LibTorch's CUDA half (libtorch_cuda, cuBLAS, cuDNN, NCCL) is loaded only when a process asks
// for CUDA, and then completely (core/device/cuda.h). One test: what it checks depends on the
// order.
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/device/cuda.h"
#include "engine/run/build.h"

namespace {

bool mapped(const std::string& library) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find(library) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST(CudaModule, LoadedOnlyWhenAskedForThenWhole) {
#ifdef TESSEL_NO_CUDA_MODULE
  GTEST_SKIP() << "built without libtessel_cuda.so (a cross build: tools/cross/aarch64.cmake)";
#endif
  // A binary of Tessel's starts without it, and a CPU plan's device does not load it.
  ASSERT_FALSE(tessel::device::cuda_loaded());
  std::string why;
  EXPECT_TRUE(tessel::run::resolve_device(tessel::plan::TrainDevice::kCpu,
                                          tessel::parallel::WorldInfo{}, &why)
                  .is_cpu());
  EXPECT_EQ(why, "training.device cpu");
  EXPECT_FALSE(tessel::device::cuda_loaded());
  EXPECT_FALSE(mapped("libtorch_cuda.so"));
  EXPECT_FALSE(mapped("libcublas"));
  EXPECT_FALSE(mapped("libnccl"));

  // The first question loads libtessel_cuda.so from beside the binary, and LibTorch's CUDA half
  // with it: LibTorch's CUDA hooks and kernels are there, with or without a device.
  const bool available = tessel::device::cuda_available();
  EXPECT_TRUE(tessel::device::cuda_loaded());
  EXPECT_TRUE(mapped("libtorch_cuda.so"));
  EXPECT_TRUE(at::detail::getCUDAHooks().isBuilt());
  EXPECT_EQ(available, torch::cuda::is_available());
  EXPECT_EQ(available, tessel::device::cuda_unavailable_reason().empty())
      << tessel::device::cuda_unavailable_reason();
  auto add = c10::Dispatcher::singleton().findSchema({"aten::add", "Tensor"});
  ASSERT_TRUE(add.has_value());
  EXPECT_TRUE(add->hasKernelForDispatchKey(c10::DispatchKey::CUDA));
  const auto* m = tessel::device::cuda_module();
  ASSERT_NE(m, nullptr) << tessel::device::cuda_unavailable_reason();
  EXPECT_EQ(m->version, tessel::device::kCudaModuleVersion);
  EXPECT_NE(m->make_nccl, nullptr);
  EXPECT_NE(m->make_graph, nullptr);
  EXPECT_NE(m->device_name, nullptr);
  EXPECT_NE(m->compute_capability, nullptr);
  ASSERT_NE(m->why_no_device, nullptr);
  // The runtime's own answer agrees with LibTorch's, and without a device names both versions.
  const std::string runtime = m->why_no_device();
  EXPECT_EQ(runtime.empty(), available) << runtime;
  if (!available)
    EXPECT_NE(runtime.find("LibTorch's CUDA runtime is 13."), std::string::npos) << runtime;
  // Without a device, auto resolves to the CPU and says why.
  if (!available) {
    EXPECT_TRUE(tessel::run::resolve_device(tessel::plan::TrainDevice::kAuto,
                                            tessel::parallel::WorldInfo{}, &why)
                    .is_cpu());
    EXPECT_NE(why.find("no CUDA device"), std::string::npos) << why;
    EXPECT_THROW(tessel::run::resolve_device(tessel::plan::TrainDevice::kCuda,
                                             tessel::parallel::WorldInfo{}, &why),
                 tessel::plan::UserError);
  }
}

// The GPUs a machine shows, from the kernel driver's files (a folder standing for `/`): what the
// GPU check uses to refuse "skipped" on a machine that has GPUs CUDA cannot use.
TEST(GpuHardware, FromTheDriversFilesElseTheDeviceNodes) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("tessel_hw_" + std::to_string(getpid()));
  fs::remove_all(root);
  EXPECT_TRUE(tessel::device::gpu_hardware(root.string()).gpus.empty());  // nothing at all

  fs::create_directories(root / "dev");
  for (const char* n : {"nvidia1", "nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-caps"})
    std::ofstream(root / "dev" / n) << "";
  auto hw = tessel::device::gpu_hardware(root.string());
  EXPECT_EQ(hw.gpus, (std::vector<std::string>{"/dev/nvidia0", "/dev/nvidia1"}));
  EXPECT_EQ(hw.driver, "");

  const auto proc = root / "proc/driver/nvidia";
  fs::create_directories(proc / "gpus/0000:c3:00.0");
  fs::create_directories(proc / "gpus/0000:1a:00.0");
  std::ofstream(proc / "version")
      << "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
         "(dvs-builder@U22-I3-AF03-09-1)  Thu Oct  9 19:42:13 UTC 2025\nGCC version:  gcc "
         "version 12.3.0\n";
  std::ofstream(proc / "gpus/0000:1a:00.0/information")
      << "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 17\n";
  std::ofstream(proc / "gpus/0000:c3:00.0/information") << "IRQ: 18\n";  // no model line
  hw = tessel::device::gpu_hardware(root.string());
  EXPECT_EQ(hw.driver, "580.159.04");
  EXPECT_EQ(hw.gpus, (std::vector<std::string>{"NVIDIA H100 80GB HBM3", "0000:c3:00.0"}));
  EXPECT_EQ(hw.describe(),
            "2 NVIDIA GPUs (NVIDIA H100 80GB HBM3, 0000:c3:00.0), driver 580.159.04");
  fs::remove_all(root);

  EXPECT_EQ(tessel::device::driver_needed(13000), "an NVIDIA driver of release 580 or newer");
  EXPECT_EQ(tessel::device::driver_needed(12080), "an NVIDIA driver of release 525 or newer");
  // This machine (CI has no GPU): nothing shown, so a GPU check may report skipped.
  if (tessel::device::gpu_hardware().gpus.empty())
    EXPECT_EQ(tessel::device::gpu_present_but_unusable(), "");
}

// training.tf32 through both of LibTorch's APIs: reading either afterwards agrees and does not
// throw (setting only the new one left the legacy cuBLAS flag contradicting it, which LibTorch
// 2.11 refuses to read: "mix of the legacy and new APIs"). Flags only: no device needed.
TEST(Tf32, SetBothWays) {
  auto& ctx = at::globalContext();
  for (bool on : {true, false, true}) {
    tessel::device::set_tf32(on);
    EXPECT_EQ(ctx.allowTF32CuBLAS(), on);
    EXPECT_EQ(ctx.allowTF32CuDNN(), on);
    EXPECT_EQ(ctx.float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL),
              on ? at::Float32Precision::TF32 : at::Float32Precision::IEEE);
  }
  tessel::device::set_tf32(false);
}

// training.deterministic: strict deterministic algorithms, cuDNN deterministic and not
// benchmarking, cuBLAS's workspace fixed unless the environment chose one; off restores
// PyTorch's defaults. Flags only: no device needed.
TEST(Deterministic, SetAndCleared) {
  auto& ctx = at::globalContext();
  unsetenv("CUBLAS_WORKSPACE_CONFIG");
  tessel::device::set_deterministic(true);
  EXPECT_TRUE(ctx.deterministicAlgorithms());
  EXPECT_FALSE(ctx.deterministicAlgorithmsWarnOnly());
  EXPECT_TRUE(ctx.deterministicCuDNN());
  EXPECT_FALSE(ctx.benchmarkCuDNN());
  ASSERT_NE(std::getenv("CUBLAS_WORKSPACE_CONFIG"), nullptr);
  EXPECT_STREQ(std::getenv("CUBLAS_WORKSPACE_CONFIG"), ":4096:8");
  setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8", 1);  // the user's choice stays
  tessel::device::set_deterministic(true);
  EXPECT_STREQ(std::getenv("CUBLAS_WORKSPACE_CONFIG"), ":16:8");
  tessel::device::set_deterministic(false);
  EXPECT_FALSE(ctx.deterministicAlgorithms());
  EXPECT_FALSE(ctx.deterministicCuDNN());
  unsetenv("CUBLAS_WORKSPACE_CONFIG");
}
