#include "engine/planner/figures.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>

#include "core/device/cuda.h"
#include "core/plan/user_error.h"
#include "engine/planner/planner.h"

namespace tessel::planner {

Peak device_peak(const plan::Config& c, const torch::Device& device, torch::ScalarType dtype) {
  if (c.logging.peak_tflops > 0) return {c.logging.peak_tflops, "logging.peak_tflops", false};
  const std::string dname = dtype == torch::kHalf       ? "fp16"
                            : dtype == torch::kBFloat16 ? "bf16"
                                                        : "fp32";
  std::string name = "CPU";
  if (device.is_cuda()) {
    const auto* cuda = device::cuda_module();
    if (!cuda)
      throw plan::UserError("CUDA device " + device.str() + ": " +
                            device::cuda_unavailable_reason());
    name = cuda->device_name(device.index() < 0 ? 0 : device.index());
    // The planner's profile of this GPU: the one peak for its step time and its MFU.
    if (const auto* p = profile_of_gpu(name))
      return {matmul_peak_tflops(*p, c.training),
              name + " " + matmul_peak_name(c.training) + " datasheet peak", false};
  }
  // No datasheet: measure the best matmul rate this device reaches in the run's dtype, on the
  // run's threads: square matmuls of growing sizes, each the best of several tries (up to ten,
  // within a quarter second per size), after a warm-up. Sizes stop growing once one matmul takes
  // over 30 ms (the next, 8x the work, would take a quarter second): a dtype without fast kernels
  // here (bf16/fp16 on many CPUs) costs well under a second of start-up.
  auto opts = torch::TensorOptions().dtype(dtype).device(device);
  double best = 0;
  int64_t best_n = 0;
  using clock = std::chrono::steady_clock;
  for (int64_t n : {256, 512, 1024, 2048}) {
    auto a = torch::randn({n, n}, opts), b = torch::randn({n, n}, opts);
    const auto warm = clock::now();
    torch::matmul(a, b).sum().item<double>();  // warm-up (and CUDA sync)
    const bool slow = clock::now() - warm > std::chrono::milliseconds(30);
    const auto start = clock::now();
    for (int i = 0; i < 10; ++i) {
      const auto t0 = clock::now();
      torch::matmul(a, b).sum().item<double>();  // synchronises CUDA; small next to the matmul
      const auto t1 = clock::now();
      const double tflops = 2.0 * n * n * n / std::chrono::duration<double>(t1 - t0).count() / 1e12;
      if (tflops > best) best = tflops, best_n = n;
      if (i >= 2 && t1 - start > std::chrono::milliseconds(250)) break;
    }
    if (slow) break;
  }
  return {best,
          fmt::format("measured: the best {} matmul rate on {} (sizes 256 and up, best {}^3), no "
                      "datasheet entry",
                      dname, name, best_n),
          true};
}

}  // namespace tessel::planner
