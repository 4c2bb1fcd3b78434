// Tessel's short-sequence CPU attention (core/kernels/attention_cpu.h) against plain attention in
// fp64: outputs and all three gradients, causal and not, grouped-query heads, rows whose length
// is not a multiple of the 8-lane vectors, and the layouts the model hands it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/kernels/attention_cpu.h"
#include "core/kernels/softmax_kernels.h"
#include "tests/common/attention_cases.h"

namespace tessel::testing {
namespace {

struct ShortCase {
  int64_t heads, kv_heads, m, n, d;
  bool causal;
};

std::string short_name(const ShortCase& c) {
  return "h" + std::to_string(c.heads) + "kv" + std::to_string(c.kv_heads) + "m" +
         std::to_string(c.m) + "n" + std::to_string(c.n) + "d" + std::to_string(c.d) +
         (c.causal ? "causal" : "full");
}

class ShortAttention : public ::testing::TestWithParam<ShortCase> {};

// Inputs as the model makes them: [b, s, heads, d] memory viewed as [b, heads, s, d].
torch::Tensor projected(int64_t b, int64_t heads, int64_t s, int64_t d) {
  return torch::randn({b, s, heads, d}).transpose(1, 2).requires_grad_(true);
}

double max_error(const torch::Tensor& got, const torch::Tensor& want) {
  return (got.to(torch::kFloat64) - want).abs().max().item<double>() /
         std::max(1.0, want.abs().max().item<double>());
}

TEST_P(ShortAttention, MatchesPlainAttentionAndItsGradients) {
  const auto c = GetParam();
  torch::manual_seed(11);
  const int64_t b = 3;
  auto q = projected(b, c.heads, c.m, c.d), k = projected(b, c.kv_heads, c.n, c.d),
       v = projected(b, c.kv_heads, c.n, c.d);
  auto dy = torch::randn({b, c.heads, c.m, c.d});
  ASSERT_TRUE(kernels::short_attention_applies(q, k, c.causal));
  auto y = kernels::short_attention(q, k, v, c.causal);
  y.backward(dy);

  auto q64 = q.detach().to(torch::kFloat64).requires_grad_(true);
  auto k64 = k.detach().to(torch::kFloat64).requires_grad_(true);
  auto v64 = v.detach().to(torch::kFloat64).requires_grad_(true);
  auto ref = plain_attention(q64, k64, v64, c.causal);
  ref.backward(dy.to(torch::kFloat64));
  EXPECT_LT(max_error(y, ref), 2e-6);
  EXPECT_LT(max_error(q.grad(), q64.grad()), 2e-6);
  EXPECT_LT(max_error(k.grad(), k64.grad()), 2e-6);
  EXPECT_LT(max_error(v.grad(), v64.grad()), 2e-6);
  EXPECT_EQ(y.sizes(), q.sizes());
  // Which path ran: the fused head loops wherever they apply (AVX2, head size a multiple of 8).
  auto [out, saved] =
      kernels::short_attention_forward(q.detach(), k.detach(), v.detach(), c.causal);
  EXPECT_EQ(saved.probs.dim(), kernels::cpu::head_loops_apply(c.d) ? 4 : 3);
  EXPECT_TRUE(torch::equal(out, y.detach()));
  EXPECT_EQ(k.grad().sizes(), k.sizes());
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, ShortAttention,
    ::testing::Values(ShortCase{6, 6, 128, 128, 32, true}, ShortCase{4, 2, 37, 37, 16, true},
                      ShortCase{8, 1, 21, 21, 24, true}, ShortCase{3, 3, 5, 61, 8, false},
                      ShortCase{4, 2, 1, 256, 64, false}, ShortCase{2, 2, 256, 256, 16, true},
                      // head sizes not a multiple of 8: the batched-matmul path
                      ShortCase{4, 2, 19, 19, 20, true}, ShortCase{3, 1, 6, 40, 12, false}),
    [](const auto& info) { return short_name(info.param); });

TEST(ShortAttention, AppliesToShortFp32CpuAttentionOnly) {
  auto q = torch::randn({1, 4, 16, 8}), k = torch::randn({1, 2, 16, 8});
  EXPECT_TRUE(kernels::short_attention_applies(q, k, true));
  EXPECT_FALSE(kernels::short_attention_applies(q, k.narrow(2, 0, 8), true));  // m != n
  EXPECT_TRUE(kernels::short_attention_applies(q, k.narrow(2, 0, 8), false));
  EXPECT_FALSE(kernels::short_attention_applies(q.to(torch::kBFloat16), k, true));
  EXPECT_FALSE(kernels::short_attention_applies(torch::randn({1, 3, 16, 8}), k, true));
  auto long_k = torch::randn({1, 2, kernels::kShortAttentionKeys + 1, 8});
  EXPECT_FALSE(kernels::short_attention_applies(q, long_k, false));
  EXPECT_THROW(kernels::short_attention(q, long_k, long_k, false), c10::Error);
}

// The row loops: the causal rows' masked keys come out exactly 0, every row sums to 1, a row's
// gradient sums to 0 (softmax's gradient is orthogonal to the ones vector), and the result does
// not depend on the thread count.
TEST(SoftmaxRows, MaskedKeysAreZeroAndRowsSumToOne) {
  torch::manual_seed(5);
  const int64_t m = 19, n = 19;
  auto s = torch::randn({4, m, n}) * 5;
  auto p = s.clone();
  kernels::cpu::ScoreRows rows{4 * m, n, m, true, 0.25f};
  kernels::cpu::softmax_rows(p.mutable_data_ptr<float>(), rows);
  auto want =
      (s * 0.25).masked_fill(torch::ones({m, n}, torch::kBool).triu(1), -INFINITY).softmax(-1);
  EXPECT_LT((p - want).abs().max().item<double>(), 1e-6);
  EXPECT_EQ(p.masked_select(torch::ones({m, n}, torch::kBool).triu(1).expand({4, m, n}))
                .abs()
                .sum()
                .item<double>(),
            0.0);
  EXPECT_LT((p.sum(-1) - 1).abs().max().item<double>(), 1e-6);
  auto dp = torch::randn({4, m, n});
  auto ds = dp.clone();
  kernels::cpu::softmax_backward_rows(p.const_data_ptr<float>(), ds.mutable_data_ptr<float>(),
                                      rows);
  EXPECT_LT(ds.sum(-1).abs().max().item<double>(), 1e-5);

  const int threads = at::get_num_threads();
  auto big = torch::randn({64, 200, 200});
  std::vector<torch::Tensor> outs;
  for (int t : {1, 2}) {
    at::set_num_threads(t);
    auto x = big.clone();
    kernels::cpu::softmax_rows(x.mutable_data_ptr<float>(), {64 * 200, 200, 200, true, 0.1f});
    outs.push_back(x);
  }
  at::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(outs[0], outs[1]));
}

}  // namespace
}  // namespace tessel::testing
