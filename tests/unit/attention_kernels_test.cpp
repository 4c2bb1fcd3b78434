// The attention kernels on the CPU (tests/gpu runs the same cases on CUDA).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tests/common/attention_cases.h"

namespace tessel::testing {
namespace {

class BlockKernels : public ::testing::TestWithParam<BlockCase> {};

TEST_P(BlockKernels, ForwardAndBackwardMatchPlainAttention) { check_block_kernels(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cpu, BlockKernels, ::testing::ValuesIn(block_cases(torch::kCPU)),
                         [](const auto& info) { return case_name(info.param); });

TEST(DenseAttention, GroupedQueryHeadsMatchPlainAttention) {
  torch::manual_seed(3);
  auto q = torch::randn({2, 4, 24, 16}), k = torch::randn({2, 2, 24, 16}),
       v = torch::randn({2, 2, 24, 16});
  auto ref =
      plain_attention(q.to(torch::kFloat64), k.to(torch::kFloat64), v.to(torch::kFloat64), true);
  for (bool tessel : {true, false}) {  // Tessel's short-sequence kernel, SDPA's flash
    auto y = kernels::dense_attention(q, k, v, true, tessel);
    EXPECT_LT((y.to(torch::kFloat64) - ref).abs().max().item<double>(), 1e-5) << tessel;
  }
}

// The kernel a plan's attention gets on CPU: the fused flash kernel in fp32 and bf16, grouped
// heads or not, at the head sizes of the shipped plans; Tessel's own in fp32 up to 256 tokens
// unless training.kernels is torch. The start-up log names it.
TEST(PlannedAttention, CpuGetsTheFlashKernelOrTesselsForShortSequences) {
  for (auto dtype : {torch::kFloat32, torch::kBFloat16})
    for (int64_t kv : {6, 2})
      for (int64_t d : {32, 64, 128}) {
        for (bool tessel : {true, false})
          EXPECT_EQ(kernels::planned_attention_kernel(6, kv, 1024, d, dtype, torch::kCPU, tessel),
                    "flash")
              << "kv " << kv << " head size " << d;
        const bool own = dtype == torch::kFloat32;
        EXPECT_EQ(kernels::planned_attention_kernel(6, kv, 256, d, dtype, torch::kCPU, true),
                  own ? "tessel" : "flash");
        EXPECT_EQ(kernels::planned_attention_kernel(6, kv, 257, d, dtype, torch::kCPU, true),
                  "flash");
        EXPECT_EQ(kernels::planned_attention_kernel(6, kv, 128, d, dtype, torch::kCPU, false),
                  "flash");
      }
}

TEST(KernelLayout, IsTheForwardsOutputLayout) {
  auto q = torch::randn({2, 3, 8, 16});
  auto [out, lse] = kernels::block_forward(q, q, q, true);
  // What the kernel returned needs no copy; a [b, h, m, d]-contiguous tensor gets one.
  EXPECT_EQ(kernels::kernel_layout(out).data_ptr(), out.data_ptr());
  auto plain = out.contiguous();
  auto laid = kernels::kernel_layout(plain);
  EXPECT_TRUE(torch::equal(laid, plain));
  EXPECT_EQ(laid.stride(2), 3 * 16);  // rows of one head are h·d apart
  EXPECT_EQ(lse.sizes(), (std::vector<int64_t>{2, 3, 8}));
}

// SDPA's CUDA backend order, pinned per dtype at start-up (flags only: no device needed).
TEST(SdpaOrder, PinnedPerDtype) {
  kernels::pin_sdpa_order(torch::kBFloat16);
  auto order = at::globalContext().sDPPriorityOrder();
  EXPECT_EQ(order[0], at::SDPBackend::cudnn_attention);
  EXPECT_EQ(order[1], at::SDPBackend::flash_attention);
  kernels::pin_sdpa_order(torch::kFloat32);
  order = at::globalContext().sDPPriorityOrder();
  EXPECT_EQ(order[0], at::SDPBackend::efficient_attention);
  EXPECT_EQ(order[1], at::SDPBackend::math);
  // training.deterministic: cuDNN's attention (whose backward does not repeat) after math.
  kernels::pin_sdpa_order(torch::kBFloat16, /*deterministic=*/true);
  order = at::globalContext().sDPPriorityOrder();
  EXPECT_EQ(order[0], at::SDPBackend::flash_attention);
  EXPECT_EQ(order[1], at::SDPBackend::efficient_attention);
  EXPECT_EQ(order[2], at::SDPBackend::math);
  EXPECT_EQ(order[3], at::SDPBackend::cudnn_attention);
}

}  // namespace
}  // namespace tessel::testing
