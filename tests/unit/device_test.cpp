// LibTorch's CUDA half (libtorch_cuda, cuBLAS, cuDNN, NCCL) is loaded only when a process asks
// for CUDA, and then completely (device/cuda.h). One test: what it checks depends on the order.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <fstream>
#include <string>

#include "device/cuda.h"
#include "run/train.h"

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
  // A binary of Tessel's starts without it, and a CPU plan's device does not load it.
  ASSERT_FALSE(tessel::device::cuda_loaded());
  std::string why;
  EXPECT_TRUE(tessel::resolve_device("cpu", tessel::parallel::WorldInfo{}, &why).is_cpu());
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
  // Without a device, auto resolves to the CPU and says why.
  if (!available) {
    EXPECT_TRUE(tessel::resolve_device("auto", tessel::parallel::WorldInfo{}, &why).is_cpu());
    EXPECT_NE(why.find("no CUDA device"), std::string::npos) << why;
    EXPECT_THROW(tessel::resolve_device("cuda", tessel::parallel::WorldInfo{}, &why),
                 tessel::UserError);
  }
}
