#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "core/kernels/activations.h"

namespace tessel::kernels {
namespace {

TEST(Activations, GeluTanhCpuMatchesTorchWithinFloatRounding) {
  // x over the range activations take, plus the tails where exp overflows or underflows.
  auto x =
      torch::cat({torch::linspace(-12, 12, 200001), torch::tensor({-1e4f, -100.f, 100.f, 1e4f})})
          .requires_grad_();
  ASSERT_TRUE(gelu_tanh_uses_cpu_kernel(x));
  auto ref_x = x.detach().to(torch::kFloat64).requires_grad_();
  auto y = gelu_tanh(x), ref = torch::gelu(ref_x, "tanh");
  auto dy = torch::randn_like(x.detach(), torch::TensorOptions().dtype(torch::kFloat32));
  y.backward(dy);
  ref.backward(dy.to(torch::kFloat64));
  // Against fp64 truth: within 2e-6 of |y| + 1e-9. In fp32 the argument of the exp is rounded,
  // and its error grows the result's relative error in the negative tail, about |argument| ulps
  // (1.3e-6 at x = -3.6, where y = -4e-4); torch::gelu's cancellation in 1 + tanh is worse there.
  auto fwd_err = (y.detach().to(torch::kFloat64) - ref.detach()).abs();
  EXPECT_TRUE((fwd_err <= 2e-6 * ref.detach().abs() + 1e-9).all().item<bool>());
  auto grad_err = (x.grad().to(torch::kFloat64) - ref_x.grad()).abs();
  EXPECT_LT((grad_err / (dy.abs().to(torch::kFloat64) + 1e-30)).max().item<double>(), 1e-6);
  // And closer to the truth than LibTorch's own fp32 kernel, summed over the range.
  auto torch_err = (torch::gelu(x.detach(), "tanh").to(torch::kFloat64) - ref.detach()).abs();
  EXPECT_LE(fwd_err.sum().item<double>(), torch_err.sum().item<double>());
  // Without a backward to come (evaluation) the forward alone runs: the same values, bitwise.
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(gelu_tanh(x.detach()), y.detach()));
  }
  // NaN in, NaN out; far tails: 0 (x -> -inf, within 1e-30) and x (x -> +inf).
  auto special = gelu_tanh(torch::tensor({std::numeric_limits<float>::quiet_NaN(), -1e4f, 1e4f}));
  EXPECT_TRUE(std::isnan(special[0].item<float>()));
  EXPECT_LT(std::abs(special[1].item<float>()), 1e-30f);
  EXPECT_EQ(special[2].item<float>(), 1e4f);
  // Other dtypes take LibTorch's kernel.
  EXPECT_FALSE(gelu_tanh_uses_cpu_kernel(x.detach().to(torch::kBFloat16)));
}

// Backward multiplies the incoming gradient in place only when nothing else holds it: here the
// same gradient tensor goes to a's accumulation and to the GELU (AddBackward passes it to both),
// and a's gradient must come out untouched. Through a linear, the in-place product is taken.
TEST(Activations, GeluBackwardLeavesASharedGradientAlone) {
  auto x = torch::randn({64, 48}).requires_grad_(), a = torch::randn({64, 48}).requires_grad_();
  auto w = torch::randn({64, 48});
  ((a + gelu_tanh(x)) * w).sum().backward();
  auto xr = x.detach().clone().requires_grad_();
  (torch::gelu(xr.to(torch::kFloat64), "tanh") * w.to(torch::kFloat64)).sum().backward();
  EXPECT_TRUE(torch::equal(a.grad(), w));
  EXPECT_LT((x.grad().to(torch::kFloat64) - xr.grad()).abs().max().item<double>(), 1e-5);

  // Through a matmul (the MLP's down projection): its input gradient is fresh, so the product
  // is taken in place, and equals the product into a new buffer.
  auto x2 = torch::randn({32, 48}).requires_grad_();
  auto m = torch::randn({48, 40}), g = torch::randn({32, 40});
  torch::matmul(gelu_tanh(x2), m).backward(g);
  torch::Tensor slope;
  gelu_tanh_cpu(x2.detach(), &slope);
  EXPECT_TRUE(torch::equal(x2.grad(), torch::matmul(g, m.t()) * slope));
}

// GELU(x + bias) in one pass (GPT-2's MLP with the up projection's bias fused): values and both
// gradients against fp64, the same values as the unfused kernel on x + bias (bitwise), and
// the same bits on one thread as on two, rows of a width that is no multiple of 8 included.
TEST(Activations, BiasGeluMatchesTheUnfusedKernel) {
  for (int64_t cols : {768, 37}) {
    auto x = (3 * torch::randn({1000, cols})).requires_grad_();
    auto b = torch::randn({cols}).requires_grad_();
    auto y = bias_gelu_tanh(x, b);
    EXPECT_TRUE(torch::equal(y.detach(), gelu_tanh_cpu((x + b).detach())));
    auto dy = torch::randn({1000, cols});
    y.backward(dy);
    auto xr = x.detach().to(torch::kFloat64).requires_grad_();
    auto br = b.detach().to(torch::kFloat64).requires_grad_();
    auto ref = torch::gelu(xr + br, "tanh");
    ref.backward(dy.to(torch::kFloat64));
    EXPECT_LT((y.detach().to(torch::kFloat64) - ref.detach()).abs().max().item<double>(), 1e-5);
    EXPECT_LT((x.grad().to(torch::kFloat64) - xr.grad()).abs().max().item<double>(), 1e-5);
    EXPECT_LT(((b.grad().to(torch::kFloat64) - br.grad()).abs() / (br.grad().abs() + 1))
                  .max()
                  .item<double>(),
              1e-5);
    const int was = at::get_num_threads();
    at::set_num_threads(1);
    torch::Tensor slope1, slope2;
    auto y1 = bias_gelu_tanh_cpu(x.detach(), b.detach(), &slope1);
    at::set_num_threads(2);
    auto y2 = bias_gelu_tanh_cpu(x.detach(), b.detach(), &slope2);
    at::set_num_threads(was);
    EXPECT_TRUE(torch::equal(y1, y2) && torch::equal(slope1, slope2));
  }
}

}  // namespace
}  // namespace tessel::kernels
