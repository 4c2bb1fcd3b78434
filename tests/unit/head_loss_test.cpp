#include <gtest/gtest.h>
#include <torch/torch.h>

#include "parallel/comm.h"
#include "parallel/tp/head_loss.h"
#include "parallel/tp/layers.h"

namespace tessel::parallel::tp {
namespace {

// The fused, chunked head + loss against the unfused path (the whole logits, then
// vocab_parallel_cross_entropy), on one rank: 37 tokens, hidden 16, 52 head rows of which the
// last 2 are padding (vocabulary 50), the loss scaled afterwards as the trainer scales it.
TEST(HeadLoss, ChunkedFusedMatchesWholeLogitsInLossAndGradients) {
  Group solo("solo", {0}, 0, nullptr);
  torch::manual_seed(3);
  const int64_t n = 37, h = 16, rows = 52, vocab = 50;
  auto y0 = torch::randn({n, h}), w0 = torch::randn({rows, h}) * 0.3;
  auto targets = torch::randint(0, vocab, {n}, torch::kInt64);
  auto ref_y = y0.clone().requires_grad_(), ref_w = w0.clone().requires_grad_();
  auto ref =
      vocab_parallel_cross_entropy(solo, torch::mm(ref_y, ref_w.t()), targets, 0, vocab).sum();
  (ref * 0.125).backward();
  for (int64_t chunk : {0, 37, 8, 1}) {
    auto y = y0.clone().requires_grad_(), w = w0.clone().requires_grad_();
    auto loss = fused_head_cross_entropy_sum(solo, y, w, targets, 0, vocab, chunk);
    (loss * 0.125).backward();
    EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-6 * ref.item<double>()) << chunk;
    auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
      return ((a - b).abs().max() / b.abs().max()).item<double>();
    };
    EXPECT_LT(rel(y.grad(), ref_y.grad()), 1e-6) << chunk;
    EXPECT_LT(rel(w.grad(), ref_w.grad()), 1e-6) << chunk;
    EXPECT_EQ(w.grad().narrow(0, vocab, rows - vocab).abs().max().item<float>(), 0.0f);  // padding
    torch::NoGradGuard no_grad;  // evaluation: the loss alone
    EXPECT_NEAR(fused_head_cross_entropy_sum(solo, y0, w0, targets, 0, vocab, chunk).item<double>(),
                ref.item<double>(), 1e-6 * ref.item<double>());
  }
  // bf16 weights and inputs (the matmuls in bf16, the weight gradient summed over chunks in
  // fp32): the loss within bf16 rounding of the fp32 one.
  auto yb = y0.to(torch::kBFloat16).requires_grad_(), wb = w0.to(torch::kBFloat16).requires_grad_();
  auto lb = fused_head_cross_entropy_sum(solo, yb, wb, targets, 0, vocab, 8);
  lb.backward();
  EXPECT_NEAR(lb.item<double>(), ref.item<double>(), 1e-2 * ref.item<double>());
  EXPECT_EQ(wb.grad().scalar_type(), torch::kBFloat16);
  EXPECT_LT(((wb.grad().to(torch::kFloat32) * 0.125 - ref_w.grad()).abs().max() /
             ref_w.grad().abs().max())
                .item<double>(),
            2e-2);
  EXPECT_EQ(head_chunk_rows(50304, int64_t{64} << 20), 333);  // 64 MiB of fp32 rows of 50304
  EXPECT_EQ(head_chunk_rows(1 << 30, 1 << 20), 1);
  // The default: Llama-3's 128256 rows in 130-token chunks on a CPU, 2092-token ones on a GPU.
  EXPECT_EQ(default_head_chunk_rows(128256, false), 130);
  EXPECT_EQ(default_head_chunk_rows(128256, true), 2092);
}

}  // namespace
}  // namespace tessel::parallel::tp
