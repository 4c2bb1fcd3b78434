// What a GPU step must not do, checked on CPU: recompute RoPE tables per micro-batch, or keep
// several fp32 copies of the logits for the loss. CPU allocations are counted by the allocator
// wrapper the trainer's step counters use (core/observe/counters.h).
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/observe/counters.h"
#include "engine/planner/cpu_profile.h"
#include "models/from_plan.h"
#include "models/registry.h"
#include "parallel/tp/layers.h"

namespace tessel {
namespace {

// The counting allocator's blocks are plain, as the default CPU allocator's: oneDNN's bf16
// matmul (CPUs with avx512_bf16 or AMX) allocates through raw_allocate, which asserts that.
TEST(Memory, CountingAllocatorServesRawAllocations) {
  auto& counter = observe::CpuAllocationCounter::get();
  auto* alloc = c10::GetCPUAllocator();
  const int64_t before = counter.now();
  void* p = alloc->raw_allocate(1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  EXPECT_EQ(counter.now() - before, 1000);
  alloc->raw_deallocate(p);
  EXPECT_EQ(counter.now(), before);
  auto a = torch::randn({64, 96}).to(torch::kBFloat16),
       b = torch::randn({96, 32}).to(torch::kBFloat16);
  auto c = torch::matmul(a, b);
  EXPECT_TRUE(torch::allclose(c.to(torch::kFloat32),
                              torch::matmul(a.to(torch::kFloat32), b.to(torch::kFloat32)), 0.05,
                              0.1));
}

// A probe measures what a function allocates at its peak, and leaves the step's peak as it was
// (the planner measures oneDNN's matmul workspaces with it: engine/planner/cpu_profile.h).
TEST(Memory, PeakDuringMeasuresAndLeavesTheStepPeak) {
  auto& counter = observe::CpuAllocationCounter::get();
  counter.take_peak();
  const int64_t peak = counter.take_peak();  // now
  const int64_t most = counter.peak_during([] {
    auto a = torch::empty({1000}, torch::kFloat32);  // 4,000 bytes
    auto b = torch::empty({500}, torch::kFloat32);   // 2,000 more at once
  });
  EXPECT_EQ(most, 6000);
  EXPECT_EQ(counter.take_peak(), peak);  // the probe is no step's peak
  // fp32: a matmul allocates its result; bf16 as this CPU's oneDNN does, at least its result.
  EXPECT_EQ(planner::cpu_matmul_bytes(16, 32, 80, torch::kFloat32, false, 1), 16 * 80 * 4);
  EXPECT_GE(planner::cpu_matmul_bytes(32, 16, 80, torch::kBFloat16, true, 1), 32 * 80 * 2);
}

TEST(Memory, CrossEntropyKeepsOneFp32CopyOfTheLogits) {
  torch::manual_seed(0);
  const int64_t n = 512, v = 1000;
  parallel::Group solo("solo", {0}, 0, nullptr);
  auto& counter = observe::CpuAllocationCounter::get();
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    auto logits = torch::randn({n, v}).to(dtype).requires_grad_();
    auto targets = torch::randint(0, v, {n});
    // The reference: torch's own cross entropy in fp32.
    auto ref_logits = logits.detach().to(torch::kFloat32).requires_grad_();
    auto ref = torch::nn::functional::cross_entropy(
        ref_logits, targets,
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    ref.backward();

    const int64_t base = counter.now();
    counter.take_peak();
    auto loss = parallel::tp::vocab_parallel_cross_entropy(solo, logits, targets, 0, v).sum();
    loss.backward();
    const int64_t extra = counter.take_peak() - base;

    const double fp32_logits = static_cast<double>(n * v * 4);
    // One fp32 [n, v] buffer (softmax, then the gradient in place), plus the gradient in the
    // logits' dtype when that is not fp32; the [n] statistics are small.
    const double budget = fp32_logits * (dtype == torch::kFloat32 ? 1.1 : 1.6);
    EXPECT_LT(static_cast<double>(extra), budget)
        << c10::toString(dtype) << ": peak " << extra << " bytes beyond the inputs";
    std::printf("cross entropy %s [%lld, %lld]: peak %.2f x the fp32 logits\n",
                c10::toString(dtype), static_cast<long long>(n), static_cast<long long>(v),
                static_cast<double>(extra) / fp32_logits);
    // What the arithmetic allows: the loss is computed in fp32 from the same logits (1e-5: the
    // order of an fp32 sum of 512 terms); the gradient is the fp32 softmax minus one-hot, rounded
    // once to the logits' dtype (bf16 keeps 8 significant bits: at most 2^-9 of the value, 2^-8
    // with margin; a 10% error in the softmax part is far outside).
    EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-5 * std::abs(ref.item<double>()));
    const double rtol = dtype == torch::kFloat32 ? 1e-5 : 1.0 / 256;
    EXPECT_TRUE(torch::allclose(logits.grad().to(torch::kFloat32), ref_logits.grad(), rtol, 1e-9))
        << c10::toString(dtype) << ": largest gradient difference "
        << (logits.grad().to(torch::kFloat32) - ref_logits.grad()).abs().max().item<double>();
  }
}

TEST(Memory, RopeTablesAreComputedOncePerShapeDeviceAndDtype) {
  auto c =
      plan::load_config_text(
          "data: {path: x, format: tokens}\nmodel: {arch: llama, layers: 1, hidden: 32, heads: 4, "
          "kv_heads: 2, ffn_hidden: 64, vocab_size: 100, max_seq_len: 128}\n",
          "t")
          .model;
  auto model = models::build_model(models::model_shape(c), 1);
  const auto& a = model->rope(16, torch::kCPU, torch::kFloat32);
  const auto& b = model->rope(16, torch::kCPU, torch::kFloat32);
  EXPECT_EQ(a.first.data_ptr(), b.first.data_ptr());  // the same tables, not recomputed
  EXPECT_EQ(a.second.data_ptr(), b.second.data_ptr());
  // Hugging Face's definition: angle = position / theta^(2i/d), cos/sin of [angles, angles].
  const int64_t d = 8;
  auto inv = 1.0 / torch::pow(c.rope_theta, torch::arange(0, d, 2).to(torch::kFloat32) / d);
  auto ang = torch::outer(torch::arange(16).to(torch::kFloat32), inv);
  EXPECT_TRUE(torch::allclose(a.first, torch::cat({ang, ang}, -1).cos()));
  EXPECT_TRUE(torch::allclose(a.second, torch::cat({ang, ang}, -1).sin()));
  // Another length or dtype: other tables.
  const auto& h = model->rope(16, torch::kCPU, torch::kBFloat16);
  EXPECT_EQ(h.first.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(model->rope(32, torch::kCPU, torch::kFloat32).first.size(0), 32);
  // A forward pass of a length seen before uses those tables (it does not replace them).
  model->forward(torch::randint(0, 100, {2, 16}));
  EXPECT_EQ(model->rope(16, torch::kCPU, torch::kFloat32).first.data_ptr(), a.first.data_ptr());
}

}  // namespace
}  // namespace tessel
